"""Triton backend: a whole batch in a few kernels, on CUDA (or on CPU under ``TRITON_INTERPRET=1``).

``token_advantage`` runs ``nosync`` (seven kernels, allocations from ``B``, ``L`` and the group count,
one read of a flag vector at the end; capturable in a CUDA graph with ``out=``) and falls back to
the synchronising pipeline below only for what that path flags (groups past the device grid,
overflowed first tables, ``fisher="upstream"``). ``key_token_scores`` (whose row count must reach
the host) always takes the pipeline below:

groups (``method.group_stats``, [B]-sized) -> ``tables``: one hash table per group, filled from one
read of the tokens -> per-table statistics (``statistics``: every table of the groups' sizes, computed
on the device and cached there) -> ``scores``: one kernel per occupied slot (lookup of its table's statistics,
direction, score) -> ``advantage``: one kernel that looks every token's score up and writes
``[B, L]``. Working memory is O(masked tokens), never groups x vocabulary. Every launch runs on the
batch's device. ``fisher="upstream"`` computes its float32 p-values with
``ktae_kernels.fisher.upstream_pvalue`` (bit-faithful to the published code) over the distinct tables.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ... import method
from ...config import KTAEConfig
from ...types import Batch, KeyTokenScores
from ..device import on_device
from . import nosync
from .advantage import token_advantages
from .scores import RowStats, TableLookup, kernel_constants, score_rows, table_lookup
from .tables import HashTables, Rows, build_hash_tables, occupied_rows, row_counts

__all__ = ["key_token_scores", "token_advantage", "pipeline", "Pipeline"]


def key_token_scores(batch: Batch, config: KTAEConfig) -> KeyTokenScores:
    with on_device(batch.device):
        stats = method.group_stats(batch, config)
        tables = build_hash_tables(batch, stats)
        rows = occupied_rows(tables, sort=True)
        counts = row_counts(tables, rows)
        lookup, _ = table_lookup(tables, rows, stats, config, counts)
        _, out = score_rows(tables, rows, stats, config, kernel_constants(config, batch.device), lookup, write_rows=True)
        return _scores(batch, stats, counts, rows, out)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None) -> Tensor:
    with on_device(batch.device):
        done = nosync.token_advantage(batch, config, given, out)
        if done is not None:
            return done
        return synchronising_token_advantage(batch, config, given, out)


def synchronising_token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None,
                                  out: Tensor | None = None) -> Tensor:
    """``token_advantage`` by the path that reads sizes back mid-pipeline (``tables.build_hash_tables``):
    any group size, table rebuilds, ``fisher="upstream"``; ``out`` untouched on an id error."""
    with on_device(batch.device):
        p = pipeline(batch, config)
        base = method.rollout_advantage(batch.rewards, batch.group, p.stats.size, config, given)
        return token_advantages(batch, p.tables, p.slot_score, base, p.consts, out)


@dataclass(frozen=True)
class Pipeline:
    """The stages of ``token_advantage`` before the rollout advantage (bench/gpu_check.py times each)."""

    consts: Tensor
    stats: method.GroupStats
    tables: HashTables
    rows: Rows
    lookup: TableLookup
    slot_score: Tensor


def pipeline(batch: Batch, config: KTAEConfig) -> Pipeline:
    """Run the stages of ``token_advantage`` up to the per-slot scores."""
    consts = kernel_constants(config, batch.device)
    stats = method.group_stats(batch, config)
    tables = build_hash_tables(batch, stats)
    rows = occupied_rows(tables, sort=False)
    lookup, _ = table_lookup(tables, rows, stats, config)
    slot_score, _ = score_rows(tables, rows, stats, config, consts, lookup, write_rows=False)
    return Pipeline(consts, stats, tables, rows, lookup, slot_score)


def _scores(batch: Batch, stats: method.GroupStats, counts, rows: Rows, out: RowStats) -> KeyTokenScores:
    g = rows.group.long()
    return KeyTokenScores(
        group=g, token=counts.token, a=counts.a, b=counts.b, c=stats.n_c[g] - counts.a, d=stats.n_w[g] - counts.b,
        f_c=counts.f_c, f_w=counts.f_w, p_value=out.p_value, F=out.F, IG=out.IG, x=out.x, score=out.score,
        n_c=stats.n_c, n_w=stats.n_w, T_c=stats.T_c, T_w=stats.T_w, group_labels=batch.group_labels,
    )
