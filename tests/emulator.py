"""The CUDA kernels built for the CPU emulator (csrc/emulation/): csrc/ktae.cpp and csrc/ktae_kernels.cu
compiled against ``cuda_on_cpu.h`` into a test-only extension whose tensors live on the CPU, and a
backend module over it (``backend``), so that plans and the API's paths run the cuda backend's code.

The build (about 80 s on a loaded 2-core machine) is cached in ``$KTAE_CACHE_DIR`` (default
``~/.cache/ktae_kernels``), keyed by a hash of the sources, the build script and its flags, torch and
Python, so a fresh clone on the same machine reuses it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

from build_cache import cache_root

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = [CSRC / "ktae.cpp", CSRC / "emulation" / "ktae_emulated.cpp"]
DEPENDS = [CSRC / "ktae_kernels.h", CSRC / "ktae_kernels.cu", CSRC / "emulation" / "cuda_on_cpu.h"]

_BUILD = """
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
setup(name="ktae_emulated", script_args=["build_ext", "--parallel", "2", "--build-lib", {lib!r}, "--build-temp", {tmp!r}],
      ext_modules=[CppExtension("ktae_emulated", {sources!r}, include_dirs=[{csrc!r}],
                                extra_compile_args=["-O2", "-g0", "-pthread", "-Wno-unknown-pragmas"],
                                extra_link_args=["-pthread"])],
      cmdclass={{"build_ext": BuildExtension.with_options(use_ninja=False)}})
"""


#: emulator builds kept in the cache (one per source version).
KEEP_BUILDS = 3


def _build_key() -> str:
    """A hash of everything the build depends on: the sources, the build script (flags), torch, Python."""
    digest = hashlib.sha256(f"{torch.__version__} {sys.version} {_BUILD}".encode())
    for path in SOURCES + DEPENDS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _build(target: Path) -> None:
    """Compile the emulator extension into ``target`` (atomically: concurrent runs may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    script = _BUILD.format(lib=str(work / "lib"), tmp=str(work / "tmp"), sources=[str(s) for s in SOURCES], csrc=str(CSRC))
    result = subprocess.run([sys.executable, "-c", script], cwd=work, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        pytest.fail(f"building the CUDA emulator extension failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    try:
        os.replace(work / "lib", target)
    except OSError:  # another run finished first
        assert target.exists()
    shutil.rmtree(work, ignore_errors=True)
    # keep the newest KEEP_BUILDS (branches or clones of other sources share the cache), drop older ones
    builds = sorted((p for p in target.parent.iterdir() if not p.name.startswith("build-")),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in builds[KEEP_BUILDS:]:
        shutil.rmtree(stale, ignore_errors=True)


def load() -> ModuleType:
    """The emulator build (built first when the cache lacks it); skips the test without a compiler."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    target = cache_root() / "cuda_emulator" / _build_key()
    if not target.exists():
        _build(target)
    so = next(target.glob("ktae_emulated*.so"))
    spec = importlib.util.spec_from_file_location("ktae_emulated", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
