"""Host time each backend spends before its first kernel launch on the paper batch, measured on a CPU.

A GPU backend's host work (Python, torch dispatch, list building, the device -> host copy it waits
for) is what stands between the call and the device; it runs whatever the GPU. Here it is timed
without one:

- ``cuda`` and ``triton``: CPU tensors with the paper batch's 1024 groups, but of 2 rollouts and
  L = 1, so that each torch op costs about its dispatch, as a queued GPU op does on the host (with
  the paper's 16384 x 3072 the CPU would do the GPU's work); the device statistics grid is already
  cached (as at every step after the first), and the first kernel launch stops the clock. ``cuda``
  sizes everything from the batch's shape and enqueues all its passes in one binding call
  (``ext.advantage``), which is stubbed: the clock stops when it is called, so the binding's own
  argument checks, a memset and its five kernel launches (a few microseconds each on a GPU) are not included; its
  one device -> host read (the id flags) comes after. ``triton``'s sync-free path
  (``triton.nosync``) also sizes from the shape; its first of ten launches (the ranks kernel) is
  stubbed, and its one read of the flags comes after the last. The number of torch ops dispatched is reported beside each time: on a GPU each costs its dispatch
  plus the driver's launch (a few microseconds).
- ``cpu``: the real paper-shaped CPU batch (its device), the clock stops when the native kernel is
  called.

Not included: the wait for the device -> host copy, which on a GPU lasts as long as the device's
queue ahead of it. ``python -m bench.host_plan [--repeats N] [--json FILE]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.data import Shape
from bench.machine import machine_info, today
from ktae_kernels import KTAEConfig
from ktae_kernels.backends import cpu, cuda, device as device_helpers
from ktae_kernels.backends.triton import nosync as triton_nosync
from ktae_kernels.types import Batch

PAPER = Shape(16, 1024, 3072)
#: the stand-in of the paper batch for the GPU backends' host work: its groups, with ops of dispatch size.
HOST_ONLY = Shape(2, 1024, 1)
#: the paper batch's mean masked tokens per group (bench.data: log-normal lengths around 0.35 L).
PAPER_GROUP_TOKENS = 16 * 1075
#: the opt-in shared memory of an H100 / H200 per block.
H200_SHARED_BYTES = 232448


class FirstLaunch(Exception):
    """Raised by a stubbed launch to stop the clock."""


def paper_batch(shape: Shape) -> Batch:
    """A CPU batch of ``shape``, rollouts in group order, every third one correct."""
    group = torch.arange(shape.prompts).repeat_interleave(shape.G)
    return Batch(responses=torch.zeros(shape.B, shape.L, dtype=torch.int64),
                 mask=torch.ones(shape.B, shape.L, dtype=torch.bool),
                 rewards=(torch.arange(shape.B) % 3 == 0).double(), group=group, group_labels=np.arange(shape.prompts))


class _StubExtension:
    """Stands in for ``ktae_kernels._C``: records when each launch is issued, or stops at the first."""

    def __init__(self, stop_at_first: bool) -> None:
        self.stop_at_first = stop_at_first
        self.launched: list[float] = []

    def launch(self, **_: object) -> None:
        self.launched.append(time.perf_counter())
        if self.stop_at_first:
            raise FirstLaunch

    def advantage(self, **_: object) -> None:
        self.launched.append(time.perf_counter())
        raise FirstLaunch  # one call enqueues every pass: the first launch is the last

    def table_statistics(self, **_: object) -> None:
        raise AssertionError("the grid must come from the cache in this measurement")

    def max_shared_bytes(self, _device: int) -> int:
        return H200_SHARED_BYTES


def _to_first_launch(ext: _StubExtension, call: Callable[[], object]) -> float:
    """Seconds from ``call()`` to the first launch ``ext`` recorded (the stub stops the call there)."""
    t0 = time.perf_counter()
    try:
        call()
    except FirstLaunch:
        pass
    return ext.launched[0] - t0


class _StubKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` stops the clock."""

    def __getitem__(self, _grid: object) -> Callable[..., None]:
        def launch(*_: object, **__: object) -> None:
            raise FirstLaunch
        return launch


@contextmanager
def _patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _cache_grid(kernel: object, config: KTAEConfig, device: torch.device, largest: int) -> None:
    """Put a grid for ``largest`` rollouts in the device cache (values unread), as after a first step.
    Only inside ``_scratch_grid_cache()``: the values are garbage."""
    bound = device_helpers.grid_bound(largest)
    if bound is None:
        return
    key = (kernel, config.alpha, config.beta, bound, device)
    device_helpers._GRID_CACHE[key] = (torch.empty(5, device_helpers.grid_size(bound), dtype=torch.float64,
                                                   device=device), None)


def _scratch_grid_cache() -> ContextManager[None]:
    """An empty device-grid cache for the measurement, the process's own restored after it (the
    ``_cache_grid`` entries must never reach a real call)."""
    return _patched(device_helpers, "_GRID_CACHE", OrderedDict())


class _OpCounter(TorchDispatchMode):
    """Counts the torch (aten) ops dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(run: Callable[[], float]) -> int:
    with _OpCounter() as counter:
        run()
    return counter.ops


def _timed(run: Callable[[], float], repeats: int, label: str) -> dict[str, float]:
    """Median and least microseconds of ``repeats`` runs (after a warm-up; on a shared machine the
    least is the run with the least interference), and the torch ops one run dispatches."""
    run()
    times = [run() * 1e6 for _ in range(repeats)]
    return {f"{label}_us": statistics.median(times), f"{label}_min_us": min(times), f"{label}_torch_ops": _ops(run)}


def cuda_host_times(repeats: int, config: KTAEConfig = KTAEConfig()) -> dict[str, float]:
    """Microseconds from the call to the binding call that enqueues every pass of ``cuda.token_advantage``
    (``first_launch``), and, with the path that reads the group sizes first (``fisher="upstream"``'s,
    kept for it), to its first launch (``sized_path_first_launch``, its device -> host copy stubbed)."""
    batch = paper_batch(HOST_ONLY)
    out = torch.empty(HOST_ONLY.B, HOST_ONLY.L, dtype=torch.float32)
    result: dict[str, float] = {}
    with _scratch_grid_cache(), _patched(device_helpers, "_LF_CACHE", {}):
        def run() -> float:
            ext = _StubExtension(True)
            plan = cuda.static_plan(ext, batch, config)
            _cache_grid(cuda._GridKernel(ext), config, batch.device, plan.bound)
            device_helpers.log_factorials(plan.largest, batch.device)
            return _to_first_launch(ext, lambda: cuda.token_advantage(batch, config, None, out, extension=ext))
        result.update(_timed(run, repeats, "first_launch"))
    with _scratch_grid_cache(), _patched(cuda, "_read_sizes", lambda size, tokens: [PAPER.G, PAPER_GROUP_TOKENS]), \
            _patched(cuda, "static_plan", lambda *_: None):
        def sized() -> float:
            ext = _StubExtension(True)
            _cache_grid(cuda._GridKernel(ext), config, batch.device, PAPER.G)
            return _to_first_launch(ext, lambda: cuda.token_advantage(batch, config, None, out, extension=ext))
        result.update(_timed(sized, repeats, "sized_path_first_launch"))
    return result


def triton_host_times(repeats: int, config: KTAEConfig = KTAEConfig()) -> dict[str, float]:
    """Microseconds from the call to the first launch (the ranks kernel) of the triton backend's
    sync-free path (``triton.nosync``), its grid statistics already cached (placeholders, in a
    scratch cache restored after the measurement)."""
    from ktae_kernels.backends import triton as triton_backend

    batch = paper_batch(HOST_ONLY)
    placeholder = torch.empty(5, device_helpers.grid_size(16), dtype=torch.float64)
    scratch = {(config.alpha, config.beta, 16, batch.device): [placeholder, None]}
    with _patched(triton_nosync, "_VALUES", scratch), _patched(triton_nosync, "_ranks_kernel", _StubKernel()):
        def run() -> float:
            t0 = time.perf_counter()
            try:
                triton_backend.token_advantage(batch, config, None)
            except FirstLaunch:
                return time.perf_counter() - t0
            raise AssertionError("the ranks kernel was not launched")
        return _timed(run, repeats, "first_launch")


def cpu_host_times(repeats: int, config: KTAEConfig = KTAEConfig()) -> dict[str, float]:
    """Microseconds from the call to the native kernel's call (``cpu`` backend, real CPU tensors)."""
    batch = paper_batch(PAPER)
    out = torch.empty(PAPER.B, PAPER.L, dtype=torch.float32)

    class Stub:
        def Method(self, **_: object) -> None:
            return None

        def advantage(self, *_: object, **__: object) -> bool:
            raise FirstLaunch

    with _patched(cpu, "load_extension", lambda: Stub()):
        def run() -> float:
            t0 = time.perf_counter()
            try:
                cpu.token_advantage(batch, config, None, out)
            except FirstLaunch:
                return time.perf_counter() - t0
            raise AssertionError("the native kernel was not called")
        return _timed(run, repeats, "first_launch")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the host's own thread; other threads only add noise on a shared machine
    report = {"machine": machine_info(torch.device("cpu")), "date": today(), "shape": str(PAPER),
              "host_only_shape": str(HOST_ONLY), "load_average": os.getloadavg()[0], "backends": {}}
    for name, measure in (("cuda", cuda_host_times), ("triton", triton_host_times), ("cpu", cpu_host_times)):
        report["backends"][name] = times = measure(args.repeats)
        print(name, ", ".join(f"{k} {v:.0f}" for k, v in times.items()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
