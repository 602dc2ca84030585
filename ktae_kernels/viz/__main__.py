"""``python -m ktae_kernels.viz BATCH_FILE``: the key-token HTML report (and a PNG summary) of a saved batch.

BATCH_FILE is a ``torch.save`` of a dict with keys ``responses`` (int ``[B, L]`` token ids),
``response_mask`` (``[B, L]`` 0/1), ``rewards`` (``[B]``, or ``[B, L]`` token-level, summed) and ``index``
(``[B]`` group ids: an int tensor or a list of ints or strings), and optionally ``prompts`` (a list
of B prompt strings, shown above each group); or of the 4-tuple ``(responses, response_mask, rewards,
index)``. For example::

    torch.save(dict(responses=responses, response_mask=mask, rewards=rewards, index=index), "batch.pt")
    python -m ktae_kernels.viz batch.pt --tokenizer /path/to/hf-tokenizer -o report.html --png summary.png
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import KTAEConfig
from .html import write_report

KEYS = ("responses", "response_mask", "rewards", "index")
#: other names accepted for a key (verl's batch uses ``uid`` for the group and ``token_level_rewards``).
ALIASES = {"response_mask": ("mask", "attention_mask"), "rewards": ("token_level_rewards", "reward"),
           "index": ("uid", "group", "groups")}


def load_batch(path: str | Path, *, allow_pickle: bool = False) -> tuple[tuple[Any, Any, Any, Any], Any]:
    """``((responses, response_mask, rewards, index), prompts or None)`` from a ``torch.save`` file
    (a dict, optionally with ``prompts``, or a 4-tuple).

    Loads with ``weights_only=True`` (tensors, lists, dicts, strings) unless ``allow_pickle``, which
    runs arbitrary pickled code: only for files you trust (e.g. a numpy object array of uids).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"BATCH_FILE: no such file: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except Exception as err:  # noqa: BLE001 - explain the usual cause, keep the original
        hint = "" if allow_pickle else (" (if it holds numpy arrays or other objects and you trust it, "
                                        "pass --allow-pickle)")
        raise ValueError(f"BATCH_FILE {path}: cannot load it with torch.load{hint}: {err}") from err
    if isinstance(data, (tuple, list)):
        if len(data) != 4:
            raise ValueError(f"BATCH_FILE {path}: a tuple must have 4 items {KEYS}, got {len(data)}")
        return tuple(data), None  # type: ignore[return-value]
    if isinstance(data, dict):
        out = []
        for key in KEYS:
            name = next((k for k in (key, *ALIASES.get(key, ())) if k in data), None)
            if name is None:
                raise ValueError(f"BATCH_FILE {path}: missing key {key!r}; found {sorted(map(str, data))}")
            out.append(data[name])
        return tuple(out), data.get("prompts")  # type: ignore[return-value]
    raise ValueError(f"BATCH_FILE {path}: expected a dict with keys {KEYS} or a 4-tuple, got {type(data).__name__}")


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer: from a local folder, else (a hub name) from the Hugging Face cache, else
    downloaded. Raises ValueError in one line, at once, where none of those can work here (no such
    folder, or the name is not cached and the hub is off or unreachable): pass a local folder then."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError('--tokenizer needs transformers: pip install "ktae_kernels[train]"') from None
    local = ("pass a local folder that holds the tokenizer's files (tokenizer.json, tokenizer_config.json), "
             "e.g. one saved with tokenizer.save_pretrained(folder) on a machine with network")
    if os.path.isdir(path):
        return _tokenizer_or_error(AutoTokenizer, path, "this folder")
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1:
        raise ValueError(f"--tokenizer {path!r}: no such folder; {local}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):  # not in the Hugging Face cache
        pass
    unreachable = _hub_unreachable(path)
    if unreachable is not None:
        raise ValueError(f"--tokenizer {path!r} is neither a local folder nor in the Hugging Face cache, and {unreachable}; "
                         f"{local}")
    return _tokenizer_or_error(AutoTokenizer, path, "the Hugging Face hub")


def _tokenizer_or_error(auto: Any, path: str, where: str) -> Any:
    """``auto.from_pretrained(path)``, or ValueError with the first line of its error."""
    try:
        return auto.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--tokenizer {path!r}: cannot load a tokenizer from {where}: {first}") from None


def _hub_unreachable(name: str, timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot serve ``name`` now (offline mode, no connection), or None: one
    short metadata request, so that a machine without network fails at once instead of after retries."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return "the hub is switched off here (HF_HUB_OFFLINE)"
    try:
        huggingface_hub.model_info(name, timeout=timeout)
    except Exception as err:  # noqa: BLE001 - a connection failure is told apart below; others go on
        if _is_connection_error(err):
            return f"the Hugging Face hub cannot be reached ({type(err).__name__})"
    return None


def _is_connection_error(err: BaseException) -> bool:
    """Whether ``err`` (from huggingface_hub's HTTP client, httpx or requests) is a failed connection or
    a timeout rather than an answer from the hub."""
    kinds = [ConnectionError, TimeoutError]
    for module, names in (("httpx", ("TransportError",)), ("requests", ("ConnectionError", "Timeout"))):
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue
        kinds += [getattr(imported, n) for n in names if hasattr(imported, n)]
    return isinstance(err, tuple(kinds))


def _id_list(text: str) -> tuple[int, ...]:
    """``"151643,151645"`` as ``(151643, 151645)``: ``--ignore-ids`` (one value, so it cannot swallow BATCH_FILE)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer token ids, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ktae_kernels.viz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batch", metavar="BATCH_FILE", type=Path, help="torch.save file of the batch (see above)")
    p.add_argument("--tokenizer", metavar="PATH", help="Hugging Face tokenizer to decode tokens: a local folder (or "
                                                       "a hub name, cached or downloaded); without it tokens "
                                                       "show as [id]")
    p.add_argument("-o", "--out", type=Path, default=Path("report.html"), help="HTML report (default: report.html)")
    p.add_argument("--png", type=Path, default=None, help="also write a PNG summary here (needs matplotlib)")
    p.add_argument("--groups", type=int, default=8, metavar="N",
                   help="groups shown, those with both correct and wrong rollouts first (default 8; 0: all)")
    p.add_argument("--top-k", type=int, default=10, help="key tokens listed per group (default 10)")
    p.add_argument("--no-tf", action="store_true", help="KTAEConfig(use_tf=False): no BM25 ratio in the direction")
    p.add_argument("--fisher", choices=("exact", "upstream"), default="exact", help="Fisher test mode (default exact)")
    p.add_argument("--ignore-ids", type=_id_list, default=(), metavar="ID[,ID...]",
                   help="token ids scored 0, comma-separated (e.g. 151643,151645)")
    p.add_argument("--threshold", type=float, default=0.0, help="a rollout is correct when reward > this (default 0)")
    p.add_argument("--backend", default="auto", help="ktae_kernels backend computing the scores (default auto)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="torch.load with weights_only=False (only for files you trust)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.groups < 0:
        parser.error(f"--groups must be >= 0, got {args.groups}")
    try:
        batch, prompts = load_batch(args.batch, allow_pickle=args.allow_pickle)
        config = KTAEConfig(use_tf=not args.no_tf, fisher=args.fisher, ignore_token_ids=args.ignore_ids,
                            correct_threshold=args.threshold)
        decode = load_tokenizer(args.tokenizer) if args.tokenizer else None
        max_groups = args.groups or None
        title = f"KTAE key tokens: {args.batch.name}"
        path = write_report(args.out, *batch, decode=decode, config=config, max_groups=max_groups,
                            top_k=args.top_k, title=title, prompts=prompts, backend=args.backend)
        print(f"wrote {path}")
        if args.png is not None:
            from .png import write_png
            png = write_png(args.png, *batch, decode=decode, config=config, max_groups=min(max_groups or 4, 8),
                            top_k=min(args.top_k, 12) or 1, title=title, backend=args.backend)
            print(f"wrote {png}")
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"python -m ktae_kernels.viz: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
