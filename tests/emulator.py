"""The CUDA kernels on the CPU emulator (csrc/emulation/): the device source NVRTC compiles
(ktae_kernels/backends/cuda/ktae_kernels.cu) built as plain C++ against ``cuda_on_cpu.h`` into a
shared library, and ``Emulator``, a launcher (``pipeline.Launcher``) over it: the cuda backend's Python
launches run unchanged, on CPU tensors.

The build (a few seconds) is cached in ``$KTAE_CACHE_DIR`` (default ``~/.cache/ktae_kernels``), keyed by
a hash of the sources and the compile command, so a fresh clone on the same machine reuses it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from build_cache import cache_root
from ktae_kernels import KernelVariant

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "emulation" / "ktae_emulated.cpp"
DEPENDS = [ROOT / "csrc" / "emulation" / "cuda_on_cpu.h", ROOT / "ktae_kernels" / "backends" / "cuda" / "ktae_kernels.cu",
           ROOT / "ktae_kernels" / "backends" / "cuda" / "ktae_args.h"]
#: emulator builds kept in the cache (one per source version and kernel variant).
KEEP_BUILDS = 6


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else ``c++``), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def command(output: Path, variant: KernelVariant = KernelVariant()) -> list[str]:
    """The compile command of the emulator library of ``variant`` (its macros, as NVRTC gets them)."""
    return [compiler(), "-std=c++17", "-O2", "-g0", "-shared", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas",
            *(f"-D{name}={value}" for name, value in variant.macros()), str(SOURCE), "-o", str(output)]


def _build_key(variant: KernelVariant) -> str:
    digest = hashlib.sha256(" ".join(command(Path("out"), variant)).encode())
    for path in [SOURCE, *DEPENDS]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _build(target: Path, variant: KernelVariant) -> None:
    """Compile the emulator library of ``variant`` to ``target`` (atomically: concurrent runs may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"build-{os.getpid()}-{target.name}")
    result = subprocess.run(command(tmp, variant), capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        pytest.fail(f"building the CUDA emulator failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    os.replace(tmp, target)
    builds = sorted((p for p in target.parent.iterdir() if not p.name.startswith("build-")),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in builds[KEEP_BUILDS:]:
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


class Emulator:
    """A launcher (``ktae_kernels.backends.cuda.pipeline.Launcher``) that runs each kernel on the CPU,
    block by block, each CUDA thread a fiber on the calling thread (``csrc/emulation/cuda_on_cpu.h``);
    the device memory is the CPU tensors' memory. ``variant``: the kernels' compile-time variant."""

    on_host = True

    def __init__(self, library: ctypes.CDLL, variant: KernelVariant = KernelVariant()) -> None:
        self.lib, self.variant = library, variant
        self.lib.ktae_emulated_launch.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                                  ctypes.c_void_p]
        for name in ("max_shared_bytes", "max_keys", "header_bytes", "shared_table_bytes", "group_shared_need"):
            getattr(self.lib, f"ktae_emulated_{name}").restype = ctypes.c_int64
        self.lib.ktae_emulated_shared_table_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_bool]
        self.lib.ktae_emulated_group_shared_need.argtypes = [ctypes.c_int64, ctypes.c_bool, ctypes.c_int64]
        self.lib.ktae_emulated_max_keys.argtypes = self.lib.ktae_emulated_header_bytes.argtypes = [ctypes.c_int64]

    def launch(self, name: str, grid: int, block: int, smem: int, args: tuple) -> None:
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        if self.lib.ktae_emulated_launch(name.encode(), grid, block, smem, params) != 0:
            raise RuntimeError(f"ktae_kernels.cuda: launching {name} failed: invalid launch configuration "
                               f"(CPU emulator: grid {grid}, block {block}, shared memory {smem})")

    def max_shared_bytes(self) -> int:
        return self.lib.ktae_emulated_max_shared_bytes()

    def __getattr__(self, name: str):
        """The header's table sizes as the emulator's C++ computes them (``max_keys``, ``header_bytes``, ...)."""
        if name.startswith("_") or name in ("lib", "variant"):
            raise AttributeError(name)
        return getattr(self.lib, f"ktae_emulated_{name}")


def load(variant: KernelVariant = KernelVariant()) -> Emulator:
    """The emulator of ``variant`` (built first when the cache lacks it); skips the test without a compiler."""
    if compiler() is None:
        pytest.skip("no C++ compiler")
    target = cache_root() / "cuda_emulator" / f"{_build_key(variant)}.so"
    if not target.exists():
        _build(target, variant)
    return Emulator(ctypes.CDLL(str(target)), variant)
