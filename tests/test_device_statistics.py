"""The per-table statistics computed on the device (``backends/device.py``: the grid's layout and the
``DeviceState`` that keeps it; ``backends/triton/statistics.py``: the kernel), against ``method``.

The Triton kernel runs on CUDA, or on CPU in Triton's interpreter (tests/conftest.py); the CUDA
kernel's version of the same checks is in test_cuda_emulation.py. The closeness claimed is in
tests/statistics_cases.py.
"""
import math

import pytest
import torch

from ktae_kernels import KTAEConfig
from ktae_kernels.backends import device as device_state
from ktae_kernels.backends.device import grid_bound, grid_index, grid_size, grid_tables
from statistics_cases import assert_matches_method, big_tables, with_last_bit_noise


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


CONFIGS = [KTAEConfig(), KTAEConfig(alpha=0.5, beta=2.0)]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "alpha0.5-beta2"])
def test_every_table_up_to_16_rollouts(config, device):
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    grid = grid_tables(16, device)
    assert_matches_method(grid_statistics_kernel(grid, config.alpha, config.beta), grid, config)


def test_random_big_tables_and_ties(device):
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    grid = big_tables(seed=0, count=96 if device.type == "cpu" else 4000)
    grid = device_state.tables_of(grid.cells.to(device), grid.bound)
    assert_matches_method(grid_statistics_kernel(grid, 1.0, 1.0), grid, KTAEConfig())


def test_the_kernel_is_checked_against_its_own_tables(device):
    """A GPU's log-factorials and angles differ from the CPU's in the last bits (libdevice): with a
    third of the angles and a quarter of the log-factorials one ulp off, the kernel still matches the
    reference built from those tables, and h stays within ``H_ULPS`` of the CPU's."""
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    for grid in (grid_tables(16, device), big_tables(seed=1, count=64)):
        noisy = with_last_bit_noise(device_state.tables_of(grid.cells.to(device), grid.bound))
        assert not torch.equal(noisy.angle, grid.angle.to(device))
        assert_matches_method(grid_statistics_kernel(noisy, 1.0, 1.0), noisy, KTAEConfig())


def test_grids_are_made_once_per_device_and_parameters(device):
    """One kernel run per (kernel, alpha, beta, bound); a hit computes nothing; ``clear`` forgets them."""
    from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

    runs = []

    def counting(grid, alpha, beta):
        runs.append(grid.bound)
        return grid_statistics_kernel(grid, alpha, beta)

    state = device_state.state(device)
    values = state.grid(counting, 1.0, 1.0, 16)
    assert state.grid(counting, 1.0, 1.0, 16) is values and runs == [16]
    assert values.shape == (5, grid_size(16)) and values.device.type == device.type
    state.grid(counting, 0.5, 1.0, 16)
    assert runs == [16, 16]
    state.clear(cached=False)  # the lessons only
    assert state.grid(counting, 1.0, 1.0, 16) is values
    state.clear()
    assert state.grid(counting, 1.0, 1.0, 16) is not values and runs == [16, 16, 16]


def test_the_state_is_bounded_and_learns_the_most_seen():
    """At most ``CACHED`` tensors and ``LEARNT`` layouts are kept (the least recently used go); a layout
    keeps the most of each figure it was taught, and a call that counted nothing teaches nothing."""
    state = device_state.DeviceState(torch.device("cpu"))
    made = [state.constant((float(i),), torch.float64) for i in range(state.CACHED + 5)]
    assert state.constant((float(state.CACHED + 4),), torch.float64) is made[-1]
    assert state.constant((0.0,), torch.float64) is not made[0]  # evicted, made again
    for i in range(state.LEARNT + 1):
        state.learn(("triton", i, 1), largest=2, distinct=3)
    assert state.learnt(("triton", 0, 1)) is None and state.learnt(("triton", 1, 1)) is not None
    state.learn("key", largest=16, distinct=40, shared_need=100)
    state.learn("key", largest=8, distinct=50)
    state.learn("key", largest=99, distinct=0)
    assert state.learnt("key") == device_state.Learnt(16, 50, 100)


def test_log_factorials_are_cached_by_power_of_two():
    from ktae_kernels.fisher import log_factorial_table

    state = device_state.DeviceState(torch.device("cpu"))
    table = state.log_factorials(1025)
    assert table.shape == (2048,) and state.log_factorials(2000) is table
    assert torch.equal(table[:1026], log_factorial_table(1025, "cpu"))
    assert state.log_factorials(3).shape == (16,) and state.log_factorials(16).shape == (32,)
