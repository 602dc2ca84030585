"""The per-table statistics computed on the device (``backends/device.py`` grid layout and cache,
``backends/triton/statistics.py`` kernel), against ``method.table_statistics``.

The Triton kernel runs on CUDA, or on CPU in Triton's interpreter (tests/conftest.py); the CUDA
kernel's version of the same checks is in test_cuda_emulation.py. The closeness claimed is in
tests/statistics_cases.py: IG and h bitwise, the p = 1 / F = 0 classification exact, p, F and
strength within 4e-15 relative.
"""
import math

import pytest
import torch

from cases import triton_devices
from ktae_kernels import KTAEConfig
from ktae_kernels.backends import device as device_helpers
from ktae_kernels.backends.device import grid_bound, grid_index, grid_size, grid_tables
from statistics_cases import assert_matches_method, big_tables


def test_grid_index_is_the_closed_form_of_the_enumeration():
    """Every block (n_c, n_w) with n_c + n_w <= 16: its tables (a, b) sit at offset + a * stride + b."""
    grid = grid_tables(16, torch.device("cpu"))
    assert grid.size == grid_size(16) == math.comb(20, 4) == 4845
    n_c, n_w = torch.tensor([(c, n - c) for n in range(17) for c in range(n + 1)]).T
    offset, stride = grid_index(n_c, n_w)
    seen = torch.zeros(grid.size, dtype=torch.int64)
    for c, w, o, s in zip(n_c.tolist(), n_w.tolist(), offset.tolist(), stride.tolist()):
        a, b = torch.meshgrid(torch.arange(c + 1), torch.arange(w + 1), indexing="ij")
        entry = (o + a * s + b).flatten()
        assert torch.equal(grid.cells[:, entry].long(), torch.stack([a.flatten(), b.flatten(),
                                                                     torch.full_like(entry, c), torch.full_like(entry, w)]))
        seen[entry] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # a partition: no entry shared, none left out
    # the offsets do not depend on the bound: the grid of 32 starts with the grid of 16
    assert torch.equal(grid_tables(32, torch.device("cpu")).cells[:, : grid.size], grid.cells)


def test_grid_bound_buckets_by_powers_of_two_up_to_the_limit():
    assert [grid_bound(g) for g in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert grid_bound(65) is None and grid_bound(1024) is None


triton = pytest.importorskip("triton")
DEVICES = triton_devices()
needs_triton = pytest.mark.skipif(not DEVICES, reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


CONFIGS = [KTAEConfig(), KTAEConfig(alpha=0.5, beta=2.0)]


@needs_triton
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "alpha0.5-beta2"])
def test_every_table_up_to_16_rollouts(config, device):
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    grid = grid_tables(16, device)
    assert_matches_method(grid_statistics_kernel(grid, config.alpha, config.beta), grid, config)


@needs_triton
def test_random_big_tables_and_ties(device):
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    grid = big_tables(seed=0, count=96 if device.type == "cpu" else 4000)
    grid = device_helpers.tables_of(grid.cells.to(device), grid.bound)
    assert_matches_method(grid_statistics_kernel(grid, 1.0, 1.0), grid, KTAEConfig())


@needs_triton
def test_grid_statistics_is_cached_on_the_device(device, monkeypatch):
    """One kernel run per (kernel, alpha, beta, bound, device); a hit computes nothing on the host."""
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    monkeypatch.setattr(device_helpers, "_GRID_CACHE", type(device_helpers._GRID_CACHE)())
    runs = []

    def counting(grid, alpha, beta):
        runs.append(grid.bound)
        return grid_statistics_kernel(grid, alpha, beta)

    n_c, n_w = torch.tensor([3, 8, 0], device=device), torch.tensor([13, 8, 5], device=device)
    config = KTAEConfig()
    index, values = device_helpers.grid_statistics(n_c, n_w, 16, config, device, counting)
    again = device_helpers.grid_statistics(n_c + 1, n_w - 1, 12, KTAEConfig(k1=1.5), device, counting)
    assert runs == [16] and again[1] is values  # k1 does not change the table statistics
    assert torch.equal(index, grid_index(n_c, n_w)) and values.device.type == device.type
    assert device_helpers.grid_statistics(n_c, n_w, 16, KTAEConfig(fisher="upstream"), device, counting) is None
    assert device_helpers.grid_statistics(n_c, n_w, 65, config, device, counting) is None
    assert runs == [16]


def test_grid_values_is_the_cached_grid_and_grid_statistics_uses_it(monkeypatch):
    """``grid_values`` (the CUDA backend's lookup: no index ops) and ``grid_statistics`` share one
    cache entry; a second call computes nothing."""
    from collections import OrderedDict

    monkeypatch.setattr(device_helpers, "_GRID_CACHE", OrderedDict())
    calls = []

    def kernel(grid, alpha, beta):
        calls.append(grid.size)
        return torch.zeros(5, grid.size, dtype=torch.float64)

    cpu = torch.device("cpu")
    values = device_helpers.grid_values(16, KTAEConfig(), cpu, kernel)
    index, again = device_helpers.grid_statistics(torch.tensor([2]), torch.tensor([3]), 5, KTAEConfig(), cpu, kernel)
    assert again is values and calls == [4845]
    assert index.tolist() == [[int(grid_index(torch.tensor([2]), torch.tensor([3]))[0])], [4]]
    assert not device_helpers.capturing(cpu)


def test_log_factorials_are_cached_by_power_of_two(monkeypatch):
    from ktae_kernels.fisher import log_factorial_table

    monkeypatch.setattr(device_helpers, "_LF_CACHE", {})
    cpu = torch.device("cpu")
    table = device_helpers.log_factorials(1025, cpu)
    assert table.shape == (2048,) and device_helpers.log_factorials(2000, cpu) is table
    assert torch.equal(table[:1026], log_factorial_table(1025, cpu))
    assert device_helpers.log_factorials(3, cpu).shape == (16,)
