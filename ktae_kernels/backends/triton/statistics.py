"""The method's maths on the device: the per-table statistics (two-sided Fisher p-value, ``F``,
information gain, Cohen's ``h`` and ``strength = alpha F + beta IG``) of every table of a
``device.GridTables``, one program per ``_BLOCK`` tables; and the per-row score (BM25 direction and
squash, ``method.tf_ratio`` / ``method.squash``) that the pipeline's score kernel applies.

The same formulas, in the same order of operations, as ``ktae_kernels.method.table_statistics`` (its
exact mode, ``fisher.exact_pvalue_flat``): each log-pmf is ``-(((lf[k] + lf[n1 - k]) + lf[col - k]) +
lf[n2 - col + k])`` from the same float64 log-factorial table, so the tie test (scipy's relative
tolerance 1e-14) and the ``p = 1`` rule of ``F`` classify every table as the CPU does; ``p`` is
``exp(lse(kept) - lse(all))`` with each log-sum-exp shifted by its own maximum, as torch's
``logsumexp``. Only the order of the two sums over the support differs from torch's reduction, so
``p`` and ``F`` agree to a few ulps, not bitwise. Cohen's ``h`` reads the grid's angle table (torch's
``asin(sqrt(k / n))``). The launch disables FP contraction (``enable_fp_fusion=False``), so every
product and sum is rounded once, as on the CPU. Every float64 constant reaches the kernel in one
float64 tensor (a Python float argument would be float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..device import GridTables, statistics_constants

_LOG_RTOL, _ERR, _ONE, _LN2, _ALPHA, _BETA = (tl.constexpr(i) for i in range(6))
_BLOCK = 128


@triton.jit
def _log_pmf(lf_ptr, k, n1, n2, col, valid):
    """Log hypergeometric pmf of ``k`` up to its k-independent normaliser (int32 tensors in)."""
    return -(((tl.load(lf_ptr + k, mask=valid, other=0.0) + tl.load(lf_ptr + (n1 - k), mask=valid, other=0.0))
              + tl.load(lf_ptr + (col - k), mask=valid, other=0.0))
             + tl.load(lf_ptr + (n2 - col + k), mask=valid, other=0.0))


@triton.jit
def _entropy(p, ln2):
    """Binary entropy in bits, ``0 log 0 = 0`` (``method.binary_entropy``)."""
    q = 1.0 - p
    xp = tl.where(p == 0.0, 0.0, p * tl.log(tl.where(p == 0.0, 1.0, p)))
    xq = tl.where(q == 0.0, 0.0, q * tl.log(tl.where(q == 0.0, 1.0, q)))
    return -(xp + xq) / ln2


@triton.jit
def _information_gain(a, b, n_c, n_w, ln2):
    """``H(Y) - H(Y | X)`` in bits, clamped at 0 (``method.information_gain``); int32 in, float64 out."""
    af, bf, ncf, nwf = a.to(tl.float64), b.to(tl.float64), n_c.to(tl.float64), n_w.to(tl.float64)
    cf, df = ncf - af, nwf - bf
    n = tl.maximum(ncf + nwf, 1.0)
    present, absent = af + bf, cf + df
    h_y = _entropy(ncf / n, ln2)
    h_present = tl.where(present > 0, present / n * _entropy(af / tl.maximum(present, 1.0), ln2), 0.0)
    h_absent = tl.where(absent > 0, absent / n * _entropy(cf / tl.maximum(absent, 1.0), ln2), 0.0)
    return tl.maximum(h_y - h_present - h_absent, 0.0)


@triton.jit
def _pvalue(a, b, n_c, n_w, valid, lf_ptr, log_rtol, log_err):
    """Two-sided Fisher p-values of the tables ``[[a, b], [n_c - a, n_w - b]]`` (int32 tensors)."""
    n1 = a + b
    n2 = n_c + n_w - n1
    col = n_c
    lo = tl.maximum(col - n2, 0)
    hi = tl.minimum(n1, col)
    width = tl.where(valid, hi - lo + 1, 0)
    lp_obs = _log_pmf(lf_ptr, a, n1, n2, col, valid)
    tol = log_rtol + log_err * tl.abs(lp_obs)
    limit = lp_obs + tol
    top = lp_obs
    top_kept = lp_obs
    for j in range(0, tl.max(width, 0)):  # the maxima: the shifts of both log-sum-exps
        inside = j < width
        lp = _log_pmf(lf_ptr, lo + j, n1, n2, col, inside)
        top = tl.where(inside, tl.maximum(top, lp), top)
        top_kept = tl.where(inside & (lp <= limit), tl.maximum(top_kept, lp), top_kept)
    total = tl.zeros_like(lp_obs)
    kept = tl.zeros_like(lp_obs)
    for j in range(0, tl.max(width, 0)):
        inside = j < width
        lp = tl.where(inside, _log_pmf(lf_ptr, lo + j, n1, n2, col, inside), lp_obs)  # no exp overflow off the support
        total += tl.where(inside, tl.exp(lp - top), 0.0)
        kept += tl.where(inside & (lp <= limit), tl.exp(lp - top_kept), 0.0)
    some = width > 0  # padding lanes: no log(0)
    p = tl.minimum(tl.exp((tl.log(tl.where(some, kept, 1.0)) + top_kept) - (tl.log(tl.where(some, total, 1.0)) + top)),
                   1.0)
    degenerate = (n1 == 0) | (n2 == 0) | (col == 0) | (col == n1 + n2)
    return tl.where(degenerate | (lp_obs >= top - tol), 1.0, p)


@triton.jit
def table_statistics(a, b, n_c, n_w, valid, lf_ptr, angle_ptr, const_ptr):
    """``p, F, IG, h, strength`` of the tables ``(a, b, n_c, n_w)`` (int32 tensors): log-factorials
    and angles up to ``n_c + n_w``, the constants of ``device.statistics_constants``."""
    p = _pvalue(a, b, n_c, n_w, valid, lf_ptr, tl.load(const_ptr + _LOG_RTOL), tl.load(const_ptr + _ERR))
    informative = (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)
    F = tl.where(informative & (p < tl.load(const_ptr + _ONE)), tl.exp(-2.0 * p), 0.0)
    IG = tl.where(informative, _information_gain(a, b, n_c, n_w, tl.load(const_ptr + _LN2)), 0.0)
    tri_c = (n_c.to(tl.int64) * (n_c + 1)) // 2
    tri_w = (n_w.to(tl.int64) * (n_w + 1)) // 2
    h = (tl.load(angle_ptr + tri_c + a, mask=valid, other=0.0) - tl.load(angle_ptr + tri_w + b, mask=valid, other=0.0))
    strength = tl.load(const_ptr + _ALPHA) * F + tl.load(const_ptr + _BETA) * IG
    return p, F, IG, h, strength


@triton.jit
def _statistics_kernel(cells_ptr, size, lf_ptr, angle_ptr, const_ptr, out_ptr, BLOCK: tl.constexpr):
    """``out[:, t]`` = ``p, F, IG, h, strength`` of the tables ``t`` of this program; ``cells``: int32
    ``[4, size]`` rows ``a, b, n_c, n_w``; ``out``: float64 ``[5, size]``."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = t < size
    a = tl.load(cells_ptr + t, mask=valid, other=0)
    b = tl.load(cells_ptr + size + t, mask=valid, other=0)
    n_c = tl.load(cells_ptr + 2 * size + t, mask=valid, other=0)
    n_w = tl.load(cells_ptr + 3 * size + t, mask=valid, other=0)
    p, F, IG, h, strength = table_statistics(a, b, n_c, n_w, valid, lf_ptr, angle_ptr, const_ptr)
    tl.store(out_ptr + t, p, mask=valid)
    tl.store(out_ptr + size + t, F, mask=valid)
    tl.store(out_ptr + 2 * size + t, IG, mask=valid)
    tl.store(out_ptr + 3 * size + t, h, mask=valid)
    tl.store(out_ptr + 4 * size + t, strength, mask=valid)


#: the statistics kernel, by name (what a compile report builds: tests/compile_report.py)
KERNELS = {"statistics": _statistics_kernel}


def grid_statistics_kernel(grid: GridTables, alpha: float, beta: float) -> Tensor:
    """float64 ``[5, grid.size]``: ``p_value, F, IG, h, strength`` of every table of ``grid``, on its
    device (a ``device.StatisticsKernel``)."""
    device = grid.cells.device
    out = torch.empty(5, grid.size, dtype=torch.float64, device=device)
    consts = torch.tensor(statistics_constants(alpha, beta), dtype=torch.float64).to(device)
    if grid.size:
        _statistics_kernel[(triton.cdiv(grid.size, _BLOCK),)](
            grid.cells, grid.size, grid.log_factorial, grid.angle, consts, out, BLOCK=_BLOCK,
            enable_fp_fusion=False)
    return out


# ----------------------------------------------------------------------------- the per-row score


@triton.jit
def _bm25_tf(f, T, avg, k1, b):
    """BM25 saturated frequency of ``f`` occurrences (int64) in a pooled document of ``T`` tokens."""
    q = f.to(tl.float64) / tl.maximum(T, 1).to(tl.float64)
    K = k1 * (1.0 - b + b * T.to(tl.float64) / avg)
    return tl.where(f > 0, q * (k1 + 1.0) / (q + K), 0.0)


@triton.jit
def direction(x, f_c, f_w, T_c, T_w, avg, k1, bm, eps):
    """``x`` plus the BM25 term-frequency ratio of ``f_c, f_w`` (``method.tf_ratio``)."""
    tf_c = _bm25_tf(f_c, T_c, avg, k1, bm)
    tf_w = _bm25_tf(f_w, T_w, avg, k1, bm)
    return x + (tf_c / (tf_w + eps) - tf_w / (tf_c + eps))


@triton.jit
def squash(strength, x, scorable, scale, top, bound):
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
