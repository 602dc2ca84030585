"""Tables and the comparison shared by the device statistics tests (Triton: test_device_statistics.py,
CUDA emulator: test_cuda_emulation.py): a kernel's ``[5, size]`` output against
``method.table_statistics``, the CPU reference-grade source.

What is compared, and how closely:
- ``IG`` and Cohen's ``h``: bitwise (the same operations in the same order on the same inputs);
- which tables have ``p = 1`` and ``F = 0`` (the tie test and the ``p >= 1 - 1e-12`` rule): exactly;
- ``p``, ``F`` and ``strength``: within ``P_RTOL`` relative, plus an ulp of the log-pmfs' magnitude
  (``p_rtol``: it matters for big groups). The log-pmfs are bitwise the CPU's, but ``p = exp(lse(kept) -
  lse(all))`` sums over the support in another order than torch's vectorised reduction and goes
  through another ``exp`` / ``log`` (numpy's or libdevice's against torch's), and each ``lse`` is
  rounded to an ulp of its magnitude (about ``log(n!)``): measured at most 2.3e-15 relative on the
  G <= 16 grid and 4.5e-13 on random tables of up to 1024 rollouts (2026-12-03).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ktae_kernels import KTAEConfig, method
from ktae_kernels.backends.device import GridTables, tables_of

#: relative tolerance of p, F and strength (about 18 ulps; see the module docstring).
P_RTOL = 4e-15


def reference_values(grid: GridTables, config: KTAEConfig) -> Tensor:
    """float64 ``[5, size]``: ``method.table_statistics`` of the grid's tables (on the CPU)."""
    a, b, n_c, n_w = grid.cells.long().cpu()
    table = method.TableGrid(offset=a[:0], stride=a[:0], a=a, b=b, n_c=n_c, n_w=n_w, width=torch.zeros_like(a))
    stats = method.table_statistics(table, config)
    return torch.stack([stats.p_value, stats.F, stats.IG, stats.h, stats.strength])


def p_rtol(grid: GridTables) -> Tensor:
    """float64 ``[size]``: the relative tolerance of each table's ``p``, ``F`` and ``strength``:
    ``P_RTOL`` plus an ulp of ``log(n!)``, the magnitude the two log-sum-exps are rounded at."""
    n = (grid.cells[2] + grid.cells[3]).cpu().double()
    return P_RTOL + torch.finfo(torch.float64).eps * torch.lgamma(n + 1)


def assert_matches_method(values: Tensor, grid: GridTables, config: KTAEConfig) -> None:
    """``values`` (a kernel's ``[5, size]``) against ``reference_values`` (see the module docstring)."""
    got, want = values.cpu(), reference_values(grid, config)
    assert got.shape == want.shape == (5, grid.size)
    p, F, IG, h, strength = got
    assert torch.equal(IG, want[2]), "IG must be bitwise the CPU's"
    assert torch.equal(h, want[3]), "Cohen's h must be bitwise the CPU's"
    assert torch.equal(p == 1.0, want[0] == 1.0), "the tie test must classify p = 1 as on the CPU"
    assert torch.equal(F == 0.0, want[1] == 0.0), "the F = 0 rule must fire where it does on the CPU"
    rtol = p_rtol(grid)
    for name, x, y in (("p", p, want[0]), ("F", F, want[1]), ("strength", strength, want[4])):
        excess = (x - y).abs() - rtol * y.abs()
        worst = int(excess.argmax()) if excess.numel() else 0
        assert not (excess > 0).any(), (f"{name}: {int((excess > 0).sum())} tables off, worst table "
                                         f"{grid.cells[:, worst].tolist()}: {x[worst].item()!r} vs {y[worst].item()!r}")


def big_tables(seed: int, count: int = 400, largest: int = 1024) -> GridTables:
    """Random tables of groups of up to ``largest`` rollouts, half of them ties: ``n_c = n_w`` and
    ``a + b = n_c``, whose mirror table ``(b, a)`` has the same probability."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(2, largest + 1, (count,), generator=g)
    n_c = (torch.rand(count, generator=g) * (n + 1)).long().clamp(max=n)
    n_c[: count // 2] = n[: count // 2] // 2
    n_w = n - n_c
    a = (torch.rand(count, generator=g) * (n_c + 1)).long().clamp(max=n_c)
    b = (torch.rand(count, generator=g) * (n_w + 1)).long().clamp(max=n_w)
    b[: count // 2] = (n_c - a)[: count // 2].clamp(max=n_w[: count // 2])
    return tables_of(torch.stack([a, b, n_c, n_w]), largest)
