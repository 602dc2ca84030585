"""The statistics stage, fused: per occupied slot its table, Fisher p and ``F``, information gain,
direction and squashed score, in one kernel over the flat rows of ``tables.occupied_rows``.

Same formulas as ``torch_backend.score_tables`` (and the reference), in float64: ``F = exp(-2p)``
(0 where ``p`` counts as 1), ``IG`` in bits, ``x = h + TF ratio`` with Cohen's ``h`` read from a
per-group ``asin(sqrt(k / n))`` table (the interpreter has no libdevice ``asin``), and
``score = top * tanh(key / 2)``, kept strictly inside ``(-top, top)``. ``F`` and ``IG`` are 0 where
the table is not informative (one class only, or the token in every rollout); the score is 0 there
and for ``ignore_token_ids``. Every float64 constant, and the ignored ids, reach the kernels in one
float64 tensor (a Python float argument or literal would be float32).

With ``fisher="exact"`` the p-value is computed in the kernel (``fisher.fisher_pvalue``). With
``fisher="upstream"`` it is the published float32 computation, which runs on the CPU
(``torch_backend.table_statistics`` -> ``ktae_kernels.fisher.upstream_pvalue``, bit-faithful to the
published code) over the distinct tables, and is passed in with its ``F``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..api import MAX_TOKEN_ID
from ..config import KTAEConfig
from ..fisher import P_ONE, log_factorial_table
from .. import method
from ..method import TF_EPS
from ..torch_backend import GroupStats
from .fisher import FISHER_CONSTANTS, LOG_ERR, LOG_RTOL, device_constants, fisher_pvalue
from .tables import HashTables, RowCounts, Rows, load_row_counts

#: indices into the float64 constant vector of the score and advantage kernels (``kernel_constants``):
#: the two Fisher constants, then these, then the ignored token ids.
_ALPHA, _BETA, _TOP, _BOUND, _K1, _B, _TF_EPS, _P_ONE, WEIGHT, _IGNORE = (tl.constexpr(i) for i in range(2, 12))
_BLOCK = 128


@dataclass(frozen=True)
class RowStats:
    """float64 ``[U]`` per row: ``p_value, F, IG, x, score`` (empty when not asked for)."""

    p_value: Tensor
    F: Tensor
    IG: Tensor
    x: Tensor
    score: Tensor


@triton.jit
def _entropy_bits(p):
    """Binary entropy in bits of float64 ``p`` in [0, 1], with ``0 log 0 = 0``."""
    q = 1.0 - p
    return -(tl.where(p > 0, p * tl.log2(tl.maximum(p, 1e-30)), 0.0)
             + tl.where(q > 0, q * tl.log2(tl.maximum(q, 1e-30)), 0.0))


@triton.jit
def _information_gain(a, b, n_c, n_w):
    """``H(Y) - H(Y | X)`` in bits (float64, >= 0) from int32 cells."""
    n = tl.maximum(n_c + n_w, 1).to(tl.float64)
    present = a + b
    absent = n_c + n_w - present
    p_present = present.to(tl.float64)
    p_absent = absent.to(tl.float64)
    h_present = p_present / n * _entropy_bits(a.to(tl.float64) / tl.maximum(p_present, 1.0))
    h_absent = p_absent / n * _entropy_bits((n_c - a).to(tl.float64) / tl.maximum(p_absent, 1.0))
    h_y = _entropy_bits(n_c.to(tl.float64) / n)
    return tl.maximum(h_y - tl.where(present > 0, h_present, 0.0) - tl.where(absent > 0, h_absent, 0.0), 0.0)


@triton.jit
def _bm25_tf(f, T, avg, k1, b):
    """BM25 saturated frequency of ``f`` occurrences (int64) in a pooled document of ``T`` tokens."""
    q = f.to(tl.float64) / tl.maximum(T, 1).to(tl.float64)
    K = k1 * (1.0 - b + b * T.to(tl.float64) / avg)
    return tl.where(f > 0, q * (k1 + 1.0) / (q + K), 0.0)


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
                  n_c_ptr, n_w_ptr, T_c_ptr, T_w_ptr, asin_ptr, asin_c_ptr, asin_w_ptr,
                  lf_ptr, const_ptr, n_ignore, p_in_ptr, F_in_ptr,
                  slot_score_ptr, p_ptr, F_ptr, IG_ptr, x_ptr, score_ptr,
                  EXACT: tl.constexpr, USE_TF: tl.constexpr, WRITE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Statistics of ``BLOCK`` rows; the score goes to ``slot_score[slot]`` and, with ``WRITE_ROWS``,
    every statistic to the row outputs."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=valid, other=0)
    g = tl.load(group_ptr + rows, mask=valid, other=0)
    token, a, b, f_c, f_w = load_row_counts(keys_ptr, occ_ptr, bits_ptr, correct_bits_ptr, words, slot, g, valid)
    n_c = tl.load(n_c_ptr + g, mask=valid, other=0).to(tl.int32)
    n_w = tl.load(n_w_ptr + g, mask=valid, other=0).to(tl.int32)

    if EXACT:
        p = fisher_pvalue(a, b, n_c - a, n_w - b, lf_ptr, tl.load(const_ptr + LOG_RTOL), tl.load(const_ptr + LOG_ERR))
        F = tl.where(p >= tl.load(const_ptr + _P_ONE), 0.0, tl.exp(-2.0 * p))
    else:
        p = tl.load(p_in_ptr + rows, mask=valid, other=1.0)
        F = tl.load(F_in_ptr + rows, mask=valid, other=0.0)
    IG = _information_gain(a, b, n_c, n_w)

    x = (tl.load(asin_ptr + tl.load(asin_c_ptr + g, mask=valid, other=0) + a, mask=valid, other=0.0)
         - tl.load(asin_ptr + tl.load(asin_w_ptr + g, mask=valid, other=0) + b, mask=valid, other=0.0))
    if USE_TF:
        T_c = tl.load(T_c_ptr + g, mask=valid, other=1)
        T_w = tl.load(T_w_ptr + g, mask=valid, other=1)
        avg = (T_c + T_w).to(tl.float64) / 2.0
        k1 = tl.load(const_ptr + _K1)
        bm = tl.load(const_ptr + _B)
        eps = tl.load(const_ptr + _TF_EPS)
        tf_c = _bm25_tf(f_c, T_c, avg, k1, bm)
        tf_w = _bm25_tf(f_w, T_w, avg, k1, bm)
        x = x + (tf_c / (tf_w + eps) - tf_w / (tf_c + eps))

    informative = (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)
    F = tl.where(informative, F, 0.0)
    IG = tl.where(informative, IG, 0.0)
    scorable = informative
    for k in range(n_ignore):
        scorable = scorable & (token != tl.load(const_ptr + _IGNORE + k).to(tl.int32))
    alpha = tl.load(const_ptr + _ALPHA)
    beta = tl.load(const_ptr + _BETA)
    key = (alpha * F + beta * IG) * x / (alpha + beta)
    bound = tl.load(const_ptr + _BOUND)
    squashed = tl.minimum(tl.maximum(tl.load(const_ptr + _TOP) * _tanh_half(key), -bound), bound)
    score = tl.where(scorable, squashed, 0.0)

    tl.store(slot_score_ptr + slot, score, mask=valid)
    if WRITE_ROWS:
        tl.store(p_ptr + rows, p, mask=valid)
        tl.store(F_ptr + rows, F, mask=valid)
        tl.store(IG_ptr + rows, IG, mask=valid)
        tl.store(x_ptr + rows, x, mask=valid)
        tl.store(score_ptr + rows, score, mask=valid)


def cohen_table(stats: GroupStats) -> tuple[Tensor, Tensor, Tensor]:
    """``asin(sqrt(k / max(n, 1)))`` for ``k = 0..n`` of every group's ``n_c`` and ``n_w``.

    Returns the float64 values ``[B + 2 n_groups]`` and the int64 start ``[n_groups]`` of each
    group's correct and wrong part.
    """
    n = torch.stack([stats.n_c, stats.n_w], dim=1).reshape(-1)
    sizes = n + 1
    start = torch.cumsum(sizes, 0) - sizes
    total = stats.correct.shape[0] + 2 * stats.n_c.shape[0]  # sum of (n_c + 1) + (n_w + 1)
    k = torch.arange(total, device=n.device) - torch.repeat_interleave(start, sizes, output_size=total)
    denom = torch.repeat_interleave(n.clamp(min=1), sizes, output_size=total)
    values = torch.asin(torch.sqrt(k.double() / denom))
    return values, start[0::2].contiguous(), start[1::2].contiguous()


def kernel_constants(config: KTAEConfig, device: torch.device) -> Tensor:
    """float64 ``[12 + k]``: the Fisher constants, ``alpha, beta, top``, the largest float below
    ``top``, ``k1, b``, the TF epsilon, ``P_ONE``, ``weight``, then the k ignored token ids that can
    occur (ids are below ``2**31``, exact in float64)."""
    top = config.top
    ignore = [float(t) for t in config.ignore_token_ids if t <= MAX_TOKEN_ID]
    values = [*FISHER_CONSTANTS, config.alpha, config.beta, top, math.nextafter(top, 0.0), config.k1, config.b,
              TF_EPS, P_ONE, config.weight, *ignore]
    return device_constants(values, device)


def score_rows(tables: HashTables, rows: Rows, stats: GroupStats, config: KTAEConfig, consts: Tensor,
               counts: RowCounts | None, write_rows: bool) -> tuple[Tensor, RowStats]:
    """Scores of every occupied slot: float64 ``[S]`` indexed by global slot (only occupied slots are
    written), and, with ``write_rows``, the per-row statistics. ``consts``: ``kernel_constants(config)``;
    ``counts`` (``tables.row_counts``) is needed with ``fisher="upstream"`` only: the CPU computes p
    from them.
    """
    device = tables.keys.device
    n = rows.slot.shape[0]
    slot_score = torch.empty(tables.keys.shape[0], dtype=torch.float64, device=device)
    out = RowStats(*(torch.empty(n if write_rows else 0, dtype=torch.float64, device=device) for _ in range(5)))
    if n == 0:
        return slot_score, out
    exact = config.fisher == "exact"
    if exact:
        p_in = F_in = slot_score  # unused
    else:
        if counts is None:
            raise ValueError("score_rows: `counts` (tables.row_counts) is required with fisher='upstream'")
        rows_ = method.Rows(group=rows.group.long(), token=counts.token, a=counts.a, b=counts.b, f_c=counts.f_c, f_w=counts.f_w)
        _, table, entry = method.row_statistics(rows_, stats.n_c, stats.n_w, config)
        p_in, F_in = table.p_value[entry], table.F[entry]
    asin, asin_c, asin_w = cohen_table(stats)
    lf = log_factorial_table(tables.largest, device)
    _score_kernel[(triton.cdiv(n, _BLOCK),)](
        rows.slot, rows.group, n, tables.keys, tables.occ, tables.bits, tables.correct_bits, tables.words,
        stats.n_c, stats.n_w, stats.T_c, stats.T_w, asin, asin_c, asin_w,
        lf, consts, consts.shape[0] - _IGNORE.value, p_in, F_in,
        slot_score, *((out.p_value, out.F, out.IG, out.x, out.score) if write_rows else (slot_score,) * 5),
        EXACT=exact, USE_TF=config.use_tf, WRITE_ROWS=write_rows, BLOCK=_BLOCK)
    return slot_score, out
