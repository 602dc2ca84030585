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


@pytest.fixture(autouse=True)
def short_warm_up(monkeypatch):
    """The real runs in these tests check what is printed and saved, not times: a 20 ms warm-up, not 1 s."""
    monkeypatch.setattr(timing, "WARM_UP_S", 0.02)


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


def test_floor_samples_follow_untimed_calls_for_the_warm_up_wall_time(monkeypatch):
    """A cold core's first calls are run but not sampled until ``warm_up_s`` of wall time has passed, however
    little of it the pass each call reports took (a call runs a warm-up pass and two timed ones, and reports
    the faster: 5 ms reported here for 20 ms of wall time)."""
    from bench import floor_stats

    clock = iter(range(100))
    monkeypatch.setattr(floor_stats, "perf_counter", lambda: next(clock) * 0.02)  # each read: 20 ms on
    samples = floor_samples(fake_measure([5e-3] * 4 + [1e-3] * FLOOR_ROUNDS), MIN_FLOOR_POSITIONS, warm_up_s=0.07)
    assert samples == [5e-3] + [1e-3] * (FLOOR_ROUNDS - 1)  # 3 calls in 60 ms of wall time (4 clock reads)


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
    assert [r.backend for r in results] == ["reference", "torch"]  # the reference first, whatever the order given
    assert [r.peak_extra_bytes for r in results] == [None, 123]  # per-group loops get no peak
    assert events.index("peak") > max(i for i, e in enumerate(events) if e in ("time", "floor"))
    assert events.count("peak") == 1


def test_every_output_is_compared_with_the_reference_and_a_wrong_one_fails_the_run(monkeypatch, tmp_path, capsys):
    """The reference listed last still runs first, so ``torch`` is compared with it; an output holding
    NaN is a mismatch (``matches_reference`` false, not a null difference) and ``python -m bench``
    exits 1 naming it."""
    from bench import __main__ as bench_main
    from bench import contenders

    args = ["--shape", "4x2x64", "--backends", "torch,reference", "--repeats", "1", "--no-plot", "--no-progress",
            "--out", str(tmp_path)]
    assert bench_main.main(args) == 0
    library = contenders._library

    def broken(name):
        contender = library(name)
        if name != "torch":
            return contender
        return contenders.Contender(name, lambda batch: contender.run(batch).index_fill(0, torch.tensor([1]), float("nan")),
                                    per_group=False)

    monkeypatch.setattr(contenders, "_library", broken)
    assert bench_main.main([*args, "--tag", "broken"]) == 1
    assert "error: torch differs from the reference by inf on 4 x 2 x 64" in capsys.readouterr().err
    import json
    cells = {c["backend"]: c for c in json.loads(next(tmp_path.glob("*broken.json")).read_text())["results"]}
    assert cells["torch"]["matches_reference"] is False and cells["reference"]["matches_reference"] is None


def test_the_upstream_loop_skips_ids_past_any_vocabulary():
    """The published loop's table has a row per id up to the largest: ids spread to 2**31 would take
    tens of GB, so that batch is skipped with the reason."""
    from bench.contenders import UPSTREAM

    spread = Shape(4, 1, 64, spread_ids=True)
    (result,) = runner.run_grid([spread], [UPSTREAM], torch.device("cpu"), Budget(1e9, 1e9, 1.0, 0.1), repeats=1,
                                progress=False)
    assert result.status == "skipped" and "2**31" in result.note


def test_new_runs_write_to_the_ignored_folder_unless_told_otherwise():
    """A plain run never adds files to the committed bench/results/: it needs --out bench/results."""
    from pathlib import Path

    from bench.__main__ import RESULTS_DIR, parse_args

    assert parse_args([]).out == RESULTS_DIR == Path("bench-results")
    assert parse_args(["--out", "bench/results"]).out == Path("bench/results")
    root = Path(__file__).resolve().parents[1]
    assert "bench-results/" in (root / ".gitignore").read_text().splitlines()
    assert 'default=Path("bench-results")' in (root / "bench" / "gpu_check.py").read_text()


@pytest.mark.parametrize("value, text", [
    (0.00902, "0.00902x"), (0.5634, "0.563x"), (4.0, "4x"), (9.996, "10x"), (63.21, "63.2x"), (99.96, "100x"),
    (999.7, "1,000x"), (1001.2, "1,001x"), (21532.4, "21,532x")])
def test_every_ratio_has_one_format(value, text):
    from bench.report import format_ratio
    assert format_ratio(value) == text


def test_times_rates_and_the_paper_summary_never_print_an_exponent():
    from bench.grid import PAPER_SHAPE
    from bench.paper import format_paper_summary, paper_summary
    from bench.report import format_time

    assert [format_time(s) for s in (81e-6, 999.7e-6, 12.34e-3, 0.9997, 2260.4)] == [
        "81 us", "1 ms", "12.3 ms", "1 s", "2,260 s"]
    loop = Result(PAPER_SHAPE, "upstream-style", "ok", tokens=21_000_000, seconds=2260.4, extrapolated=True)
    text = format_paper_summary(paper_summary([loop, cell_on(PAPER_SHAPE, "cpu", 0.0525)], 1234.6, "cpu"))
    assert "16 x 1024 x 3072" in text and "~2,260 s" in text and "22,604x the target" in text
    assert "1,235 GB/s" in text and not re.search(r"\de[+-]\d", text)


def cell_on(shape: Shape, backend: str, seconds: float, extrapolated: bool = False, **kw) -> Result:
    groups = 4 if extrapolated else shape.prompts
    return Result(shape, backend, "ok", f"extrapolated from 4 of {shape.prompts} groups" if extrapolated else "",
                  tokens=shape.positions // 3, seconds=seconds, samples_s=[seconds], groups=groups,
                  extrapolated=extrapolated, **kw)


def quick_like_results() -> list[Result]:
    """What ``python -m bench --quick`` prints for one small and one big batch, constructed."""
    small, big = Shape(8, 1, 512), Shape(16, 64, 3072)
    floor = dict(floor_s=8e-3, floor_samples_s=[8e-3])
    return [
        cell_on(small, "reference", 6.7e-3),
        cell_on(small, "upstream-style", 0.61, max_abs_diff_vs_reference=0.19),
        cell_on(small, "cpu", 162e-6, max_abs_diff_vs_reference=0.0, peak_extra_bytes=0),
        cell_on(small, "cpu+out", 148e-6, max_abs_diff_vs_reference=0.0, peak_extra_bytes=0),
        cell_on(big, "reference", 2.89, extrapolated=True, **floor),
        cell_on(big, "upstream-style", 86.5, extrapolated=True, max_abs_diff_vs_reference=0.69, **floor),
        cell_on(big, "cpu", 16e-3, max_abs_diff_vs_reference=0.0, peak_extra_bytes=15_000_000, **floor),
        cell_on(big, "cpu+out", 0.086505, max_abs_diff_vs_reference=0.0, peak_extra_bytes=0, **floor),
    ]


def test_the_quick_table_explains_every_dash_and_the_upstream_difference():
    table = format_table(quick_like_results())
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "8 x 1 x 512: " in table and "16 x 64 x 3072: " in table and "memory floor 8 ms" in table
    legend = "\n".join(lines[lines.index("", lines.index(next(l for l in lines if "cpu+out" in l and "16" not in l))):])
    for needed in ("G x P x L", "~", "x floor -", "65,536 positions", "extrapolated time", "peak MB -",
                   "per-group Python loops", "max|d| ref -", 'fisher="upstream"', "float32", "float64",
                   "cpu+out", "peak MB 0"):
        assert needed in legend, needed
    # the quick grid's ratios, in one format: thousands separated, never 1e+03
    assert "1,000x" in table and "e+" not in table and "1e" not in table
    assert "0.19" not in table.split("max|d| ref")[0]  # the header comes before any value
    assert "1.9e-01" in table and "6.9e-01" in table


def test_the_legend_holds_only_the_notes_of_cells_printed():
    big = Shape(16, 64, 3072)
    table = format_table([cell_on(big, "cpu", 16e-3, floor_s=8e-3, floor_samples_s=[8e-3], peak_extra_bytes=15_000_000)])
    for absent in ("~", "x floor -", "peak MB", "fisher", "cpu+out", "error"):
        assert absent not in table.split("G x P x L")[1], absent
    assert "x ref -" in table and "x upstream -" in table  # neither baseline ran
    assert "2x" in table


def test_a_row_not_timed_is_dashes_with_its_note():
    skipped = Result(Shape(64, 1024, 8192), "cpu", "skipped", "skipped: B*L = 536,870,912 is over this run's cap")
    table = format_table([skipped])
    assert "skipped" in table and "[1] skipped: B*L" in table and "its numbered note says why" in table
    assert "x floor -" not in table


def cited_result_files(text: str) -> set[str]:
    """The ``bench/results/`` file names a text cites, its ``{1,2}`` and ``{1..6}`` expanded."""
    names = set()
    for name in re.findall(r"bench/results/([\w.{},-]+)", text):
        choice = re.search(r"\{([^}]*)\}", name)
        if choice is None:
            names.add(name)
            continue
        body = choice.group(1)
        if ".." in body:
            low, high = body.split("..")
            options = [str(i) for i in range(int(low), int(high) + 1)]
        else:
            options = body.split(",")
        names |= {name[:choice.start()] + o + name[choice.end():] for o in options}
    return names


def test_committed_results_are_the_ones_the_docs_cite():
    """bench/results/ is a known place: each file in it is cited by docs/benchmarks.md, each file a
    doc cites is there, and it stays small."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    committed = {p.name for p in (root / "bench" / "results").iterdir()}
    docs = [root / "README.md", root / "examples" / "README.md", *sorted((root / "docs").glob("*.md"))]
    cited = {path.name: cited_result_files(path.read_text()) for path in docs}
    assert len(committed) <= 15
    assert cited["benchmarks.md"] == committed
    missing = {doc: sorted(names - committed) for doc, names in cited.items() if names - committed}
    assert not missing, missing


def test_a_same_day_rerun_never_overwrites_a_result_unless_told(tmp_path):
    """bench's result files are named by machine, date and grid: a second run the same day gets -run2,
    a third -run3; --overwrite replaces."""
    from bench.__main__ import parse_args, result_stem

    stem = tmp_path / "cpu-2core-2026-12-04-quick"
    assert result_stem(stem) == stem
    stem.with_suffix(".json").write_text("{}")
    assert result_stem(stem) == tmp_path / "cpu-2core-2026-12-04-quick-run2"
    (tmp_path / "cpu-2core-2026-12-04-quick-run2.png").write_bytes(b"")
    assert result_stem(stem) == tmp_path / "cpu-2core-2026-12-04-quick-run3"
    assert result_stem(stem, overwrite=True) == stem
    assert parse_args(["--overwrite"]).overwrite and not parse_args([]).overwrite


# ----------------------------------------------------------------------------------------- --contend
def test_contend_calls_alternate_settings_round_by_round(monkeypatch):
    """Both settings see the same machine: one call each per round, the order reversed every other
    round, at least ``min_rounds`` rounds, after each one's warm-up."""
    from bench import contention

    calls: list[str] = []
    monkeypatch.setattr(contention, "warm_up", lambda fn, device: calls.append("warm"))
    monkeypatch.setattr(contention, "timed", lambda fn, device: (fn(), None))
    samples = contention.interleaved({"a": lambda: calls.append("a") or 1e-3, "b": lambda: calls.append("b") or 2e-3},
                                     budget_s=0.0, min_rounds=3)
    assert calls == ["warm", "warm", "a", "b", "b", "a", "a", "b"]
    assert samples == {"a": [1e-3] * 3, "b": [2e-3] * 3}


def test_the_competing_process_runs_for_the_phase_and_no_longer():
    from bench.contention import competing_process

    with competing_process(1) as proc:
        assert proc.poll() is None  # started and running matrix products
    assert proc.poll() is not None


def test_contend_table_and_json(tmp_path, monkeypatch):
    """``python -m bench --contend 1 --shape ...``: the cpu backend at its default threads and at one
    thread, quiet then beside the competing process, medians, ratios and loads, in the table and the JSON."""
    import json

    from bench import contention
    from bench.__main__ import main
    from ktae_kernels.backends import cpu

    if cpu.unavailable_reason() is not None:
        pytest.skip("the native CPU kernel is not built")
    monkeypatch.setattr(contention, "BUDGET_S", 0.0)
    monkeypatch.setattr(contention, "MIN_ROUNDS", 2)
    phases = []
    run_phase = contention._phase
    monkeypatch.setattr(contention, "_phase", lambda batch, budget_s: phases.append(budget_s) or run_phase(batch, budget_s))
    assert main(["--contend", "1", "--shape", "16x4x1024", "--shape", "4x2x64", "--out", str(tmp_path),
                 "--tag", "t", "--no-progress"]) == 0
    assert len(phases) == 4  # two batches, quiet and contended
    (path,) = tmp_path.glob("*-contend-t.json")
    payload = json.loads(path.read_text())
    assert payload["competitor"]["threads"] == 1 and "--contend 1" in payload["command"]
    big, small = payload["results"]
    for row in (big, small):
        for phase in ("quiet", "contended"):
            medians = row[phase]["median_s"]
            assert medians["default"] > 0 and medians["1 thread"] > 0
            assert row[phase]["ratio"] == pytest.approx(medians["default"] / medians["1 thread"])
            assert len(row[phase]["samples_s"]["default"]) >= 2 and len(row[phase]["load_average_1min"]) == 2
    assert big["memory_floor_s"] > 0 and small["memory_floor_s"] is None  # no floor under 65,536 positions


def test_contend_rejects_what_it_does_not_time(capsys):
    from bench.__main__ import parse_args

    for argv in (["--contend", "--backends", "torch"], ["--contend", "--device", "cuda"], ["--contend", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "--contend" in capsys.readouterr().err


def test_contend_table_prints_ratios_and_never_a_ratio_under_the_floor():
    from bench.contention import ContentionResult, Phase, format_contention

    def phase(default, one):
        return Phase({"default": [default], "1 thread": [one]}, (0.4, 0.6))

    ok = ContentionResult(Shape(16, 64, 3072), 2, phase(4e-3, 8e-3), phase(9.2e-3, 8e-3), floor_s=1e-3)
    disturbed = ContentionResult(Shape(16, 8, 3072), 2, phase(0.5e-3, 1e-3), phase(1e-3, 1e-3), floor_s=1e-3)
    table = format_contention([ok, disturbed], 2)
    rows = {line.split("  ")[0]: line for line in table.splitlines() if " x 3072" in line}
    assert "0.5x" in rows["16 x 64 x 3072"] and "1.15x" in rows["16 x 64 x 3072"] and "4x" in rows["16 x 64 x 3072"]
    assert "error" in rows["16 x 8 x 3072"] and "0.5x" in rows["16 x 8 x 3072"]
    assert "0.4-0.6" in table and "2-thread matrix products" in table


def test_the_docs_count_the_gpu_variants_the_script_runs():
    """The launch-variant count docs/benchmarks.md gives is the number bench/gpu_variants.py runs."""
    from pathlib import Path

    from bench.gpu_variants import paper_variants

    text = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert f"the cuda backend's {len(paper_variants())} launch variants" in text
