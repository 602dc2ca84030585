"""Vectorised torch backend: the four KTAE stages over all groups at once, on CPU or CUDA.

groups -> tables (one stable sort of (group, token) keys) -> statistics (``method``: once per distinct
table, then per row) -> advantage. No Python loop over groups or tokens; working memory is O(B * L),
independent of the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import method
from ..config import KTAEConfig
from ..method import GroupStats, group_stats
from ..options import DEFAULT_OPTIONS, ExecutionOptions
from ..primitives import flat_nonzero, gather, masked_values, prefix_sums, repeat_counts, scatter_masked
from ..types import Batch, KeyTokenScores


@dataclass(frozen=True)
class Runs:
    """The masked positions sorted by (group, token): one run of positions per row.

    order: int64 ``[N]``, the row-major (``masked_select``) index of each sorted position;
    rollout: int32 ``[N]``, its rollout; length: int64 ``[R]``, the run lengths;
    row: int64 ``[R]``, the table row of each run, or None when run ``r`` is row ``r``.
    """

    order: Tensor
    rollout: Tensor
    length: Tensor
    row: Tensor | None = None


@dataclass(frozen=True)
class Tables(method.Rows):
    """``method.Rows`` (one per (group, token) present) and the sorted masked positions that built them."""

    runs: Runs | None = None


def score_tables(tables: Tables, stats: GroupStats, config: KTAEConfig, labels) -> KeyTokenScores:
    """Statistics stage over all rows at once (``method.score_rows``)."""
    return method.score_rows(tables, stats.n_c, stats.n_w, stats.T_c, stats.T_w, config, labels)


def build_tables(batch: Batch, stats: GroupStats) -> Tables:
    """(group, token) tables from one stable sort of packed ``group << bits | token`` keys.

    The sort is stable and positions start in row-major order, so inside a (group, token) run the
    positions of one rollout are adjacent: a new rollout starts wherever the rollout id changes.
    Counts are differences of int32 prefix sums at the run starts (N < 2**31 masked positions).
    """
    lengths = stats.lengths
    tokens = masked_values(batch.responses, batch.mask)
    token_bits = max(int(tokens.max()).bit_length(), 1) if tokens.numel() else 1
    group_bits = max(batch.n_groups - 1, 1).bit_length()
    key_dtype = torch.int32 if token_bits + group_bits <= 31 else torch.int64
    keys = repeat_counts(batch.group.to(key_dtype) << token_bits, lengths) | tokens.to(key_dtype)
    keys, order = torch.sort(keys, stable=True)
    rollout = gather(repeat_counts(torch.arange(lengths.shape[0], dtype=torch.int32, device=batch.device), lengths), order)
    n = keys.shape[0]
    new_row = torch.ones(n, dtype=torch.bool, device=keys.device)
    torch.ne(keys[1:], keys[:-1], out=new_row[1:])
    new_rollout = new_row.clone()
    new_rollout[1:] |= rollout[1:] != rollout[:-1]
    is_c = gather(stats.correct, rollout)
    starts = flat_nonzero(new_row)
    ends = torch.cat([starts[1:], starts.new_tensor([n])])
    f_c = _run_sums(is_c, starts, ends)
    a = _run_sums(is_c & new_rollout, starts, ends)
    row_keys = keys[starts].long()
    return Tables(
        group=row_keys >> token_bits,
        token=row_keys & ((1 << token_bits) - 1),
        a=a, b=_run_sums(new_rollout, starts, ends) - a, f_c=f_c, f_w=(ends - starts) - f_c,
        runs=Runs(order=order, rollout=rollout, length=ends - starts),
    )


def _run_sums(flags: Tensor, starts: Tensor, ends: Tensor) -> Tensor:
    """int64 sums of bool ``flags [n]`` over the runs ``[starts, ends)``."""
    csum = prefix_sums(flags)
    return (gather(csum, ends) - gather(csum, starts)).long()


def combine(batch: Batch, base: Tensor, row_score: Tensor, tables: Tables, weight: float,
            out: Tensor | None = None) -> Tensor:
    """float32 ``[B, L]``: ``A_i + weight * score`` at masked positions (float64 sum, rounded once), 0 elsewhere;
    written into ``out`` when given.

    Computed in the sorted order, where each row's score is one contiguous run, then put back.
    """
    runs = tables.runs
    run_score = row_score if runs.row is None else row_score[runs.row]
    sorted_values = repeat_counts(run_score, runs.length).mul_(weight).add_(gather(base, runs.rollout)).to(torch.float32)
    values = torch.empty_like(sorted_values).index_copy_(0, runs.order, sorted_values)
    return scatter_masked(batch.mask, values, out)


def key_token_scores(batch: Batch, config: KTAEConfig, options: ExecutionOptions = DEFAULT_OPTIONS) -> KeyTokenScores:
    stats = group_stats(batch, config)
    return score_tables(build_tables(batch, stats), stats, config, batch.group_labels)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None,
                    options: ExecutionOptions = DEFAULT_OPTIONS) -> Tensor:
    stats = group_stats(batch, config)
    tables = build_tables(batch, stats)
    scores = score_tables(tables, stats, config, batch.group_labels)
    base = method.rollout_advantage(batch.rewards, batch.group, stats.size, config, given)
    return combine(batch, base, scores.score, tables, config.weight, out)
