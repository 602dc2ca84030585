"""The score stage: per occupied slot, a lookup of its table's statistics and the per-row
direction and squash, in one kernel over the flat rows of ``tables.occupied_rows``.

The Fisher p-value, ``F``, ``IG`` and Cohen's ``h`` depend only on the table ``(a, b, n_c, n_w)``,
so they are computed once per table of the grid of every group of up to ``bound`` rollouts, on the
device, by ``statistics.grid_statistics_kernel``, and cached there per (alpha, beta, bound, device)
(``device.grid_statistics``); every row looks its table up at ``offset[g] + a * stride[g] + b``,
offsets in closed form on the device. Past ``device.GRID_MAX_GROUP`` rollouts, or with
``fisher="upstream"`` (whose p-value depends on the group's rows), only the tables the rows use are
computed, from the rows' counts (``method.row_statistics``).

The kernel then does the only per-row maths, in float64 with FP contraction off (one rounding per
operation, as on the CPU): ``x = h + BM25 TF ratio``, ``key = strength * x / (alpha + beta)``,
``score = top * tanh(key / 2)`` kept strictly inside ``(-top, top)``, 0 where the table is not
informative and for ``ignore_token_ids``. Every float64 constant, and the ignored ids, reach the
kernel in one float64 tensor (a Python float argument would be float32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import method
from ...config import KTAEConfig
from ...method import TF_EPS, GroupStats
from ...validation import MAX_TOKEN_ID
from ..device import grid_statistics, upload
from .statistics import grid_statistics_kernel
from .tables import HashTables, RowCounts, Rows, load_row_counts, row_counts

#: indices into the float64 constant vector of the score and advantage kernels (``kernel_constants``),
#: then the ignored token ids.
_ALPHA, _BETA, _TOP, _BOUND, _K1, _B, _TF_EPS, WEIGHT, _IGNORE = (tl.constexpr(i) for i in range(9))
_BLOCK = 128


@dataclass(frozen=True)
class RowStats:
    """float64 ``[U]`` per row: ``p_value, F, IG, x, score`` (empty when not asked for)."""

    p_value: Tensor
    F: Tensor
    IG: Tensor
    x: Tensor
    score: Tensor


@dataclass(frozen=True)
class TableLookup:
    """Per-table statistics on the device: ``index`` int64 ``[2, n_groups]`` (each group's grid offset
    and stride) and ``values`` float64 ``[5, size]`` (``p_value, F, IG, h, strength``)."""

    index: Tensor
    values: Tensor


def device_constants(values: list[float], device: torch.device | str) -> Tensor:
    """float64 ``values`` on ``device`` in one copy that does not wait for the device's queue."""
    return upload(torch.tensor(values, dtype=torch.float64), torch.device(device))


@triton.jit
def _bm25_tf(f, T, avg, k1, b):
    """BM25 saturated frequency of ``f`` occurrences (int64) in a pooled document of ``T`` tokens."""
    q = f.to(tl.float64) / tl.maximum(T, 1).to(tl.float64)
    K = k1 * (1.0 - b + b * T.to(tl.float64) / avg)
    return tl.where(f > 0, q * (k1 + 1.0) / (q + K), 0.0)


@triton.jit
def _direction(x, f_c, f_w, T_c, T_w, avg, k1, bm, eps):
    """``x`` plus the BM25 term-frequency ratio of ``f_c, f_w`` (``method.tf_ratio``)."""
    tf_c = _bm25_tf(f_c, T_c, avg, k1, bm)
    tf_w = _bm25_tf(f_w, T_w, avg, k1, bm)
    return x + (tf_c / (tf_w + eps) - tf_w / (tf_c + eps))


@triton.jit
def _squash(strength, x, scorable, scale, top, bound):
    """``method.squash``: ``top * tanh(strength * x / scale / 2)`` inside ``(-bound, bound)``, 0 where not
    ``scorable``, never ``-0.0``."""
    squashed = tl.minimum(tl.maximum(top * _tanh_half(strength * x / scale), -bound), bound)
    return tl.where(scorable, squashed, 0.0) + 0.0


@triton.jit
def _tanh_half(key):
    """``tanh(key / 2)`` in float64 to ~1e-14 relative: ``-expm1(-|key|) / (1 + exp(-|key|))``,
    with a Taylor series for ``-expm1`` where ``1 - exp`` would cancel."""
    t = tl.abs(key)
    series = t * (1.0 - t / 2.0 * (1.0 - t / 3.0 * (1.0 - t / 4.0 * (1.0 - t / 5.0 * (1.0 - t / 6.0)))))
    m = tl.where(t < 0.02, series, 1.0 - tl.exp(-t))
    return tl.where(key < 0, -1.0, 1.0) * m / (2.0 - m)


@triton.jit
def _score_kernel(slot_ptr, group_ptr, n_rows,
                  keys_ptr, occ_ptr, bits_ptr, correct_bits_ptr, words,
                  n_c_ptr, n_w_ptr, T_c_ptr, T_w_ptr, index_ptr, n_groups, values_ptr, grid_size,
                  const_ptr, n_ignore,
                  slot_score_ptr, p_ptr, F_ptr, IG_ptr, x_ptr, score_ptr,
                  USE_TF: tl.constexpr, WRITE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Scores of ``BLOCK`` rows; the score goes to ``slot_score[slot]`` and, with ``WRITE_ROWS``,
    every statistic to the row outputs. ``index``: int64 ``[2, n_groups]`` grid offset and stride;
    ``values``: float64 ``[5, grid_size]`` p, F, IG, h, strength per table."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=valid, other=0)
    g = tl.load(group_ptr + rows, mask=valid, other=0)
    token, a, b, f_c, f_w = load_row_counts(keys_ptr, occ_ptr, bits_ptr, correct_bits_ptr, words, slot, g, valid)
    n_c = tl.load(n_c_ptr + g, mask=valid, other=0).to(tl.int32)
    n_w = tl.load(n_w_ptr + g, mask=valid, other=0).to(tl.int32)
    entry = (tl.load(index_ptr + g, mask=valid, other=0)
             + a.to(tl.int64) * tl.load(index_ptr + n_groups + g, mask=valid, other=0) + b)
    x = tl.load(values_ptr + 3 * grid_size + entry, mask=valid, other=0.0)
    strength = tl.load(values_ptr + 4 * grid_size + entry, mask=valid, other=0.0)
    if USE_TF:
        T_c = tl.load(T_c_ptr + g, mask=valid, other=1)
        T_w = tl.load(T_w_ptr + g, mask=valid, other=1)
        avg = (T_c + T_w).to(tl.float64) / 2.0
        k1 = tl.load(const_ptr + _K1)
        bm = tl.load(const_ptr + _B)
        eps = tl.load(const_ptr + _TF_EPS)
        x = _direction(x, f_c, f_w, T_c, T_w, avg, k1, bm, eps)

    scorable = (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)
    for k in range(n_ignore):
        scorable = scorable & (token != tl.load(const_ptr + _IGNORE + k).to(tl.int32))
    score = _squash(strength, x, scorable, tl.load(const_ptr + _ALPHA) + tl.load(const_ptr + _BETA),
                    tl.load(const_ptr + _TOP), tl.load(const_ptr + _BOUND))

    tl.store(slot_score_ptr + slot, score, mask=valid)
    if WRITE_ROWS:
        tl.store(p_ptr + rows, tl.load(values_ptr + entry, mask=valid, other=1.0), mask=valid)
        tl.store(F_ptr + rows, tl.load(values_ptr + grid_size + entry, mask=valid, other=0.0), mask=valid)
        tl.store(IG_ptr + rows, tl.load(values_ptr + 2 * grid_size + entry, mask=valid, other=0.0), mask=valid)
        tl.store(x_ptr + rows, x, mask=valid)
        tl.store(score_ptr + rows, score, mask=valid)


def kernel_constants(config: KTAEConfig, device: torch.device) -> Tensor:
    """float64 ``[8 + k]``: ``alpha, beta, top``, the largest float below ``top``, ``k1, b``, the TF
    epsilon, ``weight``, then the k ignored token ids that can occur (ids are below ``2**31``, exact
    in float64)."""
    top = config.top
    ignore = [float(t) for t in config.ignore_token_ids if t <= MAX_TOKEN_ID]
    values = [config.alpha, config.beta, top, math.nextafter(top, 0.0), config.k1, config.b, TF_EPS,
              config.weight, *ignore]
    return device_constants(values, device)


def table_lookup(tables: HashTables, rows: Rows, stats: GroupStats, config: KTAEConfig,
                 counts: RowCounts | None = None) -> tuple[TableLookup, RowCounts | None]:
    """The per-table statistics the rows look up, and the rows' counts if they had to be read
    (``counts``: already read ones, reused). The whole grid comes from the device cache
    (``device.grid_statistics``, computed by ``statistics.grid_statistics_kernel``); past its bound,
    or with ``fisher="upstream"``, only the tables the rows use (``method.row_statistics``)."""
    device = tables.keys.device
    found = grid_statistics(stats.n_c, stats.n_w, tables.largest, config, device, grid_statistics_kernel)
    if found is not None:
        return TableLookup(*found), counts
    if counts is None:
        counts = row_counts(tables, rows)
    tab_rows = method.Rows(group=rows.group.long(), token=counts.token, a=counts.a, b=counts.b,
                           f_c=counts.f_c, f_w=counts.f_w)
    grid, table, _ = method.row_statistics(tab_rows, stats.n_c, stats.n_w, config)
    index = torch.stack([grid.offset, grid.stride])
    values = torch.stack([table.p_value, table.F, table.IG, table.h, table.strength])
    return TableLookup(index, values), counts


def score_rows(tables: HashTables, rows: Rows, stats: GroupStats, config: KTAEConfig, consts: Tensor,
               lookup: TableLookup, write_rows: bool) -> tuple[Tensor, RowStats]:
    """Scores of every occupied slot: float64 ``[S]`` indexed by global slot (only occupied slots are
    written), and, with ``write_rows``, the per-row statistics. ``consts``: ``kernel_constants(config)``;
    ``lookup``: ``table_lookup(...)``.
    """
    device = tables.keys.device
    n = rows.slot.shape[0]
    slot_score = torch.empty(tables.keys.shape[0], dtype=torch.float64, device=device)
    out = RowStats(*(torch.empty(n if write_rows else 0, dtype=torch.float64, device=device) for _ in range(5)))
    if n == 0:
        return slot_score, out
    _score_kernel[(triton.cdiv(n, _BLOCK),)](
        rows.slot, rows.group, n, tables.keys, tables.occ, tables.bits, tables.correct_bits, tables.words,
        stats.n_c, stats.n_w, stats.T_c, stats.T_w, lookup.index, lookup.index.shape[1],
        lookup.values, lookup.values.shape[1], consts, consts.shape[0] - _IGNORE.value,
        slot_score, *((out.p_value, out.F, out.IG, out.x, out.score) if write_rows else (slot_score,) * 5),
        USE_TF=config.use_tf, WRITE_ROWS=write_rows, BLOCK=_BLOCK,
        enable_fp_fusion=False)
    return slot_score, out
