"""Triton backend: a whole batch in a few kernels, on CUDA (or on CPU under ``TRITON_INTERPRET=1``).

groups (torch, [B]-sized) -> ``tables``: one hash table per group, filled from one read of the tokens
-> per-table statistics (``method.table_statistics``: once per distinct ``(a, b, n_c, n_w)``)
-> ``scores``: one kernel per occupied slot (lookup of its table's statistics, direction, score)
-> ``advantage``: one kernel that looks every token's score up and writes ``[B, L]``.
Working memory is O(masked tokens), never groups x vocabulary. Every launch runs on the batch's
device (a device guard, whatever device is current). ``fisher="upstream"`` computes its float32
p-values with ``ktae_kernels.fisher.upstream_pvalue`` (bit-faithful to the published code) over the
distinct tables.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..config import KTAEConfig
from ..torch_backend import group_stats, rollout_advantage
from ..types import Batch, KeyTokenScores
from .advantage import token_advantages
from .fisher import fisher_exact_pvalues
from .scores import full_grid_lookup, kernel_constants, score_rows, table_lookup
from .tables import build_hash_tables, interpreting, occupied_rows, row_counts

__all__ = ["key_token_scores", "token_advantage", "fisher_exact_pvalues", "profile", "interpreting"]

#: the token-id range check is folded into the table build (``tables.check_ids``), so the API skips
#: its own pass over the ids.
CHECKS_TOKEN_IDS = True


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the launches: Triton launches on the current CUDA device."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def key_token_scores(batch: Batch, config: KTAEConfig) -> KeyTokenScores:
    with _on_device(batch.device):
        stats = group_stats(batch, config)
        tables = build_hash_tables(batch, stats)
        rows = occupied_rows(tables, sort=True)
        counts = row_counts(tables, rows)
        lookup, _ = table_lookup(tables, rows, stats, config, counts)
        _, out = score_rows(tables, rows, stats, config, kernel_constants(config, batch.device), lookup, write_rows=True)
        g = rows.group.long()
        return KeyTokenScores(
            group=g, token=counts.token, a=counts.a, b=counts.b, c=stats.n_c[g] - counts.a, d=stats.n_w[g] - counts.b,
            f_c=counts.f_c, f_w=counts.f_w, p_value=out.p_value, F=out.F, IG=out.IG, x=out.x, score=out.score,
            n_c=stats.n_c, n_w=stats.n_w, T_c=stats.T_c, T_w=stats.T_w, group_labels=batch.group_labels,
        )


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None) -> Tensor:
    with _on_device(batch.device):
        p = _pipeline(batch, config)
        base = rollout_advantage(batch, p.stats, config, given)
        return token_advantages(batch, p.tables, p.slot_score, base, p.consts, out)


@dataclass(frozen=True)
class _Pipeline:
    """The stages of ``token_advantage`` before the rollout advantage, kept for ``profile``."""

    consts: Tensor
    stats: Any
    tables: Any
    rows: Any
    lookup: Any
    slot_score: Tensor


def _pipeline(batch: Batch, config: KTAEConfig) -> _Pipeline:
    consts = kernel_constants(config, batch.device)
    stats = group_stats(batch, config)
    # the per-table statistics are prepared on the host while the insert kernel runs
    tables = build_hash_tables(batch, stats, lambda counts: full_grid_lookup(counts, config, batch.device))
    rows = occupied_rows(tables, sort=False)
    lookup, _ = table_lookup(tables, rows, stats, config)
    slot_score, _ = score_rows(tables, rows, stats, config, consts, lookup, write_rows=False)
    return _Pipeline(consts, stats, tables, rows, lookup, slot_score)


def profile(batch: Batch, config: KTAEConfig | None = None, *, rep_ms: int = 100) -> dict[str, float]:
    """Median milliseconds of each stage of ``token_advantage`` on a CUDA batch, by
    ``triton.testing.do_bench`` (each stage re-run on the previous stages' outputs).

    ``batch``: a validated ``Batch`` (``ktae_kernels.api.normalise_batch(responses, mask, rewards,
    index)``) on a CUDA device. Keys: ``groups``, ``tables`` (includes its host syncs and any
    rebuild), ``rows``, ``statistics`` (the per-table statistics), ``scores``, ``rollout``,
    ``advantage`` and ``total`` (``token_advantage``).
    """
    from triton.testing import do_bench

    if batch.device.type != "cuda" or interpreting():
        raise ValueError("profile: `batch` must be on a CUDA device, with the Triton interpreter off")
    config = config or KTAEConfig()
    with _on_device(batch.device):
        p = _pipeline(batch, config)
        consts, stats, tables, rows, lookup = p.consts, p.stats, p.tables, p.rows, p.lookup
        base = rollout_advantage(batch, stats, config, None)
        out = torch.empty(batch.responses.shape, dtype=torch.float32, device=batch.device)
        stages: dict[str, Callable[[], Any]] = {
            "groups": lambda: group_stats(batch, config),
            "tables": lambda: build_hash_tables(batch, stats),
            "rows": lambda: occupied_rows(tables, sort=False),
            "statistics": lambda: table_lookup(tables, rows, stats, config),
            "scores": lambda: score_rows(tables, rows, stats, config, consts, lookup, write_rows=False),
            "rollout": lambda: rollout_advantage(batch, stats, config, None),
            "advantage": lambda: token_advantages(batch, tables, p.slot_score, base, consts, out),
            "total": lambda: token_advantage(batch, config, None, out),
        }
        return {name: float(do_bench(fn, rep=rep_ms, return_mode="median")) for name, fn in stages.items()}
