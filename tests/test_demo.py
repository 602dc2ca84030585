"""`python -m ktae_kernels`: what a new user sees first fits a terminal, and its files are written;
`--check` lists the backends this machine runs and, for each missing one, the registry's reason."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch

from ktae_kernels import __main__ as demo
from ktae_kernels import available_backends, registry
from ktae_kernels.__main__ import NEXT_BENCH, WIDTH, demo_batch, main


def test_demo_lines_fit_a_terminal_and_point_to_the_quick_bench(capsys, tmp_path):
    main(["--report", str(tmp_path / "demo.html")])
    out = capsys.readouterr().out
    too_long = [line for line in out.splitlines() if len(line) > WIDTH]
    assert WIDTH < 100 and not too_long, too_long
    assert f"Next: `{NEXT_BENCH}` (" in out and NEXT_BENCH == "python -m bench --quick"
    assert not re.search(r"-0\.0+\b(?!\d)", out), "a negative zero is printed"
    assert (tmp_path / "demo.html").stat().st_size > 1000


def test_demo_writes_the_png_the_readme_promises(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    main(["--png", str(tmp_path / "demo.png")])
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Wrote {tmp_path / 'demo.png'}" in capsys.readouterr().out


def test_png_histogram_counts_have_integer_ticks(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ktae_kernels.viz import write_png

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    write_png(tmp_path / "one.png", *demo_batch(groups=1, rollouts=2, length=4))  # counts of 1: ticks 0.2 apart by default
    ticks = figures[0].axes[0].get_yticks()
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def check_output(capsys) -> tuple[int, list[str]]:
    status = main(["--check"])
    lines = capsys.readouterr().out.splitlines()
    assert lines and not [line for line in lines if len(line) > WIDTH], lines
    return status, lines


def unwrapped(lines: list[str]) -> str:
    return " ".join(line.strip() for line in lines)


def test_check_lists_each_backend_with_the_registrys_reason(capsys):
    """One line per backend of each device type the machine has; a missing one with the registry's own
    reason (so a backend built another way is reported without a change here)."""
    status, lines = check_output(capsys)
    text = re.sub(" +", " ", unwrapped(lines))
    for backend in registry.availability("cpu"):
        assert f"{backend.name} {'yes' if backend.problem is None else f'no: {backend.problem}'}" in text
    problem = registry.device_problem("cuda")
    if problem is not None:
        assert f"CUDA tensors: none on this machine: {problem}" in text
    assert (status == 0) == ("cpu" in available_backends("cpu"))


def test_check_names_the_fix_and_fails_when_auto_falls_back(capsys):
    """Without the native kernel "auto" runs torch on CPU tensors: --check says so, gives the kernel's
    reason and fix, and exits 1, so that a script can stop on it."""
    built = registry.resolve("cpu", "cpu") if "cpu" in available_backends("cpu") else None
    if built is not None:  # as on a machine where the build skipped it
        registry.register_backend(dataclasses.replace(built, unavailable=lambda kind: "not built (stub); pip install ."))
    try:
        reason = next(s.problem for s in registry.availability("cpu") if s.name == "cpu")
        status, lines = check_output(capsys)
    finally:
        if built is not None:
            registry.register_backend(built)
    text = unwrapped(lines)
    assert status == 1 and reason is not None
    assert "CPU tensors: backend='auto' runs 'torch' instead of 'cpu', which is missing" in text
    assert f"cpu no: {reason}" in re.sub(" +", " ", text)
    assert text.endswith("backend='auto' runs a slower backend here: the fix is above.")


def test_check_on_a_gpu_machine_reports_the_cuda_backends(capsys, monkeypatch):
    """Where torch sees a GPU, the CUDA backends are listed in "auto"'s order with their reasons (here
    whatever the registry says of them on this machine, the cuda kernels' compile stubbed)."""
    from ktae_kernels.backends import cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "the CUDA kernels are not compiled (stub)")
    _, lines = check_output(capsys)
    text = unwrapped(lines)
    order = [s.name for s in registry.availability("cuda")]
    assert order[:3] == ["cuda", "triton", "torch"] and "CUDA tensors: backend='auto' runs" in text
    for name in order:
        assert re.search(rf"\b{name} +(yes|no: )", text)


def test_check_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "ktae_kernels", "--check"], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.startswith("ktae_kernels ") and "CPU tensors: backend='auto' runs" in done.stdout
    assert done.returncode == (0 if "cpu" in available_backends("cpu") else 1), done.stdout + done.stderr
