"""Data-parallel KTAE: the rollouts of a group spread over the ranks of a ``torch.distributed`` group.

Each rank passes only its own rows. Every rank gets, for its rows, exactly what one process computes
on the concatenation of all ranks' rows (rank 0's first): the same dense group ids, statistics,
scores and advantages. What travels, per call:

- the group labels present on each rank and what the call was given (``all_gather_object``, so string
  uids work): the entry point, the config and whether ``rollout_advantage`` / ``correct`` were passed.
  Every rank checks these agree before any collective depends on them, so a mismatch is a ValueError
  on every rank, not a hang;
- per-group ``size, n_c, T_c, T_w`` (one ``all_reduce`` of an int64 ``[4, n_groups]`` tensor);
- the ``(group, token, a, b, f_c, f_w)`` rows of the groups that are split across ranks only
  (``all_gather``; a group held by one rank never leaves it). Rollouts are never split, so the
  integer counts simply add up;
- for the ``grpo`` / ``mean`` baselines without a caller-given advantage, every row's reward and
  group id (``all_gather`` of ``[B]``), so the group mean / std are summed in the one-process order.

Tables and statistics use the torch backend's stages on the batch's device (CPU with gloo, CUDA
with NCCL); the GPU backends are not used in this mode. Every rank must pass the same config, and
either every rank or none a ``rollout_advantage`` (and a ``correct``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import method
from .checks import label_kind
from .backends import torch as tb
from .config import KTAEConfig
from .options import DEFAULT_OPTIONS, ExecutionOptions
from .registry import DISTRIBUTED_BACKENDS
from .types import Batch, KeyTokenScores

#: token ids are < 2**31 (checked by the API), so (group, token) packs as ``group << 31 | token``.
TOKEN_BITS = 31


@dataclass(frozen=True)
class _Call:
    """What every rank must pass alike: the collectives after the first one depend on it."""

    entry: str
    config: KTAEConfig
    rollout_advantage: bool
    correct: bool


@dataclass(frozen=True)
class _Refused:
    """In place of a ``_Call``: this rank's arguments were refused with ``message``."""

    message: str


@dataclass(frozen=True)
class _Merged:
    """This rank's rows relabelled with global group ids, the global group counts, and the merged
    (group, token) tables of every group present on this rank."""

    batch: Batch
    stats: method.GroupStats
    tables: tb.Tables


class DataParallel:
    """The backend contract (``backends.base.Backend``) over the ranks of ``process_group``: the
    torch backend's stages, with the counts of split groups merged across ranks. ``backend``: the
    caller's ``backend=`` ("auto" or "torch")."""

    def __init__(self, process_group: Any, backend: str = "auto"):
        _check(process_group, backend)
        self.process_group = process_group

    def token_advantage(self, batch: Batch, config: KTAEConfig, given: Tensor | None,
                        out: Tensor | None = None, options: ExecutionOptions = DEFAULT_OPTIONS) -> Tensor:
        """float32 ``[B, L]`` advantages of this rank's rows (see ``api.token_advantage``), in ``out`` when given."""
        call = _Call("token_advantage", config, given is not None, batch.correct is not None)
        merged = _merge(batch, call, self.process_group)
        scores = tb.score_tables(merged.tables, merged.stats, config, merged.batch.group_labels)
        base = given if given is not None else _rollout_advantage(merged, config, self.process_group)
        return tb.combine(merged.batch, base, scores.score, merged.tables, config.weight, out)

    def key_token_scores(self, batch: Batch, config: KTAEConfig,
                         options: ExecutionOptions = DEFAULT_OPTIONS) -> KeyTokenScores:
        """Rows of every group with at least one rollout on this rank, group ids dense over the union
        of all ranks' labels; group tensors ``n_c, n_w, T_c, T_w`` and ``group_labels`` cover all groups."""
        call = _Call("key_token_scores", config, False, batch.correct is not None)
        merged = _merge(batch, call, self.process_group)
        return tb.score_tables(merged.tables, merged.stats, config, merged.batch.group_labels)


@contextmanager
def refusing(process_group: Any) -> Iterator[None]:
    """Context for the API's argument checks: when one raises, this rank joins the other ranks' first
    collective (``_relabel``) with the error, so that they raise a ValueError naming it instead of
    waiting for this rank, then the error is raised here (also when that collective fails: a peer gone).
    Nothing travels when the checks pass. A rank whose ``process_group`` is no group cannot tell the
    others: they wait for it as for any rank that does not call."""
    try:
        yield
    except Exception as err:
        if _joinable(process_group):
            gathered: list[Any] = [None] * dist.get_world_size(process_group)
            try:
                dist.all_gather_object(gathered, (None, _Refused(f"{type(err).__name__}: {err}")),
                                       group=process_group)
            except Exception:  # noqa: BLE001 - the caller's error is the one to report
                pass
        raise err


def _joinable(process_group: Any) -> bool:
    """Whether this process can take part in a collective of ``process_group`` (``_check_group``)."""
    try:
        _check_group(process_group)
    except ValueError:
        return False
    return True


def _merge(batch: Batch, call: _Call, process_group: Any) -> _Merged:
    """This rank's batch relabelled over every rank's groups (after every rank's ``call`` is checked to be
    the same), the global group statistics and the merged tables."""
    batch = _relabel(batch, call, process_group)
    local = method.group_stats(batch, call.config)
    counts = torch.stack([local.size, local.n_c, local.T_c, local.T_w])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)
    size, n_c, T_c, T_w = counts.unbind(0)
    stats = method.GroupStats(correct=local.correct, lengths=local.lengths, size=size, n_c=n_c, n_w=size - n_c, T_c=T_c, T_w=T_w)
    split = (local.size > 0) & (local.size < size)
    tables = _merge_tables(tb.build_tables(batch, local), split, process_group)
    return _Merged(batch=batch, stats=stats, tables=tables)


def _check(process_group: Any, backend: str) -> None:
    """ValueError unless ``backend`` is one a ``process_group`` call accepts and ``process_group`` a group of
    an initialised torch.distributed that holds this process."""
    if backend not in DISTRIBUTED_BACKENDS:
        raise ValueError(f"`backend` must be one of {DISTRIBUTED_BACKENDS} with a `process_group` (the torch path "
                         f"computes data-parallel statistics), got {backend!r}")
    _check_group(process_group)


def _check_group(process_group: Any) -> None:
    """ValueError naming ``process_group`` unless this process can take part in its collectives."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("`process_group` needs an initialised torch.distributed (call init_process_group first)")
    try:
        rank = dist.get_rank(process_group)
    except (ValueError, RuntimeError, AttributeError, TypeError):  # torch: "Group ... is not registered"
        raise ValueError(f"`process_group` must be a torch.distributed group (dist.group.WORLD or one made by "
                         f"dist.new_group), got {process_group!r}") from None
    if rank < 0:
        raise ValueError("`process_group` does not contain this process")


def _relabel(batch: Batch, call: _Call, process_group: Any) -> Batch:
    """The batch with dense group ids over the sorted union of every rank's labels, once every rank
    is known to have made the same ``call`` (ValueError on every rank else)."""
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (batch.group_labels, call), group=process_group)
    _check_same_call([c for _, c in gathered])
    labels = _union([g for g, _ in gathered])
    own = batch.group_labels  # in the union's dtype: numpy would search int64 and uint64 ids as float64
    position = np.searchsorted(labels, own.astype(labels.dtype)) if len(own) else np.zeros(0, np.int64)
    remap = torch.as_tensor(np.asarray(position, dtype=np.int64), device=batch.device)
    return dataclasses.replace(batch, group=remap[batch.group], group_labels=labels, members=None)


def _check_same_call(calls: list[_Call | _Refused]) -> None:
    """ValueError naming what differs unless every rank's ``_Call`` is the same (ranks in group order),
    or naming the error of the ranks that refused their arguments (``refusing``)."""
    refused = [f"rank {k}: {c.message}" for k, c in enumerate(calls) if isinstance(c, _Refused)]
    if refused:
        raise ValueError(f"another rank of `process_group` refused its arguments, so every rank stops: {'; '.join(refused)}")
    first = calls[0]
    if any(c.entry != first.entry for c in calls):
        raise ValueError(f"every rank of `process_group` must call the same function, got {_by_rank(calls, 'entry')}")
    if any(c.config != first.config for c in calls):
        raise ValueError(f"`config` must be the same on every rank of `process_group`, got {_by_rank(calls, 'config')}")
    for name in ("rollout_advantage", "correct"):
        if any(getattr(c, name) != getattr(first, name) for c in calls):
            given = [k for k, c in enumerate(calls) if getattr(c, name)]
            raise ValueError(f"`{name}` must be given on every rank of `process_group` or on none, got it on "
                             f"ranks {given} of {len(calls)}")


def _by_rank(calls: list[_Call], name: str) -> str:
    """The field ``name`` of each rank's call, for an error: "'a' on rank 0, 'b' on rank 1"."""
    return ", ".join(f"{getattr(c, name)!r} on rank {k}" for k, c in enumerate(calls))


def _union(arrays: list[np.ndarray]) -> np.ndarray:
    """Sorted distinct labels of all ranks, as ``np.unique`` gives them for one process."""
    arrays = [a for a in arrays if len(a)]
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    kinds = [_kind(a) for a in arrays]
    if len(set(kinds)) > 1:
        raise ValueError("`index` group ids must be of one kind on every rank (all ints, all strings or all bytes), "
                         f"got {', '.join(f'{k} ({a.dtype})' for k, a in zip(kinds, arrays))}")
    if kinds[0] == "int" and np.result_type(*arrays).kind == "f":  # uint64 beside signed ids: numpy would use float64
        arrays = _common_ints(arrays)
    try:
        return np.unique(np.concatenate(arrays))
    except TypeError as err:
        raise ValueError(f"`index` group ids must be mutually comparable across ranks: {err}") from None


def _kind(labels: np.ndarray) -> str | None:
    """``checks.label_kind`` of a rank's (non-empty, one-kind) labels: by their dtype or, in an object
    array, by the first label."""
    return label_kind(labels.dtype.type) or label_kind(type(labels[0]))


def _common_ints(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The ranks' int labels in one dtype, as one process's ``np.asarray`` of them all would hold them:
    int64, or uint64 when ids from 2**63 on sit beside no negative id (float64 would merge distinct ids);
    ValueError when both are there (no integer dtype holds them)."""
    top = max(int(a.max()) for a in arrays)
    bottom = min(int(a.min()) for a in arrays)
    if top <= np.iinfo(np.int64).max:
        return [a.astype(np.int64) for a in arrays]
    if bottom >= 0:
        return [a.astype(np.uint64) for a in arrays]
    raise ValueError(f"`index` group ids must fit one integer dtype over every rank, got ids up to {top} (past "
                     f"int64) and down to {bottom} (below 0)")


def _merge_tables(local: tb.Tables, split: Tensor, process_group: Any) -> tb.Tables:
    """Tables of this rank's groups, counts summed over every rank holding part of a group.

    ``runs.row`` maps this rank's runs of sorted masked positions to the merged rows.
    """
    rows = torch.stack([local.group, local.token, local.a, local.b, local.f_c, local.f_w], dim=1)
    shared = split[local.group]
    others, _, _ = _all_gather_rows(rows[shared], process_group)
    others = others[split[others[:, 0]]]  # rows of the split groups present here (this rank's included)
    rows = torch.cat([rows[~shared], others])
    uniq, inverse = torch.unique(_pack(rows[:, 0], rows[:, 1]), return_inverse=True)
    summed = torch.zeros(uniq.shape[0], 4, dtype=torch.int64, device=rows.device).index_add_(0, inverse, rows[:, 2:])
    local_row = torch.searchsorted(uniq, _pack(local.group, local.token))
    a, b, f_c, f_w = summed.unbind(1)
    return tb.Tables(group=uniq >> TOKEN_BITS, token=uniq & ((1 << TOKEN_BITS) - 1), a=a, b=b, f_c=f_c, f_w=f_w,
                     runs=dataclasses.replace(local.runs, row=local_row))


def _pack(group: Tensor, token: Tensor) -> Tensor:
    return (group << TOKEN_BITS) | token


def _rollout_advantage(merged: _Merged, config: KTAEConfig, process_group: Any) -> Tensor:
    """float64 ``[B]`` baseline of this rank's rows, summed in the one-process order."""
    batch = merged.batch
    if config.baseline == "none":
        return method.rollout_advantage(batch.rewards, batch.group, merged.stats.size, config, None)
    rows = torch.stack([batch.rewards.contiguous().view(torch.int64), batch.group], dim=1)  # rewards' bits travel exactly
    everyone, offset, n = _all_gather_rows(rows, process_group)
    rewards = everyone[:, 0].view(torch.float64)
    full = Batch(responses=everyone.new_zeros(everyone.shape[0], 0), mask=everyone.new_zeros(everyone.shape[0], 0, dtype=torch.bool),
                 rewards=rewards, group=everyone[:, 1], group_labels=batch.group_labels)
    return method.rollout_advantage(full.rewards, full.group, merged.stats.size, config, None)[offset:offset + n]


def _all_gather_rows(rows: Tensor, process_group: Any) -> tuple[Tensor, int, int]:
    """Concatenation (in rank order) of every rank's int64 ``[n_r, k]`` rows, this rank's offset in
    it and its row count."""
    world = dist.get_world_size(process_group)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=process_group)
    sizes = [int(c) for c in counts]
    rank = dist.get_rank(process_group)
    offset = sum(sizes[:rank])
    if max(sizes) == 0:
        return rows, offset, rows.shape[0]
    padded = rows.new_zeros(max(sizes), rows.shape[1])
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=process_group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]), offset, rows.shape[0]
