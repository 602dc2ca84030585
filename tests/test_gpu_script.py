"""bench/gpu.sh, the hardware run, on the CPU: its dry run (KTAE_GPU_DRY_RUN=1: every stage on tiny
shapes, the Triton interpreter) hands its results back under $OUT after every stage, so a run cut
part-way keeps what it finished; an uncut one ends with them all, every gpu_check check passed."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OUT")}
    return env | {"KTAE_GPU_DRY_RUN": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
                  "KTAE_RESULTS": str(tmp_path / "results")}


def test_gpu_sh_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_dry_run_hands_back_every_stage(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu.log", "results.tgz"]
    log = (out / "gpu.log").read_text()
    for name in ("versions", "build", "check", "tests", "bench"):
        assert f"=== [{name}] rc=0" in log, log[-2000:]
    check = json.loads((out / "gpu-check.json").read_text())
    assert check["checks"] and all(result["ok"] for result in check["checks"].values()), check["checks"]
    with tarfile.open(out / "results.tgz") as tar:
        assert {"./gpu.log", "./check.log", "./tests.log"} <= set(tar.getnames())


def test_a_run_cut_part_way_has_handed_back_what_it_finished(tmp_path):
    proc = subprocess.Popen(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, env=_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = tmp_path / "out" / "gpu.log"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (log.exists() and "=== [check] at" in log.read_text()):
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the loan ends mid-stage
        proc.wait()
    assert "=== [versions] rc=0" in log.read_text()
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        assert "./versions.log" in tar.getnames()
