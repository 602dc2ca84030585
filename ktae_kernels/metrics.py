"""A step's KTAE diagnostics as a few scalars, for a trainer's logger.

``ktae_metrics`` returns (with the default ``prefix="ktae/"``):

- ``ktae/score_abs_mean``: mean ``|score|`` over the masked (response) tokens;
- ``ktae/key_token_share``: share of masked tokens with ``|score| >= 0.5`` (``key_threshold``);
- ``ktae/mixed_group_share``: share of groups with both correct and wrong rollouts (only those
  groups get non-zero scores);
- ``ktae/distinct_tokens_per_group``: mean number of distinct token ids per group (the rows of the
  group's tables; needs ``KeyTokenScores``);
- ``ktae/time_ms``: wall time of the step's KTAE computation, as the caller measured it.

Two ways to get them, so the logging costs what the caller can afford:

- from ``KeyTokenScores`` (``ktae_metrics(scores, ...)``): all five, in ``O(rows + groups)`` work: a
  row's ``f_c + f_w`` is the number of masked tokens carrying its score, so token averages need no
  per-token pass. Getting the scores is one more ``key_token_scores`` call beside ``token_advantage``;
- from the advantages (``ktae_metrics(None, advantages=..., mask=..., rollout_advantage=..., group=...,
  correct=...)``): the token score is ``(advantage - A_i) / weight`` on masked tokens, so one
  element-wise pass over ``[B, L]`` gives the token averages and ``[B]`` labels the mixed groups;
  ``distinct_tokens_per_group`` is left out (it would need the per-group token sets).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .checks import as_tensor
from .types import ArrayLike, KeyTokenScores
from .validation import correct_flags, dense_group_ids

__all__ = ["METRIC_NAMES", "ktae_metrics"]

#: metric names without the prefix, in the order ``ktae_metrics`` returns them.
METRIC_NAMES: tuple[str, ...] = (
    "score_abs_mean", "key_token_share", "mixed_group_share", "distinct_tokens_per_group", "time_ms",
)


def ktae_metrics(scores: KeyTokenScores | None = None, *, advantages: Tensor | None = None,
                 mask: ArrayLike | None = None, rollout_advantage: ArrayLike | None = None, group: Any = None,
                 correct: ArrayLike | None = None, weight: float = 1.0, elapsed_s: float | None = None,
                 key_threshold: float = 0.5, prefix: str = "ktae/") -> dict[str, float]:
    """A step's KTAE diagnostics as Python floats keyed ``prefix + name`` (see the module docstring).

    Args:
        scores: the step's ``KeyTokenScores``; when given, every metric comes from it and the
            per-token arguments are ignored.
        advantages, mask, rollout_advantage, group, correct: without ``scores``: the ``[B, L]`` KTAE
            advantages (a real tensor), the ``[B, L]`` response mask, the ``[B]`` rollout advantages
            ``A_i`` they were built on, ``[B]`` group ids (ints or strings, as ``token_advantage``'s
            ``index``) and ``[B]`` correct flags (bool or 0/1); each but ``advantages`` a tensor, numpy
            array or list. ``weight`` is ``KTAEConfig.weight``.
        elapsed_s: seconds the KTAE step took; reported as ``time_ms`` (omitted when None).
        key_threshold: ``|score|`` at or above which a token counts as a key token.
    Empty batches give 0 for the shares and means.

    Raises:
        ValueError: an argument of the wrong type or shape (the message names it), or ``correct`` holding a
            value other than 0 and 1 (its values are read on the host).
    """
    if scores is not None and not isinstance(scores, KeyTokenScores):
        raise ValueError(f"`scores` must be a KeyTokenScores or None, got {type(scores).__name__}")
    if scores is not None:
        values = _from_scores(scores, key_threshold)
    elif advantages is not None:
        values = _from_advantages(advantages, mask, rollout_advantage, group, correct, weight, key_threshold)
    else:
        raise ValueError("ktae_metrics needs `scores` (KeyTokenScores) or `advantages` with mask, "
                         "rollout_advantage, group and correct")
    if elapsed_s is not None:
        values["time_ms"] = 1000.0 * float(elapsed_s)
    return {prefix + name: values[name] for name in METRIC_NAMES if name in values}


def _ratio(num: Tensor, den: Tensor) -> float:
    den = float(den)
    return float(num) / den if den > 0 else 0.0


def _from_scores(s: KeyTokenScores, key_threshold: float) -> dict[str, float]:
    occurrences = (s.f_c + s.f_w).to(torch.float64)  # masked tokens carrying each row's score
    magnitude = s.score.abs().to(torch.float64)
    tokens = (s.T_c + s.T_w).sum()
    n_groups = int(s.n_c.shape[0])
    mixed = ((s.n_c > 0) & (s.n_w > 0)).sum()
    return {
        "score_abs_mean": _ratio((magnitude * occurrences).sum(), tokens),
        "key_token_share": _ratio(occurrences[magnitude >= key_threshold].sum(), tokens),
        "mixed_group_share": _ratio(mixed, torch.tensor(n_groups)),
        "distinct_tokens_per_group": len(s) / n_groups if n_groups else 0.0,
    }


def _from_advantages(advantages: Tensor, mask: ArrayLike | None, rollout_advantage: ArrayLike | None, group: Any,
                     correct: ArrayLike | None, weight: float, key_threshold: float) -> dict[str, float]:
    if mask is None or rollout_advantage is None or group is None or correct is None:
        raise ValueError("ktae_metrics from advantages needs mask, rollout_advantage, group and correct")
    if not isinstance(advantages, Tensor) or advantages.dim() != 2 or advantages.dtype.is_complex \
            or advantages.dtype == torch.bool:
        got = f"{advantages.dtype} {tuple(advantages.shape)}" if isinstance(advantages, Tensor) \
            else type(advantages).__name__
        raise ValueError(f"`advantages` must be a real [B, L] tensor, got {got}")
    shape, device = tuple(advantages.shape), advantages.device
    mask = _on(device, "mask", mask)
    if tuple(mask.shape) != shape:
        raise ValueError(f"`mask` must have the shape of `advantages` {shape}, got {tuple(mask.shape)}")
    base = _on(device, "rollout_advantage", rollout_advantage)
    if base.dtype.is_complex or base.dtype == torch.bool or tuple(base.shape) != shape[:1]:
        raise ValueError(f"`rollout_advantage` must be real with shape [B] = [{shape[0]}], "
                         f"got {base.dtype} {tuple(base.shape)}")
    base = base.to(advantages.dtype)
    values: dict[str, float] = {}
    if weight != 0:  # |score| * |weight| = |advantage - A_i| on masked tokens
        tokens, total, keys = _magnitudes(advantages, mask, base, key_threshold * abs(weight), key_threshold <= 0)
        values["score_abs_mean"] = _ratio(total / abs(weight), tokens)
        values["key_token_share"] = _ratio(keys, tokens)
    else:  # no score reaches the advantages
        values["score_abs_mean"] = values["key_token_share"] = 0.0
    values["mixed_group_share"] = _mixed_share(group, correct, shape[0])
    return values


def _on(device: torch.device, name: str, value: ArrayLike) -> Tensor:
    """The caller's ``name`` (a tensor, numpy array or list) as a tensor on ``device``."""
    return as_tensor(name, value).detach().to(device)


#: rows of ``[B, L]`` the metrics take at a time on the CPU, so that their temporaries stay in cache: on
#: a paper-sized verl batch (16,384 x 3072, int64 mask) the whole-batch passes took about 1.1 s a step,
#: with new pages for every temporary. On a GPU the batch is one chunk (no host sync per chunk).
CPU_METRIC_ROWS = 64


def _magnitudes(advantages: Tensor, mask: Tensor, base: Tensor, threshold: float,
                key_needs_mask: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Masked tokens, the sum of ``|advantage - A_i|`` over them (float64 over blocks) and how many reach
    ``threshold`` (only masked ones when ``key_needs_mask``: zeros off the mask would count)."""
    rows = CPU_METRIC_ROWS if advantages.device.type == "cpu" else max(advantages.shape[0], 1)
    tokens = torch.zeros((), dtype=torch.int64, device=advantages.device)
    total = torch.zeros((), dtype=torch.float64, device=advantages.device)
    keys = torch.zeros((), dtype=torch.int64, device=advantages.device)
    for start in range(0, advantages.shape[0], rows):
        on = mask[start:start + rows] != 0
        magnitude = advantages[start:start + rows].sub(base[start:start + rows, None]).abs_().mul_(on)
        key = magnitude >= threshold
        if key_needs_mask:
            key.logical_and_(on)
        tokens += torch.count_nonzero(on)  # (a bool sum would widen every element first)
        total += magnitude.sum()
        keys += torch.count_nonzero(key)
    return tokens, total, keys


def _mixed_share(group: Any, correct: ArrayLike, batch_size: int) -> float:
    """Share of groups whose rollouts are neither all correct nor all wrong (``group``: the caller's
    index, made dense as the API does; ``correct``: ``[B]`` flags, checked as the API checks them)."""
    flags = correct_flags(correct, batch_size, torch.device("cpu")).long()
    dense, labels = dense_group_ids(group, batch_size, torch.device("cpu"), name="group")
    if batch_size == 0:
        return 0.0
    n = len(labels)
    size = torch.bincount(dense, minlength=n)
    n_c = torch.bincount(dense, weights=flags.double(), minlength=n).long()
    return _ratio(((n_c > 0) & (n_c < size)).sum(), torch.tensor(n))
