"""What the GPU backends share on the host: the device guard, the rules of CUDA-graph capture, the one
owner of their runtime state per device (``DeviceState``), the layout of the device grid of per-table
statistics, and the constants both kernels' families read (``MAX_GROUP_TOKENS``, the baseline codes)."""
from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import Tensor

from .. import caches
from ..config import KTAEConfig
from ..fisher import LOG_ERR, P_ONE, SCIPY_RTOL, log_factorial_table
from ..method import block_offset
from ..types import Batch
from .base import GraphCaptureError

#: most masked tokens one group may hold (slot indices and counters stay in 32 bits).
MAX_GROUP_TOKENS = 2**30
#: the codes of the rollout baseline in both kernels' families (backends/cuda/ktae_args.h, ``Baseline``):
#: ``config.baseline``, or "given" for a caller's ``rollout_advantage``.
BASELINE_CODES = {"grpo": 0, "mean": 1, "none": 2, "given": 3}
#: what a capture refused for want of a warm-up says.
WARM_UP = ("this plan's group layout has not run outside a CUDA graph on this device yet (or `clear_caches` "
           "forgot it; a call that counted no token id, every mask value 0 or a bad id, does not count): make "
           "one call of the plan (on a batch as diverse as the replays will be) before capturing it, as every "
           "CUDA graph needs a warm-up")
#: what a replay that could not complete says.
WARM_UP_MORE = ("Warm the plan up on a batch at least as diverse as the replays, then capture it again "
                "(or use backend='cuda', whose tables cannot overflow).")


def baseline_code(config: KTAEConfig, given: Tensor | None) -> int:
    """``BASELINE_CODES`` of a call: "given" when a rollout advantage is given, else ``config.baseline``."""
    return BASELINE_CODES["given" if given is not None else config.baseline]


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the launches (Triton and the CUDA binding launch on the current device)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (nothing may be read back,
    queried or uploaded then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------ the runtime state of one device
@dataclass(frozen=True)
class Learnt:
    """What the calls of one ``(backend, B, n_groups)`` taught: the largest group (rollouts), the most
    distinct ids a group held, and the most shared memory a group's table needed (cuda; 0: unknown)."""

    largest: int = 0
    distinct: int = 0
    shared_need: int = 0


class _Lru:
    """A dict that keeps its ``size`` most recently used entries (its owner holds the lock)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: "OrderedDict[Hashable, Any]" = OrderedDict()

    def get(self, key: Hashable) -> Any:
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
        return hit

    def put(self, key: Hashable, value: Any) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)


class DeviceState:
    """The GPU backends' runtime state on one device, bounded: tensors computed or uploaded once and
    read by every later call (statistics grids, log-factorials, constant vectors; ``cached``), and what
    earlier calls of a batch layout taught (``learnt``). ``clear`` forgets everything.

    Thread-safe: every lookup, insertion, eviction and ``learn`` holds the state's lock (two threads
    that miss one key both make it, and both get the one kept). A tensor made by ``cached`` is complete
    before any stream reads it (the making stream is synchronised once), and a call on another stream
    records its use, so that an eviction never recycles memory a queued kernel still reads. While a CUDA
    graph captures, nothing is made and no stream is touched: a miss raises ``GraphCaptureError`` (make
    the call once before capturing). What a captured graph reads must outlive this cache's evictions:
    the plan that captured it holds it (``CapturedCall``).
    """

    #: tensors kept (a run uses a few: a grid, a constant vector, a log-factorial table)
    CACHED = 32
    #: batch layouts whose lessons are kept
    LEARNT = 64

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._cached = _Lru(self.CACHED)
        self._learnt = _Lru(self.LEARNT)

    def clear(self, cached: bool = True) -> None:
        """Forget what earlier calls taught (the next calls size their tables from scratch; a plan must
        run once more before it is captured) and, with ``cached``, every cached tensor (the next calls
        make them again)."""
        with self._lock:
            self._learnt = _Lru(self.LEARNT)
            if cached:
                self._cached = _Lru(self.CACHED)

    def stream(self) -> Any:
        """The stream this device's calls enqueue on now (``torch.cuda.current_stream``; None on the CPU).

        Test seam: every stream this state synchronises or records a use on comes from here, so a test
        may replace it (with a stream that records or refuses what is done to it) to check, without a
        GPU, what a call does to the stream."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value ``make()`` (a tensor or a tuple of them, on this device) once made for ``key``."""
        with self._lock:
            hit = self._cached.get(key)
        if hit is None:
            if capturing(self.device):
                raise GraphCaptureError(WARM_UP)
            value = make()
            stream = self.stream()
            if stream is not None:
                stream.synchronize()  # once: every stream may read it from now on
            with self._lock:
                hit = self._cached.get(key)  # another thread's, made meanwhile: one tensor for everyone
                if hit is None:
                    hit = (value, stream)
                    self._cached.put(key, hit)
        value, made_on = hit
        if made_on is not None and not capturing(self.device):
            stream = self.stream()
            if stream != made_on:
                for tensor in value if isinstance(value, tuple) else (value,):
                    tensor.record_stream(stream)
        return value

    def constant(self, values: tuple, dtype: torch.dtype) -> Tensor:
        """``values`` as a ``dtype`` tensor on this device (read-only: clone one a kernel writes)."""
        return self.cached(("constant", dtype, values), lambda: torch.tensor(values, dtype=dtype).to(self.device))

    def grid(self, kernel: "StatisticsKernel", alpha: float, beta: float, bound: int) -> Tensor:
        """float64 ``[5, grid_size(bound)]``: ``p_value, F, IG, h, strength`` of every table of a group of at
        most ``bound`` rollouts (``grid_tables`` order: the table ``(a, b)`` of a group is column
        ``grid_index(n_c, n_w)[0] + a * (n_w + 1) + b``), computed here by ``kernel``."""
        return self.cached(("grid", kernel, alpha, beta, bound),
                           lambda: kernel(grid_tables(bound, self.device), alpha, beta))

    def log_factorials(self, n_max: int) -> Tensor:
        """float64 ``log(k!)`` for ``k = 0 .. >= n_max`` (``fisher.log_factorial_table``, the same values as
        the CPU's), sized to a power of two >= 16."""
        size = 1 << max(4, n_max.bit_length())
        return self.cached(("log_factorial", size), lambda: log_factorial_table(size - 1, self.device))

    def learnt(self, key: Hashable) -> Learnt | None:
        """What the calls under ``key`` (``learnt_key``) taught, or None before any completed."""
        with self._lock:
            return self._learnt.get(key)

    def learn(self, key: Hashable, largest: int = 0, distinct: int = 0, shared_need: int = 0) -> None:
        """Keep the most of each seen under ``key``; a call that counted no id (every id masked out, or a
        bad id) teaches nothing."""
        if distinct <= 0:
            return
        with self._lock:
            seen = self._learnt.get(key) or Learnt()
            self._learnt.put(key, Learnt(max(largest, seen.largest), max(distinct, seen.distinct),
                                         max(shared_need, seen.shared_need)))


def learnt_key(backend: str, batch: Batch) -> tuple:
    """Where ``backend`` keeps what calls of ``batch``'s layout taught: ``(backend, B, n_groups)``, and the
    group sizes for a plan's batch (``Batch.layout``), so that a plan is sized, and its capture allowed,
    by the calls of its own layout only."""
    key = (backend, batch.responses.shape[0], batch.n_groups)
    return key if batch.layout is None else (*key, batch.layout)


_STATES: dict[torch.device, DeviceState] = {}
_STATES_LOCK = threading.Lock()


def state(device: torch.device) -> DeviceState:
    """The runtime state of the GPU backends on ``device`` (one per device, whichever thread asks first)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _STATES.get(device)
    if found is None:
        with _STATES_LOCK:
            found = _STATES.get(device)
            if found is None:
                found = _STATES[device] = DeviceState(device)
    return found


def states() -> tuple[DeviceState, ...]:
    """Every device's state made so far (to clear them all)."""
    with _STATES_LOCK:
        return tuple(_STATES.values())


def _clear_states() -> None:
    for each in states():
        each.clear()


caches.on_clear(_clear_states)


# ------------------------------------------------------------------ the device grid of per-table statistics
#: the largest group size whose every table the device grid holds: ``C(N + 4, 4)`` tables for bound
#: ``N`` (814,385 at 64); past it the kernels compute each row's table.
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
    same values on the CPU, as ``method.table_statistics``)."""

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
    return [math.log1p(SCIPY_RTOL), LOG_ERR, P_ONE, math.log(2.0), alpha, beta]


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
