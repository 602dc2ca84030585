"""Worked examples computed by hand from the method's formulas, independent of every backend."""
import math

import pytest
import torch
from scipy.stats import fisher_exact

from ktae_kernels import KTAEConfig, key_token_scores, token_advantage

BACKENDS = ["reference", "torch"]


def h2(p: float) -> float:
    return -sum(q * math.log2(q) for q in (p, 1 - p) if q > 0)


def expected_score(a, b, f_c, f_w, n_c, n_w, T_c, T_w, cfg=KTAEConfig()):
    n = n_c + n_w
    c, d = n_c - a, n_w - b
    p = fisher_exact([[a, b], [c, d]]).pvalue
    F = 0.0 if p >= 1 - 1e-12 else math.exp(-2 * p)
    ig = h2(n_c / n) - ((a + b) / n * h2(a / (a + b)) + ((c + d) / n * h2(c / (c + d)) if c + d else 0.0))
    h = math.asin(math.sqrt(a / n_c)) - math.asin(math.sqrt(b / n_w))
    avg = (T_c + T_w) / 2
    tf = [0.0 if f == 0 else (f / T) * (cfg.k1 + 1) / (f / T + cfg.k1 * (1 - cfg.b + cfg.b * T / avg))
          for f, T in ((f_c, T_c), (f_w, T_w))]
    x = h + tf[0] / (tf[1] + 1e-5) - tf[1] / (tf[0] + 1e-5)
    key = (cfg.alpha * F + cfg.beta * ig) * x / (cfg.alpha + cfg.beta)
    return p, F, ig, x, cfg.top * math.tanh(key / 2)  # = top * (2 sigmoid(key) - 1)


def worked_batch():
    """One group: 3 correct rollouts, 3 wrong. Token 7 twice in each correct rollout and once in one
    wrong one; token 9 once in two wrong rollouts; token 1 everywhere; token 2 under the mask only."""
    responses = torch.tensor([
        [7, 1, 7, 4, 2],
        [7, 7, 1, 4, 2],
        [1, 7, 7, 5, 2],
        [9, 1, 4, 4, 2],
        [1, 9, 5, 4, 2],
        [1, 7, 4, 5, 2],
    ])
    mask = torch.ones_like(responses, dtype=torch.bool)
    mask[:, 4] = False
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    return responses, mask, rewards, torch.zeros(6, dtype=torch.long)


@pytest.mark.parametrize("backend", BACKENDS)
def test_worked_example(backend):
    res = key_token_scores(*worked_batch(), backend=backend)
    assert res.token.tolist() == [1, 4, 5, 7, 9]  # token 2 is masked everywhere: no row
    assert (res.n_c.item(), res.n_w.item(), res.T_c.item(), res.T_w.item()) == (3, 3, 12, 12)
    row = {t: i for i, t in enumerate(res.token.tolist())}
    for token, (a, b, f_c, f_w) in {7: (3, 1, 6, 1), 9: (0, 2, 0, 2), 4: (2, 3, 2, 4), 5: (1, 2, 1, 2)}.items():
        i = row[token]
        assert (res.a[i], res.b[i], res.f_c[i], res.f_w[i]) == (a, b, f_c, f_w)
        p, F, ig, x, score = expected_score(a, b, f_c, f_w, 3, 3, 12, 12)
        got = [res.p_value[i].item(), res.F[i].item(), res.IG[i].item(), res.x[i].item(), res.score[i].item()]
        assert got == pytest.approx([p, F, ig, x, score], rel=1e-12, abs=1e-15)
    i = row[1]
    assert res.score[i] == 0 and res.p_value[i] == 1  # in every rollout
    assert res.score[row[7]] > 0.5 and res.score[row[9]] < -0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_worked_advantage(backend):
    responses, mask, rewards, index = worked_batch()
    adv = token_advantage(responses, mask, rewards, index, backend=backend)
    res = key_token_scores(responses, mask, rewards, index, backend=backend)
    score = dict(zip(res.token.tolist(), res.score.tolist()))
    A = (rewards.double() - 0.5) / (rewards.double().std() + 1e-6)
    expected = torch.tensor([[A[i] + score[int(t)] if mask[i, j] else 0.0 for j, t in enumerate(row)]
                             for i, row in enumerate(responses)], dtype=torch.float32)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_ids_and_switches(backend):
    batch = worked_batch()
    res = key_token_scores(*batch, config=KTAEConfig(ignore_token_ids=(7,)), backend=backend)
    plain = key_token_scores(*batch, backend=backend)
    assert res.score[res.token == 7].item() == 0 and plain.score[plain.token == 7].item() > 0.5
    assert torch.equal(res.F, plain.F) and torch.equal(res.IG, plain.IG)  # statistics still reported
    assert res.score[res.token == 9].item() != 0
    res = key_token_scores(*batch, config=KTAEConfig(use_tf=False), backend=backend)
    i = int(torch.nonzero(res.token == 7))
    assert res.x[i].item() == pytest.approx(math.asin(1.0) - math.asin(math.sqrt(1 / 3)), rel=1e-14)
