"""The CUDA kernels compile with this machine's nvcc to object code (no GPU needed): a broken kernel
never lands. The binding (csrc/ktae.cpp) is compiled and run by tests/test_cuda_emulation.py.

Architectures follow TORCH_CUDA_ARCH_LIST ("9.0" when unset, the H100 / H200), as the real build.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from build_cache import cached_run

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc") or next(
    (str(p) for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",) if p.exists()), None)

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit absent)")


def gencode_flags(arch_list: str) -> list[str]:
    """nvcc flags for a TORCH_CUDA_ARCH_LIST value such as "8.0;9.0+PTX": SASS for each
    architecture, plus PTX for those marked +PTX."""
    flags = []
    for entry in arch_list.replace(";", " ").split():
        arch = entry.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def spills(ptxas_log: str) -> dict[str, int]:
    """Spill-store bytes per kernel entry from ``-Xptxas -v`` output (per architecture, summed)."""
    out: dict[str, int] = {}
    for name, stores in re.findall(r"Function properties for (\S+)\n\s*\d+ bytes stack frame, (\d+) bytes spill stores", ptxas_log):
        out[name] = out.get(name, 0) + int(stores)
    return out


def test_gencode_flags():
    assert gencode_flags("9.0") == ["-gencode=arch=compute_90,code=sm_90"]
    assert gencode_flags("8.0;9.0+PTX") == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                                           "-gencode=arch=compute_90,code=compute_90"]


@pytest.mark.parametrize("std", ["c++17", "c++20"])
def test_kernels_compile_without_warnings_or_spills_in_the_shared_memory_path(std):
    """nvcc's verdict and ptxas report are cached per source and flags (tests/build_cache.py), so an
    unchanged kernel is not recompiled on every run."""
    cmd = [NVCC, "-c", f"-std={std}", "-O3", *gencode_flags(os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")),
           "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra", "-Xptxas", "-v",
           str(CSRC / "ktae_kernels.cu"), "-o", os.devnull]
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    result = cached_run("nvcc", cmd, sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.h")), key_extra=version)
    assert result["returncode"] == 0, result["stderr"][-4000:]
    per_kernel = spills(result["stdout"] + result["stderr"])
    kernels = {name: n for name, n in per_kernel.items()
               if re.search(r"\d(group|dynamic|scan|groups|group_sums|table_statistics)_kernel", name)}
    # 3 modes x {shared, global table}, the static-bound pass x {shared, global}, the statistics, scan
    # and two groups kernels (the per-slot statistics of big groups are a separate, non-inlined function)
    assert len(kernels) == 12, sorted(kernels)
    shared_path = {name: n for name, n in kernels.items()
                   if re.search(r"group_kernelILi\dELb1E|dynamic_kernelILb1E|scan_kernel|groups_kernel|group_sums_kernel",
                                name)}
    assert len(shared_path) == 7 and not any(shared_path.values()), shared_path
