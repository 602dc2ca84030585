"""A cuda launcher (the device's, or the emulator) with every launch recorded, for the cuda tests."""
from __future__ import annotations



class Recorder:
    """``launcher`` with each launch recorded in ``kernels`` as (kernel name, grid, block, shared bytes)
    and its argument structs in ``args``."""

    def __init__(self, launcher) -> None:
        self.launcher, self.kernels, self.args = launcher, [], []

    def __getattr__(self, name: str):
        return getattr(self.launcher, name)

    def launch(self, name: str, grid: int, block: int, smem: int, args: tuple) -> None:
        self.kernels.append((name, grid, block, smem))
        self.args.append(args)
        self.launcher.launch(name, grid, block, smem, args)

    def names(self) -> list[str]:
        """The kernels launched, in order."""
        return [name for name, *_ in self.kernels]

    @property
    def launches(self) -> list[tuple]:
        """Each call of the passes as (mode: "advantage", "count" or "rows"; whether a shared-table pass ran;
        the global pass's blocks, 0: none)."""
        modes = {0: "advantage", 1: "count", 2: "rows"}
        out: list[list] = []
        for (name, grid, *_), args in zip(self.kernels, self.args):
            if name == "ktae::groups_kernel":
                out.append(["advantage", False, 0])
            elif name == "ktae::dynamic_kernel<true>":
                out[-1][:2] = modes[args[0].mode], True
            elif name == "ktae::dynamic_kernel<false>":
                out[-1][0], out[-1][2] = modes[args[0].mode], grid
        return [tuple(x) for x in out]

    def _advantage_args(self) -> list:
        """The KernelArgs of each advantage-mode call's table passes (one struct a call)."""
        seen: dict = {}
        for (name, *_), args in zip(self.kernels, self.args):
            if name.startswith("ktae::dynamic_kernel") and args[0].mode == 0:  # kAdvantage
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
