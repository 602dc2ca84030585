"""The memory floor measured as robustly as the contenders, and the ``x floor`` ratio it gives.

``bench.floor.memory_floor_s`` times one floor pass. A single sample of a pass that takes
microseconds is at the mercy of the scheduler on a loaded machine (one run measured 8 ms for 1,466
tokens, then a contender "0.09x the floor"). So the floor is sampled ``FLOOR_ROUNDS`` times before
and again after the contenders of a shape, and its *fastest* sample is the floor: the least the
pass can take, where noise only ever adds time. Batches under ``MIN_FLOOR_POSITIONS`` positions get
no floor (their pass is below the timer's and the thread pool's noise), and a ratio below 1 is
reported as a measuring error, never as a result.
"""
from __future__ import annotations

from time import perf_counter
from typing import Callable

#: batches with fewer ``B * L`` positions get no floor: their pass takes a few microseconds.
MIN_FLOOR_POSITIONS = 1 << 16
#: floor samples taken before, and again after, the contenders of a shape.
FLOOR_ROUNDS = 7


def floor_samples(measure: Callable[[], float | None], positions: int, rounds: int = FLOOR_ROUNDS,
                  warm_up_s: float = 0.0) -> list[float]:
    """``rounds`` samples of ``measure()`` (one floor pass's seconds), after untimed calls of it for
    ``warm_up_s`` of wall time (a call may run more passes than the one it reports); none for a batch
    under ``MIN_FLOOR_POSITIONS`` positions or where ``measure`` returns None (no floor on this device)."""
    if positions < MIN_FLOOR_POSITIONS:
        return []
    start = perf_counter()
    while perf_counter() - start < warm_up_s:
        if measure() is None:
            return []
    samples = []
    for _ in range(rounds):
        seconds = measure()
        if seconds is None:
            return []
        samples.append(seconds)
    return samples


def floor_seconds(samples: list[float]) -> float | None:
    """The floor from its samples: the fastest (noise only adds time), None without samples."""
    return min(samples) if samples else None


def floor_ratio(seconds: float | None, floor_s: float | None) -> float | None:
    """``seconds / floor_s``, None where either is missing. Below 1 it is a measuring error (see
    ``is_measuring_error``), which the report flags instead of printing."""
    return seconds / floor_s if seconds and floor_s else None


def is_measuring_error(ratio: float | None) -> bool:
    """A time under the memory floor measured in the same run: no implementation can be faster
    than reading its input and writing its output once, so the timings were disturbed."""
    return ratio is not None and ratio < 1.0
