"""Host/device helpers the GPU backends share: a device guard, non-blocking uploads, and the grid of
per-table statistics computed on the device by a backend's kernel and cached there (``grid_statistics``)."""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from ..config import KTAEConfig
from ..fisher import _LOG_ERR, P_ONE, SCIPY_RTOL, log_factorial_table
from ..method import block_offset


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the launches (Triton and the CUDA binding launch on the current device)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def upload(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (CPU) on ``device``, without waiting for the device's queue (a pinned, non-blocking copy)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


#: the largest group size whose every table the device grid holds: ``C(N + 4, 4)`` tables for bound
#: ``N`` (814,385 at 64); past it only the tables the rows use are computed (``method.row_statistics``).
GRID_MAX_GROUP = 64
#: the smallest grid bound (tables of every group of up to 16 rollouts: 4,845 entries).
_MIN_BOUND = 16


@dataclass(frozen=True)
class GridTables:
    """Every table of a group of at most ``bound`` rollouts, in triangle order (``grid_index``), or
    any ``size`` tables of such groups (``tables_of``).

    ``cells``: int32 ``[4, size]`` rows ``a, b, n_c, n_w``; ``log_factorial``: float64 ``[bound + 1]``,
    ``log(k!)``; ``angle``: float64 ``[(bound + 1)(bound + 2) / 2]``, ``asin(sqrt(k / max(n, 1)))`` at
    ``n (n + 1) / 2 + k``. All on the grid's device, computed there by torch (the same ops, and so the
    same values, as ``method.table_statistics``)."""

    bound: int
    size: int
    cells: Tensor
    log_factorial: Tensor
    angle: Tensor


#: a backend's statistics kernel: float64 ``[5, size]`` rows ``p_value, F, IG, h, strength`` of every
#: table of the grid, for ``(alpha, beta)``.
StatisticsKernel = Callable[[GridTables, float, float], Tensor]


def statistics_constants(alpha: float, beta: float) -> list[float]:
    """The float64 constants every statistics kernel reads, in this order: scipy's log relative tie
    tolerance, the log-space rounding allowance, the ``p = 1`` threshold of ``F``, ``ln 2``, ``alpha``,
    ``beta`` (``fisher.exact_pvalue_flat`` / ``method.table_statistics``)."""
    return [math.log1p(SCIPY_RTOL), _LOG_ERR, P_ONE, math.log(2.0), alpha, beta]


def grid_bound(largest: int) -> int | None:
    """The grid bound for groups of at most ``largest`` rollouts: a power of two >= 16 (few distinct
    grids over a run), or None past ``GRID_MAX_GROUP``."""
    bound = _MIN_BOUND
    while bound < largest:
        bound *= 2
    return bound if bound <= GRID_MAX_GROUP else None


def grid_size(bound: int) -> int:
    """Tables of every group of at most ``bound`` rollouts: ``C(bound + 4, 4)``."""
    return math.comb(bound + 4, 4)


def grid_index(n_c: Tensor, n_w: Tensor) -> Tensor:
    """int64 ``[2, n_groups]``: each group's grid offset and stride ``n_w + 1``, in closed form on the
    counts' device (no host sync). Blocks ``(n_c, n_w)`` come by ``n = n_c + n_w``, then ``n_c``: block
    ``(c, n - c)`` starts at ``C(n + 3, 4) + (n + 2) c (c + 1) / 2 - c (c + 1)(2c + 1) / 6``, and its table
    ``(a, b)`` is entry ``offset + a (n_w + 1) + b``; the offset does not depend on the grid's bound."""
    n, c = n_c + n_w, n_c
    before = (n + 3) * (n + 2) * (n + 1) * n // 24
    return torch.stack([before + block_offset(n, c), n_w + 1])


def _triangle(bound: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """int64 ``(n, k)`` for every ``0 <= k <= n <= bound``, by ``n`` then ``k``: pair ``(n, k)`` is at
    ``n (n + 1) / 2 + k``."""
    n = torch.arange(bound + 1, device=device)
    n_of = torch.repeat_interleave(n, n + 1)
    return n_of, torch.arange(n_of.shape[0], device=device) - n_of * (n_of + 1) // 2


def grid_tables(bound: int, device: torch.device) -> GridTables:
    """Every table of a group of at most ``bound`` rollouts, on ``device`` (torch ops there)."""
    n_of_block, n_c = _triangle(bound, device)  # blocks (c, n - c), c = 0..n, by n then c
    n_w = n_of_block - n_c
    block_size = (n_c + 1) * (n_w + 1)
    member = torch.repeat_interleave(torch.arange(n_c.shape[0], device=device), block_size)
    local = torch.arange(member.shape[0], device=device) - (torch.cumsum(block_size, 0) - block_size)[member]
    stride = n_w[member] + 1
    return tables_of(torch.stack([local // stride, local % stride, n_c[member], n_w[member]]), bound)


def tables_of(cells: Tensor, bound: int) -> GridTables:
    """``GridTables`` of the given tables: ``cells`` int ``[4, size]`` rows ``a, b, n_c, n_w`` on the
    device, every ``n_c + n_w <= bound``; log-factorials and angles up to ``bound``."""
    device = cells.device
    n_of, k = _triangle(bound, device)
    angle = torch.asin(torch.sqrt(k.double() / n_of.clamp(min=1)))  # as method.cohen_h
    return GridTables(bound, int(cells.shape[1]), cells.to(torch.int32).contiguous(),
                      log_factorial_table(bound, device), angle)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (no host reads then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


#: device statistics of recently used grids, per (kernel, alpha, beta, bound, device): a run sees one or two.
_GRID_CACHE: "OrderedDict[tuple, tuple[Tensor, Optional[torch.cuda.Event]]]" = OrderedDict()
_GRID_CACHE_SIZE = 16
#: grids and log-factorial tables a CUDA graph captured: never evicted (the graph reads them on replay).
_PINNED: dict[tuple, Tensor] = {}


def _not_while_capturing(what: str) -> RuntimeError:
    return RuntimeError(f"ktae_kernels: the {what} is computed on the first call and cached; make one call with "
                        f"the same config and batch shape before capturing a CUDA graph (a warm-up)")


def grid_values(bound: int, config: KTAEConfig, device: torch.device, kernel: StatisticsKernel) -> Tensor:
    """float64 ``[5, grid_size(bound)]``: ``p_value, F, IG, h, strength`` of every table of a group of
    at most ``bound`` rollouts (``grid_tables`` order: the table ``(a, b)`` of a group is column
    ``grid_index(n_c, n_w)[0] + a * (n_w + 1) + b``), computed on ``device`` by ``kernel`` once per
    (kernel, alpha, beta, bound, device) and cached there. A hit costs a dict lookup (and, on CUDA,
    an event wait on the current stream); while a CUDA graph is capturing, a hit is pinned (never
    evicted) and a miss raises (make a warm-up call first)."""
    key = (kernel, config.alpha, config.beta, bound, device)
    hit = _GRID_CACHE.get(key)
    capture = capturing(device)
    if hit is None:
        if capture:
            raise _not_while_capturing("table statistics grid")
        values = kernel(grid_tables(bound, device), config.alpha, config.beta)
        ready = None
        if device.type == "cuda":  # later calls may come on other streams: they wait for the kernel
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        hit = (values, ready)
        _GRID_CACHE[key] = hit
        while len(_GRID_CACHE) > _GRID_CACHE_SIZE:
            _GRID_CACHE.popitem(last=False)
    else:
        _GRID_CACHE.move_to_end(key)
    values, ready = hit
    if capture:
        _PINNED[("grid",) + key] = values
    elif ready is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(ready)
        values.record_stream(stream)  # not reused while this stream may still read it
    return values


_LF_CACHE: dict[tuple, Tensor] = {}


def log_factorials(n_max: int, device: torch.device) -> Tensor:
    """float64 ``log(k!)`` for ``k = 0 .. >= n_max`` on ``device`` (``fisher.log_factorial_table``, the
    same values as the CPU's), sized to a power of two and cached per device; pinned while capturing."""
    size = 16
    while size < n_max + 1:
        size *= 2
    key = (size, device)
    table = _LF_CACHE.get(key)
    if table is None:
        if capturing(device):
            raise _not_while_capturing("log-factorial table")
        table = _LF_CACHE[key] = log_factorial_table(size - 1, device)
        if device.type == "cuda":  # read on any stream later
            torch.cuda.current_stream(device).synchronize()
    elif capturing(device):
        _PINNED[("lf",) + key] = table
    return table


def grid_statistics(n_c: Tensor, n_w: Tensor, largest: int, config: KTAEConfig, device: torch.device,
                    kernel: StatisticsKernel) -> tuple[Tensor, Tensor] | None:
    """The statistics of every table a group of at most ``largest`` rollouts can have, computed on
    ``device`` by ``kernel`` and cached there: ``index`` int64 ``[2, n_groups]`` (``grid_index`` of the
    int64 device counts ``n_c, n_w``) and ``values`` float64 ``[5, size]`` (``p_value, F, IG, h,
    strength``); the table ``(a, b)`` of group ``g`` is column ``index[0, g] + a * index[1, g] + b``.

    None where the statistics must come from the rows (``fisher="upstream"``, or ``largest`` past
    ``GRID_MAX_GROUP``). A cache hit costs a dict lookup and the few device ops of ``grid_index``:
    nothing is computed or copied on the host (``grid_values``).
    """
    bound = grid_bound(largest)
    if config.fisher != "exact" or bound is None:
        return None
    return grid_index(n_c, n_w), grid_values(bound, config, device, kernel)


# ------------------------------------------------------------------ tables sized by distinct ids
#: per (backend, device, B, n_groups): the largest number of distinct ids one group held, and the most
#: dynamic shared memory one group's table needed (a backend that reports none keeps 0); read back
#: with the flags at the end of a sync-free ``token_advantage`` (never while a CUDA graph captures)
_DISTINCT: "OrderedDict[tuple, tuple[int, int]]" = OrderedDict()
#: shapes remembered at most (the oldest is dropped)
_DISTINCT_KEYS = 64


def distinct_key(backend: str, device: torch.device, B: int, n_groups: int) -> tuple:
    """The key a sync-free call's largest distinct count is remembered under: a trainer's batches
    keep ``B`` and the number of groups while ``L`` changes from step to step."""
    return backend, device, B, n_groups


def expected_keys(key: tuple) -> int | None:
    """Distinct ids the first table of a group is sized for: the largest count remembered under
    ``key`` (None before any call completed: tables are then sized by masked tokens). The table's
    power of two at 3/4 load leaves room above it (a 8192-slot table for 4,617 ids holds 6,144); a
    group holding more overflows and the backend's fallback takes it: time, never exactness."""
    seen = _DISTINCT.get(key)
    return None if seen is None else seen[0]


def expected_shared_bytes(key: tuple) -> int | None:
    """The most dynamic shared memory one group's table needed under ``key`` (the cuda backend's
    ``group_shared_need``: its layout, sized for its distinct ids), or None before any call reported one."""
    seen = _DISTINCT.get(key)
    return None if seen is None or seen[1] <= 0 else seen[1]


def remember_keys(key: tuple, largest: int, shared_bytes: int = 0) -> None:
    """Keep ``largest`` (the most distinct ids a group of the call held) and ``shared_bytes`` (the most
    shared memory a group's table needed, 0: not reported) where each is the most seen; a call that
    held no id (every id masked out, or a bad id: nothing was built) teaches nothing."""
    if largest <= 0:
        return
    keys, need = _DISTINCT.pop(key, (0, 0))
    _DISTINCT[key] = (max(largest, keys), max(shared_bytes, need))
    while len(_DISTINCT) > _DISTINCT_KEYS:
        _DISTINCT.popitem(last=False)


def forget_keys(key: tuple) -> None:
    """Size the next call at ``key`` by masked tokens again (its remembered count was far too small)."""
    _DISTINCT.pop(key, None)
