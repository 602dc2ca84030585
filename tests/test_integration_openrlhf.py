"""OpenRLHF adapter against OpenRLHF's documented contract (it does not install without CUDA):
Experience fields and shapes, action tokens as the last A columns of ``sequences``, groups from
``index // n_samples_per_prompt`` after seqlen-balanced reordering, and the call order
(OpenRLHF's advantages first, KTAE's score term added)."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from ktae_kernels import KTAEConfig, token_advantage
from ktae_kernels.integrations import openrlhf as ktae_openrlhf

N = 4  # n_samples_per_prompt


@dataclass
class Experience:
    """The fields of openrlhf.trainer.ppo_utils.experience.Experience that the hook reads or writes."""

    sequences: torch.Tensor  # (b, S) prompt + response, right-padded with pad id
    action_mask: torch.Tensor  # (b, A), action j is sequences[:, S - A + j]
    rewards: torch.Tensor  # (b,)
    index: list  # each rollout's position in the rollout batch
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    info: dict = field(default_factory=dict)


def _rollouts(seed: int = 0, prompts: int = 3):
    """Per rollout (position i): prompt + multi-turn response ids and the action mask over S - 1 positions
    (OpenRLHF's vLLM path: ``action_mask[j]`` marks ``sequences[j + 1]``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(prompts * N):
        prompt = rng.integers(100, 110, size=rng.integers(2, 5))
        response = rng.integers(3, 15, size=rng.integers(1, 9))
        seq = torch.as_tensor(np.concatenate([prompt, response]))
        action = torch.zeros(len(seq) - 1, dtype=torch.bool)
        action[len(prompt) - 1:] = True
        if len(response) > 3:
            action[len(prompt)] = False  # a tool-output token inside the response
        out.append((i, seq, action, float(rng.random() < 0.5)))
    return out


def _experiences(rollouts, order, micro: int):
    """Concatenate rollouts in ``order`` into micro-batches as Experience.concat_experiences does."""
    pad = lambda ts, v: torch.nn.utils.rnn.pad_sequence(ts, batch_first=True, padding_value=v)  # noqa: E731
    batches = []
    for k in range(0, len(order), micro):
        part = [rollouts[i] for i in order[k:k + micro]]
        batches.append(Experience(sequences=pad([p[1] for p in part], 0), action_mask=pad([p[2] for p in part], False),
                                  rewards=torch.tensor([p[3] for p in part]), index=[p[0] for p in part]))
    return batches


def _group_norm(experiences):
    """OpenRLHF's group_norm with gamma = 1 and no KL: the rollout advantage on every action token."""
    index = torch.tensor([i for e in experiences for i in e.index])
    raw = torch.cat([e.rewards for e in experiences])
    r = torch.empty_like(raw)
    r[index] = raw
    r = r.reshape(-1, N)
    r = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)[index]
    start = 0
    for e in experiences:
        b = e.action_mask.shape[0]
        e.advantages = r[start:start + b, None] * e.action_mask.float()
        e.returns = e.advantages.clone()
        start += b
    return experiences


class FakeRemoteExperienceMaker:
    """RemoteExperienceMaker's compute_advantages_and_returns for the group_norm estimator."""

    def __init__(self, estimator: str = "group_norm"):
        algo = types.SimpleNamespace(advantage=types.SimpleNamespace(estimator=estimator))
        self.strategy = types.SimpleNamespace(args=types.SimpleNamespace(algo=algo, rollout=types.SimpleNamespace(
            n_samples_per_prompt=N)))

    def compute_advantages_and_returns(self, experiences):
        return _group_norm(experiences)


def _expected(rollouts, config):
    """One-batch token_advantage with OpenRLHF's group_norm advantage as A_i, per rollout position."""
    A = max(len(r[2]) for r in rollouts)
    ids = torch.stack([torch.nn.functional.pad(r[1][1:], (0, A - len(r[2]))) for r in rollouts])
    mask = torch.stack([torch.nn.functional.pad(r[2], (0, A - len(r[2]))) for r in rollouts])
    rewards = torch.tensor([r[3] for r in rollouts])
    base = _group_norm(_experiences(rollouts, list(range(len(rollouts))), len(rollouts)))[0].advantages
    a_i = base.sum(1) / mask.sum(1).clamp(min=1)
    return token_advantage(ids, mask, rewards, torch.arange(len(rollouts)) // N, config=config,
                           rollout_advantage=a_i.double())


@pytest.mark.parametrize("config", [KTAEConfig(), KTAEConfig(weight=0.5, fisher="upstream")], ids=["default", "upstream"])
def test_mixin_adds_scores_to_group_norm_advantages(config):
    rollouts = _rollouts()
    order = list(np.random.default_rng(1).permutation(len(rollouts)))  # seqlen-balanced batches reorder rollouts
    maker_cls = type("Maker", (ktae_openrlhf.KTAEExperienceMakerMixin, FakeRemoteExperienceMaker), {"ktae_config": config})
    experiences = maker_cls().compute_advantages_and_returns(_experiences(rollouts, order, micro=5))
    expected = _expected(rollouts, config)
    for e in experiences:
        assert e.advantages.shape == e.action_mask.shape and e.advantages.dtype == torch.float32
        assert torch.all(e.advantages[~e.action_mask] == 0)
        for row, i in enumerate(e.index):
            a = e.action_mask.shape[1]
            torch.testing.assert_close(e.advantages[row], expected[i, :a], rtol=0, atol=1e-6)
    assert torch.equal(experiences[0].returns, _group_norm(_experiences(rollouts, order, 5))[0].returns)


def test_score_term_uses_the_last_action_columns():
    rollouts = _rollouts(seed=2, prompts=2)
    experiences = _group_norm(_experiences(rollouts, list(range(len(rollouts))), len(rollouts)))
    before = experiences[0].advantages.clone()
    term = ktae_openrlhf.add_key_token_scores(experiences, n_samples_per_prompt=N, config=KTAEConfig())
    e = experiences[0]
    A = e.action_mask.shape[1]
    scores = token_advantage(e.sequences[:, -A:], e.action_mask, e.rewards, torch.tensor(e.index) // N,
                             rollout_advantage=torch.zeros(len(e.index), dtype=torch.float64))
    assert torch.equal(term, scores)
    assert torch.equal(e.advantages, before + scores)
    assert torch.any(scores != 0)


def test_gae_is_refused():
    maker_cls = type("Maker", (ktae_openrlhf.KTAEExperienceMakerMixin, FakeRemoteExperienceMaker), {})
    with pytest.raises(ValueError, match="estimator is 'gae'"):
        maker_cls("gae").compute_advantages_and_returns(_experiences(_rollouts(), list(range(12)), 12))


def test_install_replaces_the_trainer_experience_maker(monkeypatch):
    trainer_module = _fake_openrlhf(monkeypatch)
    first = ktae_openrlhf.install(KTAEConfig(top=0.5), backend="torch")
    again = ktae_openrlhf.install()
    assert trainer_module.RemoteExperienceMaker is again
    assert again.__bases__ == (ktae_openrlhf.KTAEExperienceMakerMixin, FakeRemoteExperienceMaker)
    assert first.ktae_config == KTAEConfig(top=0.5) and first.ktae_backend == "torch"


def test_task_scores_label_correct_and_metrics_reach_info():
    """OpenRLHF's binary ``scores`` split correct / wrong even when the shaped ``rewards`` say otherwise."""
    rollouts = _rollouts(seed=3, prompts=3)
    experiences = _group_norm(_experiences(rollouts, list(range(len(rollouts))), 6))
    for e in experiences:
        e.scores = e.rewards.clone()
        e.rewards = e.rewards - 1.5  # e.g. length penalties: every shaped reward < 0
    config = KTAEConfig()
    term = ktae_openrlhf.add_key_token_scores(experiences, n_samples_per_prompt=N, config=config, metrics="scores")
    A = max(e.action_mask.shape[1] for e in experiences)
    ids = torch.cat([torch.nn.functional.pad(e.sequences[:, -e.action_mask.shape[1]:], (0, A - e.action_mask.shape[1]))
                     for e in experiences])
    mask = torch.cat([torch.nn.functional.pad(e.action_mask, (0, A - e.action_mask.shape[1])) for e in experiences])
    rewards = torch.cat([e.rewards for e in experiences])
    scores = torch.cat([e.scores for e in experiences])
    group = torch.tensor([i // N for e in experiences for i in e.index])
    zero = torch.zeros(len(rewards), dtype=torch.float64)
    assert torch.equal(term, token_advantage(ids, mask, rewards, group, rollout_advantage=zero, correct=scores > 0))
    assert not torch.equal(term, token_advantage(ids, mask, rewards, group, rollout_advantage=zero))
    from ktae_kernels import key_token_scores
    from ktae_kernels.metrics import ktae_metrics

    want = ktae_metrics(key_token_scores(ids, mask, rewards, group, correct=scores > 0))
    for e in experiences:
        for name, value in want.items():
            assert e.info[name].shape == (e.action_mask.shape[0],)
            assert float(e.info[name][0]) == pytest.approx(value, rel=1e-6)
        assert "ktae/time_ms" in e.info


def _fake_openrlhf(monkeypatch):
    trainer_module = types.ModuleType("openrlhf.trainer.ppo_trainer")
    trainer_module.RemoteExperienceMaker = FakeRemoteExperienceMaker
    package = types.ModuleType("openrlhf.trainer")
    package.ppo_trainer = trainer_module
    monkeypatch.setitem(sys.modules, "openrlhf", types.ModuleType("openrlhf"))
    monkeypatch.setitem(sys.modules, "openrlhf.trainer", package)
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ppo_trainer", trainer_module)
    return trainer_module


def test_settings_reach_the_worker_with_ignore_token_ids(monkeypatch):
    """Both worker_process_setup_hook forms carry a full KTAEConfig, ignore_token_ids included."""
    import pickle

    trainer_module = _fake_openrlhf(monkeypatch)
    config = KTAEConfig(ignore_token_ids=(151643, 7), beta=2.0)
    hook = pickle.loads(pickle.dumps(ktae_openrlhf.setup_hook(config, backend="torch", metrics="scores")))
    maker = hook()
    assert trainer_module.RemoteExperienceMaker is maker
    assert (maker.ktae_config, maker.ktae_backend, maker.ktae_metrics) == (config, "torch", "scores")
    monkeypatch.setenv("KTAE_OPENRLHF", '{"ignore_token_ids": [151643, 7], "beta": 2.0, "backend": "torch"}')
    maker = ktae_openrlhf.install()  # the string form: "ktae_kernels.integrations.openrlhf.install"
    assert (maker.ktae_config, maker.ktae_backend, maker.ktae_metrics) == (config, "torch", "advantages")
    monkeypatch.setenv("KTAE_OPENRLHF", '{"alhpa": 1}')
    with pytest.raises(ValueError, match="KTAE_OPENRLHF has unknown keys \\['alhpa'\\]"):
        ktae_openrlhf.install()
    with pytest.raises(ValueError, match="metrics"):
        ktae_openrlhf.setup_hook(metrics="all")
