"""The Triton Fisher kernel against scipy.stats.fisher_exact (two-sided), on CUDA or in the interpreter."""
import numpy as np
import pytest
import torch

from cases import ktae_tables, scipy_pvalues, symmetric_tie_tables, triton_devices

pytest.importorskip("triton")
DEVICES = triton_devices()
if not DEVICES:
    pytest.skip("the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from ktae_kernels.triton import fisher_exact_pvalues  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def kernel_p(tables: np.ndarray, device: str) -> np.ndarray:
    t = torch.as_tensor(np.asarray(tables), dtype=torch.int64, device=device)
    p = fisher_exact_pvalues(t[:, 0], t[:, 1], t[:, 2], t[:, 3])
    assert p.dtype == torch.float64 and p.device.type == device
    return p.cpu().numpy()


def test_every_ktae_table_up_to_16_rollouts(device):
    tables = ktae_tables(16)
    np.testing.assert_allclose(kernel_p(tables, device), scipy_pvalues(tables), rtol=1e-9, atol=0)


def test_random_small_tables(device):
    tables = np.random.default_rng(0).integers(0, 15, size=(3000, 4))
    np.testing.assert_allclose(kernel_p(tables, device), scipy_pvalues(tables), rtol=1e-9, atol=0)


def test_symmetric_ties(device):
    """Tables whose support holds exact mirror images of the observed one: the tolerance decides."""
    tables = symmetric_tie_tables(np.random.default_rng(1), 500, 120)
    np.testing.assert_allclose(kernel_p(tables, device), scipy_pvalues(tables), rtol=1e-9, atol=0)


def test_large_counts(device):
    """Margins up to 10^5 (support kept short for the interpreter), and a few supports of ~1000 tables."""
    rng = np.random.default_rng(2)
    n = rng.integers(1000, 100_000, size=400)
    col = rng.integers(0, 30, size=400)
    a = rng.integers(0, col + 1)
    skewed = np.stack([a, n - a, col - a, rng.integers(0, 100_000, size=400)], 1)
    m = rng.integers(1000, 2000, size=8)
    wide = np.stack([m // 2, m // 2 + 7, m // 3, m // 2], 1)
    tables = np.concatenate([skewed, wide])
    p, ref = kernel_p(tables, device), scipy_pvalues(tables)
    normal = ref > 1e-290  # scipy's own values lose precision in the subnormal range
    np.testing.assert_allclose(p[normal], ref[normal], rtol=1e-9, atol=0)
    assert np.all(p[~normal] < 1e-280)


def test_degenerate_margins_are_one(device):
    tables = np.array([(0, 0, 3, 4), (3, 4, 0, 0), (0, 5, 0, 7), (2, 0, 9, 0), (0, 0, 0, 0)])
    np.testing.assert_array_equal(kernel_p(tables, device), 1.0)


def test_empty_input(device):
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    assert fisher_exact_pvalues(empty, empty, empty, empty).shape == (0,)
