"""The helpers every adapter shares (``ktae_kernels.integrations.shared``): settings sections, group ids
and the baseline, labels and their source, metrics by mode with ``ktae/threads``."""
from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from ktae_kernels import ExecutionOptions, KTAEConfig, key_token_scores, token_advantage
from ktae_kernels.integrations import shared
from ktae_kernels.metrics import ktae_metrics



def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, 12, (8, 6), generator=g)
    mask = torch.rand(8, 6, generator=g) < 0.8
    rewards = torch.tensor([1.0, 0, 1, 0, 0, 0, 1, 1])
    index = np.array(["b", "b", "b", "b", "a", "a", "a", "a"], dtype=object)
    return responses, mask, rewards, index


def test_settings_name_the_section_and_the_expected_keys():
    s = shared.settings_from_mapping({"alpha": 2.0, "ignore_token_ids": 7, "metrics": "scores", "correct_key": None},
                                     where="algorithm.ktae", default_baseline="mean")
    assert s == shared.AdapterSettings(KTAEConfig(alpha=2.0, ignore_token_ids=(7,), baseline="mean"), "auto", "scores",
                                       None)
    with pytest.raises(ValueError, match=r"sec has unknown keys \['alhpa'\]; expected KTAEConfig fields .* or one of "
                                         r"\['backend', 'metrics', 'correct_key', 'threads'\]"):
        shared.settings_from_mapping({"alhpa": 1}, where="sec")
    with pytest.raises(ValueError, match="sec.metrics must be one of"):
        shared.settings_from_mapping({"metrics": "all"}, where="sec")
    with pytest.raises(ValueError, match="sec: .*correct_key.* non-empty string"):
        shared.settings_from_mapping({"correct_key": ""}, where="sec")


def test_dense_groups_and_the_baseline_for_every_label_kind():
    _, _, rewards, index = _batch()
    for labels in (index, list(index), torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])):
        group, size = shared.dense_groups(labels)
        assert group.tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and size.tolist() == [4, 4]
    base = shared.rollout_baseline(rewards, index, KTAEConfig())
    r = rewards.double().reshape(2, 4)
    want = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
    torch.testing.assert_close(base, want, rtol=0, atol=1e-12)


def test_labels_take_the_first_source_present():
    rewards = torch.tensor([1.0, -1.0, 0.5])
    assert shared.correct_labels(rewards, 0.0, [("acc", None), ("scores", [0, 1, 1])]).source == "scores"
    first = shared.correct_labels(rewards, 0.0, [("acc", np.array([True, False, False], dtype=object))])
    assert first.source == "acc" and first.correct.tolist() == [True, False, False]
    assert shared.correct_labels(rewards, 0.7).correct.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="label source 'acc' has shape \\(2,\\), expected \\(3,\\)"):
        shared.correct_labels(rewards, 0.0, [("acc", [1, 0])])
    assert shared.column_values({"acc": [1, None, 0]}, "acc") is None
    assert shared.column_values({"acc": [1, 1, 0]}, None) is None


def test_metrics_by_mode_with_threads_and_label_source():
    responses, mask, rewards, index = _batch(seed=1)
    config = KTAEConfig(weight=0.5)
    labels = shared.Labels(rewards > 0, "acc")
    base = shared.rollout_baseline(rewards, index, config)
    adv = token_advantage(responses, mask, rewards, index, config=config, rollout_advantage=base, correct=labels.correct)
    kts = key_token_scores(responses, mask, rewards, index, config=config, correct=labels.correct)
    calls = []

    def scores():
        calls.append(1)
        return kts

    common = dict(advantages=adv, mask=mask, rollout_advantage=base, group=index)
    started = time.perf_counter()
    assert shared.step_metrics(shared.AdapterSettings(config, metrics="off"), labels, started, scores=scores, **common) == {}
    cheap = shared.step_metrics(shared.AdapterSettings(config), labels, started, scores=scores, **common)
    assert not calls
    full = shared.step_metrics(shared.AdapterSettings(config, metrics="scores"), labels, started, scores=scores, **common)
    assert calls == [1]
    want = ktae_metrics(kts)
    for name in ("ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share"):
        assert cheap[name] == pytest.approx(want[name], abs=1e-6) and full[name] == want[name]
    assert "ktae/distinct_tokens_per_group" in full and "ktae/distinct_tokens_per_group" not in cheap
    for values in (cheap, full):
        assert values["ktae/threads"] == torch.get_num_threads() and values["ktae/label_source/acc"] == 1.0
        assert values["ktae/time_ms"] > 0


def test_threads_follow_the_settings():
    """``ktae/threads``: the settings' ``threads`` (``ExecutionOptions.threads``) when set, else torch's count."""
    assert shared.threads_used(ExecutionOptions()) == torch.get_num_threads()
    assert shared.threads_used(ExecutionOptions(threads=3)) == 3
    settings = shared.settings_from_mapping({"threads": 2}, where="sec")
    assert settings.options.threads == 2 and shared.threads_used(settings.options) == 2
    with pytest.raises(ValueError, match="sec: ExecutionOptions.threads must be None or an int >= 1"):
        shared.settings_from_mapping({"threads": 0}, where="sec")
