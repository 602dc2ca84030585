"""Benchmark grids (presets) and the budgets that keep a run short on a CPU.

A shape is skipped for a contender, with the reason in the table and JSON, when running it would
take too long or too much memory on this device kind; ``--full`` lifts every cap.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from bench.data import Shape

#: the paper's batch: G = 16 rollouts, 1024 prompts, responses up to 3072 tokens.
PAPER_SHAPE = Shape(16, 1024, 3072)

PRESETS: dict[str, tuple[Shape, ...]] = {
    "quick": tuple(Shape(G, P, L) for G, P, L in itertools.product((8, 16), (1, 64), (512, 3072))),
    "default": tuple(Shape(G, P, L) for G, P, L in itertools.product((8, 16, 64), (1, 64, 1024), (512, 3072, 8192))),
    # scaling at G = 16: B = 256 .. 65536 rollouts, L up to 8192 (the GPU sweep)
    "sweep": tuple(Shape(16, B // 16, L) for B, L in itertools.product((256, 1024, 4096, 16384, 65536), (512, 3072, 8192))),
}
# the shapes a user meets, each against the memory floor (issue 20): a big paper-like batch, big groups,
# ids past the dense map, long responses, one trainer micro-batch, G = 64 and a sparse mask
PRESETS["shapes"] = (
    Shape(16, 256, 3072), Shape(256, 16, 3072), Shape(1024, 4, 3072), Shape(16, 256, 3072, spread_ids=True),
    Shape(16, 32, 24576), Shape(16, 8, 3072), Shape(64, 64, 3072), Shape(16, 256, 3072, masked=0.6),
)
PRESETS["full"] = PRESETS["default"]


@dataclass(frozen=True)
class Budget:
    """max_positions: vectorised contenders skip shapes with more ``B * L``;
    max_group_positions: per-group contenders skip shapes whose one group has more ``G * L``;
    loop_budget_s: time spent measuring a per-group contender on one shape;
    sample_budget_s: vectorised contenders stop repeating once this much time is spent."""

    max_positions: float
    max_group_positions: float
    loop_budget_s: float
    sample_budget_s: float

    def skip_reason(self, shape: Shape, per_group: bool) -> str | None:
        """Why ``shape`` is skipped for a contender of this kind, or None."""
        if per_group and shape.G * shape.L > self.max_group_positions:
            return f"skipped: one group of {shape.G}x{shape.L} is over this run's per-group cap ({self.max_group_positions:,.0f} positions)"
        if not per_group and shape.positions > self.max_positions:
            return f"skipped: B*L = {shape.positions:,} is over this run's cap ({self.max_positions:,.0f}); use --full"
        return None


def budget_for(device_type: str, preset: str) -> Budget:
    """The budget of a preset on a device type ("cpu" or "cuda").

    On a CPU the default grid stops at the paper batch (B*L = 50.3M; larger shapes take minutes and
    several GB each) and the per-group loops at 200k positions per group (one 64 x 8192 group of the
    upstream-style loop takes about 30 s there). ``full`` lifts the caps.
    """
    if preset == "full":
        return Budget(math.inf, math.inf, 10.0, 30.0)
    if device_type == "cuda":
        return Budget(math.inf, 200_000, 1.0, 2.0)
    return Budget(PAPER_SHAPE.positions, 200_000, 1.0, 2.0)
