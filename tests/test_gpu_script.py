"""bench/gpu.sh, the hardware run, on the CPU: its dry run (KTAE_GPU_DRY_RUN=1: every stage on tiny
shapes, the Triton interpreter) hands its results back under $OUT after every stage, and, when it is
cut (TERM), the stage in flight's partial results before it exits, the stage ended with it; an uncut
run ends with them all, every gpu_check check passed. Also: the versions stage names a missing import,
and gpu_check's replay timing (sync first, CUDA events, 20 samples)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest
import torch

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


def test_a_run_cut_in_the_check_stage_hands_back_its_partial_results(tmp_path):
    """The lending tool's TERM at its limit, to the script alone, while the check stage runs (after it
    wrote its first results): the finished stages were handed back already; the trap ends the stage
    (every process of it) and hands back the partial gpu-check JSON before the script exits."""
    proc = subprocess.Popen(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, env=_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out, results = tmp_path / "out", tmp_path / "results"
    try:
        _wait_for(lambda: any(_checks(p) for p in results.glob("*gpu-check*.json")), 240)
        log = (results / "gpu.log").read_text()  # the run's own log ($OUT has it as of the last stage)
        assert "=== [check] at" in log and "=== [check] rc" not in log, log[-2000:]
        with tarfile.open(out / "results.tgz") as tar:  # handed back after the stages before
            assert "./versions.log" in tar.getnames()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        _end(proc, tmp_path)
    assert rc == 128 + signal.SIGTERM
    log = (out / "gpu.log").read_text()
    assert "=== cut by SIGTERM" in log and "in stage [check]" in log, log[-2000:]
    assert "paper" in _checks(out / "gpu-check.json")
    with tarfile.open(out / "results.tgz") as tar:
        assert {"./versions.log", "./check.log"} <= set(tar.getnames())
    _wait_for(lambda: not _processes_of(tmp_path), 10)


def test_the_versions_stage_names_a_missing_import(tmp_path):
    """Without tqdm (the [bench] extra), the versions stage fails, saying what is missing and where it
    comes from, before any stage needs it (the run is cut once the stage reported)."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "tqdm.py").write_text("raise ImportError('No module named tqdm (stub)')\n")
    env = _env(tmp_path) | {"PYTHONPATH": str(stub)}
    proc = subprocess.Popen(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = tmp_path / "results" / "gpu.log"
    try:
        _wait_for(lambda: log.exists() and "=== [versions] rc=" in log.read_text(), 120)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        _end(proc, tmp_path)
    text = log.read_text()
    assert "=== [versions] rc=1" in text and "MISSING for the later stages" in text, text[-2000:]
    assert "tqdm (the [bench] extra: pip install tqdm)" in text


def test_replay_times_synchronise_then_time_each_replay_between_events(monkeypatch):
    """gpu_check's graph replay timing (no GPU: events and syncs recorded): the device synchronised
    before each of the 20 samples, each replay alone between its two events; median and spread."""
    from bench import gpu_check

    calls: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = 0

        def record(self) -> None:
            calls.append("record")
            self.at = len(calls)

        def synchronize(self) -> None:
            calls.append("wait")

        def elapsed_time(self, stop: "Event") -> float:  # milliseconds
            return float(stop.at - self.at) + len([c for c in calls if c == "replay"]) % 3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    times = gpu_check.replay_times(types.SimpleNamespace(replay=lambda: calls.append("replay")))
    assert gpu_check.REPLAYS == 20 and calls == ["sync", "record", "replay", "record", "wait"] * 20
    assert times["samples"] == 20 and times["min"] == 0.002 and times["max"] == 0.004
    assert times["q1"] <= times["median"] <= times["q3"]


def test_cuda_variants_are_named_by_the_threads_they_run_on_the_paper_batch():
    """A cuda launch variant's name gives the threads a block runs on the paper batch's L = 3072, not
    the cap it sets (a cap of 512 would run 384, and 1024 would run 768)."""
    from bench import gpu_check
    from bench.grid import PAPER_SHAPE
    from ktae_kernels.backends import cuda

    from bench import gpu_variants

    for name, options in gpu_check.VARIANTS["cuda"].items():
        tuning = options.cuda
        runs = cuda.block_threads(PAPER_SHAPE.L, cuda.most_threads(tuning.max_threads, tuning.blocks_per_sm))
        assert name.startswith(f"threads{runs}-") and runs == tuning.max_threads, name
    launch = {"default", "largest-first", *gpu_variants.KERNEL_VARIANTS}  # the default's threads
    measured = {name: t for name, t in gpu_variants.VARIANTS.items() if name not in launch}
    for name, tuning in measured.items():
        runs = cuda.block_threads(PAPER_SHAPE.L, cuda.most_threads(tuning.max_threads, tuning.blocks_per_sm))
        assert name.startswith(f"threads{runs}-sm{tuning.blocks_per_sm}-"), name
    assert len(set(measured.values())) == len(measured) == 20  # 5 block shapes x slot x slot index


# ----------------------------------------------------------------------------------------- helpers
def _checks(path: Path) -> dict:
    try:
        return json.loads(path.read_text())["checks"]
    except (OSError, ValueError, KeyError):
        return {}


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _processes_of(tmp_path: Path) -> list[int]:
    """The processes whose command line names this test's folder (the run's stages)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(tmp_path).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _end(proc: subprocess.Popen, tmp_path: Path) -> None:
    """The script, and any process of its run left behind, ended (only the ones this test started)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in _processes_of(tmp_path):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_gpu_variants_measures_each_variant_and_drops_one_that_is_not_exact(emulator, tmp_path):
    """bench/gpu_variants.py's measurement on the CPU emulator of the cuda kernels (wall-clock timings, no
    graphs, no kernel profile): every variant's call times, threads and host profile, a compile-time
    variant on its own kernels; a variant whose advantages differ by one bit from the reference is dropped
    from the ranking; the report is saved after each variant."""
    import numpy as np

    from bench import gpu_variants
    from cases import make_batch
    from ktae_kernels import ExecutionOptions, KernelVariant, KTAEConfig
    from ktae_kernels.backends import cuda
    from ktae_kernels.validation import normalise_batch
    from emulator import load

    batch = normalise_batch(*make_batch(np.random.default_rng(5), [4, 4], 32, 40))
    names = ["default", "threads256-sm2-wide-reread", "unroll2", "threads768-sm1-packed-index"]
    launchers = {emulator.variant: emulator, gpu_variants.KERNEL_VARIANTS["unroll2"]: load(KernelVariant(unroll=2))}
    variants = {name: gpu_variants.VARIANTS[name] for name in names}
    variants["planted"] = gpu_variants.VARIANTS["threads384-sm1-packed-index"]

    def call(tuning, out):
        cuda.token_advantage(batch, KTAEConfig(), None, out, ExecutionOptions(cuda=tuning),
                             launcher=launchers[tuning.variant])
        if tuning is variants["planted"]:
            out.view(torch.int32)[0, 0] ^= 1  # one bit off
        return out

    reference = cuda.token_advantage(batch, KTAEConfig(), None, launcher=emulator)
    saved: list[dict] = []
    report = gpu_variants.run_variants(variants, call, reference, repeats=3,
                                       threads=lambda t: cuda.static_plan(emulator, batch, KTAEConfig(), t).threads,
                                       save=lambda r: saved.append(json.loads(json.dumps(r, default=str))))
    assert len(saved) == 5 and list(saved[-1]["variants"]) == [*names, "planted"]
    assert sorted(report["ranking"]) == sorted(names) and report["best"] in names
    planted = report["variants"]["planted"]
    assert planted["exact"] is False and planted["positions_differing"] == 1 and "call_s" not in planted
    for name in names:
        row = report["variants"][name]
        assert row["exact"] and row["call_s"]["samples"] == 3 and row["call_s"]["median"] > 0
        assert row["threads"] in (64, 96, 128, 256) and row["host"] and row["host"][0]["own_s"] >= 0
    assert report["variants"]["unroll2"]["tuning"]["variant"] == {"unroll": 2, "match_any": True, "load_ahead": True}
