"""What every framework adapter shares: the settings section, group ids and the rollout baseline,
correctness labels with their source, and the ``ktae/*`` metrics of a step (by metrics mode).

Framework-free, so it runs and is tested anywhere.
"""
from __future__ import annotations

import difflib
import os
import re
import time
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from .. import method
from ..config import KTAEConfig
from ..options import ExecutionOptions
from ..metrics import ktae_metrics
from ..registry import DISTRIBUTED_BACKEND, check_backend_name, resolve
from ..types import KeyTokenScores
from ..validation import dense_group_ids

#: what an adapter logs under ``ktae/``: "advantages" (default: derived from the advantages, no extra
#: pass), "scores" (one more ``key_token_scores`` call, adds ``distinct_tokens_per_group``) or "off".
METRICS_MODES = ("advantages", "scores", "off")
#: keys of a framework's "ktae" settings section besides the KTAEConfig fields (``threads``:
#: ``ExecutionOptions.threads``).
EXTRA_KEYS = ("backend", "metrics", "correct_key", "threads")
#: label source used when no task-correctness record is present: the reward the advantage is built on.
REWARD_SOURCE = "reward"


@dataclass(frozen=True)
class AdapterSettings:
    """A framework's KTAE settings: the method's ``config``, the ``backend``, the ``metrics`` mode,
    ``correct_key``, the per-rollout record of task correctness to label rollouts by when the framework
    has it (verl's ``reward_extra_info``, OpenRLHF's ``experience.info``; None: never), and the calls'
    ``options`` (``ExecutionOptions``: the native kernel's threads)."""

    config: KTAEConfig = KTAEConfig()
    backend: str = "auto"
    metrics: str = "advantages"
    correct_key: str | None = "acc"
    options: ExecutionOptions = ExecutionOptions()

    def __post_init__(self) -> None:
        if not isinstance(self.config, KTAEConfig):
            raise ValueError(f"`config` must be a KTAEConfig, got {type(self.config).__name__}")
        if not isinstance(self.options, ExecutionOptions):
            raise ValueError(f"`options` must be an ExecutionOptions, got {type(self.options).__name__}")
        check_backend_name(self.backend)
        check_metrics_mode(self.metrics)
        if self.correct_key is not None and not (isinstance(self.correct_key, str) and self.correct_key):
            raise ValueError(f"`correct_key` must be a non-empty string or None, got {self.correct_key!r}")


def check_metrics_mode(mode: Any, where: str = "metrics") -> str:
    """``mode`` when it is one of ``METRICS_MODES``; else ValueError naming ``where``."""
    if mode not in METRICS_MODES:
        raise ValueError(f"{where} must be one of {METRICS_MODES}, got {mode!r}")
    return mode


def settings_from_mapping(section: Mapping[str, Any] | None, *, where: str,
                          default_baseline: str | None = None) -> AdapterSettings:
    """``AdapterSettings`` from a framework's settings mapping (dict, OmegaConf DictConfig).

    Keys: any ``KTAEConfig`` field, plus ``backend`` ("auto"; null is not a name), ``metrics`` ("advantages"),
    ``correct_key`` ("acc") and ``threads`` (``ExecutionOptions.threads``, None). ``default_baseline``
    applies when the mapping names no ``baseline``.
    ``where`` names the section in error messages (every error is a ValueError).
    """
    if section is not None and not hasattr(section, "keys"):
        raise ValueError(f"{where} must be a mapping of KTAEConfig fields, got {section!r}")
    values = {str(k): section[k] for k in section} if section is not None else {}
    known = {f.name for f in fields(KTAEConfig)}
    unknown = sorted(set(values) - known - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}{_did_you_mean(unknown, known | set(EXTRA_KEYS))}; "
                         f"expected KTAEConfig fields {sorted(known)} or one of {list(EXTRA_KEYS)}")
    backend = check_backend_name(values.pop("backend", "auto"), f"{where}.backend")
    metrics = check_metrics_mode(values.pop("metrics", "advantages"), f"{where}.metrics")
    correct_key = values.pop("correct_key", "acc")
    threads = values.pop("threads", None)
    if default_baseline is not None:
        values.setdefault("baseline", default_baseline)
    if "ignore_token_ids" in values:
        ids = values["ignore_token_ids"]
        if not isinstance(ids, int) and not (hasattr(ids, "__iter__") and not isinstance(ids, (str, bytes, Mapping))):
            raise ValueError(f"{where}.ignore_token_ids must be a token id or a list of them, got {ids!r}")
        values["ignore_token_ids"] = (ids,) if isinstance(ids, int) else tuple(ids)
    try:
        return AdapterSettings(KTAEConfig(**values), backend, metrics, correct_key, ExecutionOptions(threads=threads))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


#: the ``KTAEConfig`` fields that make the rollout advantage ``A_i``: unused where an adapter keeps the
#: framework's own ``A_i``.
BASELINE_FIELDS = ("baseline", "eps")


def check_baseline_unused(config: KTAEConfig, where: str, why: str) -> None:
    """ValueError naming ``where`` when ``config`` sets a ``BASELINE_FIELDS`` field to other than its default,
    where the framework makes ``A_i`` (``why`` says how), so that the setting would silently do nothing."""
    default = KTAEConfig()
    changed = {name: getattr(config, name) for name in BASELINE_FIELDS if getattr(config, name) != getattr(default, name)}
    if changed:
        raise ValueError(f"{where} sets {changed}, which would have no effect: {why}")


def _did_you_mean(unknown: list[str], accepted: set[str]) -> str:
    """" (did you mean 'alpha'?)" for the first unknown key close to an accepted one, else ""."""
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


# ------------------------------------------------------------------------------ framework versions
#: environment variable naming frameworks (comma-separated: ``verl,trl,openrlhf``) that may run past the
#: tested range with a warning instead of an error.
ALLOW_UNTESTED = "KTAE_ALLOW_UNTESTED"


class FrameworkMismatchError(RuntimeError):
    """The installed framework is not what the adapter was built for: a version outside the tested
    range, a class or method the adapter extends is gone, or (OpenRLHF) the framework stopped calling
    the method KTAE extends. Raised at start-up or at the first step, naming both."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string: "0.11.2.post1+cu128" -> (0, 11, 2)."""
    match = re.match(r"\d+(\.\d+)*", str(version).strip())
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def check_version(framework: str, version: str, minimum: str, below: str,
                  environ: Mapping[str, str] | None = None) -> None:
    """Raise ``FrameworkMismatchError`` unless ``version`` of ``framework`` is in the tested range
    ``>= minimum, < below``. Below it, features the adapter needs are missing. At or past ``below``
    nothing has checked that the adapter's results still match the framework's own (a release may
    change a contract without renaming it), so it is an error too, unless ``$KTAE_ALLOW_UNTESTED``
    (``environ``; ``os.environ`` when None) names the framework: then a RuntimeWarning."""
    supported = f">= {minimum}, < {below}"
    if version_tuple(version) < version_tuple(minimum):
        raise FrameworkMismatchError(f"KTAE supports {framework} {supported}; found {framework} {version}: "
                                     f"upgrade {framework}")
    if version_tuple(version) < version_tuple(below):
        return
    if framework.lower() in allowed_untested(environ):
        warnings.warn(f"KTAE is tested with {framework} {supported}; found {framework} {version}, allowed by "
                      f"${ALLOW_UNTESTED}. The patch targets are checked at start-up, but KTAE's results have not "
                      f"been compared with {framework}'s own on this version", RuntimeWarning, stacklevel=2)
        return
    raise FrameworkMismatchError(
        f"KTAE supports {framework} {supported}; found {framework} {version}, on which KTAE's results have not "
        f"been compared with {framework}'s own. Install a {framework} in that range (the [{framework.lower()}] extra "
        f"of ktae_kernels pins it), or, once the adapter's tests pass on {framework} {version}, set "
        f"{ALLOW_UNTESTED}={framework.lower()} to run with a warning")


def allowed_untested(environ: Mapping[str, str] | None = None) -> set[str]:
    """Lower-case framework names in ``$KTAE_ALLOW_UNTESTED`` (comma-separated)."""
    raw = (os.environ if environ is None else environ).get(ALLOW_UNTESTED, "")
    return {name.strip().lower() for name in raw.split(",") if name.strip()}


def missing_target(framework: str, version: str, missing: str, expected: str) -> FrameworkMismatchError:
    """The error for a patch target ``missing`` from ``framework`` ``version``: what KTAE expected there."""
    return FrameworkMismatchError(f"{framework} {version}: {missing}. KTAE expected {expected}; this {framework} "
                                  f"moved it, so KTAE cannot run (training would run without KTAE). Use a "
                                  f"{framework} version KTAE supports, or update ktae_kernels")


# ------------------------------------------------------------------------------ groups and baseline
def dense_groups(index: Any) -> tuple[Tensor, Tensor]:
    """``(group, size)``: int64 ``[B]`` dense ids of any group labels (a tensor, a numpy array, uid
    strings, a list), numbered in sorted label order as the API numbers them
    (``validation.dense_group_ids``), and int64 ``[n_groups]`` rollouts per group."""
    device = index.device if isinstance(index, Tensor) else torch.device("cpu")
    group, labels = dense_group_ids(index, len(index), device)
    return group, torch.bincount(group, minlength=len(labels))


def rollout_baseline(rewards: Tensor, index: Any, config: KTAEConfig) -> Tensor:
    """float64 ``[B]`` rollout advantages ``A_i`` of ``config.baseline`` within the groups of ``index``
    (verl's GRPO for "grpo")."""
    group, size = dense_groups(index)
    return method.rollout_advantage(rewards.to(torch.float64), group.to(rewards.device), size.to(rewards.device),
                                    config, None)


# ------------------------------------------------------------------------------------------ labels
@dataclass(frozen=True)
class Labels:
    """bool ``[B]`` correct / wrong flags of a step and where they came from (a record's name, or
    ``REWARD_SOURCE``)."""

    correct: Tensor
    source: str


def correct_labels(rewards: Tensor, threshold: float, sources: Sequence[tuple[str, Any]] = ()) -> Labels:
    """Labels from the first of ``sources`` (``(name, [B] values or None)``, in order of preference)
    that has values, else from ``rewards``; a rollout is correct when its value is > ``threshold``."""
    for name, values in sources:
        if values is not None:
            flags = torch.as_tensor(np.asarray(values, dtype=np.float64) if not isinstance(values, Tensor)
                                    else values.detach().to(torch.float64))
            if flags.shape != rewards.shape[:1]:
                raise ValueError(f"label source {name!r} has shape {tuple(flags.shape)}, expected "
                                 f"({rewards.shape[0]},) (one value per rollout)")
            return Labels(flags.to(rewards.device) > threshold, name)
    return Labels(rewards.detach().to(torch.float64) > threshold, REWARD_SOURCE)


def column_values(columns: Mapping[str, Any] | None, key: str | None) -> Any:
    """``columns[key]`` (one value per rollout) when present with no value missing (None), else None."""
    if columns is None or key is None:
        return None
    values = columns.get(key, None) if hasattr(columns, "get") else None
    if values is None or (not isinstance(values, Tensor) and any(v is None for v in values)):
        return None
    return values


# ----------------------------------------------------------------------------------------- metrics
#: the native CPU kernel's backend name: the one backend ``ktae/threads`` describes.
NATIVE_BACKEND = "cpu"


def backend_that_runs(name: str, device: torch.device | str, *, distributed: bool = False) -> str:
    """The backend a call with ``backend=name`` on ``device`` tensors runs ("auto" resolved); with a
    ``process_group`` (``distributed``): the torch stages over the ranks."""
    return DISTRIBUTED_BACKEND if distributed else resolve(name, device).name


def kernel_thread_budget(options: ExecutionOptions) -> int:
    """Threads the native CPU kernel may use: ``options.threads`` when set, else torch's count (it uses
    fewer on a batch too small to share)."""
    return options.threads or torch.get_num_threads()


def step_metrics(settings: AdapterSettings, labels: Labels, started: float, *, backend: str,
                 scores: KeyTokenScores | Callable[[], KeyTokenScores] | None = None,
                 advantages: Tensor | None = None, mask: Tensor | None = None,
                 rollout_advantage: Tensor | None = None, group: Any = None) -> dict[str, float]:
    """A step's ``ktae/*`` metrics by ``settings.metrics``: none for "off"; from ``scores`` when they
    are already computed or the mode is "scores" (a callable computes them then); else from the
    advantages (``advantages``, ``mask``, ``rollout_advantage``, ``group``). Adds ``ktae/time_ms`` since
    ``started`` (``time.perf_counter()``), ``ktae/backend/<backend>`` = 1 (the backend that ran, see
    ``backend_that_runs``), ``ktae/threads`` (``kernel_thread_budget``) only when that is the native
    "cpu" kernel, and ``ktae/label_source/<source>`` = 1."""
    if settings.metrics == "off":
        return {}
    if isinstance(scores, KeyTokenScores):
        values = ktae_metrics(scores)
    elif settings.metrics == "scores" and scores is not None:
        values = ktae_metrics(scores())
    else:
        values = ktae_metrics(advantages=advantages, mask=mask, rollout_advantage=rollout_advantage, group=group,
                              correct=labels.correct, weight=settings.config.weight)
    values["ktae/time_ms"] = 1000.0 * (time.perf_counter() - started)
    values[f"ktae/backend/{backend}"] = 1.0
    if backend == NATIVE_BACKEND:
        values["ktae/threads"] = float(kernel_thread_budget(settings.options))
    values[f"ktae/label_source/{labels.source}"] = 1.0
    return values
