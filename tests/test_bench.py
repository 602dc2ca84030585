"""The bench never contradicts itself: the floor's statistics and the ``x floor`` column, on fake timings."""
from __future__ import annotations

import re

import pytest
import torch

from bench import runner, timing
from bench.data import Shape
from bench.floor_stats import (FLOOR_ROUNDS, MIN_FLOOR_POSITIONS, floor_ratio, floor_samples, floor_seconds,
                               is_measuring_error)
from bench.grid import Budget
from bench.report import format_table, result_json
from bench.runner import Result


def fake_measure(times: list[float]):
    """A floor pass that takes ``times`` in turn."""
    it = iter(times)
    return lambda: next(it)


def test_floor_is_the_fastest_sample_so_one_disturbed_run_does_not_count():
    # the case: 8.0 ms for one sample of a pass that takes ~16 us
    samples = floor_samples(fake_measure([8.0e-3, 16e-6, 17e-6, 16.5e-6, 9e-3, 18e-6, 16.2e-6]), MIN_FLOOR_POSITIONS)
    assert len(samples) == FLOOR_ROUNDS
    assert floor_seconds(samples) == 16e-6
    assert floor_seconds([]) is None


def test_floor_samples_follow_untimed_passes_of_the_warm_up_time():
    """A cold core's first passes (5 ms here) are run but not sampled, until they add up to warm_up_s."""
    samples = floor_samples(fake_measure([5e-3] * 4 + [1e-3] * FLOOR_ROUNDS), MIN_FLOOR_POSITIONS, warm_up_s=0.02)
    assert samples == [1e-3] * FLOOR_ROUNDS


def test_contenders_warm_up_for_the_warm_up_time_holding_the_previous_output(monkeypatch):
    """``timing.warm_up`` calls twice, then until the further calls' own times add up to ``WARM_UP_S``
    (a slow first call that maps memory does not cut the warm-up short), and each call runs while the
    previous call's output is alive, as in the timed runs."""
    alive: list[int] = []
    held_during_call: list[bool] = []

    class Output:
        def __init__(self):
            alive.append(1)

        def __del__(self):
            alive.pop()

    def fake_timed(fn, device):
        held_during_call.append(len(alive) == 1)
        first = len(held_during_call) == 1
        return (1.0 if first else 4e-3), Output()  # the first call maps memory: longer than the warm-up

    monkeypatch.setattr(timing, "timed", fake_timed)
    timing.warm_up(lambda: None, torch.device("cpu"))
    assert len(held_during_call) == 2 + round(timing.WARM_UP_S / 4e-3)
    assert held_during_call == [False] + [True] * (len(held_during_call) - 1)
    held_during_call.clear()
    timing.warm_up(lambda: None, torch.device("cpu"), seconds=0.0)
    assert len(held_during_call) == 2


def test_small_batches_and_devices_without_a_floor_get_none():
    calls = []
    assert floor_samples(lambda: calls.append(1) or 1e-3, MIN_FLOOR_POSITIONS - 1) == []
    assert calls == []  # not even measured
    assert floor_samples(lambda: None, MIN_FLOOR_POSITIONS) == []


def test_a_ratio_below_one_is_a_measuring_error():
    assert floor_ratio(3e-3, 1e-3) == pytest.approx(3.0)
    assert floor_ratio(None, 1e-3) is None and floor_ratio(1e-3, None) is None
    assert is_measuring_error(floor_ratio(0.09e-3, 1e-3))
    assert not is_measuring_error(1.0) and not is_measuring_error(None)


def cell(seconds: float, floor_s: float | None, extrapolated: bool = False) -> Result:
    return Result(Shape(8, 64, 512), "cpu", "ok", tokens=100_000, seconds=seconds, samples_s=[seconds],
                  groups=64, extrapolated=extrapolated, floor_s=floor_s, floor_samples_s=[floor_s or 0.0])


def test_results_flag_a_time_under_the_floor_instead_of_a_ratio():
    fast, slow, guess = cell(0.5e-3, 1e-3), cell(4e-3, 1e-3), cell(0.5e-3, 1e-3, extrapolated=True)
    assert fast.x_floor is None and fast.floor_error
    assert slow.x_floor == pytest.approx(4.0) and not slow.floor_error
    assert guess.x_floor is None and not guess.floor_error  # extrapolated times get no ratio at all
    table = format_table([fast, slow])
    assert "error" in table and "4x" in table and "measured faster than the memory floor" in table
    assert not re.search(r"\b0\.\d+x", table)
    row = result_json([fast])[0]
    assert row["x_memory_floor"] is None and row["x_memory_floor_error"] is True


def test_run_grid_under_a_disturbed_floor_prints_no_ratio_below_one(monkeypatch):
    """Every floor sample slowed down (as on a loaded machine): the table says error, never 0.0x."""
    monkeypatch.setattr(runner, "memory_floor_s", lambda batch, device, repeats=1: 10.0)
    shape = Shape(16, 4, 1024)  # 65,536 positions: the smallest batch that gets a floor
    assert shape.positions >= MIN_FLOOR_POSITIONS
    results = runner.run_grid([shape], ["torch"], torch.device("cpu"), Budget(1e9, 1e9, 1.0, 0.1), repeats=3,
                              progress=False)
    (result,) = results
    assert result.floor_s == 10.0 and len(result.floor_samples_s) == 2 * FLOOR_ROUNDS
    assert result.floor_error and result.x_floor is None
    assert "error" in format_table(results)


def test_quick_grid_small_shapes_get_no_floor():
    from bench.grid import PRESETS
    small = [s for s in PRESETS["quick"] if s.positions < MIN_FLOOR_POSITIONS]
    assert small and all(s.prompts == 1 for s in small)  # one prompt: 4k to 49k positions


def test_plot_labels_never_overlap():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import drop_overlapping

    fig, ax = plt.subplots()
    ax.set(xlim=(0, 1), ylim=(0, 1))
    ax.legend(handles=ax.plot([], [], label="legend")[0:1], loc="upper left")
    texts = [ax.annotate("16,512", (0.5, 0.5)), ax.annotate("16,3072", (0.505, 0.505)),  # on top of the first
             ax.annotate("64,512", (0.9, 0.1)), ax.annotate("8,512", (0.01, 0.97))]   # clear / under the legend
    assert drop_overlapping(texts, keep_clear=[ax.get_legend()]) == 2
    assert [t.get_text() for t in ax.texts] == ["16,512", "64,512"]
    plt.close(fig)


def test_peak_memory_is_measured_after_every_timing_of_the_shape(monkeypatch):
    """A peak measurement trims the heap and empties the cpu output pool, which disturbed the next
    contender's timing: each shape's peaks come after its contenders and its second floor samples."""
    events: list[str] = []
    monkeypatch.setattr(runner, "memory_floor_s", lambda batch, device, repeats=1: events.append("floor") or 1e-3)
    monkeypatch.setattr(runner, "peak_extra_bytes", lambda fn, device: events.append("peak") or 123)
    measure = runner._measure
    monkeypatch.setattr(runner, "_measure", lambda *args: events.append("time") or measure(*args))
    results = runner.run_grid([Shape(16, 4, 1024)], ["torch", "reference"], torch.device("cpu"),
                              Budget(1e9, 1e9, 1.0, 0.1), repeats=3, progress=False)
    assert [r.peak_extra_bytes for r in results] == [123, None]  # per-group loops get no peak
    assert events.index("peak") > max(i for i, e in enumerate(events) if e in ("time", "floor"))
    assert events.count("peak") == 1


def test_new_runs_write_to_the_ignored_folder_unless_told_otherwise():
    """A plain run never adds files to the committed bench/results/: it needs --out bench/results."""
    from pathlib import Path

    from bench.__main__ import RESULTS_DIR, parse_args

    assert parse_args([]).out == RESULTS_DIR == Path("bench-results")
    assert parse_args(["--out", "bench/results"]).out == Path("bench/results")
    root = Path(__file__).resolve().parents[1]
    assert "bench-results/" in (root / ".gitignore").read_text().splitlines()
    assert 'default=Path("bench-results")' in (root / "bench" / "gpu_check.py").read_text()
