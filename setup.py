"""Packaging; the metadata lives in pyproject.toml. This file adds the two compiled kernels.

``ktae_kernels._cpu`` (csrc/cpu/) is the native CPU backend: C++17 (its own threads) and nanobind (typed
DLPack arrays; no torch at build time, so pip's isolated build never pulls torch). It is built
whenever a C++ compiler and nanobind are there (an isolated build installs nanobind; without isolation,
`pip install nanobind` first); without them (or if it fails) the package still installs,
``backend="cpu"`` reports why it is missing and "auto" warns that it runs the slower torch backend.
The build is portable (no ``-march=native``) unless

    KTAE_NATIVE_ARCH=1       tune the CPU kernel for this machine's processor (not portable)

``ktae_kernels._C`` (csrc/) is built when the build environment has torch with CUDA and a CUDA
toolkit (nvcc), and skipped otherwise: the package then installs as pure Python and
``backend="cuda"`` reports itself unavailable. pyproject's build requirements deliberately lack torch,
so a default (isolated) ``pip install .`` never builds it and never pulls torch into the build.

    KTAE_SKIP_CUDA_BUILD=1   never build the extension
    KTAE_FORCE_CUDA_BUILD=1  build it, or fail with the reason

GPU build, against the torch already installed (without isolation, so nanobind first):
    pip install nanobind && TORCH_CUDA_ARCH_LIST="9.0" KTAE_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation
"""
from __future__ import annotations

import glob
import os
import re
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: the kernels use __match_any_sync: compute capability 7.0 or newer.
MIN_ARCH = 7.0


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{name} must be 0 or 1, got {os.environ[name]!r}")
    return value in ("1", "true", "yes", "on")


def old_archs(arch_list: str) -> list[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST ("8.0;9.0a", "8.6+PTX 10.0f") below ``MIN_ARCH``."""
    numbers = ((entry, re.match(r"\d+\.\d+", entry)) for entry in arch_list.replace(";", " ").split())
    return [entry for entry, number in numbers if number and float(number.group()) < MIN_ARCH]


def _build_problem() -> str | None:
    """None when the extension can be built here, else the reason it cannot."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return ("torch is not importable in the build environment "
                "(build with `pip install -e . --no-build-isolation` against an installed CUDA torch)")
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (put nvcc on PATH or set CUDA_HOME)"
    old = old_archs(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    if old:
        return f"TORCH_CUDA_ARCH_LIST names {old}; the kernels need compute capability >= {MIN_ARCH}"
    return None


def _cuda_extension() -> dict:
    """setup() arguments that build ktae_kernels._C, or none."""
    skip, force = _flag("KTAE_SKIP_CUDA_BUILD"), _flag("KTAE_FORCE_CUDA_BUILD")
    if skip and force:
        raise ValueError("set at most one of KTAE_SKIP_CUDA_BUILD and KTAE_FORCE_CUDA_BUILD")
    if skip:
        print("ktae_kernels: KTAE_SKIP_CUDA_BUILD=1: not building the CUDA extension", file=sys.stderr)
        return {}
    problem = _build_problem()
    if problem is not None:
        if force:
            raise RuntimeError(f"KTAE_FORCE_CUDA_BUILD=1 but the CUDA extension cannot be built: {problem}")
        print(f"ktae_kernels: not building the CUDA extension: {problem}", file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    here = os.path.dirname(os.path.abspath(__file__))
    extension = CUDAExtension(
        name="ktae_kernels._C",
        sources=["csrc/ktae.cpp", "csrc/ktae_kernels.cu"],
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


def _nanobind_paths() -> tuple[list[str], list[str]] | str:
    """(sources, include dirs) of nanobind's runtime, compiled into the kernel module, or why not."""
    try:
        import nanobind
    except ImportError:
        return ("nanobind is not importable in the build environment (a build without isolation needs "
                "`pip install nanobind` first)")
    root = os.path.dirname(nanobind.__file__)
    return ([os.path.join(nanobind.source_dir(), "nb_combined.cpp")],
            [nanobind.include_dir(), os.path.join(root, "ext", "robin_map", "include")])


def _cpu_extension() -> list[Extension]:
    """ktae_kernels._cpu (nanobind, typed array arguments): strict IEEE float64 (no FMA contraction), so its
    per-row formulas round as the torch path does. nanobind's own sources join when the extension is
    built (``_with_nanobind``): setuptools refuses absolute paths among the sources declared here,
    and nanobind lives wherever the build environment has it (inside the project for a venv there)."""
    flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fvisibility=hidden", "-fno-strict-aliasing", "-pthread"]
    if _flag("KTAE_NATIVE_ARCH"):
        flags.append("-march=native")
    return [Extension("ktae_kernels._cpu", sources=["csrc/cpu/ktae_cpu.cpp"], language="c++",
                      include_dirs=["csrc/cpu"], depends=sorted(glob.glob("csrc/cpu/*.h")),
                      extra_compile_args=flags, extra_link_args=["-pthread"], optional=True)]


def _skip_cpu_kernel(reason: object) -> None:
    """Say, in a banner, that the package installs without its native CPU kernel. pip shows a build's
    output only with -v or when it fails; after an install ``python -m ktae_kernels --check`` says it
    (and exits 1), and "auto" warns at its first call."""
    bar = "!" * 79
    print(f"\n{bar}\nWARNING: ktae_kernels: NOT building the native CPU kernel (ktae_kernels._cpu): {reason}.\n"
          "backend='cpu' will be unavailable and backend='auto' runs the slower torch backend on CPU tensors.\n"
          f"Check an install with: python -m ktae_kernels --check\n{bar}\n", file=sys.stderr)


def _with_nanobind(base: type) -> type:
    """``base`` build_ext that builds ktae_kernels._cpu with nanobind's runtime, else skips it with the
    reason: a machine without a working compiler or nanobind still installs the package."""

    class BuildExt(base):
        def build_extension(self, ext):
            if ext.name != "ktae_kernels._cpu":
                return super().build_extension(ext)
            paths = _nanobind_paths()
            if isinstance(paths, str):
                return _skip_cpu_kernel(paths)
            declared = ext.sources, ext.include_dirs
            ext.sources, ext.include_dirs = declared[0] + paths[0], declared[1] + paths[1]
            try:  # the commands after this one (egg_info writing SOURCES.txt) see the declared sources
                try:
                    return super().build_extension(ext)
                except Exception as err:  # noqa: BLE001 - any compiler failure: install without the kernel
                    return _skip_cpu_kernel(err)
            finally:
                ext.sources, ext.include_dirs = declared

    return BuildExt


def _setup_arguments() -> dict:
    cuda = _cuda_extension()
    base = cuda.get("cmdclass", {}).get("build_ext", build_ext)
    return {"ext_modules": _cpu_extension() + cuda.get("ext_modules", []),
            "cmdclass": {"build_ext": _with_nanobind(base)}}


if __name__ == "__main__":  # also under pip: setuptools runs this file as __main__
    setup(**_setup_arguments())
