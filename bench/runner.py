"""Run contenders over a grid of shapes: one batch per shape, every contender on it, results in order.

The reference runs first on each shape; every other contender's output on the groups the reference
covered is compared with it (``max_abs_diff_vs_reference``), so the table shows exactness next to
speed. A per-group timing is measured once per (contender, G, L) and serves every number of prompts
(the first groups are the same batches), scaled to each.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import Tensor
from tqdm import tqdm

from bench import timing
from bench.contenders import UPSTREAM, Contender, make_contender, unavailable_reason
from bench.data import BenchBatch, Shape, batch_tokens, make_batch
from bench.floor import memory_floor_s, peak_extra_bytes
from bench.floor_stats import floor_ratio, floor_samples, floor_seconds, is_measuring_error
from bench.grid import Budget
from bench.timing import MIN_GROUPS, Timing, measure_per_group, measure_vectorised

#: a library backend matches the reference when its advantages are within this of the reference's.
EXACT_TOLERANCE = 1e-6
#: the batch each contender runs once, untimed, before the grid.
WARMUP_SHAPE = Shape(4, 2, 64)
#: groups drawn for a shape that only per-group contenders run on (enough for their time budget).
LOOP_PROMPTS = 64


@dataclass
class Result:
    """One (shape, contender) cell. status: "ok", "skipped", "unavailable" or "failed";
    seconds: median time for the whole batch (scaled when ``extrapolated``); groups: how many of the
    shape's groups were run; samples_s: the raw timed runs on those groups."""

    shape: Shape
    backend: str
    status: str
    note: str = ""
    tokens: int | None = None
    seconds: float | None = None
    samples_s: list[float] = field(default_factory=list)
    groups: int | None = None
    extrapolated: bool = False
    max_abs_diff_vs_reference: float | None = None
    floor_s: float | None = None
    floor_samples_s: list[float] = field(default_factory=list)
    peak_extra_bytes: int | None = None

    @property
    def x_floor(self) -> float | None:
        """Time over the machine's memory floor for this batch (measured in the same run); None where
        either is missing, extrapolated, or below 1 (a measuring error: see ``floor_error``)."""
        ratio = None if self.extrapolated else floor_ratio(self.seconds, self.floor_s)
        return None if is_measuring_error(ratio) else ratio

    @property
    def floor_error(self) -> bool:
        """Whether this cell measured faster than the memory floor, which no implementation can be."""
        return not self.extrapolated and is_measuring_error(floor_ratio(self.seconds, self.floor_s))

    @property
    def matches_reference(self) -> bool | None:
        """Whether a library backend's advantages are within ``EXACT_TOLERANCE`` of the reference's; None
        when not compared, and for the upstream-style loop (its float32 Fisher differs by design)."""
        if self.max_abs_diff_vs_reference is None or self.backend == UPSTREAM:
            return None
        return self.max_abs_diff_vs_reference <= EXACT_TOLERANCE

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds and self.tokens is not None else None


def run_grid(shapes: Iterable[Shape], names: list[str], device: torch.device, budget: Budget, repeats: int,
             seed: int = 0, progress: bool = True,
             on_shape_done: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Every contender in ``names`` on every shape; never raises for one contender's failure.
    ``on_shape_done(results so far)`` is called after each shape (to save partial results)."""
    shapes = list(shapes)
    names = sorted(names, key=lambda name: name != "reference")  # first: the others are compared with it
    results: list[Result] = []
    warm_up([n for n in names if unavailable_reason(n, device) is None], device)
    loops: dict[tuple[str, tuple], Timing] = {}  # per-group timings by (name, shape family), see _cached
    bar = tqdm(total=len(shapes) * len(names), disable=not progress, unit="run", dynamic_ncols=True)
    for shape in shapes:
        plan = [(name, _not_run(name, shape, device, budget), _cached(loops, name, shape)) for name in names]
        batch = _batch_for(shape, [n for n, skip, hit in plan if skip is None and hit is None], seed, device)
        tokens = batch_tokens(shape, seed)
        full = batch is not None and batch.responses.shape[0] == shape.B
        floor = batch_floor_samples(batch, device) if full else []  # again after the contenders: bench.floor_stats
        shape_results: list[Result] = []
        peaks: list[tuple[Result, Contender]] = []  # measured after every timing of the shape (see below)
        reference: tuple[int, Tensor] | None = None
        for name, not_run, hit in plan:
            bar.set_postfix_str(f"{shape} {name}")
            if not_run is not None:
                shape_results.append(Result(shape, name, *not_run, tokens=tokens))
                bar.update()
                continue
            contender = make_contender(name)
            if hit is not None:
                measured = hit
            else:
                measured = _measure(contender, batch, shape, device, budget, repeats)
                if isinstance(measured, Timing) and contender.per_group:
                    loops[(name, shape.family)] = measured
            result = _result(shape, name, measured, tokens)
            if result.status == "ok" and not contender.per_group and hit is None:
                peaks.append((result, contender))
            output = measured.output if isinstance(measured, Timing) else None
            if name == "reference" and output is not None:
                reference = (result.groups, output.cpu())
            elif reference is not None and output is not None:
                result.max_abs_diff_vs_reference = _max_diff(reference, output, result.groups, shape.G)
            shape_results.append(result)
            del output, measured
            _free(device)
            bar.update()
        floor += batch_floor_samples(batch, device) if full else []
        for result in shape_results:
            result.floor_s, result.floor_samples_s = floor_seconds(floor), floor
        # Last: a peak measurement trims the heap and empties the output pool, so the calls after it map
        # memory again and run several times slower for longer than a warm-up.
        for result, contender in peaks:
            result.peak_extra_bytes = peak_extra_bytes(lambda b=batch, c=contender: c.run(b), device)
        results += shape_results
        del batch
        _free(device)
        if on_shape_done is not None:
            on_shape_done(results)
    bar.close()
    return results


def batch_floor_samples(batch: BenchBatch, device: torch.device) -> list[float]:
    """Samples of the memory floor pass over ``batch`` (``floor_samples``: one pass each, after
    ``timing.WARM_UP_S`` of untimed calls; none for a small batch), for the grid and for ``--contend``."""
    return floor_samples(lambda: memory_floor_s(batch, device, repeats=1), batch.responses.numel(),
                         warm_up_s=timing.WARM_UP_S)


def _cached(loops: dict, name: str, shape: Shape) -> Timing | None:
    """A per-group timing of ``name`` measured on an earlier shape of the same family, when it ran
    on enough groups: the first groups of such shapes are identical (bench.data seeds each prompt),
    so it is a measurement of this batch's first groups too."""
    hit = loops.get((name, shape.family))
    if hit is None or not min(shape.prompts, MIN_GROUPS) <= hit.groups <= shape.prompts:
        return None
    return hit


def warm_up(names: list[str], device: torch.device) -> None:
    """One untimed run of each contender on a tiny batch: imports, first-call set-up, kernel builds."""
    tiny = make_batch(WARMUP_SHAPE, seed=1, device=device)
    for name in names:
        contender = make_contender(name)
        contender.prepare(tiny)
        try:
            contender.run(tiny)
        except Exception:  # reported by the timed run of the first shape
            pass


def _batch_for(shape: Shape, names: list[str], seed: int, device: torch.device) -> BenchBatch | None:
    """The shape's batch; only its first ``LOOP_PROMPTS`` groups when only per-group contenders run."""
    if not names:
        return None
    loops_only = all(make_contender(n).per_group for n in names)
    return make_batch(shape, prompts=min(shape.prompts, LOOP_PROMPTS) if loops_only else None, seed=seed, device=device)


def _not_run(name: str, shape: Shape, device: torch.device, budget: Budget) -> tuple[str, str] | None:
    """``(status, note)`` when contender ``name`` does not run on ``shape``, else None."""
    reason = unavailable_reason(name, device)
    if reason is not None:
        return "unavailable", reason
    if name == UPSTREAM and shape.spread_ids:
        return "skipped", ("the published loop's table has a row per id up to the largest, and these ids reach "
                           "2**31 (tens of GB)")
    reason = budget.skip_reason(shape, make_contender(name).per_group)
    return None if reason is None else ("skipped", reason)


def _measure(contender: Contender, batch: BenchBatch, shape: Shape, device: torch.device, budget: Budget,
             repeats: int) -> Timing | str:
    """The contender's timing on the batch, or the note of its failure."""
    try:
        if contender.per_group:
            return measure_per_group(contender, batch, device, repeats, budget.loop_budget_s)
        return measure_vectorised(contender, batch, device, repeats, budget.sample_budget_s)
    except Exception as err:  # a failing backend must not end the benchmark
        kind = "out of memory" if isinstance(err, torch.cuda.OutOfMemoryError) else type(err).__name__
        return f"failed: {kind}: {str(err)[:200]}"


def _result(shape: Shape, name: str, measured: Timing | str, tokens: int) -> Result:
    """The cell of a timing, scaled to the shape's ``prompts`` groups (a failure note as is)."""
    if isinstance(measured, str):
        return Result(shape, name, "failed", measured, tokens=tokens)
    extrapolated = measured.groups < shape.prompts
    note = f"extrapolated from {measured.groups} of {shape.prompts} groups" if extrapolated else ""
    seconds = statistics.median(measured.samples_s) * shape.prompts / measured.groups
    return Result(shape, name, "ok", note, tokens=tokens, seconds=seconds, samples_s=measured.samples_s,
                  groups=measured.groups, extrapolated=extrapolated)


def _max_diff(reference: tuple[int, Tensor], output: Tensor, groups: int, G: int) -> float:
    """max |output - reference| over the rows both cover (the first groups of the batch); inf where the
    output holds NaN or inf (the reference's values are finite)."""
    rows = min(reference[0], groups) * G
    ref, out = reference[1][:rows].double(), output[:rows].cpu().double()
    return float((ref - out).abs().nan_to_num(nan=float("inf")).max()) if rows else 0.0


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
