"""Run contenders over a grid of shapes: one batch per shape, every contender on it, results in order.

The reference runs first on each shape; every other contender's output on the groups the reference
covered is compared with it (``max_abs_diff_vs_reference``), so the table shows exactness next to
speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import Tensor
from tqdm import tqdm

from bench.contenders import Contender, make_contender, unavailable_reason
from bench.data import BenchBatch, Shape, batch_tokens, make_batch
from bench.grid import Budget
from bench.timing import Timing, measure_per_group, measure_vectorised

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

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds and self.tokens is not None else None


def run_grid(shapes: Iterable[Shape], names: list[str], device: torch.device, budget: Budget, repeats: int,
             seed: int = 0, progress: bool = True,
             on_shape_done: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Every contender in ``names`` on every shape; never raises for one contender's failure.
    ``on_shape_done(results so far)`` is called after each shape (to save partial results)."""
    shapes = list(shapes)
    results: list[Result] = []
    warm_up([n for n in names if unavailable_reason(n, device) is None], device)
    bar = tqdm(total=len(shapes) * len(names), disable=not progress, unit="run", dynamic_ncols=True)
    for shape in shapes:
        plan = [(name, _not_run(name, shape, device, budget)) for name in names]
        batch = _batch_for(shape, [n for n, r in plan if r is None], seed, device)
        tokens = batch_tokens(shape, seed)
        reference: tuple[int, Tensor] | None = None
        for name, not_run in plan:
            bar.set_postfix_str(f"{shape} {name}")
            if not_run is not None:
                results.append(Result(shape, name, *not_run, tokens=tokens))
            else:
                result, output = _run_one(make_contender(name), batch, shape, device, budget, repeats)
                result.tokens = tokens
                if name == "reference" and output is not None:
                    reference = (result.groups, output.cpu())
                elif reference is not None and output is not None:
                    result.max_abs_diff_vs_reference = _max_diff(reference, output, result.groups, shape.G)
                results.append(result)
                del output
                _free(device)
            bar.update()
        del batch
        _free(device)
        if on_shape_done is not None:
            on_shape_done(results)
    bar.close()
    return results


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
    reason = budget.skip_reason(shape, make_contender(name).per_group)
    return None if reason is None else ("skipped", reason)


def _run_one(contender: Contender, batch: BenchBatch, shape: Shape, device: torch.device, budget: Budget,
             repeats: int) -> tuple[Result, Tensor | None]:
    try:
        if contender.per_group:
            t: Timing = measure_per_group(contender, batch, shape.prompts, device, repeats, budget.loop_budget_s)
        else:
            t = measure_vectorised(contender, batch, device, repeats, budget.sample_budget_s)
    except Exception as err:  # a failing backend must not end the benchmark
        kind = "out of memory" if isinstance(err, torch.cuda.OutOfMemoryError) else type(err).__name__
        return Result(shape, contender.name, "failed", f"failed: {kind}: {str(err)[:200]}"), None
    note = f"extrapolated from {t.groups} of {shape.prompts} groups" if t.extrapolated else ""
    result = Result(shape, contender.name, "ok", note, seconds=t.seconds, samples_s=t.samples_s,
                    groups=t.groups, extrapolated=t.extrapolated)
    return result, t.output


def _max_diff(reference: tuple[int, Tensor], output: Tensor, groups: int, G: int) -> float:
    """max |output - reference| over the rows both cover (the first groups of the batch)."""
    rows = min(reference[0], groups) * G
    ref, out = reference[1][:rows].double(), output[:rows].cpu().double()
    return float((ref - out).abs().max()) if rows else 0.0


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
