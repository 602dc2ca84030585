"""The CUDA kernels compile with this machine's nvcc for sm_80 and sm_90, without a GPU, warnings as
errors (C++17 and C++20), and ptxas -v (tests/compile_report.py) shows:
- no register spills in the kernels of the shared-memory path (the scan and groups passes, the
  shared-table passes, the statistics kernel); the global-memory passes may spill (they run only for
  the groups a shared table cannot hold);
- no static shared memory (every table is dynamic, sized by the host within the device's opt-in limit:
  tests/test_cuda_host.py checks that sizing against sm_80's and sm_90's limits), and the shared-table
  kernels' registers and shared memory let the blocks per SM the host chooses (1 or 2) share an SM;
- in the sm_90 SASS (cuobjdump -sass), a tile's token-id loads all issue before the first range check of
  any of them, in every kernel that builds a table (a check's atomic between two loads makes each load
  wait for the one before: kUnroll dependent DRAM trips a tile instead of one).
The binding (csrc/ktae.cpp) is compiled and run by tests/test_cuda_emulation.py.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from compile_report import (ARCHS, OPT_IN_SHARED, _demangled, cuda_command, cuobjdump, id_loads_and_checks, nvcc, ptxas_report,
                            sass_command, sass_functions)
from build_cache import cached_run
from ktae_kernels.backends import cuda

CSRC = Path(__file__).resolve().parents[1] / "csrc"
pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc not found (CUDA toolkit absent)")
#: every kernel entry of csrc/ktae_kernels.cu
KERNELS = {"scan_kernel", "groups_kernel", "group_sums_kernel", "table_statistics_kernel", "dynamic_kernel<true>",
           "dynamic_kernel<false>", "group_kernel<0, true>", "group_kernel<0, false>", "group_kernel<1, true>",
           "group_kernel<1, false>", "nan_on_error_kernel"}
SHARED_PATH = {name for name in KERNELS if "false" not in name}
#: the kernels that build tables (load_tile)
TABLE_KERNELS = {name for name in KERNELS if name.startswith(("dynamic_kernel", "group_kernel"))}
UNROLL = 4  # kUnroll, csrc/ktae_kernels.h


def _compiled(arch: int, std: str = "c++17") -> dict:
    version = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout
    result = cached_run("nvcc", cuda_command(arch, std), sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.h")),
                        key_extra=version)
    assert result["returncode"] == 0, result["stderr"][-4000:]
    return {_demangled(name): entry for name, entry in ptxas_report(result["stdout"] + result["stderr"]).items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_without_spills_in_the_shared_memory_path(arch):
    kernels = _compiled(arch)
    assert set(kernels) == KERNELS, sorted(kernels)
    spilled = {name: kernels[name]["spill_stores"] for name in SHARED_PATH if kernels[name]["spill_stores"]}
    assert not spilled, spilled
    assert all(entry["shared"] == 0 for entry in kernels.values())
    assert all(0 < entry["registers"] <= 64 for entry in kernels.values())  # 1024-thread blocks


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("blocks_per_sm", [1, 2])
def test_shared_table_kernels_fit_the_blocks_per_sm_the_host_chooses(arch, blocks_per_sm):
    """At 1 or 2 blocks per SM the host launches at most ``most_threads`` threads a block and at most
    ``shared_limit`` bytes of dynamic shared memory: with the kernels' registers (65,536 a SM) and static
    shared memory (an SM holds the opt-in limit plus 1 KB, a block reserves 1 KB) that many blocks fit."""
    kernels = _compiled(arch)
    threads = cuda.most_threads(cuda.MAX_THREADS, blocks_per_sm)
    dynamic = cuda.shared_limit(OPT_IN_SHARED[arch], blocks_per_sm)
    for name in sorted(SHARED_PATH & TABLE_KERNELS):
        entry = kernels[name]
        assert blocks_per_sm * threads * entry["registers"] <= 65536, (name, entry)
        assert blocks_per_sm * (dynamic + entry["shared"] + 1024) <= OPT_IN_SHARED[arch] + 1024, (name, entry)


@pytest.mark.skipif(cuobjdump() is None, reason="cuobjdump not found (CUDA toolkit or Triton wheel)")
def test_a_tiles_id_loads_all_issue_before_their_range_checks():
    version = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout
    result = cached_run("sass", sass_command(90), sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.h")),
                        key_extra=version)
    assert result["returncode"] == 0, result["stderr"][-4000:]
    functions = sass_functions(result["stdout"])
    assert set(functions) == KERNELS, sorted(functions)
    tile = "L" * UNROLL + "C" * UNROLL
    order = {name: id_loads_and_checks(functions[name]) for name in TABLE_KERNELS}
    assert all(seen and seen == tile * (len(seen) // len(tile)) for seen in order.values()), order


def test_id_loads_and_checks_reads_the_order_of_loads_and_checks():
    sass = """
        /*0010*/               @P4 LDG.E.64 R20, desc[UR24][R26.64] ;
        /*0020*/                   LDG.E.64 R8, desc[UR24][R2.64] ;
        /*0030*/               @P5 LDG.E.64.CONSTANT R16, desc[UR24][R24.64] ;
        /*0040*/                   ISETP.GE.U32.AND P4, PT, R20, -0x80000000, PT ;
        /*0050*/                   IADD3 R8, R8, 0x1, RZ ;
        /*0060*/                   ISETP.GE.U32.AND P2, PT, R16, -0x80000000, PT ;
        /*0070*/                   LDG.E.64 R20, desc[UR24][R28.64] ;
        /*0080*/                   ISETP.GE.U32.AND P3, PT, R20, -0x80000000, PT ;"""
    assert id_loads_and_checks(sass) == "LLCCLC"  # R8's load feeds no check


def test_kernels_compile_as_cpp20():
    assert set(_compiled(90, "c++20")) == KERNELS


def test_demangled_names():
    assert _demangled("_ZN4ktae48_GLOBAL__N__d3_15_ktae_kernels_cu_b8314dynamic_kernelILb1EEEvNS_10KernelArgsE") == \
        "dynamic_kernel<true>"
    assert _demangled("_ZN4ktae48_GLOBAL__N__d3_15_ktae_kernels_cu_b8312group_kernelILi1ELb0EEEvNS_10KernelArgsE") == \
        "group_kernel<1, false>"
    assert _demangled("_ZN4ktae48_GLOBAL__N__d3_15_ktae_kernels_cu_b8311scan_kernelENS_11PrepareArgsE") == "scan_kernel"
    assert re.fullmatch(r"\w+", _demangled("plain"))
