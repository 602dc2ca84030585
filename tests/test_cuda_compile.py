"""Every CUDA kernel the cuda backend launches compiles for sm_80 and sm_90 through NVRTC, the path a
user's first call takes (``runtime.cubin``: no GPU needed), and ptxas's report of that compile
(tests/compile_report.py) shows:
- no register spills in the kernels of the shared-memory path (the scan and groups passes, the
  shared-table passes, the statistics kernel); the global-memory passes may spill (they run only for
  the groups a shared table cannot hold);
- no static shared memory (every table is dynamic, sized by the host within the device's opt-in limit:
  tests/test_cuda_host.py checks that sizing against sm_80's and sm_90's limits), and the shared-table
  kernels' registers and shared memory let the blocks per SM the host chooses (1 or 2) share an SM;
- at most 64 registers a thread (1024-thread blocks);
- in the sm_90 SASS (cuobjdump -sass), a tile's token-id loads all issue before the first range check of
  any of them, in every kernel that builds a table and in the scan (a check between two loads makes each
  load wait for the one before: kUnroll dependent DRAM trips a tile instead of one).
The launches themselves run on the CPU emulator: tests/test_cuda_emulation.py.
"""
from __future__ import annotations

import re

import pytest

from compile_report import (ARCHS, OPT_IN_SHARED, _demangled, cuobjdump, id_loads_and_checks, ptxas_report, sass,
                            sass_functions)
from bench.gpu_variants import KERNEL_VARIANTS
from ktae_kernels import KernelVariant
from ktae_kernels.backends import cuda
from ktae_kernels.backends.cuda import runtime

pytest.importorskip("cuda.core", reason='needs cuda-core and NVRTC (pip install -e ".[cuda]")')
#: the readable name (compile_report._demangled) of every kernel the backend launches
KERNELS = {re.sub(r"^ktae::", "", name) for name in runtime.KERNELS}
SHARED_PATH = {name for name in KERNELS if "false" not in name}
#: the kernels that load and check token ids: those that build tables (load_tile) and the scan
ID_KERNELS = {name for name in KERNELS if name.startswith(("dynamic_kernel", "scan_kernel"))}
#: the default kernel variant and those bench/gpu_variants.py measures
VARIANTS = [KernelVariant(), *KERNEL_VARIANTS.values()]


@pytest.fixture(scope="module")
def compiled_reports() -> dict[int, dict]:
    """ptxas's report per kernel (readable names), per arch, of NVRTC's compile."""
    return {arch: {_demangled(name): entry for name, entry in ptxas_report(runtime.compile_report(arch)[1]).items()}
            for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request) -> tuple[int, dict, str]:
    """(arch, ptxas's report per kernel, the compile log) of NVRTC's compile for one arch."""
    _, log = runtime.compile_report(request.param)
    return request.param, {_demangled(name): entry for name, entry in ptxas_report(log).items()}, log


def test_every_kernel_compiles_through_nvrtc_for_sm_80_and_sm_90():
    for arch in ARCHS:
        found = runtime.cubin(arch)
        assert found.arch == arch and set(found.symbols) == set(runtime.KERNELS)
        assert found.code[:4] == b"\x7fELF"  # a cubin


def test_no_spills_in_the_shared_memory_path(compiled):
    arch, kernels, log = compiled
    assert set(kernels) == KERNELS, sorted(kernels)
    spilled = {name: kernels[name]["spill_stores"] for name in SHARED_PATH if kernels[name]["spill_stores"]}
    assert not spilled, spilled
    assert all(entry["shared"] == 0 for entry in kernels.values())
    assert all(0 < entry["registers"] <= 64 for entry in kernels.values())
    assert "warning" not in log.lower(), log


@pytest.mark.skipif(cuobjdump() is None, reason="no cuobjdump (CUDA toolkit or Triton's wheel)")
@pytest.mark.parametrize("arch", ARCHS)
def test_the_report_reads_the_code_users_run(arch):
    """The report's compile (with ptxas -v) gives the same machine code as the one users load."""
    reported, _ = runtime.compile_report(arch)
    assert sass(reported.code) == sass(runtime.cubin(arch).code)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("blocks_per_sm", [1, 2])
def test_shared_table_kernels_fit_the_blocks_per_sm_the_host_chooses(compiled_reports, arch, blocks_per_sm):
    """At 1 or 2 blocks per SM the host launches at most ``most_threads`` threads a block and at most
    ``shared_limit`` bytes of dynamic shared memory: with the kernels' registers (65,536 a SM) and static
    shared memory (an SM holds the opt-in limit plus 1 KB, a block reserves 1 KB) that many blocks fit."""
    kernels = compiled_reports[arch]
    threads = cuda.most_threads(cuda.MAX_THREADS, blocks_per_sm)
    dynamic = cuda.shared_limit(OPT_IN_SHARED[arch], blocks_per_sm)
    for name in sorted(SHARED_PATH & ID_KERNELS):  # the scan runs on the table passes' threads
        entry = kernels[name]
        assert blocks_per_sm * threads * entry["registers"] <= 65536, (name, entry)
        assert blocks_per_sm * (dynamic + entry["shared"] + 1024) <= OPT_IN_SHARED[arch] + 1024, (name, entry)


@pytest.mark.skipif(cuobjdump() is None, reason="cuobjdump not found (CUDA toolkit or Triton wheel)")
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_a_tiles_id_loads_all_issue_before_their_range_checks(variant):
    functions = sass_functions(sass(runtime.cubin(90, variant).code))
    assert set(functions) == KERNELS, sorted(functions)
    tile = f"L{{{variant.unroll}}}C{{{variant.unroll}}}"
    order = {name: id_loads_and_checks(functions[name]) for name in ID_KERNELS}
    assert len(order) == 3, order
    for name, seen in order.items():  # the scan's last check, of its largest id, follows no load
        assert re.fullmatch(f"(?:{tile})+{'C' if name == 'scan_kernel' else ''}", seen), (name, seen)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS[1:], ids=str)
def test_the_variants_compile_and_spill_only_where_they_unroll_past_4(arch, variant):
    """The variants the GPU run measures (compiled only when a call asks for one) compile without a
    warning. Those of at most 4 loads a step keep the shared-memory path spill-free; 8 loads a step spill
    in the shared-table pass at 64 registers (docs/kernels.md), which only a GPU run can weigh against
    its longer tiles."""
    _, log = runtime.compile_report(arch, variant)
    kernels = {_demangled(name): entry for name, entry in ptxas_report(log).items()}
    assert set(kernels) == KERNELS and "warning" not in log.lower(), log
    spilled = {name for name in SHARED_PATH if kernels[name]["spill_stores"]}
    assert spilled == (set() if variant.unroll <= 4 else {"dynamic_kernel<true>"}), spilled


def test_id_loads_and_checks_reads_the_order_of_loads_and_checks():
    sass_text = """
        /*0010*/               @P4 LDG.E.64 R20, desc[UR24][R26.64] ;
        /*0020*/                   LDG.E.64 R8, desc[UR24][R2.64] ;
        /*0030*/               @P5 LDG.E.64.CONSTANT R16, desc[UR24][R24.64] ;
        /*0040*/                   ISETP.GE.U32.AND P4, PT, R20, -0x80000000, PT ;
        /*0050*/                   IADD3 R8, R8, 0x1, RZ ;
        /*0060*/                   ISETP.GE.U32.AND P2, PT, R16, -0x80000000, PT ;
        /*0070*/                   LDG.E.64 R20, desc[UR24][R28.64] ;
        /*0080*/                   ISETP.GE.U32.AND P3, PT, R20, -0x80000000, PT ;"""
    assert id_loads_and_checks(sass_text) == "LLCCLC"  # R8's load feeds no check


def test_demangled_names():
    assert _demangled("_ZN4ktae48_GLOBAL__N__00000000_15_ktae_kernels_cu_dfa5a0a314dynamic_kernelILb1EEEvNS_10KernelArgsE") == \
        "dynamic_kernel<true>"
    assert _demangled("_ZN4ktae48_GLOBAL__N__00000000_15_ktae_kernels_cu_dfa5a0a312group_kernelILi1ELb0EEEvNS_10KernelArgsE") == \
        "group_kernel<1, false>"
    assert _demangled("_ZN4ktae48_GLOBAL__N__00000000_15_ktae_kernels_cu_dfa5a0a311scan_kernelENS_11PrepareArgsE") == \
        "scan_kernel"
    assert re.fullmatch(r"\w+", _demangled("plain"))
