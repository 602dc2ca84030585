"""The benchmark's contenders: the library backends and the upstream-style loop, behind one call shape.

Every contender maps a ``BenchBatch`` (on the benchmark device) to float32 ``[B, L]`` advantages.
Library backends go through the public ``token_advantage`` (validation and index normalisation
included: the time a caller sees). All contenders share one ``KTAEConfig`` except that the
upstream-style loop uses the published float32 Fisher (``fisher="upstream"``), as it must.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

import ktae_kernels
from bench.data import PAD_ID, BenchBatch
from bench.upstream_style import upstream_token_advantage
from ktae_kernels.registry import BackendUnavailableError, get_backend

UPSTREAM = "upstream-style"
#: every contender name, in table order.
ALL_NAMES: tuple[str, ...] = ("reference", UPSTREAM, "torch", "cpu", "cpu+out", "triton", "cuda")
#: a backend name with this suffix writes into one preallocated ``out`` reused across calls (a trainer's
#: pattern: no fresh output to fault in at every call).
REUSE_OUT = "+out"
#: the library configuration benchmarked: defaults, with Qwen's pad id ignored as upstream did.
BENCH_CONFIG = ktae_kernels.KTAEConfig(ignore_token_ids=(PAD_ID,))


@dataclass(frozen=True)
class Contender:
    """name; run(batch) -> float32 ``[B, L]``; per_group: its cost is a Python loop over groups, so
    it may be measured on the first groups and scaled linearly (always labelled as extrapolated);
    prepare(batch): untimed set-up before the runs (a host copy for the upstream-style loop)."""

    name: str
    run: Callable[[BenchBatch], Tensor]
    per_group: bool
    prepare: Callable[[BenchBatch], object] = lambda batch: None


def _library(name: str) -> Contender:
    backend = name.removesuffix(REUSE_OUT)
    buffers: dict[tuple, Tensor] = {}

    def run(batch: BenchBatch) -> Tensor:
        out = None
        if name.endswith(REUSE_OUT):
            key = (tuple(batch.responses.shape), batch.responses.device)
            if key not in buffers:
                buffers.clear()
                buffers[key] = torch.empty(key[0], dtype=torch.float32, device=key[1])
            out = buffers[key]
        return ktae_kernels.token_advantage(*batch.args(), config=BENCH_CONFIG, backend=backend, out=out)

    return Contender(name, run, per_group=backend == "reference")


def _upstream() -> Contender:
    config = replace(BENCH_CONFIG, fisher="upstream")

    def run(batch: BenchBatch) -> Tensor:
        # the published code ran on CPU tensors in the trainer's driver: the host copy is made
        # by `prepare`, before timing, so only the algorithm is timed.
        return upstream_token_advantage(*batch.on_host().args(), config)

    return Contender(UPSTREAM, run, per_group=True, prepare=BenchBatch.on_host)


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """None when contender ``name`` can run on ``device``, else why not (shown in the table)."""
    if name not in ALL_NAMES:
        return f"unknown contender (choose from {', '.join(ALL_NAMES)})"
    if name == UPSTREAM:
        return None
    if name == "triton" and device.type != "cuda":
        return "Triton is benchmarked on CUDA only (the CPU interpreter is a test tool)"
    name = name.removesuffix(REUSE_OUT)
    if name not in ktae_kernels.available_backends(device):
        try:
            get_backend(name, device)
        except (BackendUnavailableError, ValueError) as err:
            return str(err)
        return "not available on this device"
    return None


def make_contender(name: str) -> Contender:
    """The contender called ``name`` (see ``ALL_NAMES``); check ``unavailable_reason`` first."""
    if name not in ALL_NAMES:
        raise ValueError(f"`name` must be one of {ALL_NAMES}, got {name!r}")
    return _upstream() if name == UPSTREAM else _library(name)
