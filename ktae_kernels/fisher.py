"""Two-sided Fisher exact test on 2x2 tables, batched, as a torch op.

Exact mode matches ``scipy.stats.fisher_exact(table, alternative="two-sided")``: the p-value is the
hypergeometric mass of every table in the support whose probability does not exceed the observed
one (relative tolerance 1e-14), clipped to 1. It is computed in float64 log space from
log-factorials, normalised by the support's own sum (so no huge log-normaliser cancels).

Upstream mode reproduces the published KTAE code: float32 ``lgamma`` over a ``[rows, K]`` support
grid, ``p = sum(p_k where p_k <= p_obs)`` with no tolerance. Its float32 rounding is the point, so it
always runs on the CPU with torch's own kernels, bucketed by the grid width ``K`` the published code
used (the group's largest ``min(a + b, a + c)`` plus one).
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

from .checks import host_tensor
from .types import ArrayLike

#: scipy's relative tolerance for "no more probable than the observed table".
SCIPY_RTOL = 1e-14
#: p-values at least this close to 1 count as 1 for the F = 0 rule.
P_ONE = 1.0 - 1e-12
#: float64 rounding of a sum of four log-factorials, in units of its magnitude (generous bound).
LOG_ERR = 16 * torch.finfo(torch.float64).eps
#: elements of one support grid chunk (rows x support width).
_GRID_BUDGET = 1 << 22


def log_factorial_table(n_max: int, device: torch.device | str = "cpu") -> Tensor:
    """``log(k!)`` for ``k = 0..n_max`` as float64 ``[n_max + 1]``."""
    return torch.lgamma(torch.arange(n_max + 1, dtype=torch.float64, device=device) + 1.0)


def fisher_exact_pvalue(a: ArrayLike, b: ArrayLike, c: ArrayLike, d: ArrayLike) -> Tensor:
    """Two-sided Fisher exact p-values of the tables ``[[a, b], [c, d]]``.

    Args:
        a, b, c, d: broadcastable non-negative integer tensors, numpy arrays, lists or ints (the cells).

    Returns:
        float64 tensor of the broadcast shape on the inputs' device, equal to
        ``scipy.stats.fisher_exact([[a, b], [c, d]]).pvalue`` to ~1e-12 relative for small tables.

    Raises:
        ValueError: a cell is not an integer or is negative, or the cells do not broadcast (the message
            names them).

    Example:
        >>> from ktae_kernels import fisher_exact_pvalue
        >>> round(float(fisher_exact_pvalue(8, 2, 1, 5)), 6)
        0.034965
    """
    cells = [_as_count_tensor(name, v) for name, v in zip("abcd", (a, b, c, d))]
    try:
        torch.broadcast_shapes(*(t.shape for t in cells))
    except RuntimeError:
        raise ValueError(f"fisher_exact_pvalue: `a`, `b`, `c`, `d` must broadcast to one shape, got shapes "
                         f"{', '.join(str(tuple(t.shape)) for t in cells)}") from None
    device = next((t.device for t in cells if t.device.type != "cpu"), cells[0].device)
    a, b, c, d = torch.broadcast_tensors(*(t.to(device) for t in cells))
    shape = a.shape
    p = exact_pvalue_flat(a.reshape(-1), b.reshape(-1), c.reshape(-1), d.reshape(-1))
    return p.reshape(shape)


def _as_count_tensor(name: str, value: object) -> Tensor:
    """int64 cells of the caller's ``name``; ValueError naming it unless they are non-negative integers."""
    if isinstance(value, Tensor):
        t = value
    elif isinstance(value, (np.ndarray, list, tuple)):
        try:
            t = host_tensor(name, value)
        except ValueError as err:
            raise ValueError(f"fisher_exact_pvalue: {err}") from None
    elif isinstance(value, (numbers.Real, np.bool_)):
        t = torch.as_tensor(value)
    else:
        raise ValueError(f"fisher_exact_pvalue: `{name}` must be an integer tensor, numpy array, list or int, "
                         f"got {type(value).__name__}")
    if t.dtype.is_floating_point:
        if not bool(torch.isfinite(t).all()) or not bool((t == t.round()).all()):
            raise ValueError(f"fisher_exact_pvalue: `{name}` must hold non-negative integer counts")
        t = t.to(torch.int64)
    elif t.dtype == torch.bool or t.dtype.is_complex:
        raise ValueError(f"fisher_exact_pvalue: `{name}` must be an integer tensor, got {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"fisher_exact_pvalue: `{name}` must be >= 0, got min {int(t.min())}")
    return t


def exact_pvalue_flat(a: Tensor, b: Tensor, c: Tensor, d: Tensor, log_factorial: Tensor | None = None) -> Tensor:
    """Exact two-sided p-values of flat int64 ``[T]`` cell tensors; float64 ``[T]``.

    Tables are processed in chunks of similar support width so the ``[rows, width]`` grid stays
    within a fixed budget whatever the counts. ``log_factorial``: the float64 ``log(k!)`` table to use,
    on the cells' device, up to the largest ``a + b + c + d`` (default: ``log_factorial_table``'s; a
    GPU's own table checks a GPU kernel against its inputs).
    """
    n1, n2, col = a + b, c + d, a + c  # row sums and first column sum (scipy's n1, n2, n)
    lo = torch.clamp(col - n2, min=0)
    width = torch.minimum(n1, col) - lo + 1
    p = torch.ones(a.shape, dtype=torch.float64, device=a.device)
    if a.numel() == 0:
        return p
    lf = log_factorial_table(int((n1 + n2).max()), a.device) if log_factorial is None else log_factorial
    order = torch.argsort(width)
    widths = width[order].tolist()
    start = 0
    while start < len(widths):
        stop = start + 1
        while stop < len(widths) and (stop - start + 1) * widths[stop] <= _GRID_BUDGET:
            stop += 1
        rows = order[start:stop]
        p[rows] = _pvalue_grid(lf, a[rows], n1[rows], n2[rows], col[rows], lo[rows], widths[stop - 1])
        start = stop
    return p


def _pvalue_grid(lf: Tensor, x: Tensor, n1: Tensor, n2: Tensor, col: Tensor, lo: Tensor, width: int) -> Tensor:
    """p-values of one chunk over a ``[rows, width]`` grid of the support ``k = lo + j``."""
    hi = torch.minimum(n1, col)
    k = lo[:, None] + torch.arange(width, device=x.device)
    inside = k <= hi[:, None]
    k = torch.minimum(k, hi[:, None])  # keep padded columns on valid indices
    # log pmf up to the k-independent normaliser: -(log k! + log(n1-k)! + log(col-k)! + log(n2-col+k)!)
    lp = -(lf[k] + lf[n1[:, None] - k] + lf[col[:, None] - k] + lf[n2[:, None] - col[:, None] + k])
    lp_obs = -(lf[x] + lf[n1 - x] + lf[col - x] + lf[n2 - col + x])
    lp = torch.where(inside, lp, -math.inf)
    top = lp.max(dim=1).values
    tol = math.log1p(SCIPY_RTOL) + LOG_ERR * lp_obs.abs()
    kept = torch.where(lp <= (lp_obs + tol)[:, None], lp, -math.inf)
    p = torch.clamp(torch.exp(torch.logsumexp(kept, dim=1) - torch.logsumexp(lp, dim=1)), max=1.0)
    degenerate = (n1 == 0) | (n2 == 0) | (col == 0) | (col == n1 + n2)
    return torch.where(degenerate | (lp_obs >= top - tol), 1.0, p)


def fisher_weight(p: Tensor) -> Tensor:
    """``F = exp(-2 p)``, and 0 where ``p`` counts as 1 (``p >= 1 - 1e-12``); float64."""
    return torch.where(p >= P_ONE, 0.0, torch.exp(-2.0 * p))


def upstream_pvalue(a: Tensor, b: Tensor, c: Tensor, d: Tensor, width: Tensor) -> Tensor:
    """The published code's float32 p-values; float32 ``[T]`` on the inputs' device.

    Args: ``a, b, c, d``: int64 ``[T]`` cells; ``width``: int64 ``[T]``, the grid width ``K`` of each
    row's group (its largest ``min(a + b, a + c)`` plus one), which sets torch's summation order.
    """
    device = a.device
    cells = torch.stack([a, b, c, d], dim=1).cpu().to(torch.float32)
    width = width.cpu()
    p = torch.empty(a.shape[0], dtype=torch.float32)
    for k in torch.unique(width).tolist():
        rows = torch.nonzero(width == k).squeeze(1)
        p[rows] = _upstream_grid(cells[rows], int(k))
    return p.to(device)


def _upstream_grid(cells: Tensor, width: int) -> Tensor:
    """float32 p-values of ``[rows, 4]`` float32 cells over a ``[rows, width]`` grid, op for op as upstream.

    The rows are padded with empty tables so that torch's vectorised kernels (not their scalar
    tail loop, whose ``exp`` rounds differently) handle every real element, as they do upstream.
    """
    pad = torch.zeros(64, 4, dtype=torch.float32)
    a, b, c, d = torch.unbind(torch.cat([cells, pad]), dim=1)
    r1, r2, c1 = a + b, c + d, a + c
    n = r1 + r2
    k_min = torch.max(torch.tensor(0, dtype=torch.float32), r1 + c1 - n)
    k_max = torch.min(r1, c1)
    k = torch.tile(torch.arange(width, dtype=torch.float32), (a.shape[0], 1))
    inside = (k >= k_min[:, None]) & (k <= k_max[:, None])
    c1g, r1g, ng = c1[:, None].expand_as(k), r1[:, None].expand_as(k), n[:, None].expand_as(k)
    log_p_k = _log_comb(c1g, k) + _log_comb(ng - c1g, r1g - k) - _log_comb(ng, r1g)
    p_k = torch.exp(log_p_k) * inside.float()
    p_obs = torch.exp(_log_comb(c1, a) + _log_comb(n - c1, r1 - a) - _log_comb(n, r1))
    p = torch.sum(torch.where((p_k <= p_obs[:, None]) & inside, p_k, 0.0), dim=1)
    return p[: cells.shape[0]]


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def upstream_fisher_weight(p: Tensor) -> Tensor:
    """Upstream's ``F``: ``exp(-2 p)`` unless the float32 ``p`` is exactly 1.0; float64."""
    return torch.where(p != 1.0, torch.exp(-2.0 * p.double()), 0.0)
