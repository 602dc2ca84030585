"""A cuda launcher (the device's, or the emulator) with every launch recorded, for the cuda tests."""
from __future__ import annotations

import ctypes
import re


class Recorder:
    """``launcher`` with each launch recorded in ``kernels`` as (kernel name, grid, block, shared bytes)
    and its argument structs in ``args``."""

    def __init__(self, launcher) -> None:
        self.launcher, self.kernels, self.args, self._groups = launcher, [], [], {}

    def __getattr__(self, name: str):
        return getattr(self.launcher, name)

    def launch(self, name: str, grid: int, block: int, smem: int, args: tuple) -> None:
        self.kernels.append((name, grid, block, smem))
        self.args.append(args)
        if name.startswith("ktae::group_kernel") and args[0].n_items and getattr(self.launcher, "on_host", False):
            # read now (host memory: the emulator): the tensor is freed later
            self._groups[len(self.kernels) - 1] = list((ctypes.c_int64 * args[0].n_items).from_address(args[0].block_group))
        self.launcher.launch(name, grid, block, smem, args)

    def names(self) -> list[str]:
        """The kernels launched, in order."""
        return [name for name, *_ in self.kernels]

    @property
    def launches(self) -> list[tuple]:
        """Each rows-kernel pass as (mode, shared table, groups: read from host memory at the launch, so on
        the emulator only), and each ``advantage`` call as ("advantage", shared pass, global-pass blocks)."""
        out: list[tuple] = []
        for i, (name, grid, *_) in enumerate(self.kernels):
            if rows := re.fullmatch(r"ktae::group_kernel<(\d), (true|false)>", name):
                out.append((int(rows.group(1)), rows.group(2) == "true", self._groups.get(i, [])))
            elif name == "ktae::groups_kernel":
                out.append(["advantage", False, 0])
            elif name == "ktae::dynamic_kernel<true>":
                out[-1][1] = True
            elif name == "ktae::dynamic_kernel<false>":
                out[-1][2] = grid
        return [tuple(x) for x in out]

    def _advantage_args(self) -> list:
        """The KernelArgs of each ``advantage`` call's table passes (one struct a call)."""
        seen: dict = {}
        for (name, *_), args in zip(self.kernels, self.args):
            if name.startswith("ktae::dynamic_kernel"):
                seen.setdefault(id(args[0]), args[0])
        return list(seen.values())

    @property
    def tables(self) -> list[tuple[bool, bool]]:
        """Per ``advantage`` call: whether it got the grid, and the log-factorials."""
        return [(bool(a.table_values), bool(a.log_factorial)) for a in self._advantage_args()]

    @property
    def given_rows(self) -> list[int]:
        """Per ``advantage`` call given the rows' scores: how many rows."""
        return [a.n_rows for a in self._advantage_args() if a.use_given]

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Per ``advantage`` call: its shared pass's bytes (0: none) and threads per block (its scan's)."""
        out: list[list[int]] = []
        for name, _, block, smem in self.kernels:
            if name == "ktae::scan_kernel":
                out.append([0, block])
            elif name == "ktae::dynamic_kernel<true>":
                out[-1][0] = smem
        return [tuple(x) for x in out]
