"""GPU correctness and timing of the triton and cuda backends against the torch backend, on one device.

The checks a first hardware run needs, in one process (``bench/gpu.sh`` runs it with a timeout):

correctness (each against ``backend="torch"`` on the same device; integer columns of
``key_token_scores`` bit for bit, float columns to 1e-9, advantages to 1e-6):
- ``paper``: the paper batch (G = 16, 1024 prompts, L = 3072, ``bench.data``), ``fisher`` exact;
- ``diverse``: groups of 64 x 4096 uniform ids over 30k (thousands of distinct ids per group, every
  Triton program of a group racing on its table; the CUDA shared table overflows);
- ``hot``: 16 x 8192 tokens per group, almost all one of 4 ids (every lane on the same slots);
- ``overflow``: Triton with a first table guess 100x too small (the rebuild), CUDA with 32-slot
  shared tables and 2 fallback blocks (the fallback taking groups in turn);
- ``upstream``: a smaller batch with ``fisher="upstream"``;
- ``stream``: inputs produced on a non-default stream and the call made on it, with work queued
  ahead; ``out=`` written in place;
- ``devices``: tensors on the last GPU while GPU 0 is current (when there are two);
- ``ids``: an out-of-range id under the mask raises ValueError naming ``responses``; cuda leaves ``out``
  untouched;
- ``graph``: cuda.token_advantage with ``out=`` captured in a CUDA graph and replayed on new ids;
- ``repeat``: each backend 5 times on ``diverse`` and ``hot``, bit for bit the same every run (races);
- ``tuning``: every launch variant the timings use (``CUDA_VARIANTS``, ``TRITON_GUESSES``) against torch;
- ``G128``, ``G1024``: groups of 128 and 1024 rollouts.

The report is written after every check and every timed backend, so a run cut by its timeout keeps
what it measured.

timings (CUDA events, median of ``--repeats``): each backend's ``token_advantage`` on the paper
batch, through the API and on a validated batch with a reused ``out`` (tables sized by the distinct
ids of the calls before), and with tables sized by masked tokens as a shape's first call sizes
them (``backend_s_sized_by_tokens``); Triton's stages
(``triton.profile``) and its time by first table-size guess; the CUDA backend's static-bound call
(with and without its final flag read) beside the path that reads sizes first, and its time by launch shape (threads a block, slot layout, blocks per SM); the
achieved bandwidth of the unavoidable I/O against a measured
device copy.

Writes ``<out>/<device>-<date>-gpu-check.json`` (and ``.png``); exit status 1 when a check failed.
``--dry-run`` runs tiny shapes on the CPU (Triton interpreter; no cuda backend) to check the script.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if "--dry-run" in sys.argv:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from ktae_kernels import KTAEConfig, key_token_scores, token_advantage  # noqa: E402
from ktae_kernels.validation import normalise_batch  # noqa: E402
from ktae_kernels.registry import available_backends, get_backend  # noqa: E402

from bench.data import Shape, make_batch  # noqa: E402
from bench.machine import machine_info, machine_slug, today  # noqa: E402
from bench.paper import copy_bandwidth_gb_s, io_bytes  # noqa: E402

#: the launch shapes the cuda backend is timed with (max threads a block, blocks per SM, packed slot),
#: each also checked against torch (check "tuning").
CUDA_VARIANTS = ((256, 1, True), (512, 1, True), (1024, 1, True), (1024, 1, False), (512, 2, True))
#: the Triton first table-size guesses it is timed with, each also checked against torch.
TRITON_GUESSES = (0.0625, 0.125, 0.25)
#: runs of each backend on the same batch that must agree bit for bit (check "repeat": races).
REPEATS_FOR_RACES = 5
INT_COLUMNS = ("group", "token", "a", "b", "c", "d", "f_c", "f_w")
REAL_COLUMNS = ("p_value", "F", "IG", "x", "score")
ADVANTAGE_ATOL = 1e-6
REAL_ATOL = 1e-9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    p.add_argument("--skip-timings", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    backends = [b for b in ("triton", "cuda") if b in available_backends(device)]
    print(f"device {device}, backends under test: {backends}", flush=True)
    small = args.dry_run
    paper = Shape(4, 3, 64) if small else Shape(16, 1024, 3072)
    report: dict[str, Any] = {"machine": machine_info(device), "date": today(), "backends": backends,
                              "paper_shape": str(paper), "checks": {}, "timings": {}}
    checks = report["checks"]

    stem = args.out / f"{machine_slug(device)}-{today()}-gpu-check{'-dry-run' if small else ''}"
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """Write what is measured so far: a stage killed by its timeout keeps it."""
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))

    def check(name: str, fn: Callable[[], dict]) -> None:
        t0 = time.perf_counter()
        try:
            result = {"ok": True, **fn()}
        except Exception as err:  # a failed check is recorded; the others still run
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - t0, 3)
        checks[name] = result
        print(f"[{'ok' if result['ok'] else 'FAIL'}] {name} ({result['seconds']} s)"
              + ("" if result["ok"] else f": {result['error']}"), flush=True)
        save()

    bench_batch = make_batch(paper, device=device, seed=0)
    check("paper", lambda: compare_all(bench_batch.args(), backends, KTAEConfig()))
    diverse = uniform_batch(groups=2 if small else 16, G=8 if small else 64, L=64 if small else 4096,
                            vocab=300 if small else 30_000, device=device, seed=1)
    check("diverse", lambda: compare_all(diverse, backends, KTAEConfig()))
    hot = hot_batch(groups=2 if small else 8, G=4 if small else 16, L=64 if small else 8192, device=device)
    check("hot", lambda: compare_all(hot, backends, KTAEConfig()))
    check("overflow", lambda: forced_overflow(diverse, backends))
    upstream = make_batch(Shape(16, 2 if small else 64, 64 if small else 3072), device=device, seed=2).args()
    check("upstream", lambda: compare_all(upstream, backends, KTAEConfig(fisher="upstream")))
    if device.type == "cuda":
        check("stream", lambda: non_default_stream(bench_batch.args(), backends))
        check("devices", lambda: other_device(backends))
    check("ids", lambda: bad_ids(diverse, backends))
    if device.type == "cuda" and "cuda" in backends:
        check("graph", lambda: graph_capture(bench_batch.args()))
    check("repeat", lambda: repeat_and_compare([diverse, hot], backends))
    check("tuning", lambda: tuning_variants(diverse if small else bench_batch.args(), backends))
    for G, groups, L in ((128, 2, 8), (1024, 1, 3)) if small else ((128, 32, 1024), (1024, 16, 192)):
        big = uniform_batch(groups=groups, G=G, L=L, vocab=60 if small else 30_000, device=device, seed=G)
        check(f"G{G}", lambda: compare_all(big, backends, KTAEConfig()))

    if not args.skip_timings:
        try:
            timings(bench_batch, backends, args.repeats, device, report["timings"], save)
        except Exception as err:
            report["timings"] |= {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print("timings failed:", err, flush=True)
    save()
    with contextlib.suppress(Exception):
        plot(report, stem.with_suffix(".png"))
    failed = [name for name, r in checks.items() if not r["ok"]]
    print(f"wrote {stem}.json; {len(checks) - len(failed)}/{len(checks)} checks passed"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------ batches
def uniform_batch(groups: int, G: int, L: int, vocab: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B = groups * G
    responses = torch.randint(0, vocab, (B, L), generator=gen)
    lengths = torch.randint(L // 4, L + 1, (B,), generator=gen)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    rewards = (torch.rand(B, generator=gen) < 0.5).float()
    index = torch.arange(B) // G
    return tuple(t.to(device) for t in (responses, mask, rewards, index))


def hot_batch(groups: int, G: int, L: int, device: torch.device):
    gen = torch.Generator().manual_seed(3)
    B = groups * G
    responses = torch.randint(0, 4, (B, L), generator=gen)
    rare = torch.rand(B, L, generator=gen) < 0.001
    responses[rare] = torch.randint(4, 151_936, (int(rare.sum()),), generator=gen)
    mask = torch.ones(B, L, dtype=torch.bool)
    rewards = (torch.arange(B) % 3 == 0).float()
    index = torch.arange(B) // G
    return tuple(t.to(device) for t in (responses, mask, rewards, index))


# ---------------------------------------------------------------------------------------- comparisons
def compare_scores(want, got) -> dict:
    if len(want) != len(got):
        raise AssertionError(f"{len(got)} rows, torch has {len(want)}")
    for col in INT_COLUMNS:
        if not torch.equal(getattr(want, col).cpu(), getattr(got, col).cpu()):
            raise AssertionError(f"integer column {col} differs")
    diffs = {}
    for col in REAL_COLUMNS:
        diffs[col] = float((getattr(want, col).cpu() - getattr(got, col).cpu()).abs().max()) if len(want) else 0.0
        if diffs[col] > REAL_ATOL:
            raise AssertionError(f"column {col} differs by {diffs[col]:.3g} > {REAL_ATOL}")
    return {"rows": len(want), "max_real_diff": diffs}


def compare_advantage(want: torch.Tensor, got: torch.Tensor) -> float:
    if got.shape != want.shape or got.dtype != torch.float32 or got.device != want.device:
        raise AssertionError(f"advantage {got.dtype} {tuple(got.shape)} on {got.device}")
    diff = float((want - got).abs().max()) if want.numel() else 0.0
    if diff > ADVANTAGE_ATOL:
        raise AssertionError(f"advantages differ by {diff:.3g} > {ADVANTAGE_ATOL}")
    return diff


def compare_all(args, backends: list[str], config: KTAEConfig, **extra) -> dict:
    want_adv = token_advantage(*args, config=config, backend="torch")
    want_rows = key_token_scores(*args, config=config, backend="torch")
    out = {"rows": len(want_rows)}
    for name in backends:
        got = token_advantage(*args, config=config, backend=name)
        out[name] = {"advantage_max_diff": compare_advantage(want_adv, got),
                     **compare_scores(want_rows, key_token_scores(*args, config=config, backend=name))}
    return out


def forced_overflow(args, backends: list[str]) -> dict:
    config = KTAEConfig()
    want = token_advantage(*args, config=config, backend="torch")
    want_rows = key_token_scores(*args, config=config, backend="torch")
    batch = normalise_batch(*args)
    out: dict[str, Any] = {}
    if "triton" in backends:
        from ktae_kernels.backends.triton import tables

        saved = tables._FIRST_GUESS
        tables._FIRST_GUESS = 0.0025
        try:
            calls = []
            regrow = tables._regrow
            tables._regrow = lambda *a: calls.append(int(a[2].ne(0).sum())) or regrow(*a)
            got = get_backend("triton", batch.device).token_advantage(batch, config, None)
            rows = get_backend("triton", batch.device).key_token_scores(batch, config)
        finally:
            tables._FIRST_GUESS, tables._regrow = saved, regrow
        if not calls or not calls[0]:
            raise AssertionError("triton: the forced overflow did not rebuild any group")
        out["triton"] = {"rebuilt_groups": calls, "advantage_max_diff": compare_advantage(want, got),
                         **compare_scores(want_rows, rows)}
    if "cuda" in backends:
        from ktae_kernels.backends import cuda

        saved = cuda.FALLBACK_BLOCKS
        cuda.FALLBACK_BLOCKS = 2
        try:
            got = cuda.token_advantage(batch, config, None, tuning=cuda.Tuning(table_slots=32))
            rows = cuda.key_token_scores(batch, config, tuning=cuda.Tuning(table_slots=32))
        finally:
            cuda.FALLBACK_BLOCKS = saved
        out["cuda"] = {"advantage_max_diff": compare_advantage(want, got), **compare_scores(want_rows, rows)}
    return out


def non_default_stream(args, backends: list[str]) -> dict:
    want = token_advantage(*args, backend="torch")
    stream = torch.cuda.Stream()
    out: dict[str, Any] = {}
    for name in backends:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # inputs written on this stream right before the call, behind a long queued kernel
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                busy = busy @ busy
                busy /= busy.norm()
            responses = args[0].clone()
            target = torch.empty(responses.shape, dtype=torch.float32, device="cuda")
            got = token_advantage(responses, *args[1:], backend=name, out=target)
        torch.cuda.current_stream().wait_stream(stream)
        if got.data_ptr() != target.data_ptr():
            raise AssertionError(f"{name}: out= was not written in place")
        out[name] = {"advantage_max_diff": compare_advantage(want, got)}
    return out


def other_device(backends: list[str]) -> dict:
    if torch.cuda.device_count() < 2:
        return {"skipped": "one GPU"}
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    args = uniform_batch(groups=4, G=16, L=512, vocab=5000, device=last, seed=4)
    want = token_advantage(*args, backend="torch")
    out = {}
    with torch.cuda.device(0):
        for name in backends:
            got = token_advantage(*args, backend=name)
            out[name] = {"advantage_max_diff": compare_advantage(want, got), "device": str(got.device)}
    return out


def repeat_and_compare(batches: list[tuple], backends: list[str]) -> dict:
    """Each backend ``REPEATS_FOR_RACES`` times on each batch: the advantages and every column of the
    rows must agree bit for bit from run to run (an unsynchronised write or a lost atomic shows up as
    a difference), and with torch to the usual tolerance."""
    out: dict[str, Any] = {}
    for i, args in enumerate(batches):
        want = token_advantage(*args, backend="torch")
        for name in backends:
            first = token_advantage(*args, backend=name)
            rows = key_token_scores(*args, backend=name)
            for run in range(1, REPEATS_FOR_RACES):
                again = token_advantage(*args, backend=name)
                if not torch.equal(first, again):
                    raise AssertionError(f"{name}, batch {i}: run {run} differs from run 0 by "
                                         f"{float((first - again).abs().max()):.3g}")
                rows_again = key_token_scores(*args, backend=name)
                for col in INT_COLUMNS + REAL_COLUMNS:
                    if not torch.equal(getattr(rows, col), getattr(rows_again, col)):
                        raise AssertionError(f"{name}, batch {i}: column {col} of run {run} differs from run 0")
            out[f"{name}[{i}]"] = {"runs": REPEATS_FOR_RACES, "advantage_max_diff": compare_advantage(want, first)}
    return out


def tuning_variants(args, backends: list[str]) -> dict:
    """Every launch variant the timings use (``CUDA_VARIANTS``, ``TRITON_GUESSES``) against torch."""
    config = KTAEConfig()
    want = token_advantage(*args, config=config, backend="torch")
    batch = normalise_batch(*args)
    out: dict[str, Any] = {}
    if "cuda" in backends:
        from ktae_kernels.backends import cuda

        for threads, blocks, packed in CUDA_VARIANTS:
            tuning = cuda.Tuning(packed=packed, blocks_per_sm=blocks, max_threads=threads)
            got = cuda.token_advantage(batch, config, None, tuning=tuning)
            out[f"cuda {_variant_name(threads, blocks, packed)}"] = compare_advantage(want, got)
    if "triton" in backends:
        from ktae_kernels.backends.triton import tables

        saved = tables._FIRST_GUESS
        try:
            for guess in TRITON_GUESSES:
                tables._FIRST_GUESS = guess
                got = get_backend("triton", batch.device).token_advantage(batch, config, None)
                out[f"triton first guess {guess}"] = compare_advantage(want, got)
        finally:
            tables._FIRST_GUESS = saved
    return out


def _variant_name(threads: int, blocks: int, packed: bool) -> str:
    return f"threads<={threads} blocks/SM={blocks} {'packed' if packed else 'wide'}"


def bad_ids(args, backends: list[str]) -> dict:
    responses, mask = args[0].clone(), args[1].clone()
    mask[0, 0] = True
    responses[0, 0] = -3
    out = {}
    for name in ["torch", *backends]:
        try:
            token_advantage(responses, mask, *args[2:], backend=name)
        except ValueError as err:
            if "`responses`" not in str(err):
                raise AssertionError(f"{name}: the error does not name `responses`: {err}") from None
            out[name] = str(err)
        else:
            raise AssertionError(f"{name}: a negative id under the mask was accepted")
    if "cuda" in backends:  # the id flag is read after the launches, which wrote nothing
        nan = torch.full(responses.shape, float("nan"), dtype=torch.float32, device=responses.device)
        try:
            token_advantage(responses, mask, *args[2:], backend="cuda", out=nan)
        except ValueError:
            pass
        if not bool(torch.isnan(nan).all()):
            raise AssertionError("cuda: `out` was written although an id was out of range")
        out["cuda_out_untouched"] = True
    return out


def graph_capture(args) -> dict:
    """cuda.token_advantage with ``out=`` captured in a CUDA graph (after a warm-up on a side stream),
    replayed on new ids copied into the captured tensors, against torch."""
    from ktae_kernels.backends import cuda
    from ktae_kernels.validation import normalise_batch

    batch = normalise_batch(*args)
    out = torch.empty(batch.responses.shape, dtype=torch.float32, device=batch.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda.token_advantage(batch, KTAEConfig(), None, out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda.token_advantage(batch, KTAEConfig(), None, out)
    shifted = (args[0] + 7) % 151_936
    batch.responses.copy_(shifted)
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    replay_s = time.perf_counter() - t0
    want = token_advantage(shifted, *args[1:], backend="torch")
    torch.testing.assert_close(out, want, rtol=0.0, atol=1e-6)
    return {"replay_s": replay_s}


# -------------------------------------------------------------------------------------------- timings
def cuda_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` between CUDA events (after one warm-up), or wall time on the CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timings(bench_batch, backends: list[str], repeats: int, device: torch.device, result: dict[str, Any],
            save: Callable[[], None]) -> None:
    """The paper batch's timings into ``result``, saved after each backend."""
    args = bench_batch.args()
    positions = bench_batch.responses.numel()
    config = KTAEConfig()
    batch = normalise_batch(*args)
    out = torch.empty(batch.responses.shape, dtype=torch.float32, device=device)
    copy = copy_bandwidth_gb_s(device, gbytes=4.0 if device.type == "cuda" else 0.05)
    result.update({"copy_gb_s": copy, "io_bytes": io_bytes(positions), "backends": {}})
    result["api_validation_s"] = cuda_time(lambda: normalise_batch(*args), repeats)
    for name in ["torch", *backends]:
        impl = get_backend(name, device)
        api_s = cuda_time(lambda: token_advantage(*args, backend=name, out=out), repeats)
        backend_s = cuda_time(lambda: impl.token_advantage(batch, config, None, out), repeats)
        row = {"api_s": api_s, "backend_s": backend_s,
               "achieved_gb_s": io_bytes(positions) / backend_s / 1e9,
               "share_of_copy": io_bytes(positions) / backend_s / 1e9 / copy}
        if name in ("cuda", "triton"):
            row["backend_s_sized_by_tokens"] = cuda_time(
                sized_by_tokens(name, batch, lambda: impl.token_advantage(batch, config, None, out)), repeats)
        if name == "triton":
            if device.type == "cuda":
                with contextlib.suppress(Exception):
                    row["stages_ms"] = triton_stages(batch, config, rep_ms=50)
            row["backend_s_by_first_guess"] = triton_guess_sweep(impl, batch, config, out, repeats)
        if name == "cuda":
            row["stages_s"] = cuda_stages(batch, config, repeats)
            row["backend_s_by_max_threads"] = cuda_threads_sweep(impl, batch, config, out, repeats)
        result["backends"][name] = row
        save()
        print(f"  {name:<7} api {1e3 * api_s:8.3f} ms, backend {1e3 * backend_s:8.3f} ms, "
              f"{row['achieved_gb_s']:.0f} GB/s ({100 * row['share_of_copy']:.1f}% of copy)", flush=True)


def sized_by_tokens(backend: str, batch, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with no distinct-id count remembered for ``batch``'s shape, so that each call sizes its
    tables by masked tokens, as a shape's first call does (``device.expected_keys``)."""
    from ktae_kernels.backends import device as device_helpers

    key = device_helpers.distinct_key(backend, batch.device, batch.responses.shape[0], batch.n_groups)

    def run() -> Any:
        device_helpers.forget_keys(key)
        return fn()
    return run


def cuda_stages(batch, config: KTAEConfig, repeats: int) -> dict:
    """The cuda backend's token_advantage by stage: the static-bound call (one binding call: scan,
    groups, shared and global table passes) without and with its final id-flag read, and the path
    that reads the group sizes first (``fisher="upstream"``'s; here with the exact statistics grid)."""
    from ktae_kernels import method
    from ktae_kernels.backends import cuda
    from ktae_kernels.backends.device import on_device

    ext = cuda.load_extension()
    out = torch.empty(batch.responses.shape, dtype=torch.float32, device=batch.device)
    with on_device(batch.device):
        static = cuda.static_plan(ext, batch, config)
        plan = cuda._prepare(ext, batch, config, cuda.DEFAULT_TUNING)
        stages = {
            "static_enqueue": cuda_time(lambda: cuda._enqueue(static, batch, config, None, out), repeats),
            "static_token_advantage": cuda_time(lambda: cuda._static_advantage(static, batch, config, None, out),
                                                repeats),
            "sized_group_stats": cuda_time(lambda: method.group_stats(batch, config), repeats),
            "sized_prepare": cuda_time(lambda: cuda._prepare(ext, batch, config, cuda.DEFAULT_TUNING), repeats),
            "sized_advantage_passes": cuda_time(lambda: cuda._advantage(plan, batch, config, None, out), repeats),
        }
    stages["static_shared_bytes"] = static.shared_bytes
    stages["static_blocks_per_sm"] = static.blocks_per_sm
    stages["static_max_capacity"] = static.max_capacity
    stages["static_fallback_blocks"] = static.fallback_blocks
    stages["static_fallback_bytes"] = static.fallback_bytes
    stages["threads"] = static.threads
    return stages


def triton_guess_sweep(impl, batch, config: KTAEConfig, out: torch.Tensor, repeats: int) -> dict:
    """The triton backend's time and table slots by first table-size guess (``tables._FIRST_GUESS``,
    distinct ids as a fraction of masked tokens: smaller tables to clear and probe, more rebuilds)."""
    from ktae_kernels.method import group_stats
    from ktae_kernels.backends.triton import tables

    saved, result = tables._FIRST_GUESS, {}
    try:
        for guess in TRITON_GUESSES:
            tables._FIRST_GUESS = guess
            built = tables.build_hash_tables(batch, group_stats(batch, config))
            seconds = cuda_time(lambda: impl.token_advantage(batch, config, None, out), repeats)
            result[str(guess)] = {"seconds": seconds, "slots": int(built.keys.shape[0]), "rows": built.n_rows}
    finally:
        tables._FIRST_GUESS = saved
    return result


def cuda_threads_sweep(impl, batch, config: KTAEConfig, out: torch.Tensor, repeats: int) -> dict:
    """The cuda backend's time by launch shape (``cuda.Tuning``): at most 256 / 512 / 1024 threads a
    block, the wide or packed slot, one or two blocks per SM, to choose the defaults from."""
    from ktae_kernels.backends import cuda

    times = {}
    for threads, blocks, packed in CUDA_VARIANTS:
        tuning = cuda.Tuning(packed=packed, blocks_per_sm=blocks, max_threads=threads)
        times[_variant_name(threads, blocks, packed)] = cuda_time(lambda: impl.token_advantage(batch, config, None, out, tuning=tuning), repeats)
    return times


def triton_stages(batch, config: KTAEConfig, *, rep_ms: int = 100) -> dict[str, float]:
    """Median milliseconds of each stage of the triton backend's ``token_advantage`` on a CUDA batch, by
    ``triton.testing.do_bench`` (each stage re-run on the previous stages' outputs)."""
    from triton.testing import do_bench

    from ktae_kernels import method
    from ktae_kernels.backends import triton as backend
    from ktae_kernels.backends.device import on_device
    from ktae_kernels.backends.triton.advantage import token_advantages
    from ktae_kernels.backends.triton.scores import score_rows, table_lookup
    from ktae_kernels.backends.triton.tables import build_hash_tables, occupied_rows

    with on_device(batch.device):
        p = backend.pipeline(batch, config)
        base = method.rollout_advantage(batch.rewards, batch.group, p.stats.size, config, None)
        out = torch.empty(batch.responses.shape, dtype=torch.float32, device=batch.device)
        stages = {
            "groups": lambda: method.group_stats(batch, config),
            "tables": lambda: build_hash_tables(batch, p.stats),
            "rows": lambda: occupied_rows(p.tables, sort=False),
            "statistics": lambda: table_lookup(p.tables, p.rows, p.stats, config),
            "scores": lambda: score_rows(p.tables, p.rows, p.stats, config, p.consts, p.lookup, write_rows=False),
            "rollout": lambda: method.rollout_advantage(batch.rewards, batch.group, p.stats.size, config, None),
            "advantage": lambda: token_advantages(batch, p.tables, p.slot_score, base, p.consts, out),
            "total": lambda: backend.token_advantage(batch, config, None, out),
        }
        return {name: float(do_bench(fn, rep=rep_ms, return_mode="median")) for name, fn in stages.items()}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["timings"].get("backends", {})
    if not rows:
        return
    names = list(rows)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([f"{n}\n(api)" for n in names], [1e3 * rows[n]["api_s"] for n in names], color="#9ecae1")
    ax.bar([f"{n}\n(backend)" for n in names], [1e3 * rows[n]["backend_s"] for n in names], color="#3182bd")
    floor = report["timings"]["io_bytes"] / (report["timings"]["copy_gb_s"] * 1e9) * 1e3
    ax.axhline(floor, color="k", ls="--", lw=1, label=f"I/O at copy bandwidth ({floor:.3f} ms)")
    ax.set_ylabel("ms, paper batch")
    ax.set_title(f"token_advantage, {report['paper_shape']}, {report['machine'].get('device', '')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
