"""verl adapter against the installed verl: plugin entry point, estimator contract, idempotent
registration, the legacy trainer's compute_advantage and the v1 trainer's _compute_advantage."""
from __future__ import annotations

import importlib
import importlib.metadata
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
from ktae_kernels import KTAEConfig, token_advantage  # noqa: E402
from ktae_kernels.integrations import verl as ktae_verl  # noqa: E402

SETTINGS = {"alpha": 1.0, "beta": 2.0, "ignore_token_ids": [3], "backend": "torch"}
KTAE = KTAEConfig(alpha=1.0, beta=2.0, ignore_token_ids=(3,))


def _verl_batch(seed: int = 0):
    """(responses, response_mask float, token_level_rewards [bs, T] with the reward on the last
    response token, uid object array), as verl builds them."""
    _, responses, mask, rewards, index = random_cases(seed=seed, small=True)[1]
    lengths = mask.sum(1).clamp(min=1)  # right-padded responses of at least one token
    mask = torch.arange(mask.shape[1])[None, :] < lengths[:, None]
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
    token_rewards[torch.arange(mask.shape[0]), lengths - 1] = rewards
    uid = np.array([f"uid-{int(g)}-{seed}" for g in index], dtype=object)
    return responses, mask.float(), token_rewards, uid


def _algorithm(**extra):
    return OmegaConf.create({"adv_estimator": "ktae", "norm_adv_by_std_in_grpo": True, "gamma": 1.0, "lam": 1.0,
                             "use_kl_in_reward": False, "ktae": dict(SETTINGS), **extra})


def test_entry_point_registers_on_import_verl():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    if names.get("ktae") != "ktae_kernels.integrations.verl":
        pytest.skip("ktae_kernels is not pip-installed here, so its verl.plugins entry point is absent")
    if LOADED_BEFORE_VERL:
        pytest.skip("the adapter was imported before verl in this session")
    assert LOADED_BY_VERL
    assert core_algos.get_adv_estimator_fn("ktae") is ktae_verl.compute_ktae_advantage


def test_estimator_contract_matches_token_advantage():
    responses, mask, token_rewards, uid = _verl_batch()
    fn = core_algos.get_adv_estimator_fn("ktae")
    adv, ret = fn(token_level_rewards=token_rewards, response_mask=mask, config=_algorithm(), index=uid,
                  responses=responses, reward_baselines=None)
    expected = token_advantage(responses, mask, token_rewards.sum(1), uid, config=KTAE)
    assert adv.dtype == torch.float32 and adv.shape == mask.shape and ret is adv
    assert torch.equal(adv, expected)
    with ktae_verl.provide_responses(responses):
        dr, _ = fn(token_level_rewards=token_rewards, response_mask=mask, index=uid,
                   config=_algorithm(norm_adv_by_std_in_grpo=False))
    mean = token_advantage(responses, mask, token_rewards.sum(1), uid, config=KTAEConfig(
        alpha=1.0, beta=2.0, ignore_token_ids=(3,), baseline="mean"))
    assert torch.equal(dr, mean) and not torch.equal(dr, adv)


def test_missing_inputs_and_bad_settings_are_named():
    responses, mask, token_rewards, uid = _verl_batch()
    with pytest.raises(ValueError, match="VERL_USE_EXTERNAL_MODULES"):
        ktae_verl.compute_ktae_advantage(token_rewards, mask, index=uid, config=None)
    with pytest.raises(ValueError, match="index"):
        ktae_verl.compute_ktae_advantage(token_rewards, mask, config=None, responses=responses)
    with pytest.raises(ValueError, match="algorithm.ktae has unknown keys \\['alhpa'\\]"):
        ktae_verl.compute_ktae_advantage(token_rewards, mask, index=uid, responses=responses,
                                         config=OmegaConf.create({"ktae": {"alhpa": 1.0}}))


def test_registering_twice_and_reloading_do_not_raise(monkeypatch):
    ktae_verl.register()
    ktae_verl.register()
    reloaded = importlib.reload(ktae_verl)
    assert core_algos.get_adv_estimator_fn("ktae") is reloaded.compute_ktae_advantage
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "ktae", lambda **kw: None)
    with pytest.raises(ValueError, match="already registered"):
        reloaded.register()


def test_legacy_compute_advantage_passes_responses():
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer", reason="verl trainer deps missing: '.[verl]'")
    importlib.import_module("ktae_kernels.integrations.verl_trainers")
    responses, mask, token_rewards, uid = _verl_batch(seed=1)
    data = DataProto.from_dict(tensors={"responses": responses, "response_mask": mask,
                                        "token_level_rewards": token_rewards}, non_tensors={"uid": uid})
    out = ray_trainer.compute_advantage(data, adv_estimator="ktae", config=_algorithm())
    expected = token_advantage(responses, mask, token_rewards.sum(1), uid, config=KTAE)
    assert torch.equal(out.batch["advantages"], expected) and torch.equal(out.batch["returns"], expected)
    grpo = ray_trainer.compute_advantage(data, adv_estimator="grpo", config=_algorithm())
    ref, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, uid)
    assert torch.equal(grpo.batch["advantages"], ref)


class _FakeTransferQueue:
    """The two TransferQueue calls verl's v1 ``_compute_advantage`` makes, over one TensorDict."""

    def __init__(self, store):
        self.store, self.put = store, None

    def kv_batch_get(self, keys, partition_id, select_fields):
        return self.store.select(*[f for f in select_fields if f in self.store.keys()])

    def kv_batch_put(self, keys, partition_id, fields):
        self.put = fields
        return _Meta(keys)


class _Meta:
    def __init__(self, keys):
        self.keys, self.partition_id, self.extra_info = keys, "train", {}

    def __len__(self):
        return len(self.keys)


def test_v1_trainer_mode_fetches_responses(monkeypatch):
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl v1 deps missing: '.[verl]'")
    import transfer_queue
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    trainers = importlib.import_module("ktae_kernels.integrations.verl_trainers")
    cls = trainer_base.get_trainer_cls("ktae_sync")
    assert cls is trainers.KTAEPPOTrainerSync and issubclass(cls, trainers.KTAEResponsesMixin)
    responses, mask, token_rewards, uid = _verl_batch(seed=2)
    lengths = mask.long().sum(1).tolist()
    nested = lambda t: torch.nested.as_nested_tensor([row[:n] for row, n in zip(t, lengths)], layout=torch.jagged)  # noqa: E731
    store = TensorDict({"responses": nested(responses), "response_mask": nested(mask.long()),
                        "rm_scores": nested(token_rewards), "uid": NonTensorStack(*uid.tolist())},
                       batch_size=len(uid))
    fake = _FakeTransferQueue(store)
    monkeypatch.setattr(trainer_base, "tq", fake)
    monkeypatch.setattr(transfer_queue, "kv_batch_get", fake.kv_batch_get)
    trainer = object.__new__(cls)  # _compute_advantage reads only the config
    trainer.config = OmegaConf.create({"algorithm": _algorithm(), "actor_rollout_ref": {"rollout": {"n": 4}}})
    keys = [f"{u}_0_{i}" for i, u in enumerate(uid)]
    trainer._compute_advantage(_Meta(keys), metrics={})
    got = fake.put["advantages"].to_padded_tensor(padding=0.0)
    T = got.shape[1]
    expected = token_advantage(responses[:, :T], mask[:, :T], token_rewards.sum(1), uid, config=KTAE)
    assert torch.equal(got, expected)
