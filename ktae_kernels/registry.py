"""The backend registry: ``backend=`` name -> ``BackendSpec``, availability, and the "auto" order.

"auto" order: on CPU tensors the native ``cpu`` kernel, then ``torch``. On CUDA tensors ``cuda`` (when
NVRTC compiles its kernels for the GPU: the ``cuda`` extra), then ``triton``, then ``torch``: the order
of their paper-batch times on an H200 (docs/benchmarks.md), where ``triton``, ``torch`` and the ``cuda``
kernels as nvcc built them passed the GPU tests; ``cuda`` as NVRTC builds it has not yet run on a GPU.
``reference`` is never chosen automatically.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from typing import Any, NamedTuple

import torch

from . import caches
from .backends.base import Backend, BackendSpec, BackendUnavailableError

_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec | None:
    """Add (or replace) a backend; returns the spec it replaced (None for a new name), so that a test
    that replaces one can put it back."""
    replaced = _REGISTRY.get(spec.name)
    _REGISTRY[spec.name] = spec
    return replaced


#: the backend a ``process_group=`` call runs (the torch stages, merged over the ranks), and the
#: ``backend=`` names such a call accepts.
DISTRIBUTED_BACKEND = "torch"
DISTRIBUTED_BACKENDS = ("auto", DISTRIBUTED_BACKEND)


def backend_spec(name: str) -> BackendSpec:
    """The registered spec of ``name``, whether or not it can run here (``resolve`` checks that);
    ValueError for an unknown name."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"`backend` must be one of {backend_names()}, got {name!r}")
    return _REGISTRY[name]


def backend_names() -> tuple[str, ...]:
    """Every registered backend name."""
    return tuple(_REGISTRY)


def as_device(device: object) -> torch.device:
    """``device`` (a ``torch.device`` or a string such as "cuda:0") as a ``torch.device``; ValueError naming
    ``device`` for anything else (an int, None, an unknown device type)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError:
            pass
    raise ValueError(f"`device` must be a torch.device or a device string such as 'cpu' or 'cuda:0', got {device!r}")


def available_backends(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """Backends that run tensors on ``device`` on this machine: none for CUDA tensors where torch can use no
    CUDA GPU.

    Example: ``available_backends("cpu")`` -> ``('reference', 'cpu', 'torch')`` where the native
    kernel is built.
    """
    kind = as_device(device).type
    return tuple(n for n, s in _REGISTRY.items() if kind in s.devices and s.unavailable(kind) is None)


class BackendStatus(NamedTuple):
    """A backend for tensors of one device type: ``problem`` is None where it can run here, else why not
    and the fix; ``auto``: "auto" may pick it there."""

    name: str
    problem: str | None
    auto: bool


def availability(device: torch.device | str = "cpu") -> list[BackendStatus]:
    """Every backend for tensors on ``device``'s type: those "auto" may pick first, in its order, then the
    others (what ``python -m ktae_kernels --check`` prints)."""
    kind = as_device(device).type
    names = sorted((n for n, s in _REGISTRY.items() if kind in s.devices),
                   key=lambda n: _REGISTRY[n].auto_rank.get(kind, len(_REGISTRY)))
    return [BackendStatus(n, _REGISTRY[n].unavailable(kind), kind in _REGISTRY[n].auto_rank) for n in names]


def device_problem(device: torch.device | str) -> str | None:
    """None when this machine can hold tensors of ``device``'s type (the CPU; CUDA with a usable GPU),
    else why not."""
    kind = as_device(device).type
    return None if kind == "cpu" else _no_cuda_gpu() if kind == "cuda" else f"no backend runs on {kind} tensors"


def check_backend_name(name: Any, where: str = "`backend`") -> str:
    """``name`` when it is "auto" or a registered backend's name (whether that backend can run here is
    known only for the tensors' device); else ValueError naming ``where`` and the accepted names."""
    if not isinstance(name, str) or (name != "auto" and name not in _REGISTRY):
        raise ValueError(f"{where} must be 'auto' or one of {backend_names()}, got {name!r}")
    return name


def resolve(name: str, device: torch.device | str) -> BackendSpec:
    """The spec of ``name`` on ``device``; "auto" picks the first usable one in the auto order.

    Raises ValueError for an unknown name, and BackendUnavailableError (saying why and what to do)
    when the backend is known but cannot run on ``device`` here (CUDA tensors where torch can use no CUDA
    GPU included). ValueError for a ``device`` that is not one (``as_device``).
    """
    kind = as_device(device).type
    if name == "auto":
        ranked = sorted((s.auto_rank[kind], n) for n, s in _REGISTRY.items() if kind in s.auto_rank)
        skipped: list[tuple[str, str]] = []
        for _, candidate in ranked:
            reason = _REGISTRY[candidate].unavailable(kind)
            if reason is None:
                if skipped:
                    _warn_fallback(kind, candidate, skipped[0])
                return _REGISTRY[candidate]
            skipped.append((candidate, reason))
        problem = _no_cuda_gpu() if kind == "cuda" else None
        raise BackendUnavailableError(f"no backend can run on device type {kind!r} here"
                                      f"{'' if problem is None else ': ' + problem}; use CPU tensors (`.cpu()`, or "
                                      f"device='cpu' for a plan)")
    spec = _REGISTRY[check_backend_name(name)]
    if kind not in spec.devices:
        where = " or ".join(repr(d) for d in spec.devices)
        problem = spec.unavailable(spec.devices[0])
        if problem is not None:  # moving the tensors would not help: say what runs here instead
            raise BackendUnavailableError(
                f"backend {name!r} runs on {where} tensors, and cannot run on this machine: {problem}. For {kind} "
                f"tensors use backend='auto' (here it runs {resolve('auto', kind).name!r}) or one of "
                f"{available_backends(kind)}")
        raise BackendUnavailableError(
            f"backend {name!r} runs on {where} tensors, got a {kind!r} tensor; move `responses` (and the "
            f"other tensors) to {spec.devices[0]!r} with `.to({spec.devices[0]!r})`, or use backend='auto'")
    reason = spec.unavailable(kind)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    return spec


#: (device type, backend) pairs whose "auto" fallback has been warned about in this process
#: (``clear_caches`` forgets them).
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()
caches.on_clear(_WARNED.clear)


def _warn_fallback(kind: str, chosen: str, skipped: tuple[str, str]) -> None:
    """Warn once per process that "auto" runs ``chosen`` on ``kind`` tensors because the backend it
    prefers there is unavailable (``skipped``: its name and the reason, which says how to build it)."""
    with _WARNED_LOCK:
        if (kind, skipped[0]) in _WARNED:
            return
        _WARNED.add((kind, skipped[0]))
    warnings.warn(f"backend='auto' runs the slower {chosen!r} backend on {kind} tensors: backend {skipped[0]!r} "
                  f"is unavailable: {skipped[1]}", RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, for a warning raised by the caller of this function, that names the
    first line outside this package (the user's call)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The implementation of ``name`` on ``device`` (see ``resolve``)."""
    return resolve(name, device).load()


def _gpu_if_cuda(kind: str) -> str | None:
    """Why a backend that runs on any device cannot run ``kind`` tensors here: CUDA ones need a CUDA GPU."""
    return _no_cuda_gpu() if kind == "cuda" else None


def _rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def _no_cuda_gpu() -> str | None:
    """Why torch cannot use a CUDA GPU here, or None."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build, so no CUDA GPU can be used (on a GPU "
                f"machine, install a CUDA build of torch)")
    return "no usable CUDA GPU is visible (torch.cuda.is_available() is False)"


def _triton_unavailable(kind: str) -> str | None:
    if kind == "cuda" and _rocm():
        return "ROCm is not supported: the Triton kernels use NVIDIA inline PTX"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "triton is not installed (pip install triton)"
    if kind == "cuda":
        return _no_cuda_gpu()
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing triton"


def _cuda_unavailable(_: str) -> str | None:
    if _rocm():
        return "ROCm is not supported: the CUDA kernels are written for NVIDIA GPUs"
    if _no_cuda_gpu() is not None:
        return _no_cuda_gpu()
    from .backends import cuda

    return cuda.unavailable_reason()


def _cpu_unavailable(_: str) -> str | None:
    from .backends import cpu

    return cpu.unavailable_reason()


register_backend(BackendSpec("reference", "ktae_kernels.reference", ("cpu", "cuda"), _gpu_if_cuda))
register_backend(BackendSpec("cpu", "ktae_kernels.backends.cpu", ("cpu",), _cpu_unavailable,
                             {"cpu": 0}, checks_token_ids=True))
register_backend(BackendSpec("torch", "ktae_kernels.backends.torch", ("cpu", "cuda"), _gpu_if_cuda,
                             {"cpu": 1, "cuda": 2}))
register_backend(BackendSpec("triton", "ktae_kernels.backends.triton", ("cpu", "cuda"), _triton_unavailable,
                             {"cuda": 1}, checks_token_ids=True, capturable=True))
register_backend(BackendSpec("cuda", "ktae_kernels.backends.cuda", ("cuda",), _cuda_unavailable,
                             {"cuda": 0}, checks_token_ids=True, checks_values=True,
                             capturable=True))
