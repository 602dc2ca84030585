"""The CUDA extension (built, or the emulator build) with every launch recorded, for the cuda tests."""
from __future__ import annotations

from types import ModuleType


class Recorder:
    """``ext`` with each rows-kernel pass recorded in ``launches`` as (mode, shared table, groups) and
    each ``advantage`` call as ("advantage", shared pass, global-pass blocks); ``shapes`` holds each
    ``advantage`` call's (shared bytes, threads), ``tables`` whether it got the grid and the
    log-factorials, ``given_rows`` how many rows' scores it was given."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext, self.launches, self.shapes, self.tables, self.given_rows = ext, [], [], [], []

    def __getattr__(self, name: str):
        return getattr(self.ext, name)

    def launch(self, pass_, inputs, table) -> None:
        self.launches.append((pass_.mode, table.shared_table, pass_.block_group.tolist()))
        self.ext.launch(pass_, inputs, table)

    def advantage(self, inputs, scoring, shape) -> None:
        self.launches.append(("advantage", shape.shared_bytes > 0, shape.fallback_blocks))
        self.shapes.append((shape.shared_bytes, shape.threads))
        self.tables.append((scoring.table_values is not None, scoring.log_factorial is not None))
        if scoring.given_token is not None:
            self.given_rows.append(scoring.given_token.numel())
        self.ext.advantage(inputs, scoring, shape)
