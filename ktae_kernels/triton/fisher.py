"""Two-sided Fisher exact p-values in float64 log space, as a Triton device function and kernel.

Standalone (``fisher_exact_pvalues``): the backend's score kernel no longer computes a p-value per
row, it looks up the per-table statistics of ``ktae_kernels.method`` (see ``scores.py``).

Same definition as ``ktae_kernels.fisher._pvalue_grid`` (scipy's ``fisher_exact``, two-sided): the
hypergeometric mass of every table of the support whose probability does not exceed the observed
one, with scipy's relative tolerance, normalised by the support's own sum. Log-factorials come from
a float64 table gathered with ``tl.load`` (no lgamma: the interpreter has no libdevice), and the
support is walked once, summing ``exp(log pmf - log pmf at the mode)`` (a log-sum-exp whose shift,
the mode, is known in advance).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..fisher import _LOG_ERR, SCIPY_RTOL, log_factorial_table

#: float64 constants the kernel loads (a Python float argument would reach it as float32):
#: ``log1p(scipy rtol)`` and the relative float64 error bound of a log-pmf, at these indices.
FISHER_CONSTANTS = (math.log1p(SCIPY_RTOL), _LOG_ERR)
LOG_RTOL, LOG_ERR = tl.constexpr(0), tl.constexpr(1)
_BLOCK = 128


def device_constants(values: list[float], device: torch.device | str) -> Tensor:
    """float64 ``values`` on ``device`` in one copy that does not wait for the device's queue."""
    return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


@triton.jit
def _log_pmf(lf_ptr, k, n1, n2, col):
    """Log hypergeometric pmf of ``k`` up to its k-independent normaliser (int32 tensors in)."""
    return -(tl.load(lf_ptr + k) + tl.load(lf_ptr + (n1 - k)) + tl.load(lf_ptr + (col - k))
             + tl.load(lf_ptr + (n2 - col + k)))


@triton.jit
def fisher_pvalue(a, b, c, d, lf_ptr, log_rtol, log_err):
    """float64 p-values of the tables ``[[a, b], [c, d]]`` (int32 tensors, non-negative, valid
    entries of ``lf_ptr`` up to ``a + b + c + d``); ``log_rtol``, ``log_err``: float64 scalars."""
    n1 = a + b
    n2 = c + d
    col = a + c
    lo = tl.maximum(col - n2, 0)
    hi = tl.minimum(n1, col)
    mode = tl.minimum(tl.maximum(((n1 + 1).to(tl.int64) * (col + 1) // (n1 + n2 + 2)).to(tl.int32), lo), hi)
    lp_obs = _log_pmf(lf_ptr, a, n1, n2, col)
    shift = _log_pmf(lf_ptr, mode, n1, n2, col)
    tolerance = log_rtol + log_err * tl.abs(lp_obs)
    limit = lp_obs + tolerance
    total = tl.zeros_like(lp_obs)
    kept = tl.zeros_like(lp_obs)
    top = shift
    width = hi - lo + 1
    for j in range(0, tl.max(width, 0)):
        inside = j < width
        k = tl.where(inside, lo + j, lo)
        lp = _log_pmf(lf_ptr, k, n1, n2, col)
        mass = tl.where(inside, tl.exp(lp - shift), 0.0)
        total += mass
        kept += tl.where(lp <= limit, mass, 0.0)
        top = tl.maximum(top, tl.where(inside, lp, shift))
    p = tl.minimum(kept / total, 1.0)
    degenerate = (n1 == 0) | (n2 == 0) | (col == 0) | (col == n1 + n2)
    return tl.where(degenerate | (lp_obs >= top - tolerance), 1.0, p)


@triton.jit
def _fisher_kernel(a_ptr, b_ptr, c_ptr, d_ptr, p_ptr, n, lf_ptr, const_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    a = tl.load(a_ptr + offs, mask=valid, other=0)
    b = tl.load(b_ptr + offs, mask=valid, other=0)
    c = tl.load(c_ptr + offs, mask=valid, other=0)
    d = tl.load(d_ptr + offs, mask=valid, other=0)
    p = fisher_pvalue(a, b, c, d, lf_ptr, tl.load(const_ptr + LOG_RTOL), tl.load(const_ptr + LOG_ERR))
    tl.store(p_ptr + offs, p, mask=valid)


def fisher_exact_pvalues(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """Two-sided Fisher p-values (float64 ``[T]``) of flat non-negative integer ``[T]`` cells.

    Runs on the cells' device (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``a + b + c + d`` must
    stay below ``2**31``. Tables are processed in order of support width, so that each block's
    loop over the support is about as long as each of its tables needs.
    """
    n = a.shape[0]
    p = torch.empty(n, dtype=torch.float64, device=a.device)
    if n == 0:
        return p
    n1, col = a + b, a + c
    width = torch.minimum(n1, col) - torch.clamp(col - c - d, min=0)
    order = torch.argsort(width)
    cells = [t[order].to(torch.int32) for t in (a, b, c, d)]
    lf = log_factorial_table(int((n1 + c + d).max()), a.device)
    out = torch.empty_like(p)
    consts = device_constants(list(FISHER_CONSTANTS), a.device)
    _fisher_kernel[(triton.cdiv(n, _BLOCK),)](*cells, out, n, lf, consts, BLOCK=_BLOCK)
    p[order] = out
    return p
