"""Every CUDA kernel the cuda backend launches compiles for sm_80 and sm_90 through NVRTC, the path a
user's first call takes (``runtime.cubin``: no GPU needed), and ptxas's report of that compile
(tests/compile_report.py) shows:
- no register spills in the kernels of the shared-memory path (the scan and groups passes, the
  shared-table passes, the statistics kernel); the global-memory passes may spill (they run only for
  the groups a shared table cannot hold);
- no static shared memory (every table is dynamic, sized by the host within the device's opt-in limit:
  tests/test_cuda_host.py checks that sizing against sm_80's and sm_90's limits);
- at most 64 registers a thread (1024-thread blocks).
The launches themselves run on the CPU emulator: tests/test_cuda_emulation.py.
"""
from __future__ import annotations

import re

import pytest

from compile_report import ARCHS, _demangled, cuobjdump, ptxas_report, sass
from ktae_kernels.backends.cuda import runtime

pytest.importorskip("cuda.core", reason='needs cuda-core and NVRTC (pip install -e ".[cuda]")')
#: the readable name (compile_report._demangled) of every kernel the backend launches
KERNELS = {re.sub(r"^ktae::", "", name) for name in runtime.KERNELS}
SHARED_PATH = {name for name in KERNELS if "false" not in name}


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


def test_demangled_names():
    assert _demangled("_ZN4ktae48_GLOBAL__N__00000000_15_ktae_kernels_cu_dfa5a0a314dynamic_kernelILb1EEEvNS_10KernelArgsE") == \
        "dynamic_kernel<true>"
    assert _demangled("_ZN4ktae48_GLOBAL__N__00000000_15_ktae_kernels_cu_dfa5a0a312group_kernelILi1ELb0EEEvNS_10KernelArgsE") == \
        "group_kernel<1, false>"
    assert _demangled("_ZN4ktae48_GLOBAL__N__00000000_15_ktae_kernels_cu_dfa5a0a311scan_kernelENS_11PrepareArgsE") == \
        "scan_kernel"
    assert re.fullmatch(r"\w+", _demangled("plain"))
