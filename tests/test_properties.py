"""Hypothesis property tests of the torch backend (checked against the reference elsewhere)."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cases import make_batch
from ktae_kernels import KTAEConfig, key_token_scores, token_advantage

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def batches(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
    length = draw(st.integers(1, 40))
    vocab = draw(st.sampled_from([2, 5, 50, 151936, 2**31 - 1]))
    rng = np.random.default_rng(seed)
    r, m, w, i = make_batch(rng, sizes, length, vocab, zipf=vocab > 1000 and vocab < 2**31 - 1,
                            mask_rate=draw(st.sampled_from([0.0, 0.3, 0.9])),
                            p_correct=draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])), shuffle=True)
    if draw(st.booleans()):
        w = torch.as_tensor(rng.normal(0, draw(st.sampled_from([1.0, 1e6])), size=len(w)), dtype=torch.float32)
    return r, m, w, i


configs = st.builds(
    KTAEConfig,
    alpha=st.sampled_from([0.0, 1.0, 3.0]), beta=st.sampled_from([0.5, 1.0]), use_tf=st.booleans(),
    top=st.sampled_from([0.1, 1.0, 3.0]), fisher=st.sampled_from(["exact", "upstream"]),
)


@SETTINGS
@given(batches(), configs)
def test_scores_bounded_and_finite(batch, config):
    res = key_token_scores(*batch, config=config, backend="torch")
    for name in ("p_value", "F", "IG", "x", "score"):
        assert torch.isfinite(getattr(res, name)).all(), name
    assert torch.all(res.score.abs() < config.top)
    p_max = 1.0 if config.fisher == "exact" else 1.0 + 1e-5  # upstream's float32 sums can pass 1
    assert torch.all((res.p_value >= 0) & (res.p_value <= p_max)) and torch.all(res.IG >= 0)
    adv = token_advantage(*batch, config=config, backend="torch")
    assert torch.isfinite(adv).all() and torch.all(adv[~batch[1]] == 0)


@SETTINGS
@given(batches())
def test_sign_flips_with_correctness(batch):
    r, m, w, i = batch
    binary = (w > 0).float()
    res = key_token_scores(r, m, binary, i, backend="torch")
    flipped = key_token_scores(r, m, 1.0 - binary, i, backend="torch")
    torch.testing.assert_close(flipped.score, -res.score, rtol=1e-9, atol=1e-12)
    assert torch.equal(flipped.a, res.b) and torch.equal(flipped.f_c, res.f_w)


@SETTINGS
@given(batches(), st.data())
def test_ignored_ids_score_zero(batch, data):
    r, m, w, i = batch
    ids = r[m].unique().tolist()
    ignored = data.draw(st.lists(st.sampled_from(ids), max_size=3)) if ids else []
    cfg = KTAEConfig(ignore_token_ids=ignored)
    res = key_token_scores(r, m, w, i, config=cfg, backend="torch")
    hit = torch.isin(res.token, torch.tensor(ignored, dtype=torch.int64))
    assert torch.all(res.score[hit] == 0)
    base = key_token_scores(r, m, w, i, backend="torch")
    assert torch.equal(res.score[~hit], base.score[~hit])


@SETTINGS
@given(batches(), st.integers(0, 2**32 - 1))
def test_invariant_to_rollout_and_group_order(batch, seed):
    r, m, w, i = batch
    perm = torch.as_tensor(np.random.default_rng(seed).permutation(len(w)))
    res = key_token_scores(r, m, w, i, backend="torch")
    res_p = key_token_scores(r[perm], m[perm], w[perm], i[perm], backend="torch")
    assert torch.equal(res.token, res_p.token) and torch.equal(res.a, res_p.a)
    torch.testing.assert_close(res_p.score, res.score, rtol=0, atol=1e-12)
    adv = token_advantage(r, m, w, i, backend="torch")
    torch.testing.assert_close(token_advantage(r[perm], m[perm], w[perm], i[perm], backend="torch"), adv[perm],
                               rtol=1e-6, atol=1e-6)
