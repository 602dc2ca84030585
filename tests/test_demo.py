"""`python -m ktae_kernels`: what a new user sees first fits a terminal, and its files are written."""
from __future__ import annotations

import re

import pytest

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
