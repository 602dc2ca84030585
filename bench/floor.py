"""The machine's memory floor for a batch, and the extra memory a contender needs at its peak.

Floor: one pass that reads the int64 ids and the bool mask once and writes float32 ``[B, L]`` once,
the least any KTAE implementation must do. On the CPU it is the native kernel's ``floor`` pass on
``torch.get_num_threads()`` threads (the same threads the backends get); elsewhere it is not measured.
"""
from __future__ import annotations

import ctypes
import gc
import statistics
import time
from typing import Callable

import torch

from bench.data import BenchBatch


def memory_floor_s(batch: BenchBatch, device: torch.device, repeats: int = 5) -> float | None:
    """Median seconds of the floor pass over ``batch`` (after a warm-up), or None where not measured."""
    if device.type != "cpu":
        return None
    try:
        from ktae_kernels import _cpu
    except ImportError:
        return None
    ids, mask = batch.responses.contiguous(), batch.mask.contiguous()
    out = torch.empty(ids.shape, dtype=torch.float32)
    args = (ids.data_ptr(), ids.stride(0), mask.data_ptr(), mask.stride(0), ids.shape[0], ids.shape[1],
            out.data_ptr(), torch.get_num_threads())
    _cpu.floor(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _cpu.floor(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _resident_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc), so that the resident set before a call holds
    only live data and the call's own peak shows."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes a call of ``fn`` needs at its peak beyond what was allocated before it (its output
    included): CUDA's allocator peak, or on Linux the resident-set peak (``/proc/self/status`` VmHWM,
    reset through ``/proc/self/clear_refs``); None where neither is available."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    _trim_heap()
    before = _resident_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    fn()
    peak = _resident_bytes("VmHWM")
    return None if before is None or peak is None else max(peak - before, 0)
