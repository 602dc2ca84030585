"""The backend registry: name -> implementation module, where it runs, and the "auto" choice.

A backend module exposes two functions over a validated ``Batch``:
``key_token_scores(batch, config) -> KeyTokenScores`` and
``token_advantage(batch, config, rollout_advantage, out) -> float32 [B, L]`` (written into ``out``
when it is not None), and may set ``CHECKS_TOKEN_IDS = True`` when it checks the token-id range
itself while counting (the API then skips its own pass over the ids).
Modules are imported lazily, so a missing optional dependency only matters when it is asked for.

"auto" order: on CPU tensors the native ``cpu`` kernel, else ``torch``. On CUDA tensors ``torch``
only, until the Triton and CUDA kernels have passed their tests on real GPU hardware (they have
only run in the Triton interpreter and a CPU emulator of CUDA so far); ``backend="triton"`` /
``"cuda"`` select them explicitly.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class BackendSpec:
    """name: the ``backend=`` string; module: import path of the implementation;
    devices: torch device types it accepts; auto_rank: per device type, lower runs first under "auto"
    (absent: never chosen automatically); unavailable: returns None when usable on that device type,
    else the reason."""

    name: str
    module: str
    devices: tuple[str, ...]
    auto_rank: dict[str, int]
    unavailable: Callable[[str], str | None]


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) a backend."""
    _REGISTRY[spec.name] = spec


def backend_names() -> tuple[str, ...]:
    """Every registered backend name."""
    return tuple(_REGISTRY)


def available_backends(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """Backends usable for tensors on ``device``."""
    kind = torch.device(device).type
    return tuple(n for n, s in _REGISTRY.items() if kind in s.devices and s.unavailable(kind) is None)


def get_backend(name: str, device: torch.device | str) -> ModuleType:
    """The implementation module for ``name`` on ``device``; "auto" picks the fastest usable one.

    Raises ValueError for an unknown name or a device the backend does not accept, and
    BackendUnavailableError when it is known but cannot run here.
    """
    kind = torch.device(device).type
    if name == "auto":
        ranked = sorted((s.auto_rank[kind], n) for n, s in _REGISTRY.items() if kind in s.auto_rank)
        for _, candidate in ranked:
            if _REGISTRY[candidate].unavailable(kind) is None:
                return importlib.import_module(_REGISTRY[candidate].module)
        raise BackendUnavailableError(f"no backend can run on device type {kind!r}")
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"`backend` must be 'auto' or one of {backend_names()}, got {name!r}")
    if kind not in spec.devices:
        raise ValueError(f"backend {name!r} runs on {spec.devices} tensors, got a {kind!r} tensor")
    reason = spec.unavailable(kind)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    return importlib.import_module(spec.module)


def _always(_: str) -> None:
    return None


def _rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def _triton_unavailable(kind: str) -> str | None:
    if kind == "cuda" and _rocm():
        return "ROCm is not supported: the Triton kernels use NVIDIA inline PTX"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "triton is not installed (pip install triton)"
    if kind == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing triton"


def _cuda_unavailable(kind: str) -> str | None:
    if _rocm():
        return "ROCm is not supported: the extension is written for NVIDIA GPUs"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        importlib.import_module("ktae_kernels._C")
    except ImportError as err:
        return (f"the compiled extension ktae_kernels._C is not built ({err}); build it on a CUDA machine "
                "with `TORCH_CUDA_ARCH_LIST=9.0 KTAE_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation`")
    return None


def _cpu_unavailable(_: str) -> str | None:
    from . import cpu

    return cpu.unavailable_reason()


register_backend(BackendSpec("reference", "ktae_kernels.reference", ("cpu", "cuda"), {}, _always))
register_backend(BackendSpec("cpu", "ktae_kernels.cpu", ("cpu",), {"cpu": 0}, _cpu_unavailable))
register_backend(BackendSpec("torch", "ktae_kernels.torch_backend", ("cpu", "cuda"), {"cpu": 1, "cuda": 0}, _always))
register_backend(BackendSpec("triton", "ktae_kernels.triton", ("cpu", "cuda"), {}, _triton_unavailable))
register_backend(BackendSpec("cuda", "ktae_kernels.cuda", ("cuda",), {}, _cuda_unavailable))
