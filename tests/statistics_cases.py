"""Tables and the comparison shared by the device statistics tests (Triton: test_device_statistics.py,
CUDA emulator: test_cuda_emulation.py, GPU: test_gpu_backends.py): a kernel's ``[5, size]`` output
against ``method``'s formulas.

A kernel reads a grid's log-factorial and angle tables, which the device computes (``torch.lgamma``,
``asin``), and takes logs and exps itself. On a GPU those come from libdevice, whose ``lgamma``,
``asin`` and ``log`` differ from the CPU's in the last bits. So the reference is built from the
device's own tables, and each statistic is held to what its inputs allow:
- ``p``, and which tables have ``p = 1`` and ``F = 0`` (the tie test and the ``p >= 1 - 1e-12`` rule):
  ``fisher.exact_pvalue_flat`` on the device's log-factorials; the classification exactly, ``p``, ``F``
  and ``strength`` within ``P_RTOL`` relative plus an ulp of the log-pmfs' magnitude (``p_rtol``): the
  kernel sums the support in another order than torch's reduction and rounds each log-sum-exp to an
  ulp of about ``log(n!)``;
- Cohen's ``h``: bitwise the difference of the device's two angles, and within ``H_ULPS`` ulps of pi / 2
  of ``method.cohen_h`` (each angle within two ulps of the CPU's ``asin``);
- ``IG``: within ``IG_ULPS`` ulps of 1 bit of ``method.information_gain`` (each entropy term is at most
  1 bit; the kernel's ``log`` is libdevice's on a GPU and numpy's in the interpreter, not torch's).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ktae_kernels import KTAEConfig, method
from ktae_kernels.backends.device import GridTables, tables_of
from ktae_kernels.fisher import exact_pvalue_flat, fisher_weight

#: relative tolerance of p, F and strength (about 18 ulps; see the module docstring).
P_RTOL = 4e-15
#: ulps (of values in [1, 2): 2**-52) that h may differ from the CPU's by: two for each angle.
H_ULPS = 4
#: ulps of 1 bit that IG may differ from the CPU's by (another log: libdevice's, numpy's).
IG_ULPS = 8
_ULP = 2.0**-52


def reference_values(grid: GridTables, config: KTAEConfig) -> Tensor:
    """float64 ``[5, size]``: ``p_value, F, IG, h, strength`` of the grid's tables on the CPU, ``p`` from the
    grid's own log-factorials and ``h`` from its own angles."""
    a, b, n_c, n_w = grid.cells.long().cpu()
    p = exact_pvalue_flat(a, b, n_c - a, n_w - b, log_factorial=grid.log_factorial.cpu())
    informative = method.informative_rows(a, b, n_c, n_w)
    F = torch.where(informative, fisher_weight(p), 0.0)
    IG = torch.where(informative, method.information_gain(a, b, n_c, n_w), 0.0)
    angle = grid.angle.cpu()
    h = angle[n_c * (n_c + 1) // 2 + a] - angle[n_w * (n_w + 1) // 2 + b]
    return torch.stack([p, F, IG, h, config.alpha * F + config.beta * IG])


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
    a, b, n_c, n_w = grid.cells.long().cpu()
    assert torch.equal(h, want[3]), "Cohen's h must be the difference of the device's angles"
    assert bool(((h - method.cohen_h(a, b, n_c, n_w)).abs() <= H_ULPS * _ULP).all()), "h: angles off the CPU's"
    assert bool(((IG - want[2]).abs() <= IG_ULPS * _ULP).all()), f"IG off by more than {IG_ULPS} ulps of 1 bit"
    assert torch.equal(p == 1.0, want[0] == 1.0), "the tie test must classify p = 1 as the reference"
    assert torch.equal(F == 0.0, want[1] == 0.0), "the F = 0 rule must fire where it does in the reference"
    rtol = p_rtol(grid)
    for name, x, y in (("p", p, want[0]), ("F", F, want[1]), ("strength", strength, want[4])):
        excess = (x - y).abs() - rtol * y.abs() - (IG_ULPS * _ULP * config.beta if name == "strength" else 0.0)
        worst = int(excess.argmax()) if excess.numel() else 0
        assert not (excess > 0).any(), (f"{name}: {int((excess > 0).sum())} tables off, worst table "
                                         f"{grid.cells[:, worst].tolist()}: {x[worst].item()!r} vs {y[worst].item()!r}")


def with_last_bit_noise(grid: GridTables, seed: int = 0) -> GridTables:
    """``grid`` with a third of its angles and a quarter of its log-factorials one ulp off, up or down:
    the tables a GPU's libdevice ``asin`` and ``lgamma`` give (the kernels must be checked against
    their inputs, not against the CPU's bits)."""
    g = torch.Generator().manual_seed(seed)

    def nudge(t: Tensor, share: float) -> Tensor:
        hit = (torch.rand(t.shape, generator=g) < share) & (t.cpu() != 0)  # drawn on the CPU, as `g`
        towards = torch.where(torch.rand(t.shape, generator=g) < 0.5, math.inf, -math.inf).to(t.dtype)
        return torch.where(hit.to(t.device), torch.nextafter(t, towards.to(t.device)), t)

    return GridTables(grid.bound, grid.size, grid.cells, nudge(grid.log_factorial, 0.25), nudge(grid.angle, 1 / 3))


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
