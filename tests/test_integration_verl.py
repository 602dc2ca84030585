"""verl adapter against the installed verl's real code: plugin entry point, estimator contract, task-score
labels under a KL penalty, start-up validation, every v1 trainer mode left as verl builds it (and fed
the response ids), multi-output agent sessions as verl's GRPO, the legacy trainer, ktae/ metrics."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

LOADED_BEFORE_VERL = "ktae_kernels.integrations.verl" in sys.modules
verl = pytest.importorskip("verl", reason="verl not installed: pip install -e '.[verl]'")
LOADED_BY_VERL = not LOADED_BEFORE_VERL and "ktae_kernels.integrations.verl" in sys.modules

from omegaconf import OmegaConf  # noqa: E402  (a verl dependency)
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from cases import random_cases  # noqa: E402
from verl_fakes import FakeTransferQueue, Meta, RowTransferQueue  # noqa: E402

VERL_VERSION = tuple(int(x) for x in verl.__version__.split(".")[:2])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import ktae_kernels  # noqa: E402
from ktae_kernels import KTAEConfig, key_token_scores, token_advantage  # noqa: E402
from ktae_kernels.integrations import verl as ktae_verl  # noqa: E402
from ktae_kernels.integrations.verl.trainers import V1_FIELDS  # noqa: E402
from ktae_kernels.metrics import ktae_metrics  # noqa: E402

SETTINGS = {"alpha": 1.0, "beta": 2.0, "ignore_token_ids": [3], "backend": "torch"}
KTAE = KTAEConfig(alpha=1.0, beta=2.0, ignore_token_ids=(3,))
MODES = ("sync", "colocate_async", "separate_async")
METRIC_KEYS = {"ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share", "ktae/time_ms"}


def _verl_batch(seed: int = 0):
    """(responses, response_mask float, token_level_scores [bs, T] with the score on the last
    response token, uid object array), as verl builds them."""
    _, responses, mask, rewards, index = random_cases(seed=seed, small=True)[1]
    lengths = mask.sum(1).clamp(min=1)  # right-padded responses of at least one token
    mask = torch.arange(mask.shape[1])[None, :] < lengths[:, None]
    token_scores = torch.zeros(mask.shape, dtype=torch.float32)
    token_scores[torch.arange(mask.shape[0]), lengths - 1] = rewards
    uid = np.array([f"uid-{int(g)}-{seed}" for g in index], dtype=object)
    return responses, mask.float(), token_scores, uid


def _kl_rewards(token_scores, mask, seed=0):
    """``token_level_scores - beta * kl`` as verl's apply_kl_penalty writes them."""
    kl = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * mask
    return token_scores - 0.3 * kl


def _algorithm(**extra):
    ktae = dict(SETTINGS, **extra.pop("ktae", {}))
    return OmegaConf.create({"adv_estimator": "ktae", "norm_adv_by_std_in_grpo": True, "gamma": 1.0, "lam": 1.0,
                             "use_kl_in_reward": False, "ktae": ktae, **extra})


def test_entry_point_registers_on_import_verl():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    if names.get("ktae") != "ktae_kernels.integrations.verl":
        pytest.skip("ktae_kernels is not pip-installed here, so its verl.plugins entry point is absent")
    if LOADED_BEFORE_VERL:
        pytest.skip("the adapter was imported before verl in this session")
    if VERL_VERSION < (0, 9):
        pytest.skip(f"verl {verl.__version__} loads no verl.plugins entry points (0.9+)")
    assert LOADED_BY_VERL
    assert core_algos.get_adv_estimator_fn("ktae") is ktae_verl.compute_ktae_advantage


def test_estimator_contract_matches_token_advantage():
    responses, mask, scores, uid = _verl_batch()
    fn = core_algos.get_adv_estimator_fn("ktae")
    adv, ret = fn(token_level_rewards=scores, response_mask=mask, config=_algorithm(), index=uid,
                  responses=responses, reward_baselines=None)
    expected = token_advantage(responses, mask, scores.sum(1), uid, config=KTAE)
    assert adv.dtype == torch.float32 and adv.shape == mask.shape and ret is adv
    assert torch.equal(adv, expected)
    with ktae_verl.provide_responses(responses):
        dr, _ = fn(token_level_rewards=scores, response_mask=mask, index=uid,
                   config=_algorithm(norm_adv_by_std_in_grpo=False))
    mean = token_advantage(responses, mask, scores.sum(1), uid, config=KTAEConfig(
        alpha=1.0, beta=2.0, ignore_token_ids=(3,), baseline="mean"))
    assert torch.equal(dr, mean) and not torch.equal(dr, adv)


@pytest.mark.parametrize("norm", [True, False])
def test_rollout_advantage_is_verls_grpo(norm):
    responses, mask, scores, uid = _verl_batch(seed=4)
    rewards = _kl_rewards(scores, mask)
    adv, _ = ktae_verl.compute_ktae_advantage(rewards, mask, index=uid, responses=responses, token_level_scores=scores,
                                              config=_algorithm(norm_adv_by_std_in_grpo=norm, ktae={"weight": 0.0}))
    grpo, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uid, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, grpo, rtol=1e-5, atol=1e-6)


def test_correct_wrong_from_task_score_under_kl_penalty():
    responses, mask, scores, uid = _verl_batch(seed=5)
    rewards = _kl_rewards(scores, mask, seed=5)
    flips = ((rewards.sum(1) > 0) != (scores.sum(1) > 0)).sum()
    assert flips > 0, "the KL penalty should move some rollouts across the threshold in this batch"
    adv, _ = ktae_verl.compute_ktae_advantage(rewards, mask, index=uid, responses=responses, token_level_scores=scores,
                                              config=_algorithm())
    expected = token_advantage(responses, mask, rewards, uid, config=KTAE, correct=scores.sum(1) > 0)
    assert torch.equal(adv, expected)
    by_reward = token_advantage(responses, mask, rewards, uid, config=KTAE)
    assert not torch.equal(adv, by_reward)


def test_missing_inputs_and_bad_settings_are_named():
    responses, mask, scores, uid = _verl_batch()
    with pytest.raises(ValueError, match="response token ids"):
        ktae_verl.compute_ktae_advantage(scores, mask, index=uid, config=None)
    with pytest.raises(ValueError, match="index"):
        ktae_verl.compute_ktae_advantage(scores, mask, config=None, responses=responses)
    with pytest.raises(ValueError, match="algorithm.ktae has unknown keys \\['alhpa'\\]"):
        ktae_verl.compute_ktae_advantage(scores, mask, index=uid, responses=responses,
                                         config=OmegaConf.create({"ktae": {"alhpa": 1.0}}))
    with pytest.raises(ValueError, match="algorithm.ktae: KTAEConfig.alpha"):
        ktae_verl.ktae_settings(OmegaConf.create({"ktae": {"alpha": -1.0}}))
    with pytest.raises(ValueError, match="algorithm.ktae.metrics"):
        ktae_verl.ktae_settings(OmegaConf.create({"ktae": {"metrics": "all"}}))


def test_registering_twice_and_reloading_do_not_raise(monkeypatch):
    ktae_verl.register()
    ktae_verl.register()
    reloaded = importlib.reload(ktae_verl)
    assert core_algos.get_adv_estimator_fn("ktae") is reloaded.compute_ktae_advantage
    assert sum(getattr(f, "owner", None) == "ktae_kernels.integrations.verl.loading" for f in sys.meta_path) == 1
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "ktae", lambda **kw: None)
    with pytest.raises(ValueError, match="already registered"):
        reloaded.register()


# ------------------------------------------------------------------------------- start-up validation
def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def test_validate_config_rejects_a_typo_before_anything_starts():
    from verl.utils import config as verl_config

    if not hasattr(verl_config, "validate_config"):
        pytest.skip(f"verl {verl.__version__} validates its config inside the trainer (no start-up hook)")
    assert getattr(verl_config.validate_config, "ktae_wrapped", False)
    bad = _compose("algorithm.adv_estimator=ktae", "+algorithm.ktae.alhpa=2.0")
    with pytest.raises(ValueError, match="algorithm.ktae has unknown keys \\['alhpa'\\]"):
        verl_config.validate_config(bad, use_reference_policy=False, use_critic=False)
    ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae", "+algorithm.ktae.alpha=2.0"))
    ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=grpo", "+algorithm.ktae.alhpa=2.0"))


@pytest.mark.slow
def test_main_ppo_fails_on_a_typo_before_ray_starts(tmp_path):
    """``python -m verl.trainer.main_ppo`` as a user runs it: the typo stops it where verl validates its
    config, before any worker starts or any generation."""
    if VERL_VERSION < (0, 6):
        pytest.skip(f"verl {verl.__version__} has no hook to load KTAE into main_ppo (0.6+)")
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=ktae",
                           "+algorithm.ktae.alhpa=2.0", "trainer.n_gpus_per_node=1"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,  # Hydra writes outputs/ there
                          env={**os.environ, "RAY_ADDRESS": "",
                               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode != 0
    assert "algorithm.ktae has unknown keys ['alhpa']" in proc.stderr + proc.stdout
    if VERL_VERSION >= (0, 9):  # 0.9 validates in the Hydra driver;
        assert "Started a local Ray instance" not in proc.stderr + proc.stdout  # older: in the TaskRunner actor


# ------------------------------------------------------------------------------------ v1 trainer modes
def _mode_config(mode, estimator):
    extra = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
             "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "data.train_batch_size=1024",
             "actor_rollout_ref.actor.ppo_mini_batch_size=256"] if mode == "separate_async" else []
    ktae = ["+algorithm.ktae.beta=2.0", "+algorithm.ktae.ignore_token_ids=[151643]"] if estimator == "ktae" else []
    return _compose(f"trainer.v1.trainer_mode={mode}", f"algorithm.adv_estimator={estimator}", *extra, *ktae)


def _summary(trainer):
    rb = trainer.replay_buffer
    simple = {k: v for k, v in vars(rb).items() if isinstance(v, (int, float, str, bool, type(None)))}
    section = OmegaConf.to_container(rb.trainer_config) if OmegaConf.is_config(rb.trainer_config) else rb.trainer_config
    return (type(trainer), type(rb), simple, section, rb.sampler_kwargs, trainer.parameter_sync_step,
            trainer.trainer_mode)


@pytest.mark.parametrize("mode", MODES)
def test_v1_trainer_is_verls_own_for_every_mode(mode):
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl v1 deps missing: '.[verl]'")
    cls = trainer_base.get_trainer_cls(mode)
    assert cls.__module__.startswith("verl.") and not any(n.startswith("ktae") for n in trainer_base.TRAINER_REGISTRY)
    assert "_compute_advantage" not in vars(cls)  # every mode inherits the one wrapped method
    assert getattr(trainer_base.PPOTrainer._compute_advantage, "ktae_wrapped", False)
    with_ktae = _summary(cls(_mode_config(mode, "ktae")))
    without = _summary(cls(_mode_config(mode, "grpo")))
    assert with_ktae == without
    assert with_ktae[6] == mode and (with_ktae[1].__name__ == "ReplayBuffer") == (mode == "sync")
    if mode == "separate_async":
        assert with_ktae[5] == 4  # verl's trainer.v1.separate_async.parameter_sync_step


def _run_v1(monkeypatch, mode, responses, mask, scores, uid, keys, algorithm):
    """verl's real v1 ``_compute_advantage`` of ``mode`` over a fake TransferQueue; returns
    (advantages padded, metrics dict, fake queue)."""
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl v1 deps missing: '.[verl]'")
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    lengths = mask.long().sum(1).tolist()
    nested = lambda t: torch.nested.as_nested_tensor([row[:n] for row, n in zip(t, lengths)], layout=torch.jagged)  # noqa: E731
    store = TensorDict({"responses": nested(responses), "response_mask": nested(mask.long()),
                        "rm_scores": nested(scores), "uid": NonTensorStack(*uid.tolist())}, batch_size=len(uid))
    fake = FakeTransferQueue(store)
    monkeypatch.setattr(trainer_base, "tq", fake)
    trainer = object.__new__(trainer_base.get_trainer_cls(mode))  # _compute_advantage reads only the config
    trainer.config = OmegaConf.create({"algorithm": algorithm, "actor_rollout_ref": {"rollout": {"n": 4}}})
    if algorithm.use_kl_in_reward:
        trainer.kl_ctrl_in_reward = core_algos.FixedKLController(kl_coef=0.3)
    metrics = {}
    trainer._compute_advantage(Meta(keys), metrics=metrics)
    return fake.put["advantages"].to_padded_tensor(padding=0.0), metrics, fake


@pytest.mark.parametrize("mode", MODES)
def test_v1_compute_advantage_gets_the_ids_in_every_mode(monkeypatch, mode):
    responses, mask, scores, uid = _verl_batch(seed=2)
    keys = [f"{u}_{i}_0" for i, u in enumerate(uid)]  # one output per session
    got, metrics, fake = _run_v1(monkeypatch, mode, responses, mask, scores, uid, keys, _algorithm())
    T = got.shape[1]
    expected = token_advantage(responses[:, :T], mask[:, :T], scores.sum(1), uid, config=KTAE)
    assert torch.equal(got, expected)
    assert [*V1_FIELDS, "acc"] in fake.gets  # acc: a colocated reward model's own field
    assert METRIC_KEYS <= set(metrics)
    grpo, grpo_metrics, fake = _run_v1(monkeypatch, mode, responses, mask, scores, uid, keys,
                                       _algorithm(adv_estimator="grpo"))
    assert not any("extra_fields" in get for get in fake.gets) and not any(k.startswith("ktae/") for k in grpo_metrics)


def _v1_rows(uid, acc, seed=0):
    """Rows of a v1 batch stored per key (one output per session): ids, mask, task score on the last
    token, the fields verl's padding template copies, and ``acc`` in the agent loop's reward extra info."""
    g = torch.Generator().manual_seed(seed)
    keys, rows = [f"{u}_{i}_0" for i, u in enumerate(uid)], {}
    for i, (key, u, a) in enumerate(zip(keys, uid, acc)):
        n = int(torch.randint(3, 8, (1,), generator=g))
        rows[key] = {"prompts": torch.tensor([1, 2, 3][:2 + i % 2]),  # ragged, so the queue nests them
                     "responses": torch.randint(10, 20, (n,), generator=g),
                     "response_mask": torch.ones(n, dtype=torch.long), "uid": u,
                     "rm_scores": torch.cat([torch.zeros(n - 1), torch.tensor([float(a)])]),
                     "input_ids": torch.ones(n + 3, dtype=torch.long), "attention_mask": torch.ones(n + 3, dtype=torch.long),
                     "position_ids": torch.arange(n + 3), "extra_fields": {"reward_extra_info": {"acc": bool(a)}}}
    return keys, rows


def _v1_trainer(trainer_base):
    trainer = object.__new__(trainer_base.get_trainer_cls("sync"))  # _compute_advantage reads only the config
    trainer.config = OmegaConf.create({"algorithm": _algorithm(ktae={"backend": "auto"}),
                                       "actor_rollout_ref": {"rollout": {"n": 4}}})
    return trainer


def test_v1_padding_rows_verl_appends_count_in_no_metric(monkeypatch):
    """verl's own ``upsample_batch_to_divisible_size`` appends padding rows (no tokens, their own uid, a
    copy of the first row's extra fields, tagged ``is_padding``) before the advantage step: they get
    advantage 0, and the metrics are those of the real rows (4 padding groups made mixed_group_share 1/2)."""
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl < 0.9 has no v1 trainer")
    padding_utils = pytest.importorskip("verl.trainer.ppo.padding_utils")
    uid = np.array(["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4, dtype=object)
    keys, rows = _v1_rows(uid, [1, 0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    tq = RowTransferQueue(rows)
    monkeypatch.setattr(trainer_base, "tq", tq)
    monkeypatch.setattr(padding_utils, "tq", tq)
    real = {}
    _v1_trainer(trainer_base)._compute_advantage(Meta(keys), real)
    want = tq.put["advantages"].to_padded_tensor(padding=0.0)
    padded = padding_utils.upsample_batch_to_divisible_size(Meta(keys), 16, eos_token_id=2)
    assert len(padded) == 16 and sum(tag.get("is_padding", False) for tag in padded.tags) == 4
    metrics = {}
    _v1_trainer(trainer_base)._compute_advantage(padded, metrics)
    got = tq.put["advantages"].to_padded_tensor(padding=0.0)
    assert torch.equal(got[:12, :want.shape[1]], want) and not got[12:].any()
    drop = lambda m: {k: v for k, v in m.items() if k != "ktae/time_ms"}  # noqa: E731
    assert drop(metrics) == drop(real) and metrics["ktae/mixed_group_share"] == pytest.approx(2 / 3)


def test_v1_colocated_reward_model_labels_by_its_acc_field(monkeypatch):
    """With a colocated reward model verl's ``_compute_reward_colocate`` writes each reward extra key
    (``acc``) as a TransferQueue field of its own, not into ``extra_fields``: the labels come from it, so
    a correct answer whose score a length penalty took to 0 stays correct."""
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl < 0.9 has no v1 trainer")
    uid = np.array(["p0"] * 4 + ["p1"] * 4, dtype=object)
    acc = [True, False, True, False, True, False, False, True]
    keys, rows = _v1_rows(uid, acc, seed=1)
    for row in rows.values():
        del row["extra_fields"]["reward_extra_info"]  # the agent loop fills it on the async reward path only
    rows[keys[2]]["responses"] = torch.randint(10, 20, (16,))  # correct, at the length limit: penalised to 0
    rows[keys[2]]["response_mask"] = torch.ones(16, dtype=torch.long)
    lengths = [len(rows[k]["responses"]) for k in keys]
    score = [(1.0 if a else -1.0) - (1.0 if n == 16 else 0.0) for a, n in zip(acc, lengths)]

    class ColocatedRewardModel:  # what verl's RewardLoopManager.compute_rm_score returns
        def compute_rm_score(self, data):
            rm = torch.zeros(data.batch["responses"].shape)
            for i, n in enumerate(lengths):
                rm[i, n - 1] = score[i]
            return DataProto(batch=TensorDict({"rm_scores": rm}, batch_size=len(data)),
                             non_tensor_batch={"acc": np.array(acc), "score": np.array(score)},
                             meta_info={"reward_extra_keys": ["acc", "score"]})

    from tensordict import TensorDict

    rows = {k: {**row, "raw_prompt": [{"role": "user", "content": "q"}]} for k, row in rows.items()}
    tq = RowTransferQueue(rows)
    monkeypatch.setattr(trainer_base, "tq", tq)
    trainer = _v1_trainer(trainer_base)
    trainer.reward_loop_manager, trainer.tokenizer = ColocatedRewardModel(), type("Tokenizer", (), {"pad_token_id": 0})()
    trainer._compute_reward_colocate(Meta(keys))
    metrics = {}
    trainer._compute_advantage(Meta(keys), metrics)
    assert metrics["ktae/label_source/acc"] == 1.0
    got = tq.put["advantages"].to_padded_tensor(padding=0.0)
    responses = torch.nn.utils.rnn.pad_sequence([rows[k]["responses"] for k in keys], batch_first=True)
    want = token_advantage(responses, responses > 0, torch.tensor(score), uid, config=KTAE, correct=torch.tensor(acc))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_v1_kl_in_reward_labels_by_task_score(monkeypatch):
    """With use_kl_in_reward verl's own apply_kl_penalty runs; labels stay the task score's."""
    responses, mask, scores, uid = _verl_batch(seed=6)
    keys = [f"{u}_{i}_0" for i, u in enumerate(uid)]
    algorithm = _algorithm(use_kl_in_reward=True, kl_penalty="kl")
    # apply_kl_penalty needs old and reference log-probs
    g = torch.Generator().manual_seed(0)
    old, ref = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
    lengths = mask.long().sum(1).tolist()
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack
    nested = lambda t: torch.nested.as_nested_tensor([row[:n] for row, n in zip(t, lengths)], layout=torch.jagged)  # noqa: E731
    store = TensorDict({"responses": nested(responses), "response_mask": nested(mask.long()),
                        "rm_scores": nested(scores), "old_log_probs": nested(old), "ref_log_prob": nested(ref),
                        "uid": NonTensorStack(*uid.tolist())}, batch_size=len(uid))
    fake = FakeTransferQueue(store)
    monkeypatch.setattr(trainer_base, "tq", fake)
    trainer = object.__new__(trainer_base.get_trainer_cls("sync"))
    trainer.config = OmegaConf.create({"algorithm": algorithm, "actor_rollout_ref": {"rollout": {"n": 4}}})
    trainer.kl_ctrl_in_reward = core_algos.FixedKLController(kl_coef=0.3)
    trainer._compute_advantage(Meta(keys), metrics={})
    got = fake.put["advantages"].to_padded_tensor(padding=0.0)
    rewards = fake.put["token_level_rewards"].to_padded_tensor(padding=0.0)
    T = got.shape[1]
    assert not torch.equal(rewards.sum(1), scores[:, :T].sum(1))
    expected = token_advantage(responses[:, :T], mask[:, :T], rewards, uid, config=KTAE, correct=scores.sum(1) > 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_v1_multi_output_sessions_group_final_outputs_as_verls_grpo(monkeypatch):
    """Agent loops with several outputs per session: groups hold the final outputs only; the other
    outputs get their session's A_i and the (uid, token) scores of the final outputs' tables."""
    v1_utils = pytest.importorskip("verl.trainer.ppo.v1.utils", reason="verl < 0.9 has no v1 trainer")
    compute_advantage_for_multi_trajectories = v1_utils.compute_advantage_for_multi_trajectories

    responses, mask, scores, uid = _verl_batch(seed=3)
    B = len(uid)
    # sessions of 1-3 outputs; each session's outputs are consecutive rows with the same uid
    keys, session_of, s = [], [], 0
    i = 0
    while i < B:
        n = 1 + (s % 3)
        rows = [r for r in range(i, min(i + n, B)) if uid[r] == uid[i]]
        for k, r in enumerate(rows):
            keys.append(f"{uid[r]}_{s}_{k}")
            session_of.append(s)
        i += len(rows)
        s += 1
    session_of = np.array(session_of)
    final = np.array([r for r in range(B) if r == max(np.nonzero(session_of == session_of[r])[0])])
    assert len(final) < B

    got, metrics, _ = _run_v1(monkeypatch, "sync", responses, mask, scores, uid, keys, _algorithm())
    T = got.shape[1]
    r, m = responses[:, :T], mask[:, :T]
    # A_i: exactly what verl's GRPO gives every row (weight 0)
    zero, _, _ = _run_v1(monkeypatch, "sync", responses, mask, scores, uid, keys, _algorithm(ktae={"weight": 0.0}))
    data = DataProto.from_dict(tensors={"response_mask": m, "token_level_rewards": scores[:, :T]},
                               non_tensors={"uid": uid})
    grpo = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator=core_algos.AdvantageEstimator.GRPO)
    torch.testing.assert_close(zero, grpo.batch["advantages"], rtol=1e-5, atol=1e-6)
    # final rows: KTAE over the final outputs alone
    alone = token_advantage(r[final], m[final], scores[final].sum(1), uid[final], config=KTAE)
    torch.testing.assert_close(got[final], alone, rtol=0, atol=1e-6)
    # other rows: their session's A_i + the group's score of each token
    kts = key_token_scores(r[final], m[final], scores[final].sum(1), uid[final], config=KTAE)
    dense = {lab: k for k, lab in enumerate(kts.group_labels)}
    table = {(int(g), int(t)): float(sc) for g, t, sc in zip(kts.group, kts.token, kts.score)}
    for row in set(range(B)) - set(final.tolist()):
        base = float(zero[row][m[row].bool()][0]) if m[row].any() else 0.0
        for t in range(T):
            want = (base + table.get((dense[uid[row]], int(r[row, t])), 0.0)) if m[row, t] else 0.0
            assert float(got[row, t]) == pytest.approx(want, abs=1e-5)
    assert METRIC_KEYS | {"ktae/distinct_tokens_per_group"} <= set(metrics)
    assert metrics["ktae/distinct_tokens_per_group"] == pytest.approx(ktae_metrics(kts)["ktae/distinct_tokens_per_group"])


# ------------------------------------------------------------------------------------ legacy trainer
def test_legacy_compute_advantage_passes_responses_scores_and_metrics():
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer", reason="verl trainer deps missing: '.[verl]'")
    responses, mask, scores, uid = _verl_batch(seed=1)
    rewards = _kl_rewards(scores, mask, seed=1)
    prompts = torch.ones(len(uid), 3, dtype=torch.long)
    data = DataProto.from_dict(tensors={"responses": responses, "response_mask": mask, "token_level_scores": scores,
                                        "token_level_rewards": rewards, "prompts": prompts,
                                        "attention_mask": torch.cat([torch.ones_like(prompts), mask.long()], 1)},
                               non_tensors={"uid": uid})
    out = ray_trainer.compute_advantage(data, adv_estimator="ktae", config=_algorithm(ktae={"metrics": "scores"}))
    expected = token_advantage(responses, mask, rewards, uid, config=KTAE, correct=scores.sum(1) > 0)
    assert torch.equal(out.batch["advantages"], expected) and torch.equal(out.batch["returns"], expected)
    logged = ray_trainer.compute_data_metrics(batch=out, use_critic=False)
    assert METRIC_KEYS | {"ktae/distinct_tokens_per_group"} <= set(logged) and "critic/score/mean" in logged
    assert "ktae_metrics" not in out.meta_info
    grpo = ray_trainer.compute_advantage(data, adv_estimator="grpo", config=_algorithm())
    ref, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uid)
    assert torch.equal(grpo.batch["advantages"], ref)


EXPERIMENTAL = [("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer"),
                ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer")]


@pytest.mark.parametrize("module, name", EXPERIMENTAL, ids=["one_step_off_policy", "fully_async_policy"])
def test_experimental_trainers_log_the_ktae_metrics(module, name):
    """verl's experimental trainers (their base ``SeparateRayPPOTrainer`` takes ``compute_advantage`` and
    ``compute_data_metrics`` by name): their own ``_fit_compute_advantage`` computes KTAE's advantages
    and their ``_fit_collect_metrics`` puts the ``ktae/*`` metrics into the step's metrics."""
    trainer_cls = getattr(pytest.importorskip(module, reason="verl's experimental trainers do not import"), name)
    trainer_cls = getattr(trainer_cls, "__ray_actor_class__", trainer_cls)  # FullyAsyncTrainer is a Ray actor class
    from ktae_kernels.integrations.verl.framework import SEPARATION_MODULE, trainer_modules

    assert SEPARATION_MODULE in trainer_modules(_compose("algorithm.adv_estimator=ktae"))
    responses, mask, scores, uid = _verl_batch(seed=11)
    prompts = torch.ones(len(uid), 3, dtype=torch.long)
    acc = np.arange(len(uid)) % 3 == 0
    batch = DataProto.from_dict(tensors={"responses": responses, "response_mask": mask, "prompts": prompts,
                                         "attention_mask": torch.cat([torch.ones_like(prompts), mask.long()], 1)},
                                non_tensors={"uid": uid}, meta_info={"global_token_num": [int(mask.sum()) + 3 * len(uid)]})
    trainer = object.__new__(trainer_cls)  # the two steps read only these attributes
    trainer.config = OmegaConf.create({"algorithm": _algorithm(), "actor_rollout_ref": {"rollout": {"n": 4}}})
    trainer.metrics, trainer.timing_raw, trainer.use_critic = {}, {"step": 1.0}, False
    trainer.reward_tensor, trainer.reward_extra_infos_dict = scores, {"acc": acc.tolist()}
    trainer.resource_pool_manager = type("Pool", (), {"get_n_gpus": lambda self: 1})()
    out = trainer._fit_compute_advantage(batch)
    trainer._fit_collect_metrics(out)
    want = token_advantage(responses, mask, scores, uid, config=KTAE, correct=torch.as_tensor(acc))
    assert torch.equal(out.batch["advantages"], want)
    assert METRIC_KEYS | {"ktae/label_source/acc", "ktae/backend/torch"} <= set(trainer.metrics)
    assert "critic/score/mean" in trainer.metrics and "ktae_metrics" not in out.meta_info


def test_metrics_modes():
    responses, mask, scores, uid = _verl_batch(seed=7)
    logged = METRIC_KEYS | {"ktae/backend/torch", "ktae/label_source/token_level_scores"}  # torch: no kernel threads
    for mode, names in [("off", set()), ("advantages", logged),
                        ("scores", logged | {"ktae/distinct_tokens_per_group"})]:
        step = ktae_verl.StepInputs(responses=responses, scores=scores, metrics={})
        with ktae_verl.provide_step(step):
            ktae_verl.compute_ktae_advantage(scores, mask, index=uid, config=_algorithm(ktae={"metrics": mode}))
        assert set(step.metrics) == names, mode
    if "cpu" in ktae_kernels.available_backends("cpu"):  # the native kernel: its threads are logged
        step = ktae_verl.StepInputs(responses=responses, scores=scores, metrics={})
        with ktae_verl.provide_step(step):
            ktae_verl.compute_ktae_advantage(scores, mask, index=uid, config=_algorithm(ktae={"backend": "cpu",
                                                                                                 "threads": 1}))
        assert step.metrics["ktae/backend/cpu"] == 1.0 and step.metrics["ktae/threads"] == 1.0
    cheap, full = ({k: v for k, v in s.items() if k != "ktae/time_ms"} for s in (
        ktae_verl.ktae_step(responses, mask, scores, uid, ktae_verl.ktae_settings(_algorithm(ktae={"metrics": m})))[1]
        for m in ("advantages", "scores")))
    for k, v in cheap.items():
        assert full[k] == pytest.approx(v, abs=1e-5)


# ------------------------------------------------------------------- labels: reward_extra_info first
def test_labels_fall_back_to_the_task_score_and_correct_key_names_the_record():
    responses, mask, scores, uid = _verl_batch(seed=9)
    B = len(uid)
    flags = np.arange(B) % 2 == 0
    cases = [({"acc": list(flags)}, {}, flags, "acc"),                      # the default record
             ({"acc": [True] * (B - 1) + [None]}, {}, scores.sum(1) > 0, "token_level_scores"),  # a row lacks it
             ({"judge": list(flags)}, {"correct_key": "judge"}, flags, "judge"),
             ({"acc": list(flags)}, {"correct_key": None}, scores.sum(1) > 0, "token_level_scores")]
    for extra, ktae, labels, source in cases:
        step = ktae_verl.StepInputs(responses=responses, scores=scores, extra=extra, metrics={})
        with ktae_verl.provide_step(step):
            adv, _ = ktae_verl.compute_ktae_advantage(scores, mask, index=uid, config=_algorithm(ktae=ktae))
        want = token_advantage(responses, mask, scores.sum(1), uid, config=KTAE, correct=torch.as_tensor(labels))
        assert torch.equal(adv, want), source
        assert step.metrics[f"ktae/label_source/{source}"] == 1.0


def test_legacy_labels_from_non_tensor_acc():
    """The legacy trainer puts ``reward_extra_info`` columns into ``non_tensor_batch`` before the advantage."""
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer", reason="verl trainer deps missing: '.[verl]'")
    responses, mask, scores, uid = _verl_batch(seed=10)
    acc = np.array([i % 3 == 0 for i in range(len(uid))])
    data = DataProto.from_dict(tensors={"responses": responses, "response_mask": mask, "token_level_scores": scores,
                                        "token_level_rewards": scores},
                               non_tensors={"uid": uid, "acc": acc})
    out = ray_trainer.compute_advantage(data, adv_estimator="ktae", config=_algorithm())
    expected = token_advantage(responses, mask, scores, uid, config=KTAE, correct=torch.as_tensor(acc))
    assert torch.equal(out.batch["advantages"], expected)
    assert out.meta_info["ktae_metrics"]["ktae/label_source/acc"] == 1.0


# ---------------------------------------------------------------- misspelled sections and --check
def test_a_section_misspelled_close_to_ktae_fails_at_start_up():
    from verl.utils import config as verl_config

    bad = _compose("algorithm.adv_estimator=ktae", "+algorithm.ktea.weight=0")
    with pytest.raises(ValueError, match="algorithm.ktea looks like a misspelled algorithm.ktae section"):
        verl_config.validate_config(bad, use_reference_policy=False, use_critic=False)
    good = _compose("algorithm.adv_estimator=ktae", "+algorithm.ktae.weight=0")
    assert ktae_verl.check_trainer_config(good).config.weight == 0  # verl's own algorithm keys pass
    assert ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=grpo", "+algorithm.ktea.weight=0")) is None


def test_check_names_a_bad_section_and_passes_a_good_one():
    from ktae_kernels.integrations.verl.check import config_problem

    assert config_problem(["algorithm.adv_estimator=ktae", "+algorithm.ktae.alpha=2.0"]) is None
    assert "unknown keys ['alhpa']" in config_problem(["algorithm.adv_estimator=ktae", "+algorithm.ktae.alhpa=2"])
    assert "misspelled" in config_problem(["algorithm.adv_estimator=ktae", "+algorithm.ktea.weight=0"])
    assert "algorithm.ktae_weight looks like a misspelled" in config_problem(["algorithm.adv_estimator=ktae",
                                                                               "+algorithm.ktae_weight=0.5"])
    for bad in ("null", "3.5"):  # a ValueError naming the setting, not a TypeError traceback
        problem = config_problem(["algorithm.adv_estimator=ktae", f"+algorithm.ktae.ignore_token_ids={bad}"])
        assert problem is not None and "algorithm.ktae.ignore_token_ids must be a token id or a list of them" in problem
    assert "not 'ktae'" in config_problem(["algorithm.adv_estimator=grpo"])
    for bad in ("gpu", "null"):  # a typo, or Hydra's null (the string "None" once str() was applied)
        problem = config_problem(["algorithm.adv_estimator=ktae", f"+algorithm.ktae.backend={bad}"])
        assert problem is not None and "algorithm.ktae.backend must be 'auto' or one of ('reference'" in problem
    assert config_problem(["algorithm.adv_estimator=ktae", "+algorithm.ktae.backend=torch"]) is None


@pytest.mark.slow
def test_check_says_why_the_plugin_does_not_load(tmp_path):
    """In a fresh process: plugins switched off, or the adapter failing to import (verl logs it at DEBUG
    only), are named; VERL_USE_EXTERNAL_MODULES loads it."""
    from ktae_kernels.integrations.verl.check import plugin_problem

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""}
    problem = plugin_problem(env)
    assert problem.startswith("`import verl` does not register the 'ktae' estimator: ")
    if VERL_VERSION >= (0, 9):
        assert "VERL_USE_EXTERNAL_PLUGINS=none turns verl's plugin discovery off" in problem
        assert "pip-install" not in problem and "pip install" not in problem
    assert plugin_problem({**env, "VERL_USE_EXTERNAL_MODULES": "ktae_kernels.integrations.verl"}) is None
    (tmp_path / "sitecustomize.py").write_text(  # a broken install: one of the adapter's modules fails to import
        "import sys\n"
        "class Broken:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ktae_kernels.integrations.verl.settings':\n"
        "            raise ImportError('a broken install')\n"
        "sys.meta_path.insert(0, Broken())\n")
    problem = plugin_problem({**env, "VERL_USE_EXTERNAL_PLUGINS": "auto",
                              "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])})
    assert "raises" in problem and "DEBUG" in problem and "a broken install" in problem


def test_check_names_the_real_cause_of_an_unregistered_estimator():
    """Each cause verl has for loading no adapter, named with its fix (and never "pip-install" where the
    package is installed and only verl's switch keeps it out)."""
    from ktae_kernels.integrations.verl.check import MODULE, unregistered_cause

    point = "ktae_kernels.integrations.verl"
    off = unregistered_cause({"VERL_USE_EXTERNAL_PLUGINS": "None "}, "0.9.1", point)
    assert off.startswith("VERL_USE_EXTERNAL_PLUGINS=none turns verl's plugin discovery off") and "install" not in off
    listed = unregistered_cause({"VERL_USE_EXTERNAL_PLUGINS": "other,plugin"}, "0.9.1", point)
    assert "loads only the entry points it names, and not 'ktae': add ktae to it" in listed
    assert "install" not in unregistered_cause({"VERL_USE_EXTERNAL_PLUGINS": "other, ktae"}, "0.9.1", point)
    assert "pip-installed" in unregistered_cause({}, "0.9.1", None)
    assert "verl 0.8.0 loads no verl.plugins entry points" in unregistered_cause({}, "0.8.0", None)
    for cause in (off, listed):
        assert cause.endswith(f"set VERL_USE_EXTERNAL_MODULES={MODULE}")


def test_a_moved_patch_target_fails_at_start_up(monkeypatch):
    """A v1 ``PPOTrainer`` without ``_compute_advantage`` is recorded when verl's module is patched (a run
    without KTAE goes on), and a "ktae" run fails at start-up naming verl's version and what KTAE
    expected; the first advantage step says the same. The legacy trainer, untouched, still passes."""
    from verl.trainer.ppo.v1 import trainer_base

    from ktae_kernels.integrations.shared import FrameworkMismatchError
    from ktae_kernels.integrations.verl import framework, trainers

    monkeypatch.setitem(framework.PATCH_PROBLEMS, framework.V1_MODULE, "")  # restored after the test
    monkeypatch.setattr(trainer_base, "PPOTrainer", type("PPOTrainer", (), {}))
    trainers.PATCHES[framework.V1_MODULE](trainer_base)
    expected = (rf"verl {verl.__version__}: verl.trainer.ppo.v1.trainer_base has no PPOTrainer._compute_advantage\. "
                r"KTAE expected verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage: the v1 trainer's")
    with pytest.raises(FrameworkMismatchError, match=expected):
        ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae"))
    assert ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=grpo")) is None
    assert ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae", "trainer.use_v1=false")) is not None
    responses, mask, scores, uid = _verl_batch()
    with pytest.raises(FrameworkMismatchError, match="has no PPOTrainer._compute_advantage"):
        ktae_verl.compute_ktae_advantage(scores, mask, uid, _algorithm())
    from ktae_kernels.integrations.verl.check import config_problem

    assert "has no PPOTrainer._compute_advantage" in config_problem(["algorithm.adv_estimator=ktae"])


def test_a_moved_experimental_target_fails_at_start_up(monkeypatch):
    """Where verl's experimental trainers' base is imported (their entry points import it before they
    validate the config), a ``compute_data_metrics`` gone from it fails a "ktae" run at start-up."""
    from ktae_kernels.integrations.shared import FrameworkMismatchError
    from ktae_kernels.integrations.verl import framework, trainers

    separation = pytest.importorskip(framework.SEPARATION_MODULE, reason="verl's experimental trainers do not import")
    monkeypatch.setitem(framework.PATCH_PROBLEMS, framework.SEPARATION_MODULE, "")  # restored after the test
    monkeypatch.delattr(separation, "compute_data_metrics")
    trainers.PATCHES[framework.SEPARATION_MODULE](separation)
    with pytest.raises(FrameworkMismatchError, match=r"verl.experimental.separation.ray_trainer has no "
                                                     r"compute_data_metrics\. KTAE expected .*experimental trainers"):
        ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae"))


def test_verl_version_is_checked_against_the_supported_range(monkeypatch):
    from ktae_kernels.integrations.shared import FrameworkMismatchError

    monkeypatch.setattr(verl, "__version__", "0.5.0")
    with pytest.raises(FrameworkMismatchError, match=r"KTAE supports verl >= 0.6, < 0.10; found verl 0.5.0"):
        ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae"))
    monkeypatch.setattr(verl, "__version__", "0.10.0")
    monkeypatch.delenv("KTAE_ALLOW_UNTESTED", raising=False)
    with pytest.raises(FrameworkMismatchError, match=r"KTAE supports verl >= 0.6, < 0.10; found verl 0.10.0, .* set "
                                                     r"KTAE_ALLOW_UNTESTED=verl to run with a warning"):
        ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae"))
    monkeypatch.setenv("KTAE_ALLOW_UNTESTED", "verl")
    with pytest.warns(RuntimeWarning, match=r"tested with verl >= 0.6, < 0.10; found verl 0.10.0, allowed by"):
        ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktae"))


def test_a_misspelled_estimator_name_close_to_ktae_fails_at_start_up():
    with pytest.raises(ValueError, match="algorithm.adv_estimator='ktea' is not a verl estimator; did you mean 'ktae'"):
        ktae_verl.check_trainer_config(_compose("algorithm.adv_estimator=ktea"))
    for name in ("grpo", "gae", "rloo", "reinforce_plus_plus"):
        assert ktae_verl.check_trainer_config(_compose(f"algorithm.adv_estimator={name}")) is None


def test_check_command_exits_non_zero_saying_why(monkeypatch, capsys):
    from ktae_kernels.integrations.verl import check

    monkeypatch.setattr(check, "plugin_problem", lambda: None)  # probed for real in the slow test above
    assert check.main(["--check", "algorithm.adv_estimator=ktae", "+algorithm.ktae.alhpa=1"]) == 1
    assert "ktae check failed: algorithm.ktae has unknown keys ['alhpa']" in capsys.readouterr().err
    assert check.main(["--check", "algorithm.adv_estimator=ktae", "+algorithm.ktae.alpha=2"]) == 0
    assert "ktae check passed" in capsys.readouterr().out
    monkeypatch.setattr(check, "plugin_problem", lambda: "`import verl` does not register the 'ktae' estimator")
    assert check.main(["--check", "algorithm.adv_estimator=ktae"]) == 1
    assert "does not register" in capsys.readouterr().err


class _CharTokenizer:
    """One token per character (id = code point): what a reward manager needs to decode a response."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if int(i) > 0)


def test_v1_labels_under_verls_own_dapo_reward_manager(monkeypatch):
    """verl's DAPO reward manager (math_dapo score, overlong buffer of 4 in 16 tokens) scores each response;
    rows stored as verl's agent loop stores them reach verl's v1 ``_compute_advantage``: a correct answer
    at the maximum length has ``rm_scores`` 1 - 1 = 0 but ``acc`` True, and KTAE labels it correct."""
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl v1 deps missing: '.[verl]'")
    dapo = pytest.importorskip("verl.experimental.reward_loop.reward_manager.dapo", reason="no reward-loop DAPO manager")
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    max_len = 16
    config = OmegaConf.create({"reward": {"reward_kwargs": {"max_resp_len": max_len, "overlong_buffer_cfg": {
        "enable": True, "len": 4, "penalty_factor": 1.0, "log": False}}}})
    manager = dapo.DAPORewardManager(config, _CharTokenizer(), None)
    padded = " " * 7 + "Answer: 5"  # correct, exactly max_len tokens: penalty -1
    texts = {"p0": ["Answer: 5", "Answer: 7", padded, "Answer: 7"], "p1": ["Answer: 5", "so Answer: 7", "Answer: 7", padded]}
    rows, uid = [], []
    for prompt, answers in texts.items():
        for text in answers:
            ids = torch.tensor([ord(c) for c in text] + [0] * (max_len - len(text)))
            data = DataProto.from_dict(
                tensors={"responses": ids[None], "prompts": torch.tensor([[81]]),
                         "attention_mask": torch.cat([torch.ones(1, dtype=torch.long), (ids > 0).long()])[None]},
                non_tensors={"data_source": np.array(["math_dapo"], dtype=object),
                             "reward_model": np.array([{"ground_truth": "5"}], dtype=object)})
            out = manager.loop.run_until_complete(manager.run_single(data))
            n = len(text)
            score = torch.zeros(n)
            score[-1] = float(out["reward_score"])
            rows.append({"responses": ids[:n], "response_mask": torch.ones(n, dtype=torch.long), "rm_scores": score,
                         "uid": prompt, "extra_fields": {"reward_extra_info": out["reward_extra_info"]}})
            uid.append(prompt)
    acc = torch.tensor([bool(r["extra_fields"]["reward_extra_info"]["acc"]) for r in rows])
    task = torch.stack([r["rm_scores"].sum() for r in rows])
    assert acc.tolist() == [True, False, True, False, True, False, False, True]
    assert task[2] == 0 and task[7] == 0  # the correct answers at the maximum length
    fake = FakeTransferQueue(list_of_dict_to_tensordict(rows))
    monkeypatch.setattr(trainer_base, "tq", fake)
    trainer = object.__new__(trainer_base.get_trainer_cls("sync"))
    trainer.config = OmegaConf.create({"algorithm": _algorithm(), "actor_rollout_ref": {"rollout": {"n": 4}}})
    metrics = {}
    trainer._compute_advantage(Meta([f"{u}_{i}_0" for i, u in enumerate(uid)]), metrics=metrics)
    got = fake.put["advantages"].to_padded_tensor(padding=0.0)
    responses = torch.nn.utils.rnn.pad_sequence([r["responses"] for r in rows], batch_first=True)
    mask = responses > 0
    index = np.array(uid, dtype=object)
    rewards = torch.nn.utils.rnn.pad_sequence([r["rm_scores"] for r in rows], batch_first=True)
    want = token_advantage(responses, mask, rewards, index, config=KTAE, correct=acc)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.equal(want, token_advantage(responses, mask, rewards, index, config=KTAE, correct=task > 0))
    assert metrics["ktae/label_source/acc"] == 1.0
