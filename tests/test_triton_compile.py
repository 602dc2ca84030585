"""Every Triton kernel variant the backend launches compiles for sm_80 and sm_90 without a GPU
(tests/compile_report.py: Triton's compiler, then ptxas -v), and holds to these rules:
- no atomic whose result a kernel uses has a layout that replicates tensor elements over threads
  (before Triton 3.5 only one replica received the result, triton-lang/triton#7402; the interpreter
  cannot show it), and the scan does flag that pattern;
- the kernels that promise one rounding per float64 operation (statistics, score, advantage) keep no
  fma of their own: the advantage kernel none, the others only libdevice's exp / log;
- no register spills, except in the one-program plan kernel (it runs once per call, over the groups);
- their registers, spills and shared memory are in the report (docs/kernels.md quotes them).
The compile runs in a subprocess (TRITON_INTERPRET must be unset there) and is cached per source.
"""
import json
import os
import sys
from pathlib import Path

import pytest

from build_cache import cached_run

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "ktae_kernels" / "backends" / "triton").glob("*.py")) + [ROOT / "tests" / "compile_report.py"]


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "tests" / "compile_report.py"), "--only", "triton"]
    done = cached_run("triton-compile", cmd, SOURCES, key_extra=triton.__version__, env=env, cwd=ROOT)
    assert done["returncode"] == 0, done["stderr"][-4000:]
    return json.loads(done["stdout"])["triton"]


def test_every_kernel_compiles_for_sm80_and_sm90(report):
    from ktae_kernels.backends.triton import pipeline, statistics

    defined = {name for module in (pipeline, statistics) for name in vars(module)
               if name.startswith("_") and name.endswith("_kernel")}  # the kernels (their launchers are public)
    for arch in ("sm_80", "sm_90"):
        compiled = {name.split("{")[0] for name in report[arch]}
        assert compiled == defined, (arch, compiled ^ defined)
        assert all(entry["registers"] > 0 for entry in report[arch].values()), "ptxas gave no register count"


def test_no_replicated_atomic_results(report):
    assert report["checker_catches_7402"]
    bad = {name: entry["replicated_atomics"] for arch in ("sm_80", "sm_90") for name, entry in report[arch].items()
           if entry["replicated_atomics"]}
    assert not bad, bad


def test_the_exact_kernels_keep_only_libdevice_fma(report):
    for name, entry in report["sm_90"].items():
        if name.startswith("_advantage_kernel"):
            assert entry["fma_f64"] == 0, name
        if name.startswith(("_score_kernel", "_statistics_kernel")):
            assert entry["fma_f64"] > 0, name  # libdevice's exp / log; the kernel's own products stay unfused


def test_no_spills_outside_the_plan_kernel(report):
    spilled = {(arch, name): entry["spill_stores"] for arch in ("sm_80", "sm_90") for name, entry in report[arch].items()
               if entry["spill_stores"] and not name.startswith("_plan_kernel")}
    assert not spilled, spilled
