"""ktae_metrics: from KeyTokenScores and from the advantages, against a per-token brute force."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cases import as_uids, make_batch
from ktae_kernels import KTAEConfig, key_token_scores, token_advantage
from ktae_kernels.metrics import METRIC_NAMES, ktae_metrics


def _batch(seed=0, groups=5, G=6, L=12, vocab=9):
    """``cases.make_batch`` with uid strings and one all-correct group."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(seed), [G] * groups, L, vocab)
    rewards[:G] = 1.0
    return responses, mask, rewards, as_uids(index)


def _brute(responses, mask, rewards, index, config):
    """Per-token |score| from the tables, looked up token by token."""
    s = key_token_scores(responses, mask, rewards, index, config=config)
    dense = {lab: i for i, lab in enumerate(s.group_labels)}
    table = {(int(gr), int(t)): float(sc) for gr, t, sc in zip(s.group, s.token, s.score)}
    mags = [abs(table[(dense[index[i]], int(responses[i, t]))])
            for i in range(responses.shape[0]) for t in range(responses.shape[1]) if mask[i, t]]
    groups = sorted(set(index.tolist()))
    mixed = [0 < rewards[index == lab].gt(0).sum() < (index == lab).sum() for lab in groups]
    distinct = [len({int(responses[i, t]) for i in np.nonzero(index == lab)[0] for t in range(responses.shape[1])
                     if mask[i, t]}) for lab in groups]
    return {"ktae/score_abs_mean": float(np.mean(mags)), "ktae/key_token_share": float(np.mean(np.array(mags) >= 0.5)),
            "ktae/mixed_group_share": float(np.mean(mixed)), "ktae/distinct_tokens_per_group": float(np.mean(distinct))}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_from_scores_matches_brute_force(seed):
    batch = _batch(seed)
    config = KTAEConfig(ignore_token_ids=(2,))
    got = ktae_metrics(key_token_scores(*batch, config=config), elapsed_s=0.0123)
    assert list(got) == ["ktae/" + n for n in METRIC_NAMES]
    assert got["ktae/time_ms"] == pytest.approx(12.3)
    for name, value in _brute(*batch, config).items():
        assert got[name] == pytest.approx(value, abs=1e-12), name
    assert all(isinstance(v, float) for v in got.values())


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_from_advantages_matches_from_scores(weight):
    responses, mask, rewards, index = _batch(3)
    config = KTAEConfig(weight=weight)
    base = torch.randn(responses.shape[0], dtype=torch.float64)
    adv = token_advantage(responses, mask, rewards, index, config=config, rollout_advantage=base)
    cheap = ktae_metrics(advantages=adv, mask=mask, rollout_advantage=base, group=index, correct=rewards > 0,
                         weight=weight, prefix="k/")
    full = ktae_metrics(key_token_scores(responses, mask, rewards, index, config=config), prefix="k/")
    assert set(cheap) == {"k/score_abs_mean", "k/key_token_share", "k/mixed_group_share"}
    assert cheap["k/score_abs_mean"] == pytest.approx(full["k/score_abs_mean"], abs=1e-5)
    assert cheap["k/key_token_share"] == pytest.approx(full["k/key_token_share"], abs=1e-9)
    assert cheap["k/mixed_group_share"] == full["k/mixed_group_share"]


def test_empty_and_missing_inputs():
    empty = key_token_scores(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool),
                             torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert all(v == 0.0 for v in ktae_metrics(empty).values())
    with pytest.raises(ValueError, match="needs"):
        ktae_metrics()
    with pytest.raises(ValueError, match="needs mask"):
        ktae_metrics(advantages=torch.zeros(2, 2))


def _per_token(**changes):
    """ktae_metrics from the advantages of a 2 x 3 batch, with ``changes`` to its arguments."""
    responses = torch.tensor([[5, 7, 2], [5, 8, 2]])
    args = dict(advantages=token_advantage(responses, responses != 0, [1.0, 0.0], [0, 0]), mask=responses != 0,
                rollout_advantage=torch.tensor([0.7071, -0.7071]), group=[0, 0], correct=torch.tensor([True, False]))
    args.update(changes)
    return ktae_metrics(**args)


def test_from_advantages_takes_lists():
    assert _per_token(mask=[[1, 1, 1], [1, 1, 1]], rollout_advantage=[0.7071, -0.7071], correct=[1, 0]) == _per_token()
    assert _per_token()["ktae/mixed_group_share"] == 1.0


@pytest.mark.parametrize("changes, message", [
    (dict(mask=torch.ones(2, 2)), r"`mask` must have the shape of `advantages` \(2, 3\), got \(2, 2\)"),
    (dict(rollout_advantage=torch.zeros(3)), r"`rollout_advantage` must be real with shape \[B\] = \[2\], "
                                             r"got torch.float32 \(3,\)"),
    (dict(group=[0]), r"`group` must be 1-D of length B = 2, got shape \(1,\)"),
    (dict(correct=[1]), r"`correct` must have shape \[B\] = \[2\], got \(1,\)"),
    (dict(correct=[[1, 0]]), r"`correct` must have shape \[B\] = \[2\], got \(1, 2\)"),
    (dict(correct=[1, 2]), r"`correct` must be bool or hold only 0 and 1, found 2 at row 1"),
    (dict(advantages=torch.zeros(2)), r"`advantages` must be a real \[B, L\] tensor, got torch.float32 \(2,\)"),
    (dict(advantages=[[0.0] * 3] * 2), r"`advantages` must be a real \[B, L\] tensor, got list"),
    (dict(group=torch.tensor([0.0, 0.0])), r"`group` as a tensor must hold integers, got torch.float32; "
                                           r"convert with `group.long\(\)`"),
])
def test_from_advantages_names_a_bad_argument(changes, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        _per_token(**changes)


def test_scores_must_be_key_token_scores():
    with pytest.raises(ValueError, match=r"^`scores` must be a KeyTokenScores or None, got dict"):
        ktae_metrics({"score": 1.0})
