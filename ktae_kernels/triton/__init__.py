"""Triton backend: a whole batch in a few kernels, on CUDA (or on CPU under ``TRITON_INTERPRET=1``).

groups (torch, [B]-sized) -> ``tables``: one hash table per group, filled from one read of the tokens
-> ``scores``: one fused kernel per occupied slot (table, Fisher p, F, IG, direction, score)
-> ``advantage``: one kernel that looks every token's score up and writes ``[B, L]``.
Working memory is O(masked tokens), never groups x vocabulary. ``fisher="upstream"`` computes its
float32 p-values on the CPU (``ktae_kernels.fisher.upstream_pvalue``, bit-faithful to the published
code); everything else stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from ..config import KTAEConfig
from ..torch_backend import group_stats, rollout_advantage
from ..types import Batch, KeyTokenScores
from .advantage import token_advantages
from .fisher import fisher_exact_pvalues
from .scores import kernel_constants, score_rows
from .tables import build_hash_tables, interpreting, occupied_rows, row_counts

__all__ = ["key_token_scores", "token_advantage", "fisher_exact_pvalues", "profile", "interpreting"]


def key_token_scores(batch: Batch, config: KTAEConfig) -> KeyTokenScores:
    stats = group_stats(batch, config)
    tables = build_hash_tables(batch, stats)
    rows = occupied_rows(tables, sort=True)
    counts = row_counts(tables, rows)
    _, out = score_rows(tables, rows, stats, config, kernel_constants(config, batch.device), counts, write_rows=True)
    g = rows.group.long()
    return KeyTokenScores(
        group=g, token=counts.token, a=counts.a, b=counts.b, c=stats.n_c[g] - counts.a, d=stats.n_w[g] - counts.b,
        f_c=counts.f_c, f_w=counts.f_w, p_value=out.p_value, F=out.F, IG=out.IG, x=out.x, score=out.score,
        n_c=stats.n_c, n_w=stats.n_w, T_c=stats.T_c, T_w=stats.T_w, group_labels=batch.group_labels,
    )


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None) -> Tensor:
    p = _pipeline(batch, config)
    base = rollout_advantage(batch, p.stats, config, given)
    result = token_advantages(batch, p.tables, p.slot_score, base, p.consts)
    return result if out is None else out.copy_(result)


@dataclass(frozen=True)
class _Pipeline:
    """The stages of ``token_advantage`` before the rollout advantage, kept for ``profile``."""

    consts: Tensor
    stats: Any
    tables: Any
    rows: Any
    counts: Any
    slot_score: Tensor


def _pipeline(batch: Batch, config: KTAEConfig) -> _Pipeline:
    consts = kernel_constants(config, batch.device)
    stats = group_stats(batch, config)
    tables = build_hash_tables(batch, stats)
    rows = occupied_rows(tables, sort=False)
    counts = row_counts(tables, rows) if config.fisher == "upstream" else None
    slot_score, _ = score_rows(tables, rows, stats, config, consts, counts, write_rows=False)
    return _Pipeline(consts, stats, tables, rows, counts, slot_score)


def profile(batch: Batch, config: KTAEConfig | None = None, *, rep_ms: int = 100) -> dict[str, float]:
    """Median milliseconds of each stage of ``token_advantage`` on a CUDA batch, by
    ``triton.testing.do_bench`` (each stage re-run on the previous stages' outputs).

    ``batch``: a validated ``Batch`` (``ktae_kernels.api.normalise_batch(responses, mask, rewards,
    index)``) on a CUDA device. Keys: ``groups``, ``tables`` (includes its host syncs and any
    rebuild), ``rows``, ``scores``, ``rollout``, ``advantage`` and ``total`` (``token_advantage``).
    """
    from triton.testing import do_bench

    if batch.device.type != "cuda" or interpreting():
        raise ValueError("profile: `batch` must be on a CUDA device, with the Triton interpreter off")
    config = config or KTAEConfig()
    p = _pipeline(batch, config)
    consts, stats, tables, rows, counts = p.consts, p.stats, p.tables, p.rows, p.counts
    base = rollout_advantage(batch, stats, config, None)
    stages: dict[str, Callable[[], Any]] = {
        "groups": lambda: group_stats(batch, config),
        "tables": lambda: build_hash_tables(batch, stats),
        "rows": lambda: occupied_rows(tables, sort=False),
        "scores": lambda: score_rows(tables, rows, stats, config, consts, counts, write_rows=False),
        "rollout": lambda: rollout_advantage(batch, stats, config, None),
        "advantage": lambda: token_advantages(batch, tables, p.slot_score, base, consts),
        "total": lambda: token_advantage(batch, config, None),
    }
    return {name: float(do_bench(fn, rep=rep_ms, return_mode="median")) for name, fn in stages.items()}
