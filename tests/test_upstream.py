"""fisher="upstream" reproduces the published algorithm (bench/upstream_style.py), quirks included."""
import numpy as np
import pytest
import torch

from bench.upstream_style import upstream_token_advantage
from cases import make_batch
from ktae_kernels import KTAEConfig, token_advantage


def batches():
    rng = np.random.default_rng(7)
    for sizes, length, vocab, zipf in [([16, 16], 200, 151936, True), ([8] * 3, 60, 40, False),
                                       ([4, 16, 5], 120, 3000, False), ([16], 300, 151936, True)]:
        yield make_batch(rng, sizes, length, vocab, zipf=zipf, shuffle=True)


@pytest.mark.parametrize("config", [KTAEConfig(fisher="upstream"),
                                    KTAEConfig(fisher="upstream", alpha=2.0, beta=0.5, use_tf=False),
                                    KTAEConfig(fisher="upstream", ignore_token_ids=(151643, 3))])
def test_upstream_mode_matches_published_algorithm(config):
    for responses, mask, rewards, index in batches():
        expected = upstream_token_advantage(responses, mask, rewards, index, config)
        for backend in ("reference", "torch"):
            actual = token_advantage(responses, mask, rewards, index, config=config, backend=backend)
            torch.testing.assert_close(actual, expected, rtol=0, atol=2e-6)


def test_exact_mode_differs_where_upstream_is_wrong():
    """The point of fisher="exact": a sizeable share of upstream token scores move."""
    moved = []
    for responses, mask, rewards, index in batches():
        up = token_advantage(responses, mask, rewards, index, config=KTAEConfig(fisher="upstream"))
        ex = token_advantage(responses, mask, rewards, index)
        moved.append(((up - ex).abs()[mask] > 1e-4).float().mean().item())
    assert 0.05 < np.mean(moved) < 0.9
