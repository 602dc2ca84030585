"""OpenRLHF adapter against OpenRLHF's documented contract (it does not install without CUDA):
Experience fields and shapes, action tokens as the last A columns of ``sequences``, groups from
``index // n_samples_per_prompt`` after seqlen-balanced reordering, and the call order
(OpenRLHF's advantages first, KTAE's score term added)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ktae_kernels import KTAEConfig, token_advantage
from ktae_kernels.integrations import openrlhf as ktae_openrlhf
from ktae_kernels.integrations.shared import AdapterSettings
from openrlhf_fakes import N, FakeRemoteExperienceMaker, group_norm, use_fake_openrlhf
from openrlhf_fakes import experiences as _experiences
from openrlhf_fakes import rollouts as _rollouts

_group_norm = group_norm

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
    maker_cls = type("Maker", (ktae_openrlhf.KTAEExperienceMakerMixin, FakeRemoteExperienceMaker), {"ktae_settings": AdapterSettings(config)})
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
    term = ktae_openrlhf.add_key_token_scores(experiences, n_samples_per_prompt=N)
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


def test_task_scores_label_correct_and_metrics_reach_info():
    """OpenRLHF's binary ``scores`` split correct / wrong even when the shaped ``rewards`` say otherwise."""
    rollouts = _rollouts(seed=3, prompts=3)
    experiences = _group_norm(_experiences(rollouts, list(range(len(rollouts))), 6))
    for e in experiences:
        e.scores = e.rewards.clone()
        e.rewards = e.rewards - 1.5  # e.g. length penalties: every shaped reward < 0
    config = KTAEConfig()
    term = ktae_openrlhf.add_key_token_scores(experiences, n_samples_per_prompt=N,
                                              settings=AdapterSettings(config, metrics="scores"))
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


def test_install_patches_the_trainer_module_only_when_it_is_imported(tmp_path, monkeypatch):
    """``install`` imports nothing of OpenRLHF; the trainer module is patched when imported, again
    (on OpenRLHF's own class) when installed again, and at once when already imported."""
    import sys

    use_fake_openrlhf(tmp_path, monkeypatch)
    settings = AdapterSettings(KTAEConfig(top=0.5), backend="torch", metrics="scores")
    ktae_openrlhf.install(settings)
    assert "openrlhf.trainer.ppo_trainer" not in sys.modules
    from openrlhf.trainer import ppo_trainer

    maker = ppo_trainer.RemoteExperienceMaker
    assert maker.__bases__ == (ktae_openrlhf.KTAEExperienceMakerMixin, FakeRemoteExperienceMaker)
    assert maker.ktae_settings == settings
    ktae_openrlhf.install(AdapterSettings())
    assert ppo_trainer.RemoteExperienceMaker.__bases__[1] is FakeRemoteExperienceMaker
    assert ppo_trainer.RemoteExperienceMaker.ktae_settings == AdapterSettings()
    assert sum(getattr(f, "owner", None) == ktae_openrlhf.__name__ for f in sys.meta_path) == 1


def test_settings_travel_as_json_with_ignore_token_ids():
    config = KTAEConfig(ignore_token_ids=(151643, 7), beta=2.0, weight=0.5)
    settings = AdapterSettings(config, backend="torch", metrics="scores", correct_key="accuracy")
    env = {ktae_openrlhf.ENV_VAR: ktae_openrlhf.settings_json(settings)}
    assert ktae_openrlhf.settings_from_env(env) == settings
    assert ktae_openrlhf.settings_from_env({}) == AdapterSettings()
    with pytest.raises(ValueError, match="KTAE_OPENRLHF has unknown keys \\['alhpa'\\]"):
        ktae_openrlhf.settings_from_env({ktae_openrlhf.ENV_VAR: '{"alhpa": 1}'})
    with pytest.raises(ValueError, match="KTAE_OPENRLHF must hold a JSON object"):
        ktae_openrlhf.settings_from_env({ktae_openrlhf.ENV_VAR: "{"})


def test_runtime_env_merges_openrlhfs_own_and_the_users():
    """OpenRLHF's defaults (zero-copy tensors, NCCL_DEBUG, TOKENIZERS_PARALLELISM) are kept; a value set in
    the launching shell or in the user's runtime_env wins; the hook is the named function's path."""
    settings = AdapterSettings(KTAEConfig(weight=0.5))
    env = ktae_openrlhf.runtime_env(settings, base={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "X": "1"},
                                                    "working_dir": "."}, environ={"NCCL_DEBUG": "INFO"})
    assert env["worker_process_setup_hook"] == "ktae_kernels.integrations.openrlhf.worker_setup"
    assert env["working_dir"] == "."
    assert env["env_vars"] == {"TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "INFO", "X": "1",
                               "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
                               "KTAE_OPENRLHF": ktae_openrlhf.settings_json(settings)}
    with pytest.raises(ValueError, match="worker_process_setup_hook"):
        ktae_openrlhf.runtime_env(base={"worker_process_setup_hook": "my.hook"})


def test_label_source_preference_info_then_scores_then_rewards():
    """``info[correct_key]`` (a reward function's extra field) over the binary ``scores`` over the shaped
    ``rewards``; the source is logged as ``ktae/label_source/<name>``."""
    rollouts = _rollouts(seed=4, prompts=3)
    rng = np.random.default_rng(0)
    acc = torch.tensor(rng.random(len(rollouts)) < 0.5, dtype=torch.float32)

    def run(with_info: bool, with_scores: bool):
        experiences = _group_norm(_experiences(rollouts, list(range(len(rollouts))), 6))
        for e in experiences:
            if with_scores:
                e.scores = 1.0 - e.rewards
            if with_info:
                e.info["acc"] = acc[e.index]
        settings = AdapterSettings(KTAEConfig(), metrics="advantages")
        term = ktae_openrlhf.add_key_token_scores(experiences, n_samples_per_prompt=N, settings=settings)
        return term, experiences

    ids_mask = _expected_inputs(rollouts)
    for with_info, with_scores, source, labels in [(True, True, "acc", acc > 0),
                                                   (False, True, "scores", ids_mask[2] < 1),
                                                   (False, False, "reward", ids_mask[2] > 0)]:
        term, experiences = run(with_info, with_scores)
        ids, mask, rewards = ids_mask
        zero = torch.zeros(len(rewards), dtype=torch.float64)
        want = token_advantage(ids, mask, rewards, torch.arange(len(rewards)) // N, rollout_advantage=zero,
                               correct=labels)
        assert torch.equal(term, want), source
        assert float(experiences[0].info[f"ktae/label_source/{source}"][0]) == 1.0
        assert not any(k.startswith("ktae/label_source/") and not k.endswith(source) for k in experiences[0].info)


def _expected_inputs(rollouts):
    """(ids, mask, rewards) of the rollouts in position order, padded to the widest action mask."""
    A = max(len(r[2]) for r in rollouts)
    ids = torch.stack([torch.nn.functional.pad(r[1][1:], (0, A - len(r[2]))) for r in rollouts])
    mask = torch.stack([torch.nn.functional.pad(r[2], (0, A - len(r[2]))) for r in rollouts])
    return ids, mask, torch.tensor([r[3] for r in rollouts])


@pytest.mark.slow
def test_real_ray_runs_the_named_hook_and_the_trainer_actor_builds_ktae(tmp_path):
    """Real Ray (``ray.init`` with the launcher's runtime_env): Ray accepts the named setup hook; a worker
    that builds no trainer has the hook installed but imports nothing of OpenRLHF; the trainer actor's
    experience maker is KTAE's with the configured settings and its advantages equal the driver's."""
    import os

    ray = pytest.importorskip("ray")
    import openrlhf_fakes

    root = openrlhf_fakes.write_fake_openrlhf(tmp_path)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([str(root), tests_dir, os.path.dirname(tests_dir)])
    settings = AdapterSettings(KTAEConfig(ignore_token_ids=(5,), weight=0.5), backend="torch", metrics="scores")
    env = ktae_openrlhf.runtime_env(settings, base={"env_vars": {"PYTHONPATH": path, "NCCL_DEBUG": "INFO"}})
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, runtime_env=env, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        plain = ray.get(ray.remote(openrlhf_fakes.worker_state).remote(), timeout=60)
        trainer = ray.remote(num_cpus=0)(openrlhf_fakes.TrainerActor).remote()
        built = ray.get(trainer.step.remote(seed=5, micro=5), timeout=60)
    finally:
        ray.shutdown()
    assert plain == {"hooked": True, "trainer_imported": False, "openrlhf_imported": False,
                     "env": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "NCCL_DEBUG": "INFO",
                             "TOKENIZERS_PARALLELISM": "true"}}
    assert built["maker"] == "KTAERemoteExperienceMaker" and built["settings"] == settings
    rollouts = _rollouts(seed=5)
    order = list(np.random.default_rng(5).permutation(len(rollouts)))
    expected = _group_norm(_experiences(rollouts, order, 5))
    ktae_openrlhf.add_key_token_scores(expected, n_samples_per_prompt=N, settings=settings)
    for got, want, index, info in zip(built["advantages"], expected, built["index"], built["info"]):
        assert index == want.index and torch.equal(got, want.advantages)
        assert float(info["ktae/threads"][0]) >= 1 and "ktae/distinct_tokens_per_group" in info
    assert any(not torch.equal(e.advantages, g.advantages)
               for e, g in zip(expected, _group_norm(_experiences(rollouts, order, 5))))
