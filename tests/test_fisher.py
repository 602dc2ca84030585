"""fisher_exact_pvalue against scipy.stats.fisher_exact, and the upstream float32 mode."""
import itertools

import numpy as np
import pytest
import torch

from cases import ktae_tables, scipy_pvalues, symmetric_tie_tables
from ktae_kernels import fisher_exact_pvalue
from ktae_kernels.fisher import fisher_weight, upstream_pvalue


def ours(tables: np.ndarray) -> np.ndarray:
    t = torch.as_tensor(tables, dtype=torch.int64)
    return fisher_exact_pvalue(t[:, 0], t[:, 1], t[:, 2], t[:, 3]).numpy()


def assert_matches_scipy(tables: np.ndarray, rtol: float = 1e-9) -> None:
    np.testing.assert_allclose(ours(tables), scipy_pvalues(tables), rtol=rtol, atol=0)


def test_every_ktae_table_up_to_16_rollouts():
    assert_matches_scipy(ktae_tables(16))


def test_random_small_tables():
    assert_matches_scipy(np.random.default_rng(0).integers(0, 15, size=(3000, 4)))


def test_symmetric_ties():
    assert_matches_scipy(symmetric_tie_tables(np.random.default_rng(1), 700, 300))


def test_large_counts():
    rng = np.random.default_rng(2)
    n = rng.integers(1000, 100_000, size=300)
    a, b = rng.binomial(n, 0.5), rng.binomial(n, 0.5)
    tables = np.concatenate([np.stack([a, n - a, b, n - b], 1), rng.integers(0, 100_001, size=(200, 4))])
    p, ref = ours(tables), scipy_pvalues(tables)
    normal = ref > 1e-290  # scipy's own values lose precision in the subnormal range
    np.testing.assert_allclose(p[normal], ref[normal], rtol=1e-9, atol=0)
    assert np.all(p[~normal] < 1e-280)


def test_degenerate_margins_are_one():
    tables = np.array([(0, 0, 3, 4), (3, 4, 0, 0), (0, 5, 0, 7), (2, 0, 9, 0), (0, 0, 0, 0)])
    np.testing.assert_array_equal(ours(tables), 1.0)


def test_broadcasting_and_device_of_inputs():
    p = fisher_exact_pvalue(torch.tensor([[1], [2]]), 3, torch.tensor([4, 5, 6]), 0)
    assert p.shape == (2, 3) and p.dtype == torch.float64
    np.testing.assert_allclose(p.numpy().ravel(), scipy_pvalues(np.array(
        [(a, 3, c, 0) for a, c in itertools.product([1, 2], [4, 5, 6])])), rtol=1e-12)


@pytest.mark.parametrize("bad", [[-1], [1.5], [float("nan")], torch.tensor([True])])
def test_rejects_non_counts(bad):
    with pytest.raises(ValueError, match="`a`"):
        fisher_exact_pvalue(bad, [1], [1], [1])


def test_fisher_weight_rule():
    p = torch.tensor([0.0, 0.5, 1.0 - 1e-13, 1.0], dtype=torch.float64)
    torch.testing.assert_close(fisher_weight(p), torch.tensor([1.0, np.exp(-1.0), 0.0, 0.0], dtype=torch.float64))


def test_upstream_mode_is_float32_without_tolerance():
    """The published code's float32 sums: p often misses 1.0 exactly, and ties can be misclassified."""
    tables = np.array([(a, b, 8 - a, 8 - b) for a in range(9) for b in range(9)])
    t = torch.as_tensor(tables)
    width = torch.full((len(tables),), 9)
    p32 = upstream_pvalue(t[:, 0], t[:, 1], t[:, 2], t[:, 3], width)
    assert p32.dtype == torch.float32
    exact = scipy_pvalues(tables)
    np.testing.assert_allclose(p32.double().numpy(), exact, atol=0.5)  # close, but not exact
    assert np.sum(exact == 1.0) > np.sum(p32.numpy() == 1.0)


@pytest.mark.parametrize("cells, message", [
    (([1, 2], [1, 2, 3], 1, 1), r"^fisher_exact_pvalue: `a`, `b`, `c`, `d` must broadcast to one shape, got shapes "
                                r"\(2,\), \(3,\), \(\), \(\)$"),
    ((None, 1, 1, 1), r"^fisher_exact_pvalue: `a` must be an integer tensor, numpy array, list or int, got NoneType$"),
    ((1, "3", 1, 1), r"^fisher_exact_pvalue: `b` must be an integer tensor, numpy array, list or int, got str$"),
    ((1, 1, [[1], [2, 3]], 1), r"^fisher_exact_pvalue: `c` must be a rectangular array"),
    ((1, 1, 1, [1, None]), r"^fisher_exact_pvalue: `d` must hold numbers, found None"),
])
def test_bad_cells_are_named(cells, message):
    with pytest.raises(ValueError, match=message):
        fisher_exact_pvalue(*cells)
