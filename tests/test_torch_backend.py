"""The vectorised torch backend against the scipy reference on random and adversarial batches."""
import os
import subprocess
import sys

import pytest
import torch

from cases import adversarial_cases, assert_scores_match, random_cases
from ktae_kernels import KTAEConfig, key_token_scores, token_advantage

CASES = random_cases(seed=0) + adversarial_cases()
CONFIGS = {
    "default": KTAEConfig(),
    "upstream": KTAEConfig(fisher="upstream"),
    "no-tf-ignore": KTAEConfig(use_tf=False, ignore_token_ids=(3, 5, 151643)),
    "weights": KTAEConfig(alpha=0.5, beta=2.0, top=0.3, k1=1.2, b=0.75, weight=0.5, baseline="mean",
                          correct_threshold=0.5),
}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_reference(case, config):
    _, responses, mask, rewards, index = case
    expected = key_token_scores(responses, mask, rewards, index, config=config, backend="reference")
    actual = key_token_scores(responses, mask, rewards, index, config=config, backend="torch")
    assert_scores_match(expected, actual)
    adv_ref = token_advantage(responses, mask, rewards, index, config=config, backend="reference")
    adv = token_advantage(responses, mask, rewards, index, config=config, backend="torch")
    torch.testing.assert_close(adv, adv_ref, rtol=0, atol=1e-6)
    assert torch.isfinite(adv).all()


def test_degenerate_rows_score_zero():
    cases = {name: rest for name, *rest in adversarial_cases()}
    r, m, w, i = cases["all-correct-and-all-wrong-groups"]
    res = key_token_scores(r, m, w, i, backend="torch")
    mixed = res.group == 2
    assert torch.all(res.score[~mixed] == 0) and torch.all(res.F[~mixed] == 0) and torch.all(res.IG[~mixed] == 0)
    assert torch.any(res.score[mixed] != 0)
    r, m, w, i = cases["token-in-every-rollout"]
    res = key_token_scores(r, m, w, i, backend="torch")
    everywhere = res.token == 5
    assert torch.all(res.p_value[everywhere] == 1) and torch.all(res.score[everywhere] == 0)


def test_rows_are_sparse_and_sorted():
    _, r, m, w, i = random_cases(seed=3)[2]  # Qwen-sized vocabulary
    res = key_token_scores(r, m, w, i, backend="torch")
    key = res.group * 2**31 + res.token
    assert torch.all(key[1:] > key[:-1])
    assert len(res) == len({(int(g), int(t)) for g, t in zip(i[:, None].expand_as(r)[m], r[m])})
    assert torch.equal(res.a + res.c, res.n_c[res.group]) and torch.equal(res.b + res.d, res.n_w[res.group])


def test_group_sums_on_the_cpu_match_index_add():
    """``primitives.group_sum`` runs numpy on the CPU (bool values counted by selection, others as
    bincount weights): the dtype and the bits of ``index_add_``, the GPU path, for every kind of value and
    an empty group."""
    from ktae_kernels.primitives import group_sum

    gen = torch.Generator().manual_seed(3)
    group = torch.randint(0, 6, (300,), generator=gen)
    group[group == 4] = 5  # group 4 has no rollout
    for values in (None, torch.rand(300, generator=gen) < 0.4, torch.randint(-9, 9, (300,), generator=gen),
                   torch.randn(300, generator=gen), torch.randn(300, generator=gen).double()):
        floating = values is not None and values.dtype.is_floating_point
        dtype = torch.float64 if floating else torch.int64
        source = torch.ones_like(group) if values is None else values.to(dtype)
        expected = torch.zeros(7, dtype=dtype).index_add_(0, group, source)
        got = group_sum(group, 7, values)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def _one_big_group(G: int, vocab: int = 50):
    gen = torch.Generator().manual_seed(G)
    responses = torch.randint(0, vocab, (G, 8), generator=gen)
    rewards = (torch.rand(G, generator=gen) > 0.5).double()
    return responses, torch.ones_like(responses, dtype=torch.bool), rewards, torch.zeros(G, dtype=torch.int64)


@pytest.mark.parametrize("fisher", ["exact", "upstream"])
def test_a_group_of_thousands_of_rollouts_matches_reference_through_the_sorted_tables(fisher, monkeypatch):
    """Past ``DENSE_GRID_PER_ROW`` grid entries per row, the rows' distinct tables come from a sort: the
    same scores as the reference, and as the bool-mask path forced on the same batch."""
    from ktae_kernels import method

    batch, config = _one_big_group(1500), KTAEConfig(fisher=fisher)
    grid_rows = 751 * 751 / (50 * 8)  # about (G/2 + 1)^2 entries for at most 50 rows
    assert grid_rows > method.DENSE_GRID_PER_ROW
    monkeypatch.setattr(method, "DENSE_GRID_MIN", 0)
    sorted_tables = key_token_scores(*batch, config=config, backend="torch")
    assert_scores_match(key_token_scores(*batch, config=config, backend="reference"), sorted_tables)
    monkeypatch.setattr(method, "DENSE_GRID_PER_ROW", 10**9)
    assert_scores_match(key_token_scores(*batch, config=config, backend="torch"), sorted_tables, p_rtol=0, atol=0)


def big_group_peak_growth_mb(backend: str, fisher: str = "exact") -> int:
    """MB that one ``token_advantage`` call on a group of 8,000 short rollouts adds to the peak RSS of a fresh
    process (after a warm-up call on a small group)."""
    code = ("import resource, torch, test_torch_backend as t; from ktae_kernels import KTAEConfig, token_advantage\n"
            f"config, backend = KTAEConfig(fisher={fisher!r}), {backend!r}\n"
            "batch = t._one_big_group(8000); token_advantage(*t._one_big_group(16), config=config, backend=backend)\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "token_advantage(*batch, config=config, backend=backend)\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=env).stdout)


def test_memory_does_not_grow_with_the_tables_a_group_could_have():
    """One group of 8,000 rollouts could have 16 million tables; a call's peak memory stays with its rows
    (tens of MB), in a fresh process."""
    grown_mb = big_group_peak_growth_mb("torch")
    assert grown_mb < 100, grown_mb
