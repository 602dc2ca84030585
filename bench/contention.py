"""``python -m bench --contend``: the ``cpu`` backend on a node whose cores another process uses too.

A trainer's driver (verl's TaskRunner, OpenRLHF's driver) runs the CPU kernel beside other work.
For each batch this mode times the ``cpu`` backend at its default threads (``ExecutionOptions()``:
``torch.get_num_threads()``, or ``--threads``) and at one thread, interleaved call by call so that
both see the same machine, in two phases:

- **quiet**: nothing else started; also the batch's memory floor (``bench.floor``), as in the grid;
- **contended**: beside a competing process that runs torch matrix products on ``--contend N``
  threads (default: one per core) for the whole phase.

The figure of merit is ``default / 1 thread``, the ratio of the medians: under 1 where the threads
pay, and the cost of the threads where they do not. The load average is recorded with every phase.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor

import ktae_kernels
from bench.contenders import BENCH_CONFIG
from bench.data import BenchBatch, Shape, make_batch
from bench.floor_stats import floor_ratio, floor_seconds, is_measuring_error
from bench.grid import PAPER_SHAPE
from bench.machine import load_average
from bench.report import format_ratio, format_time, shape_title
from bench.runner import batch_floor_samples
from bench.timing import timed, warm_up
from ktae_kernels import ExecutionOptions

#: the batches of ``--contend`` without ``--shape``: a trainer's micro-batch and two bigger steps at G = 16,
#: big groups, and the paper batch.
SHAPES: tuple[Shape, ...] = (Shape(16, 8, 3072), Shape(16, 64, 3072), Shape(16, 256, 3072), Shape(256, 16, 3072),
                             PAPER_SHAPE)
#: the two settings compared, in the order of the first round (the order alternates between rounds).
SETTINGS = ("default", "1 thread")
#: seconds of calls per batch and phase (both settings together), at least MIN_ROUNDS rounds.
BUDGET_S = 2.0
MIN_ROUNDS = 7
MAX_ROUNDS = 400
#: the competing process: torch matrix products of 512 x 512 float32 on `threads` threads, forever.
COMPETITOR = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(512, 512)
a @ a
print("running", flush=True)
while True:
    a @ a
"""


@dataclass
class Phase:
    """One phase of one batch: samples_s per setting (seconds of single calls), the load averages at its
    start and end."""

    samples_s: dict[str, list[float]] = field(default_factory=dict)
    load: tuple[float | None, float | None] = (None, None)

    def median(self, setting: str) -> float | None:
        samples = self.samples_s.get(setting)
        return statistics.median(samples) if samples else None

    @property
    def ratio(self) -> float | None:
        """Median default time over median one-thread time."""
        default, one = self.median("default"), self.median("1 thread")
        return default / one if default and one else None


@dataclass
class ContentionResult:
    """A batch's quiet and contended phases and its memory floor (seconds; None when not measured)."""

    shape: Shape
    threads: int
    quiet: Phase = field(default_factory=Phase)
    contended: Phase = field(default_factory=Phase)
    floor_s: float | None = None

    @property
    def x_floor(self) -> float | None:
        """The quiet default time over the memory floor (below 1: a disturbed measurement, see
        ``bench.floor_stats.is_measuring_error``)."""
        return floor_ratio(self.quiet.median("default"), self.floor_s)


@contextmanager
def competing_process(threads: int) -> Iterator[subprocess.Popen]:
    """A process running ``COMPETITOR`` on ``threads`` threads, started and running when this yields,
    killed after."""
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(threads)], stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "running":
            raise RuntimeError(f"the competing process did not start (exit code {proc.wait()})")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _call(batch: BenchBatch, threads: int | None) -> Callable[[], Tensor]:
    options = ExecutionOptions(threads=threads)
    return lambda: ktae_kernels.token_advantage(*batch.args(), config=BENCH_CONFIG, backend="cpu", options=options)


def interleaved(calls: dict[str, Callable[[], Tensor]], budget_s: float = BUDGET_S, min_rounds: int = MIN_ROUNDS,
                max_rounds: int = MAX_ROUNDS) -> dict[str, list[float]]:
    """Seconds of single calls of each of ``calls``, after each one's warm-up (``bench.timing.warm_up``):
    rounds of one call each, the order reversed every other round, until ``budget_s`` is spent (at least
    ``min_rounds`` rounds, at most ``max_rounds``)."""
    device = torch.device("cpu")
    for fn in calls.values():
        warm_up(fn, device)
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (rounds < max_rounds and spent < budget_s):
        for name in names if rounds % 2 == 0 else names[::-1]:
            seconds, _ = timed(calls[name], device)
            samples[name].append(seconds)
            spent += seconds
        rounds += 1
    return samples


def _phase(batch: BenchBatch, budget_s: float) -> Phase:
    start = load_average()
    samples = interleaved({"default": _call(batch, None), "1 thread": _call(batch, 1)}, budget_s)
    return Phase(samples, (start, load_average()))


def run_contention(shapes: tuple[Shape, ...], competitor_threads: int, seed: int = 0, budget_s: float = BUDGET_S,
                   on_progress: Callable[[str], None] = lambda text: None) -> list[ContentionResult]:
    """Every batch quiet (with its floor), then every batch beside one competing process."""
    device = torch.device("cpu")
    batches = [make_batch(shape, seed=seed, device=device) for shape in shapes]
    results = [ContentionResult(shape, torch.get_num_threads()) for shape in shapes]
    for result, batch in zip(results, batches):
        on_progress(f"quiet: {shape_title(result.shape)}")
        floor = batch_floor_samples(batch, torch.device("cpu"))
        result.quiet = _phase(batch, budget_s)
        result.floor_s = floor_seconds(floor + batch_floor_samples(batch, torch.device("cpu")))
    with competing_process(competitor_threads):
        for result, batch in zip(results, batches):
            on_progress(f"contended: {shape_title(result.shape)}")
            result.contended = _phase(batch, budget_s)
    return results


def _floor_cell(ratio: float | None) -> str:
    return "-" if ratio is None else "error" if is_measuring_error(ratio) else format_ratio(ratio)


def _load(phase: Phase) -> str:
    known = [v for v in phase.load if v is not None]
    return "-" if not known else f"{min(known):.1f}-{max(known):.1f}" if len(set(known)) > 1 else f"{known[0]:.1f}"


COLUMNS = ("batch (G x P x L)", "default", "1 thread", "ratio", "x floor", "load", "|", "default", "1 thread",
           "ratio", "load")


def format_contention(results: list[ContentionResult], competitor_threads: int) -> str:
    """The table of ``--contend``: per batch, the quiet and contended medians and their ratios."""
    rows = []
    for r in results:
        q, c = r.quiet, r.contended
        rows.append((shape_title(r.shape), format_time(q.median("default")), format_time(q.median("1 thread")),
                     format_ratio(q.ratio) if q.ratio else "-", _floor_cell(r.x_floor),
                     _load(q), "|", format_time(c.median("default")), format_time(c.median("1 thread")),
                     format_ratio(c.ratio) if c.ratio else "-", _load(c)))
    widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    quiet_width = sum(widths[1:6]) + 2 * 4
    threads = results[0].threads if results else torch.get_num_threads()
    out = [f"cpu backend, default threads ({threads}) against one thread: medians of interleaved calls",
           " " * (widths[0] + 2) + "quiet".ljust(quiet_width) + "  |  "
           + f"beside a process of {competitor_threads}-thread matrix products",
           line(COLUMNS), line(tuple("-" * w for w in widths)), *map(line, rows), "",
           "ratio: median default time / median one-thread time; x floor: the quiet default time over the",
           "batch's memory floor (error: measured under it, the timings were disturbed; - : not measured);",
           "load: 1-minute load average at the start and end of the phase"]
    return "\n".join(out)


def contention_json(results: list[ContentionResult], competitor_threads: int) -> dict:
    """JSON-ready results of ``--contend``."""
    def phase(p: Phase) -> dict:
        return {"median_s": {s: p.median(s) for s in SETTINGS}, "ratio": p.ratio, "samples_s": p.samples_s,
                "load_average_1min": list(p.load)}

    return {
        "competitor": {"threads": competitor_threads, "work": "torch matrix products, 512 x 512 float32"},
        "results": [{"shape": str(r.shape), "G": r.shape.G, "prompts": r.shape.prompts, "L": r.shape.L,
                     "threads": r.threads, "memory_floor_s": r.floor_s,
                     "x_memory_floor": None if is_measuring_error(r.x_floor) else r.x_floor,
                     "x_memory_floor_error": is_measuring_error(r.x_floor),
                     "quiet": phase(r.quiet), "contended": phase(r.contended)} for r in results],
    }


def default_competitor_threads() -> int:
    """One competing thread per core."""
    return os.cpu_count() or 1
