"""OpenRLHF adapter against the real OpenRLHF (installed with ``--no-deps``; flash_attn, deepspeed and
vllm stubbed by ``openrlhf_stubs``): ``train_ppo_ray``'s own parser and checks, ``SamplesGenerator``'s
Experience layout (multi-turn action ranges, truncation), ``split_rollout_samples`` (micro-batches and
dynamic batching), ``compute_approx_kl``, the length penalties and ``compute_advantages_and_returns``,
all run by ``RemoteExperienceMaker.make_experience_batch`` through the patched class. Only the model
forward passes are stand-ins (``openrlhf_real.ForwardGroup``). The expected values come from the
reference backend on the action tokens listed from the vLLM responses, added to what OpenRLHF's own
class computes without KTAE."""
from __future__ import annotations

import importlib
import os
import sys
import warnings

import pytest
import torch

from ktae_kernels import KTAEConfig, token_advantage
from ktae_kernels.integrations import openrlhf as ktae_openrlhf
from ktae_kernels.integrations.shared import AdapterSettings, FrameworkMismatchError


@pytest.fixture(scope="module")
def real():
    """``openrlhf_real``: the real OpenRLHF, imported with its CUDA-only packages stubbed."""
    pytest.importorskip("openrlhf", reason="OpenRLHF not installed: pip install --no-deps openrlhf==0.11.2")
    import openrlhf_real

    return openrlhf_real


@pytest.fixture
def trainer_module(real, monkeypatch):
    """OpenRLHF's real trainer module; what a test patches there is undone after it."""
    module = real.ppo_trainer
    monkeypatch.setattr(module, "RemoteExperienceMaker", module.RemoteExperienceMaker)
    monkeypatch.setattr(module.BasePPOTrainer, "__init__", module.BasePPOTrainer.__init__)
    return module


def _maker_class(real, settings):
    return type("Maker", (ktae_openrlhf.KTAEExperienceMakerMixin, real.experience_maker.RemoteExperienceMaker),
                {"ktae_settings": settings})


def _action_tokens(real, items, max_len):
    """Each response's action tokens listed from its ``action_ranges``, cut at the context window."""
    return [[t for start, end in item["action_ranges"] for t in item["observation_tokens"][start:min(end, max_len)]]
            for item in items]


def _reference_term(tokens, correct, config):
    """float32 ``[B, max tokens]``: the reference backend's ``weight * score`` of the listed action tokens."""
    width = max(len(t) for t in tokens)
    ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens], dtype=torch.bool)
    group = torch.arange(len(tokens)) // 4
    zero = torch.zeros(len(tokens), dtype=torch.float64)
    return token_advantage(ids, mask, correct.double(), group, config=config, backend="reference",
                           rollout_advantage=zero, correct=correct)


def _check_advantages(got, base, term, samples, tokens):
    """Each row of ``got`` is OpenRLHF's own advantage (``base``) plus the reference term of its rollout's
    action tokens at the positions its action mask marks (the layout: ``sequences[:, 1:]``)."""
    assert torch.any(term != 0)
    checked = 0
    for e, b in zip(got, base):
        assert e.index == b.index and e.advantages.shape == b.advantages.shape == e.action_mask.shape
        torch.testing.assert_close(e.returns, b.returns, rtol=0, atol=0)
        for row, i in enumerate(e.index):
            positions = torch.nonzero(e.action_mask[row]).reshape(-1)
            assert e.sequences[row, 1:][positions].tolist() == tokens[i]
            want = b.advantages[row].clone()
            want[positions] += term[i, :len(positions)]
            torch.testing.assert_close(e.advantages[row], want, rtol=0, atol=1e-6)
            checked += 1
    assert checked == len(samples)


def _run(real, flags, settings, seed=0, scored=True):
    """(items, samples, OpenRLHF's experiences, the patched class's experiences) of one batch."""
    args = real.parse_args(flags)
    items = real.responses(seed, scored=scored)
    samples = real.rollout_samples(args, items)
    base = real.make_experiences(real.build_maker(args), samples)
    got = real.make_experiences(real.build_maker(args, _maker_class(real, settings)), samples)
    return args, items, samples, base, got


# --------------------------------------------------------------------------------- OpenRLHF's CLI
def test_train_ppo_ray_parses_and_checks_the_flags_ktae_needs(real):
    """OpenRLHF's own parser and checks: the estimator, the group size and the reward settings KTAE reads
    land where the adapter reads them; dynamic batching switches packing on as OpenRLHF does."""
    args = real.parse_args(real.FLAGS + real.OVERLONG + ["--algo.advantage.estimator", "rloo",
                                                         "--reward.remote_url", "reward.py"])
    assert ktae_openrlhf.check_estimator(args.algo.advantage.estimator) == "rloo"
    assert args.rollout.n_samples_per_prompt == real.N and args.reward.remote_url == ["reward.py"]
    assert (args.rollout.max_new_tokens, args.reward.overlong_buffer_len) == (10, 4.0)
    dynamic = real.parse_args(real.FLAGS + real.DYNAMIC + ["--reward.remote_url", "reward.py"])
    assert dynamic.train.dynamic_batch_enable and dynamic.ds.packing_samples
    assert dynamic.algo.advantage.estimator == "gae"  # OpenRLHF's default, which KTAE refuses
    with pytest.raises(ValueError, match=r"--algo.advantage.estimator one of .* \(got 'gae'\)"):
        ktae_openrlhf.check_estimator(dynamic.algo.advantage.estimator)


def test_experience_layout_multi_turn_and_truncation(real):
    """``SamplesGenerator`` marks action tokens over ``sequences[1:]``; tool output between turns is not an
    action, and the context window cuts long rollouts: the adapter reads exactly the listed action tokens."""
    args = real.parse_args(real.FLAGS + ["--algo.advantage.estimator", "group_norm"])
    items = real.responses(0)
    samples = real.rollout_samples(args, items)
    tokens = _action_tokens(real, items, args.data.max_len)
    assert any(len(item["action_ranges"]) == 2 for item in items)
    assert any(len(item["observation_tokens"]) > args.data.max_len for item in items)
    for sample, listed in zip(samples, tokens):
        assert sample.action_mask.shape[1] == sample.sequences.shape[1] - 1
        assert sample.sequences[0, 1:][sample.action_mask[0].bool()].tolist() == listed


@pytest.mark.parametrize("kl", [0.0, 0.05], ids=["no_kl", "kl"])
@pytest.mark.parametrize("estimator", ktae_openrlhf.ESTIMATORS)
def test_every_estimator_adds_the_reference_term_to_openrlhfs_advantages(real, estimator, kl):
    """For every estimator KTAE accepts, with and without the KL reward (``compute_approx_kl``), under
    DAPO's overlong penalty: the patched class's advantages are OpenRLHF's own (whitened for
    ``reinforce`` / ``reinforce_baseline``) plus ``weight * score``, added after the whitening; labels
    from the reward function's ``acc``."""
    flags = real.FLAGS + real.OVERLONG + ["--algo.advantage.estimator", estimator, "--algo.kl.init_coef", str(kl),
                                          "--reward.remote_url", "reward.py"]
    settings = AdapterSettings(KTAEConfig(), metrics="off")
    args, items, samples, base, got = _run(real, flags, settings)
    tokens = _action_tokens(real, items, args.data.max_len)
    acc = torch.tensor([item["extra_logs"]["acc"] for item in items]) > 0
    _check_advantages(got, base, _reference_term(tokens, acc, settings.config), samples, tokens)
    assert (kl > 0) == any(bool(torch.any(e.info["kl"] != 0)) for e in base)


@pytest.mark.parametrize("estimator", ["group_norm", "reinforce_baseline"])
def test_dynamic_batching_regroups_rollouts_by_index(real, estimator):
    """Seqlen-balanced micro-batches (``split_rollout_samples`` with dynamic batching) reorder rollouts:
    groups still come from each rollout's ``index``."""
    flags = real.FLAGS + real.DYNAMIC + ["--algo.advantage.estimator", estimator, "--algo.kl.init_coef", "0.05",
                                         "--reward.remote_url", "reward.py"]
    settings = AdapterSettings(KTAEConfig(weight=0.5, fisher="upstream"), metrics="off")
    args, items, samples, base, got = _run(real, flags, settings, seed=3)
    order = [i for e in got for i in e.index]
    assert sorted(order) == list(range(len(items))) and order != sorted(order)
    tokens = _action_tokens(real, items, args.data.max_len)
    acc = torch.tensor([item["extra_logs"]["acc"] for item in items]) > 0
    _check_advantages(got, base, _reference_term(tokens, acc, settings.config), samples, tokens)


# -------------------------------------------------------------------------------------- labels
def test_reward_model_path_labels_from_the_reward_before_overlong_shaping(real):
    """No ``scores`` and no ``acc`` (a reward model): the labels come from the reward model's output as
    it came in, not from the rewards OpenRLHF's overlong penalty shaped in place, so no correct rollout
    is labelled wrong although the penalty brings some correct ones to 0 or below."""
    flags = real.FLAGS + real.OVERLONG + ["--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0"]
    settings = AdapterSettings(KTAEConfig(), metrics="advantages")
    args, items, samples, base, got = _run(real, flags, settings, seed=1, scored=False)
    assert all(s.rewards is None and s.scores is None for s in samples)
    correct = torch.cat([real.reward_model(s.sequences, s.attention_mask) for s in samples]) > 0
    shaped = torch.empty(len(items))
    for e in base:
        shaped[torch.tensor(e.index)] = e.rewards.float()
    assert torch.any(correct & (shaped <= 0)), "the overlong penalty must bring a correct rollout to <= 0"
    tokens = _action_tokens(real, items, args.data.max_len)
    _check_advantages(got, base, _reference_term(tokens, correct, settings.config), samples, tokens)
    assert all(float(e.info["ktae/label_source/reward"][0]) == 1.0 for e in got)


def test_label_source_preference_acc_then_scores_then_rewards(real):
    """``info[correct_key]`` (the reward function's ``extra_logs``) over the binary ``scores`` over the
    rewards before shaping; the source is logged as ``ktae/label_source/<name>``."""
    flags = real.FLAGS + real.OVERLONG + ["--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
                                          "--reward.remote_url", "reward.py"]
    args = real.parse_args(flags)
    items = real.responses(2)
    for k, item in enumerate(items):  # three different verdicts, so that each source gives other labels
        item["extra_logs"] = {"acc": float(k % 3 == 0)}
        item["scores"] = float(k % 2 == 0)
    samples = real.rollout_samples(args, items)
    base = real.make_experiences(real.build_maker(args), samples)
    tokens = _action_tokens(real, items, args.data.max_len)
    k = torch.arange(len(items))
    reward = torch.tensor([item["reward"] for item in items]) > 0
    for correct_key, no_scores, source, labels in [("acc", False, "acc", k % 3 == 0), (None, False, "scores", k % 2 == 0),
                                                   (None, True, "reward", reward)]:
        settings = AdapterSettings(KTAEConfig(), metrics="advantages", correct_key=correct_key)
        run = real.rollout_samples(args, items)
        if no_scores:
            for s in run:
                s.scores = None
        got = real.make_experiences(real.build_maker(args, _maker_class(real, settings)), run)
        _check_advantages(got, base, _reference_term(tokens, labels, settings.config), samples, tokens)
        names = [n for n in got[0].info if n.startswith("ktae/label_source/")]
        assert names == [f"ktae/label_source/{source}"], source


def test_metrics_reach_every_experiences_info(real):
    from ktae_kernels import key_token_scores
    from ktae_kernels.metrics import ktae_metrics

    flags = real.FLAGS + ["--algo.advantage.estimator", "dr_grpo", "--algo.kl.init_coef", "0",
                          "--reward.remote_url", "reward.py"]
    settings = AdapterSettings(KTAEConfig(), metrics="scores")
    args, items, samples, base, got = _run(real, flags, settings, seed=4)
    tokens = _action_tokens(real, items, args.data.max_len)
    width = max(map(len, tokens))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens], dtype=torch.bool)
    acc = torch.tensor([item["extra_logs"]["acc"] for item in items])
    want = ktae_metrics(key_token_scores(ids, mask, acc, torch.arange(len(items)) // real.N, backend="reference",
                                         correct=acc > 0))
    for e in got:
        for name, value in want.items():
            assert e.info[name].shape == (len(e.index),)
            assert float(e.info[name][0]) == pytest.approx(value, rel=1e-6)
        assert float(e.info["ktae/time_ms"][0]) > 0


# ----------------------------------------------------------------------------------- start-up
def test_gae_is_refused_when_the_maker_is_built(real, trainer_module):
    """The estimator is checked when OpenRLHF's trainer builds the experience maker (start-up), not at
    the first advantage step."""
    args = real.parse_args(real.FLAGS + ["--reward.remote_url", "reward.py"])
    assert args.algo.advantage.estimator == "gae"
    with pytest.raises(ValueError, match=r"one of .* \(got 'gae'\)"):
        real.build_maker(args, _maker_class(real, AdapterSettings()))
    ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings())
    with pytest.raises(ValueError, match=r"one of .* \(got 'gae'\)"):
        real.TrainerActor(real.FLAGS + ["--reward.remote_url", "reward.py"])


def test_one_rollout_per_prompt_is_refused_when_the_maker_is_built(real, trainer_module):
    """With ``n_samples_per_prompt=1`` every group holds one rollout, so KTAE's term is 0 and training is
    the bare estimator. OpenRLHF refuses that for its group-baseline estimators but not for ``reinforce``;
    KTAE refuses it for every estimator, when the maker is built and in ``add_key_token_scores``."""
    single = ["--rollout.n_samples_per_prompt", "1", "--rollout.micro_batch_size", "1", "--reward.remote_url", "reward.py"]
    args = real.parse_args(real.FLAGS + single + ["--algo.advantage.estimator", "reinforce"])
    assert args.rollout.n_samples_per_prompt == 1  # OpenRLHF's own checks pass
    message = r"KTAE needs groups of rollouts: pass --rollout.n_samples_per_prompt >= 2 \(got 1\)"
    for estimator in ktae_openrlhf.ESTIMATORS:  # also where a launcher skips OpenRLHF's checks
        args.algo.advantage.estimator = estimator
        with pytest.raises(ValueError, match=message):
            real.build_maker(args, _maker_class(real, AdapterSettings()))
    ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings())
    with pytest.raises(ValueError, match=message):
        real.TrainerActor(real.FLAGS + single + ["--algo.advantage.estimator", "reinforce"])
    for n in (1, 0):
        with pytest.raises(ValueError, match=rf"`n_samples_per_prompt` must be >= 2 .*got {n}"):
            ktae_openrlhf.add_key_token_scores([], n_samples_per_prompt=n)


def test_install_patches_the_trainer_module_only_when_it_is_imported(real, monkeypatch):
    """``install`` imports nothing of OpenRLHF; importing the trainer module patches it, and the trainer
    built from its ``BasePPOTrainer`` gets KTAE's experience maker with the settings; installing again
    rebuilds the class on OpenRLHF's own."""
    import openrlhf.trainer

    import openrlhf_stubs

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, ktae_openrlhf.TRAINER_MODULE)
    monkeypatch.setattr(openrlhf.trainer, "ppo_trainer", real.ppo_trainer)
    settings = AdapterSettings(KTAEConfig(top=0.5), backend="torch", metrics="scores")
    ktae_openrlhf.install(settings)
    assert ktae_openrlhf.TRAINER_MODULE not in sys.modules
    with openrlhf_stubs.stubbed():
        module = importlib.import_module(ktae_openrlhf.TRAINER_MODULE)
    assert module is not real.ppo_trainer
    original = real.experience_maker.RemoteExperienceMaker
    assert module.RemoteExperienceMaker.__bases__ == (ktae_openrlhf.KTAEExperienceMakerMixin, original)
    args = real.parse_args(real.FLAGS + ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "r.py"])
    trainer = module.BasePPOTrainer(*_trainer_arguments(real, args))
    assert type(trainer.experience_maker) is module.RemoteExperienceMaker
    assert type(trainer.experience_maker).ktae_settings == settings
    ktae_openrlhf.install(AdapterSettings())
    assert module.RemoteExperienceMaker.__bases__[1] is original
    assert module.RemoteExperienceMaker.ktae_settings == AdapterSettings()
    assert sum(getattr(f, "owner", None) == ktae_openrlhf.__name__ for f in sys.meta_path) == 1


def _trainer_arguments(real, args):
    """``BasePPOTrainer``'s arguments for ``args``: strategy, model groups, vLLM engines, tokenizer."""
    import types

    actor, critic, reward, reference = real.model_groups(args)
    return (types.SimpleNamespace(args=args), actor, critic, reward, reference, None,
            types.SimpleNamespace(pad_token_id=real.PAD))


def _skipping_make_experience_batch(real):
    """``make_experience_batch`` of an OpenRLHF that computes the advantages without calling the overridable
    ``compute_advantages_and_returns`` (it calls its own class's directly): a batch made without KTAE."""
    own = real.experience_maker.RemoteExperienceMaker

    def make_experience_batch(self, rollout_samples):
        experiences = self.make_experience(self.split_rollout_samples(rollout_samples))
        return own.compute_advantages_and_returns(self, experiences)
    return make_experience_batch


@pytest.mark.parametrize("metrics", ["off", "advantages"])
def test_a_maker_that_skips_the_ktae_step_fails_at_the_first_batch(real, trainer_module, monkeypatch, metrics):
    """OpenRLHF's own ``BasePPOTrainer`` builds KTAE's maker; when OpenRLHF's ``make_experience_batch`` no
    longer calls ``compute_advantages_and_returns``, the trainer's first ``train_step`` stops with
    ``FrameworkMismatchError`` before any PPO update, whatever the metrics mode. With OpenRLHF's own
    ``make_experience_batch`` the step runs and is counted."""
    args = real.parse_args(real.FLAGS + ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "r.py"])
    samples = real.rollout_samples(args, real.responses(0))
    ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings(metrics=metrics))
    trainer = trainer_module.BasePPOTrainer(*_trainer_arguments(real, args))
    with real.local_ray():
        made = trainer.experience_maker.make_experience_batch(samples)
    assert trainer.experience_maker.ktae_steps == 1 and len(made) == 3
    assert any(k.startswith("ktae/") for k in made[0].info) == (metrics != "off")

    monkeypatch.setattr(real.experience_maker.RemoteExperienceMaker, "make_experience_batch",
                        _skipping_make_experience_batch(real))
    trainer = trainer_module.BasePPOTrainer(*_trainer_arguments(real, args))
    monkeypatch.setattr(trainer, "ppo_train", lambda *a, **k: pytest.fail("a PPO update ran without KTAE"))
    version = ktae_openrlhf.installed_version()
    with real.local_ray(), pytest.raises(FrameworkMismatchError,
                                         match=rf"OpenRLHF {version}: RemoteExperienceMaker.make_experience_batch made "
                                               r"a batch without calling compute_advantages_and_returns"):
        trainer.train_step(samples, 0)
    assert trainer.experience_maker.ktae_steps == 0


def test_a_moved_patch_target_fails_at_start_up(real, trainer_module, monkeypatch):
    """A trainer module without ``RemoteExperienceMaker`` or ``BasePPOTrainer``, or a trainer that builds
    its maker some other way, fails when the trainer module is patched or the trainer is built, naming
    OpenRLHF's version and what KTAE expected; so does a version below the supported range."""
    import types

    version = ktae_openrlhf.installed_version()
    renamed = types.ModuleType(ktae_openrlhf.TRAINER_MODULE)
    renamed.BasePPOTrainer = trainer_module.BasePPOTrainer
    renamed.ExperienceMaker = trainer_module.RemoteExperienceMaker
    with pytest.raises(FrameworkMismatchError, match=rf"OpenRLHF {version}: .* no class RemoteExperienceMaker.*"
                                                     r"KTAE expected the experience-maker class"):
        ktae_openrlhf.patch_trainer_module(renamed, AdapterSettings())
    renamed.RemoteExperienceMaker = type("RemoteExperienceMaker", (), {  # the batch step renamed
        "compute_advantages_and_returns": trainer_module.RemoteExperienceMaker.compute_advantages_and_returns})
    with pytest.raises(FrameworkMismatchError, match="no class RemoteExperienceMaker with the methods "
                                                     "make_experience_batch and compute_advantages_and_returns"):
        ktae_openrlhf.patch_trainer_module(renamed, AdapterSettings())
    renamed.RemoteExperienceMaker = renamed.ExperienceMaker
    del renamed.BasePPOTrainer
    with pytest.raises(FrameworkMismatchError, match="no class BasePPOTrainer"):
        ktae_openrlhf.patch_trainer_module(renamed, AdapterSettings())

    args = real.parse_args(real.FLAGS + ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "r.py"])
    original = trainer_module.RemoteExperienceMaker
    ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings())
    trainer_module.RemoteExperienceMaker = original  # an OpenRLHF that builds its maker by another name
    with pytest.raises(FrameworkMismatchError, match="built self.experience_maker as RemoteExperienceMaker, not KTAE's"):
        trainer_module.BasePPOTrainer(*_trainer_arguments(real, args))

    monkeypatch.setattr(ktae_openrlhf, "installed_version", lambda: "0.10.1")
    with pytest.raises(FrameworkMismatchError, match=r"KTAE supports OpenRLHF >= 0.10.2, < 0.12; found OpenRLHF 0.10.1"):
        ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings())


def test_an_openrlhf_past_the_range_stops_the_trainer_unless_allowed(real, trainer_module, monkeypatch):
    """OpenRLHF 0.12 fails where the trainer module is patched (start-up), naming the range and the way to run
    anyway; ``KTAE_ALLOW_UNTESTED=openrlhf`` (which ``runtime_env`` carries to the trainer actor) makes it a
    warning."""
    monkeypatch.setattr(ktae_openrlhf, "installed_version", lambda: "0.12.0")
    monkeypatch.delenv("KTAE_ALLOW_UNTESTED", raising=False)
    with pytest.raises(FrameworkMismatchError, match=r"KTAE supports OpenRLHF >= 0.10.2, < 0.12; found OpenRLHF 0.12.0"):
        ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings())
    monkeypatch.setenv("KTAE_ALLOW_UNTESTED", "openrlhf")
    with pytest.warns(RuntimeWarning, match="found OpenRLHF 0.12.0, allowed by"):
        ktae_openrlhf.patch_trainer_module(trainer_module, AdapterSettings())
    assert ktae_openrlhf.runtime_env(environ={"KTAE_ALLOW_UNTESTED": "openrlhf"})["env_vars"]["KTAE_ALLOW_UNTESTED"] == \
        "openrlhf"
    assert "KTAE_ALLOW_UNTESTED" not in ktae_openrlhf.runtime_env(environ={})["env_vars"]


def test_ci_tests_both_ends_of_the_supported_range():
    """The README's whole-suite command installs an OpenRLHF inside the supported range, and CI runs these
    tests again on the oldest supported one."""
    import re
    from pathlib import Path

    from ktae_kernels.integrations.shared import version_tuple

    root = Path(__file__).resolve().parents[1]
    (pinned,) = re.findall(r"openrlhf==([\d.]+)", (root / "README.md").read_text())
    low, below = ktae_openrlhf.MIN_VERSION, ktae_openrlhf.BELOW_VERSION
    assert version_tuple(low) <= version_tuple(pinned) < version_tuple(below)
    assert f"openrlhf=={low}" in (root / ".ci" / "run").read_text()


def test_the_installed_openrlhf_is_in_the_supported_range(real):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ktae_openrlhf.check_trainer_module(real.ppo_trainer) == ktae_openrlhf.installed_version()


# ------------------------------------------------------------------------------- settings, Ray
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
    for bad in ('"gpu"', "null"):  # fails in the launcher and the trainer actor at start-up, not at the first batch
        with pytest.raises(ValueError, match=r"KTAE_OPENRLHF.backend must be 'auto' or one of \('reference'"):
            ktae_openrlhf.settings_from_env({ktae_openrlhf.ENV_VAR: f'{{"backend": {bad}}}'})


def test_a_baseline_openrlhfs_estimator_replaces_is_refused(monkeypatch):
    """OpenRLHF's estimator makes ``A_i``: a ``baseline`` or ``eps`` other than the default would do nothing,
    so the launcher's ``runtime_env`` and the trainer actor's ``install`` refuse it."""
    for config in (KTAEConfig(baseline="mean"), KTAEConfig(eps=1e-3)):
        settings = AdapterSettings(config)
        with pytest.raises(ValueError, match=r"the KTAE settings sets \{'(baseline|eps)': .*\}, which would have no "
                                             r"effect: OpenRLHF's advantage estimator"):
            ktae_openrlhf.runtime_env(settings)
        monkeypatch.setenv(ktae_openrlhf.ENV_VAR, ktae_openrlhf.settings_json(settings))
        with pytest.raises(ValueError, match="which would have no effect"):
            ktae_openrlhf.install()
    monkeypatch.setenv(ktae_openrlhf.ENV_VAR, '{"baseline": "grpo"}')  # the default: nothing is lost
    assert ktae_openrlhf.settings_from_env().config == KTAEConfig()


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


@pytest.mark.slow
def test_real_ray_trainer_actor_from_base_ppo_trainer_gets_the_ktae_maker(real):
    """Real Ray, started with the launcher's runtime_env: a worker that builds no trainer has the hook
    installed but imports nothing of OpenRLHF; an actor built from OpenRLHF's ``BasePPOTrainer`` (its own
    ``__init__`` builds the maker) gets KTAE's with the configured settings, and its advantages equal
    OpenRLHF's own plus the reference term."""
    ray = pytest.importorskip("ray")
    import openrlhf_stubs

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([tests_dir, os.path.dirname(tests_dir), *filter(None, [os.environ.get("PYTHONPATH")])])
    settings = AdapterSettings(KTAEConfig(ignore_token_ids=(5,), weight=0.5), backend="torch", metrics="scores")
    env = ktae_openrlhf.runtime_env(settings, base={"env_vars": {"PYTHONPATH": path, "NCCL_DEBUG": "INFO"}})
    flags = real.FLAGS + ["--algo.advantage.estimator", "reinforce_baseline", "--algo.kl.init_coef", "0.05",
                          "--reward.remote_url", "reward.py"]
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, runtime_env=env, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        plain = ray.get(ray.remote(openrlhf_stubs.worker_state).remote(), timeout=120)
        trainer = ray.remote(num_cpus=0)(real.TrainerActor).remote(flags)
        built = ray.get(trainer.step.remote(seed=5), timeout=120)
    finally:
        ray.shutdown()
    assert plain == {"hooked": True, "openrlhf_imported": False,
                     "env": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "NCCL_DEBUG": "INFO",
                             "TOKENIZERS_PARALLELISM": "true"}}
    assert built["maker"] == "KTAERemoteExperienceMaker" and built["settings"] == settings
    assert built["version"] == ktae_openrlhf.installed_version()
    args = real.parse_args(flags)
    items = real.responses(5)
    samples = real.rollout_samples(args, items)
    base = real.make_experiences(real.build_maker(args), samples)
    got = [type("E", (), {"index": i, "advantages": a, "action_mask": b.action_mask, "returns": b.returns,
                          "sequences": b.sequences})()
           for i, a, b in zip(built["index"], built["advantages"], base)]
    tokens = _action_tokens(real, items, args.data.max_len)
    acc = torch.tensor([item["extra_logs"]["acc"] for item in items]) > 0
    _check_advantages(got, base, _reference_term(tokens, acc, settings.config), samples, tokens)
    for info in built["info"]:  # the torch backend ran: no native kernel threads to report
        assert float(info["ktae/backend/torch"][0]) == 1.0 and "ktae/threads" not in info
        assert "ktae/distinct_tokens_per_group" in info
