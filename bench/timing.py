"""Timing of one contender on one batch: wall clock around a synchronised call, median of runs.

Vectorised contenders run on the whole batch: two untimed warm-up runs, then more for at least
``WARM_UP_S``, each while the previous output is held (first-call costs such as imports, lazy tables and
first-touch of memory are not the steady state a trainer sees, nor is a core that sat idle: see
``WARM_UP_S`` and ``warm_up``), then ``MIN_SAMPLES`` to ``repeats`` timed runs, stopping early once
``sample_budget_s`` is spent.
Per-group contenders (Python loops over groups) run on the first ``k`` groups (at least 4, more
while the runs fit ``loop_budget_s``); the caller scales their time by ``prompts / k`` and marks it
extrapolated when ``k < prompts``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from bench.contenders import Contender
from bench.data import BenchBatch

#: vectorised contenders are timed at least this many times (when ``repeats`` allows), whatever the budget.
MIN_SAMPLES = 3
#: per-group contenders always run on at least this many groups (when the batch has them).
MIN_GROUPS = 4
#: seconds of untimed runs before a vectorised contender's samples (and the floor's, ``bench.runner``): after
#: an idle spell a call runs slower until the core's clock, caches and the allocator have settled, so one
#: warm-up run would time a cold core; a second covers that on a shared VM.
WARM_UP_S = 1.0


@dataclass(frozen=True)
class Timing:
    """samples_s: wall times of the measured runs, on the first ``groups`` groups of the batch;
    output: the last run's output (those groups' rows)."""

    samples_s: list[float]
    groups: int
    output: Tensor


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Tensor], device: torch.device) -> tuple[float, Tensor]:
    """Seconds of one synchronised call of ``fn`` and its output."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def _samples(fn: Callable[[], Tensor], device: torch.device, repeats: int, budget_s: float) -> tuple[list[float], Tensor]:
    """Up to ``repeats`` timed calls, at least ``min(MIN_SAMPLES, repeats)``, stopping once ``budget_s`` is spent."""
    samples: list[float] = []
    while len(samples) < min(MIN_SAMPLES, max(repeats, 1)) or (len(samples) < repeats and sum(samples) < budget_s):
        seconds, out = timed(fn, device)
        samples.append(seconds)
    return samples, out


def warm_up(fn: Callable[[], Tensor], device: torch.device, seconds: float | None = None) -> None:
    """Untimed calls of ``fn``: two, then more until these further calls have taken ``seconds``. Each is made
    while the previous call's output is still held, as in the timed runs: a backend that recycles freed
    outputs (the native CPU kernel's pool) then maps its second output here, not in a timed run, where
    mapping costs many times a warm call. The first two calls, which may map memory, do not count toward
    ``seconds``: a first call that maps its output and workspaces can take longer than the whole
    warm-up, which would then end before the core is warm. ``seconds``: ``WARM_UP_S`` when None."""
    seconds = WARM_UP_S if seconds is None else seconds
    _, out = timed(fn, device)
    _, out = timed(fn, device)
    spent = 0.0
    while spent < seconds:
        more, out = timed(fn, device)
        spent += more


def measure_vectorised(contender: Contender, batch: BenchBatch, device: torch.device, repeats: int,
                       sample_budget_s: float) -> Timing:
    """Whole-batch timing of a vectorised contender."""
    contender.prepare(batch)
    fn = lambda: contender.run(batch)  # noqa: E731
    warm_up(fn, device)
    samples, out = _samples(fn, device, repeats, sample_budget_s)
    return Timing(samples, batch.shape.prompts, out)


def measure_per_group(contender: Contender, batch: BenchBatch, device: torch.device, repeats: int,
                      loop_budget_s: float) -> Timing:
    """Timing of a per-group contender on the first ``k`` groups of ``batch``.

    The first ``MIN_GROUPS`` groups run first; ``k`` then grows (at most 8x a step) while a run on
    ``k`` groups fits the budget left; runs on the final ``k`` groups repeat within the budget and
    are the samples. Groups are drawn independently, so the first ``k`` are a fair sample.
    """
    available = batch.shape.prompts
    k, spent, samples = 0, 0.0, []
    grow_to = min(available, MIN_GROUPS)
    while grow_to > k:
        k = grow_to
        sub = batch.first_groups(k)
        contender.prepare(sub)
        seconds, out = timed(lambda: contender.run(sub), device)
        spent, samples = spent + seconds, [seconds]
        grow_to = min(available, 8 * k, int((loop_budget_s - spent) * k / max(seconds, 1e-9)))
    while len(samples) < repeats and spent + samples[-1] <= loop_budget_s:
        seconds, out = timed(lambda: contender.run(sub), device)
        spent += seconds
        samples.append(seconds)
    return Timing(samples, k, out)
