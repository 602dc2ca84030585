"""The machine's memory floor for a batch, and the extra memory a contender needs at its peak.

Floor: one pass that reads the int64 ids and the bool mask once and writes float32 ``[B, L]`` once,
the least any KTAE implementation must do. On the CPU it is ``bench/floor.c``, compiled here at first
use with the system C compiler (``cc -O3 -fopenmp``) into a cache folder and loaded with ctypes, run on
``torch.get_num_threads()`` threads (the same threads the backends get) and on one, the faster counting;
elsewhere, without a C compiler, or on several threads where the compiler has no OpenMP (one thread is no
floor for several), it is not measured (the reason is printed once).
"""
from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from bench.data import BenchBatch

SOURCE = Path(__file__).with_name("floor.c")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ktae_kernels" / "bench"


@functools.lru_cache(maxsize=1)
def floor_library() -> ctypes.CDLL | str:
    """The compiled floor pass (built once per source version), or why it is not available."""
    source = SOURCE.read_bytes()
    library = _cache_dir() / f"floor-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not library.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            return "no C compiler (cc, gcc or clang) on PATH to build bench/floor.c"
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        for openmp in (["-fopenmp"], []):
            done = subprocess.run([compiler, "-O3", *openmp, "-shared", "-fPIC", str(SOURCE), "-o", str(partial)],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            return f"{compiler} could not build bench/floor.c: {done.stderr.strip()[:300]}"
        os.replace(partial, library)
    lib = ctypes.CDLL(str(library))
    lib.ktae_floor.restype = None
    lib.ktae_floor.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.ktae_floor_openmp.restype = ctypes.c_int
    lib.ktae_floor_openmp.argtypes = []
    return lib


def memory_floor_s(batch: BenchBatch, device: torch.device, repeats: int = 5) -> float | None:
    """Median seconds of the floor pass over ``batch`` (after a warm-up), or None where not measured.

    Each sample is the faster of the pass on ``torch.get_num_threads()`` threads and on one thread: an
    OpenMP team waits at its barrier for a thread the scheduler took away, so beside a busy process the
    two-thread pass can take many times the one-thread pass (docs/benchmarks.md), a floor that would hide
    any backend's cost. One thread is a pass the backends' threads can run too.
    """
    if device.type != "cpu":
        return None
    lib = floor_library()
    if isinstance(lib, str):
        _warn_once(f"bench: the memory floor is not measured: {lib}")
        return None
    threads = torch.get_num_threads()
    if threads > 1 and not lib.ktae_floor_openmp():
        _warn_once(f"bench: the memory floor is not measured: bench/floor.c was built without OpenMP, and one "
                   f"thread is no floor for backends on {threads} (use --threads 1, or a compiler with -fopenmp)")
        return None
    ids, mask = batch.responses.contiguous(), batch.mask.contiguous()
    out = torch.empty(ids.shape, dtype=torch.float32)
    args = (ids.data_ptr(), ids.stride(0), mask.data_ptr(), mask.stride(0), ids.shape[0], ids.shape[1],
            out.data_ptr())
    thread_counts = sorted({threads, 1})
    for n in thread_counts:
        lib.ktae_floor(*args, n)
    times = []
    for _ in range(repeats):
        passes = []
        for n in thread_counts:
            start = time.perf_counter()
            lib.ktae_floor(*args, n)
            passes.append(time.perf_counter() - start)
        times.append(min(passes))
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr)


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
    """Give freed memory back to the OS (glibc's heap, and the outputs the native CPU kernel keeps for
    reuse), so that the resident set before a call holds only live data and the call's own peak
    shows, its output included."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    from ktae_kernels.backends import cpu

    if cpu.unavailable_reason() is None:
        cpu.release_output_pool()


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
