"""Packaging; the metadata lives in pyproject.toml. This file adds the native CPU kernel.

``ktae_kernels._cpu`` (csrc/cpu/) is the native CPU backend: C++17 (its own threads) and nanobind (typed
DLPack arrays; no torch at build time, so pip's isolated build never pulls torch). It is built
whenever a C++ compiler and nanobind are there (an isolated build installs nanobind; without isolation,
`pip install nanobind` first); without them (or if it fails) the package still installs,
``backend="cpu"`` reports why it is missing and "auto" warns that it runs the slower torch backend.
The build is portable (no ``-march=native``) unless

    KTAE_NATIVE_ARCH=1       tune the CPU kernel for this machine's processor (not portable)

The CUDA kernels are not built here: the wheel carries their source (ktae_kernels/backends/cuda/), which
NVRTC compiles at first use on the GPU (``pip install "ktae_kernels[cuda]"``).
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{name} must be 0 or 1, got {os.environ[name]!r}")
    return value in ("1", "true", "yes", "on")


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
    return {"ext_modules": _cpu_extension(), "cmdclass": {"build_ext": _with_nanobind(build_ext)}}


if __name__ == "__main__":  # also under pip: setuptools runs this file as __main__
    setup(**_setup_arguments())
