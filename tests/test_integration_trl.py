"""TRL adapter against the installed TRL: real GRPO training steps on CPU with a tiny locally built
model and tokenizer: token advantages, ktae/ metrics in TRL's _metrics, the completions table, the
sequence-level branches of OPSM and VESPO, and Liger (layer kernels only in TRL >= 1.16). Groups
split across processes: tests/test_distributed.py."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="trl not installed: pip install -e '.[trl]'")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from ktae_kernels import ExecutionOptions, KTAEConfig, token_advantage  # noqa: E402
from ktae_kernels.integrations import shared  # noqa: E402
from ktae_kernels.integrations.trl import KTAEGRPOMixin, KTAEGRPOTrainer  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"
G = 4


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over single letters, built in memory (no hub)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{ch: i + 3 for i, ch in enumerate(LETTERS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(config)


def _even_majority(completions, completion_ids, **kwargs):
    """1 when most completion tokens have even ids: a coin flip per rollout for a random model."""
    return [float(2 * sum(t % 2 == 0 for t in ids) > len(ids)) for ids in completion_ids]


def _args(tmp_path, **extra) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=G,
                    max_completion_length=6, max_steps=1, learning_rate=1e-2, report_to="none", use_cpu=True,
                    logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0)
    return GRPOConfig(**{**settings, **extra})


class _Recording(KTAEGRPOTrainer):
    """Keeps what went into and came out of each advantage computation."""

    seen: list

    def ktae_advantages(self, output, rollout_advantage=None):
        result = super().ktae_advantages(output, rollout_advantage)
        self.seen.append({"ids": output["completion_ids"].clone(), "mask": output["completion_mask"].clone(),
                          "trl": output["advantages"].clone(), "rewards": self.ktae_rewards_per_func.clone(),
                          "labels": self.ktae_labels(),
                          "ktae": result.clone()})
        return result


def test_grpo_step_trains_on_token_advantages(tmp_path):
    prompts = datasets.Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l"]})
    config = KTAEConfig(alpha=1.0, beta=1.0)
    trainer = _Recording(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=prompts,
                         processing_class=_tokenizer(), ktae_config=config)
    trainer.seen = []
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train()
    assert trainer.seen, "the KTAE advantage hook did not run"
    assert np.isfinite(result.training_loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    for step in trainer.seen:
        ids, mask, ktae = step["ids"], step["mask"], step["ktae"]
        assert ktae.shape == ids.shape and ktae.dtype == torch.float32
        rewards = step["rewards"].nansum(dim=1)
        group = torch.arange(ids.shape[0]) // G
        expected = token_advantage(ids, mask, rewards, group, config=config, rollout_advantage=step["trl"])
        assert torch.equal(ktae, expected)
        assert torch.all(ktae[mask == 0] == 0)


def _prompts():
    return datasets.Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l"]})


def test_metrics_reach_trls_metrics_and_the_table_shows_ktae(tmp_path):
    trainer = _Recording(_model(), reward_funcs=_even_majority, args=_args(tmp_path, max_steps=2),
                         train_dataset=_prompts(), processing_class=_tokenizer(), ktae_metrics="scores")
    trainer.seen = []
    trainer.train()
    names = {"ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share",
             "ktae/distinct_tokens_per_group", "ktae/time_ms"}
    steps = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(steps) == 2 and all(names <= set(entry) for entry in steps)
    assert all(0 <= entry["ktae/key_token_share"] <= 1 and entry["ktae/time_ms"] > 0 for entry in steps)
    last = trainer.seen[-1]
    mask = last["mask"].float()
    want = ((last["ktae"] * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    assert list(trainer._logs["advantages"])[-len(want):] == pytest.approx(want, abs=1e-6)
    assert list(trainer._logs["advantages"])[-len(want):] != pytest.approx(last["trl"].tolist(), abs=1e-6)


def test_metrics_off_logs_nothing(tmp_path):
    trainer = KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                              processing_class=_tokenizer(), ktae_metrics="off")
    trainer.train()
    assert not any(k.startswith("ktae/") for entry in trainer.state.log_history for k in entry)
    with pytest.raises(ValueError, match="ktae_metrics"):
        KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path), processing_class=_tokenizer(),
                        ktae_metrics="all")


def test_a_bad_backend_name_fails_when_the_trainer_is_built(tmp_path):
    """``ktae_backend`` is checked at construction (not at the first step's kernel call)."""
    for bad in ("gpu", None):
        with pytest.raises(ValueError, match=r"`ktae_backend` must be 'auto' or one of \('reference'.*got "
                                             + repr(bad)):
            KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                            processing_class=_tokenizer(), ktae_backend=bad)


def test_a_backend_that_cannot_merge_split_groups_fails_when_built_for_several_processes(tmp_path, monkeypatch):
    """With several processes the gathered groups are merged on the torch path, which takes backend "auto"
    or "torch" only: another name fails when the trainer is built, not at the first step."""
    import accelerate

    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"`ktae_backend` must be 'auto' or 'torch' with several processes .*got 'cpu'"):
        KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                        processing_class=_tokenizer(), ktae_backend="cpu")


def test_keywords_of_the_wrong_type_fail_naming_the_keyword(tmp_path):
    """``ktae_use_trl_advantage`` takes True or False only (a truthy string would pick TRL's advantage);
    ``ktae_options`` an ``ExecutionOptions`` or None (the defaults): a dict, even an empty one, is refused
    naming ``ktae_options``, as the API refuses one for ``options``."""
    build = dict(reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                 processing_class=_tokenizer())
    for bad in ("no", 0, None):
        with pytest.raises(ValueError, match=rf"`ktae_use_trl_advantage` must be True or False, got {bad!r}"):
            KTAEGRPOTrainer(_model(), ktae_use_trl_advantage=bad, **build)
    for bad in ({"threads": 2}, {}):
        with pytest.raises(ValueError, match=r"`ktae_options` must be an ExecutionOptions or None, got dict; build one "
                                             r"with ExecutionOptions\(threads=\.\.\.\)"):
            KTAEGRPOTrainer(_model(), ktae_options=bad, **build)
    trainer = KTAEGRPOTrainer(_model(), ktae_options=ExecutionOptions(threads=2), ktae_use_trl_advantage=False, **build)
    assert trainer.ktae_settings.options == ExecutionOptions(threads=2) and trainer.ktae_use_trl_advantage is False
    assert KTAEGRPOTrainer(_model(), **build).ktae_settings.options == ExecutionOptions()


class _SequenceBranches(_Recording):
    """Records the advantages TRL's sequence-level branches (OPSM mask, VESPO weights) receive."""

    branch: list

    def get_off_policy_mask(self, advantages, *args, **kwargs):
        out = super().get_off_policy_mask(advantages, *args, **kwargs)
        self.branch.append(("opsm", advantages, self.ktae_per_sequence(advantages), out))
        return out

    def get_gamma_weights(self, advantages, *args, **kwargs):
        out = super().get_gamma_weights(advantages, *args, **kwargs)
        self.branch.append(("vespo", advantages, self.ktae_per_sequence(advantages), out))
        return out


@pytest.mark.parametrize("loss_type", ["vespo", "dapo"])
def test_opsm_and_vespo_branch_on_the_rollout_sign(tmp_path, loss_type):
    args = _args(tmp_path, loss_type=loss_type, off_policy_mask_threshold=0.0, num_iterations=2, max_steps=2)
    trainer = _SequenceBranches(_model(), reward_funcs=_even_majority, args=args, train_dataset=_prompts(),
                                processing_class=_tokenizer())
    trainer.seen, trainer.branch = [], []
    trainer.train()
    kinds = {kind for kind, *_ in trainer.branch}
    assert "opsm" in kinds and (loss_type != "vespo" or "vespo" in kinds)
    trl_signs = torch.cat([s["trl"] for s in trainer.seen]).sign()
    for kind, given, used, out in trainer.branch:
        assert given.dim() == 2 and given.shape[1] > 1  # the token advantages TRL passes
        assert used.shape == (given.shape[0], 1)
        assert out.shape == (given.shape[0], 1)  # a per-sequence mask / weight, as TRL defines it
        assert set(used.flatten().sign().tolist()) <= set(trl_signs.tolist())


def test_hub_kernels_keep_ktae_advantages_without_a_warning(tmp_path, monkeypatch):
    """The setting TRL 1.16 prefers to ``use_liger_kernel`` (deprecated, FutureWarning):
    ``model_init_kwargs={"use_kernels": True}`` (transformers' Hub kernels; a stand-in records the call
    here, the kernels need a GPU). The model's layers change, the loss is TRL's own: KTAE's [B, T]
    advantages reach it unchanged, and no FutureWarning is raised."""
    import warnings

    from transformers import PreTrainedModel

    requested = []
    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", lambda self, use, config=None: requested.append(use))
    model_dir = tmp_path / "model"
    _model().save_pretrained(model_dir)
    args = _args(tmp_path, model_init_kwargs={"use_kernels": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer = _Recording(str(model_dir), reward_funcs=_even_majority, args=args, train_dataset=_prompts(),
                             processing_class=_tokenizer())
    trainer.seen = []
    losses = []
    original = trainer._compute_loss
    monkeypatch.setattr(trainer, "_compute_loss", lambda model, inputs: losses.append(inputs["advantages"]) or
                        original(model, inputs))
    trainer.train()
    assert requested == [True]
    assert losses and all(a.dim() == 2 for a in losses)
    assert torch.equal(torch.cat(losses).sort(0).values, torch.cat([s["ktae"] for s in trainer.seen]).sort(0).values)


def accuracy(completions, completion_ids, **kwargs):
    """The task reward: 1 when most completion tokens have even ids."""
    return _even_majority(completions, completion_ids)


def formatted(completions, completion_ids, **kwargs):
    """A format reward every completion earns."""
    return [1.0] * len(completion_ids)


def test_correct_reward_funcs_define_the_labels(tmp_path):
    """A format reward plus an accuracy reward: naming ``accuracy`` in ``ktae_correct_reward_funcs`` labels by
    it alone. Without the keyword the trainer cannot tell which function says "correct" (1 + 0 > 0 would
    label a well-formatted wrong answer correct): construction fails, naming the keyword and the functions."""
    trainer = _Recording(_model(), reward_funcs=[formatted, accuracy], args=_args(tmp_path, reward_weights=[0.5, 1.0]),
                         train_dataset=_prompts(), processing_class=_tokenizer(), ktae_correct_reward_funcs=["accuracy"])
    trainer.seen = []
    trainer.train()
    step = trainer.seen[0]
    rewards = step["rewards"] * torch.tensor([0.5, 1.0])
    correct = rewards[:, 1] > 0
    assert torch.any(~correct) and torch.all(rewards.nansum(1) > 0)  # the sum would call every rollout correct
    ids, mask = step["ids"], step["mask"]
    group = torch.arange(ids.shape[0]) // G
    want = token_advantage(ids, mask, rewards.nansum(1), group, rollout_advantage=step["trl"], correct=correct)
    assert torch.equal(step["ktae"], want) and torch.equal(step["labels"].correct, correct)
    assert trainer.state.log_history[0]["ktae/label_source/accuracy"] == 1.0
    with pytest.raises(ValueError, match=r"cannot tell which of the reward functions \['formatted', 'accuracy'\] say "
                                         r"whether an answer is correct: name them in `ktae_correct_reward_funcs`, "
                                         r"e.g. ktae_correct_reward_funcs=\['formatted'\]"):
        KTAEGRPOTrainer(_model(), reward_funcs=[formatted, accuracy], args=_args(tmp_path), train_dataset=_prompts(),
                        processing_class=_tokenizer())
    with pytest.raises(ValueError, match="ktae_correct_reward_funcs.*'formatted', 'accuracy'.*'acc'"):
        KTAEGRPOTrainer(_model(), reward_funcs=[formatted, accuracy], args=_args(tmp_path), train_dataset=_prompts(),
                        processing_class=_tokenizer(), ktae_correct_reward_funcs=["acc"])


def _scored(completions, completion_ids, kind, **kwargs):
    """A format or an accuracy reward, as ``kind`` says (two partials of it share TRL's name ``_scored``)."""
    return (formatted if kind == "format" else accuracy)(completions, completion_ids)


def test_reward_functions_sharing_a_name_are_named_by_the_function_itself(tmp_path):
    """Two ``functools.partial`` of one function share TRL's name: naming it is refused as ambiguous
    (it would label by the first, the format reward, and call every rollout correct); passing the
    accuracy partial itself labels by it."""
    import functools

    fmt, acc = functools.partial(_scored, kind="format"), functools.partial(_scored, kind="acc")
    build = dict(reward_funcs=[fmt, acc], args=_args(tmp_path), train_dataset=_prompts(), processing_class=_tokenizer())
    with pytest.raises(ValueError, match=r"names '_scored', the name TRL gives to the reward functions at positions "
                                         r"\[0, 1\] .* ktae_correct_reward_funcs=\[reward_funcs\[1\]\]"):
        KTAEGRPOTrainer(_model(), ktae_correct_reward_funcs=["_scored"], **build)
    with pytest.raises(ValueError, match=r"names of this trainer's reward functions \(\['_scored', '_scored'\]\) or the "
                                         r"functions themselves; got <function accuracy"):
        KTAEGRPOTrainer(_model(), ktae_correct_reward_funcs=[accuracy], **build)
    trainer = _Recording(_model(), ktae_correct_reward_funcs=acc, **build)
    trainer.seen = []
    trainer.train()
    step = trainer.seen[0]
    correct = step["rewards"][:, 1] > 0
    assert trainer.ktae_correct_columns == [1] and torch.any(~correct)
    assert torch.equal(step["labels"].correct, correct)


def test_a_labelling_reward_that_grades_nothing_is_refused(tmp_path):
    """A labelling function with reward weight 0 (logged only) would call every rollout wrong: refused at
    construction. One that returns None for some rows that another function scored (ungraded) stops the
    step, naming the rows, instead of counting them wrong; with a second labelling function grading
    those rows it trains, and so it does where no function scored those rows (they join no group)."""
    def partial_accuracy(completions, completion_ids, **kwargs):
        return [None if i % 4 == 1 else v for i, v in enumerate(accuracy(completions, completion_ids))]

    def other_accuracy(completions, completion_ids, **kwargs):
        return [v if i % 4 == 1 else None for i, v in enumerate(accuracy(completions, completion_ids))]

    build = dict(train_dataset=_prompts(), processing_class=_tokenizer())
    with pytest.raises(ValueError, match=r"reward functions \['accuracy'\] that label rollouts correct or wrong have "
                                         r"reward weight 0"):
        KTAEGRPOTrainer(_model(), reward_funcs=[formatted, accuracy], args=_args(tmp_path, reward_weights=[1.0, 0.0]),
                        ktae_correct_reward_funcs=["accuracy"], **build)
    trainer = KTAEGRPOTrainer(_model(), reward_funcs=[formatted, partial_accuracy], args=_args(tmp_path),
                              ktae_correct_reward_funcs=["partial_accuracy"], **build)
    with pytest.raises(ValueError, match=r"\(partial_accuracy\) returned None for the gathered rows \[1, 5\] of this "
                                         r"step"):
        trainer.train()
    trainer = _Recording(_model(), reward_funcs=[formatted, partial_accuracy, other_accuracy], args=_args(tmp_path),
                         ktae_correct_reward_funcs=["partial_accuracy", "other_accuracy"], **build)
    trainer.seen = []
    trainer.train()
    step = trainer.seen[0]
    assert torch.equal(step["labels"].correct, step["rewards"][:, 1:].nansum(1) > 0)
    trainer = _Recording(_model(), reward_funcs=partial_accuracy, args=_args(tmp_path), **build)
    trainer.seen = []
    trainer.train()
    assert trainer.seen[0]["rewards"][1::4].isnan().all() and torch.all(trainer.seen[0]["ktae"][1::4] == 0)


def test_a_baseline_trls_advantage_replaces_is_refused(tmp_path):
    """``KTAEConfig.baseline`` / ``eps`` make ``A_i`` only with ``ktae_use_trl_advantage=False``; set with
    TRL's own advantage they would do nothing, so the trainer refuses them."""
    build = dict(reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                 processing_class=_tokenizer())
    for config in (KTAEConfig(baseline="none"), KTAEConfig(eps=1e-3)):
        with pytest.raises(ValueError, match=r"`ktae_config` sets \{'(baseline|eps)': .*\}, which would have no effect: "
                                             r"with ktae_use_trl_advantage=True"):
            KTAEGRPOTrainer(_model(), ktae_config=config, **build)
        KTAEGRPOTrainer(_model(), ktae_config=config, ktae_use_trl_advantage=False, **build)


def test_trls_overlong_punishment_does_not_relabel_a_correct_answer(tmp_path):
    """Real ``GRPOTrainer`` with an accuracy reward plus TRL's own DAPO length penalty
    (``get_soft_overlong_punishment``) and no ``ktae_correct_reward_funcs``: the labels come from the
    accuracy reward alone (TRL's shaping rewards never label), so no correct rollout is labelled wrong,
    although the penalty brings correct-but-long ones to a reward of 0 or below."""
    from trl.rewards import get_soft_overlong_punishment

    overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=3)
    trainer = _Recording(_model(), reward_funcs=[accuracy, overlong], args=_args(tmp_path), train_dataset=_prompts(),
                         processing_class=_tokenizer())
    trainer.seen = []
    trainer.train()
    step = trainer.seen[0]
    correct = step["rewards"][:, 0] > 0
    assert torch.any(correct & (step["rewards"].nansum(1) <= 0)), "the penalty must bring a correct rollout to <= 0"
    assert torch.equal(step["labels"].correct, correct) and step["labels"].source == "accuracy"
    ids, mask = step["ids"], step["mask"]
    want = token_advantage(ids, mask, step["rewards"].nansum(1), torch.arange(ids.shape[0]) // G,
                           rollout_advantage=step["trl"], correct=correct)
    assert torch.equal(step["ktae"], want)
    logged = trainer.state.log_history[0]
    assert logged["ktae/label_source/accuracy"] == 1.0
    ran = shared.backend_that_runs("auto", "cpu")
    assert [k for k in logged if k.startswith("ktae/backend/")] == [f"ktae/backend/{ran}"]
    assert ("ktae/threads" in logged) == (ran == "cpu")


class _MyTrainer(trl.GRPOTrainer):
    """A user's own GRPOTrainer subclass."""


def test_the_mixin_listed_second_fails_when_the_class_is_created(tmp_path):
    """``class T(MyTrainer, KTAEGRPOMixin)`` would train plain GRPO (TRL's methods come first): it raises
    TypeError at class creation, giving the order that works; that order trains with KTAE (the torch
    backend here: its metrics name it and report no native-kernel threads)."""
    with pytest.raises(TypeError, match=r"class Second\(_MyTrainer, KTAEGRPOMixin\): KTAEGRPOMixin comes after "
                                        r"GRPOTrainer .* plain GRPO; list it first: class Second\(KTAEGRPOMixin, "
                                        r"_MyTrainer\)"):
        class Second(_MyTrainer, KTAEGRPOMixin):
            pass

    class First(KTAEGRPOMixin, _MyTrainer):
        pass

    class Deeper(First):  # a subclass of a KTAE trainer keeps the order
        pass

    trainer = Deeper(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                     processing_class=_tokenizer(), ktae_backend="torch")
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["ktae/backend/torch"] == 1.0 and "ktae/threads" not in logged
    assert logged["ktae/label_source/_even_majority"] == 1.0 and "ktae/score_abs_mean" in logged


class _Replaying(trl.GRPOTrainer):
    """A subclass that, as TRL's replay-buffer trainer did, swaps groups of the step for stored ones after
    the rewards were computed (so the rows no longer match the rewards KTAE labels them by)."""

    def _generate_and_score_completions(self, inputs):
        return super()._generate_and_score_completions(inputs)


def _gmpo_trainer() -> type:
    """TRL's own GMPOTrainer (its ``_compute_loss`` takes ``(B,)`` advantages), or a stand-in for a TRL
    without it."""
    try:
        with warnings.catch_warnings():  # TRL warns about importing trl.experimental
            warnings.simplefilter("ignore")
            from trl.experimental.gmpo import GMPOTrainer
        return GMPOTrainer
    except ImportError:
        class GMPOTrainer(trl.GRPOTrainer):
            def _compute_loss(self, model, inputs):
                return super()._compute_loss(model, inputs)

        return GMPOTrainer


@pytest.mark.parametrize("kind", ["gmpo", "replay", "gmpo-listed-first"])
def test_a_subclass_that_replaces_what_ktae_relies_on_is_refused(tmp_path, kind):
    """A GRPOTrainer subclass with its own loss (GMPO: ``(B,)`` advantages) or its own batch making (a
    replay buffer) under the mixin, or listed before ``KTAEGRPOTrainer`` (its methods then run first),
    would run KTAE's ``(B, T)`` advantages through code never checked with them: refused when the
    trainer is built, naming the class and the method, unless allowed explicitly."""
    base, method = (_Replaying, "_generate_and_score_completions") if kind == "replay" else (_gmpo_trainer(), "_compute_loss")

    if kind == "gmpo-listed-first":
        class KTAEVariant(base, KTAEGRPOTrainer):
            pass
    else:
        class KTAEVariant(KTAEGRPOMixin, base):
            pass

    build = dict(reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                 processing_class=_tokenizer())
    with pytest.raises(TypeError, match=rf"KTAEVariant: {base.__name__}\.{method} replaces GRPOTrainer's .* "
                                        rf"ktae_allow_overrides=True"):
        KTAEVariant(_model(), **build)
    assert isinstance(KTAEVariant(_model(), ktae_allow_overrides=True, **build), base)
    with pytest.raises(ValueError, match="`ktae_allow_overrides` must be True or False, got 'yes'"):
        KTAEVariant(_model(), ktae_allow_overrides="yes", **build)


def test_a_batch_that_bypassed_ktae_stops_the_loss(tmp_path):
    """An override of ``_generate_and_score_completions`` that skips ``super()`` (TRL's advantages only)
    stops training at the loss, before any update, naming the override."""
    from ktae_kernels.integrations.shared import FrameworkMismatchError

    class Bypass(KTAEGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            return trl.GRPOTrainer._generate_and_score_completions(self, inputs)

    trainer = Bypass(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                     processing_class=_tokenizer())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(FrameworkMismatchError, match="Bypass computed a loss on a batch that KTAE's "
                                                     "_generate_and_score_completions did not make"):
        trainer.train()
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_liger_loss_of_older_trl_is_refused(tmp_path, monkeypatch):
    class OldTRL(KTAEGRPOTrainer):
        def compute_liger_loss(self, *args, **kwargs):  # what TRL < 1.16 had
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="use_liger_kernel"):
        OldTRL(_model(), reward_funcs=_even_majority, args=_args(tmp_path, use_liger_kernel=True),
               processing_class=_tokenizer())


def test_a_moved_override_target_fails_when_the_trainer_is_built(tmp_path, monkeypatch):
    """A TRL whose ``GRPOTrainer`` no longer has a method KTAE overrides (the override would never run)
    fails when the trainer is built, naming TRL's version and what KTAE expected; so does a TRL outside
    the supported range."""
    from ktae_kernels.integrations.shared import FrameworkMismatchError

    monkeypatch.delattr(trl.GRPOTrainer, "_generate_and_score_completions")
    with pytest.raises(FrameworkMismatchError, match=rf"TRL {trl.__version__}: GRPOTrainer has no method "
                                                     r"_generate_and_score_completions\. KTAE expected the method"):
        KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path), processing_class=_tokenizer())
    monkeypatch.undo()
    monkeypatch.delenv("KTAE_ALLOW_UNTESTED", raising=False)
    for version in ("0.29.0", "2.0.0"):
        monkeypatch.setattr(trl, "__version__", version)
        with pytest.raises(FrameworkMismatchError, match=f"KTAE supports TRL >= 1.0, < 2; found TRL {version}"):
            KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path), processing_class=_tokenizer())


def test_own_baseline_instead_of_trls_advantage(tmp_path):
    config = KTAEConfig(baseline="mean")
    trainer = _Recording(_model(), reward_funcs=_even_majority, args=_args(tmp_path), train_dataset=_prompts(),
                         processing_class=_tokenizer(), ktae_config=config, ktae_use_trl_advantage=False)
    trainer.seen = []
    trainer.train()
    for step in trainer.seen:
        ids, mask = step["ids"], step["mask"]
        rewards = step["rewards"].nansum(dim=1)
        expected = token_advantage(ids, mask, rewards, torch.arange(ids.shape[0]) // G, config=config)
        torch.testing.assert_close(step["ktae"], expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_two_gloo_ranks_log_metrics_of_the_whole_batch(tmp_path):
    """Two CPU processes (gloo), 12 rows per step in groups of 4, so one group is split across the ranks:
    each rank's advantages are its rows of the one-process result, and the logged ``ktae/*`` metrics are
    those of all 12 rows (token metrics weighted by each rank's tokens, mixed groups of the gathered rows);
    they name the torch path over the ranks, which runs no native-kernel threads."""
    import os
    import socket
    import subprocess
    import sys

    from ktae_kernels.metrics import ktae_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "trl_rank.py"), str(tmp_path)],
                              env={**os.environ, "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                                   "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    steps = [r["seen"][0] for r in ranks]
    T = max(s["ids"].shape[1] for s in steps)
    pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1]))  # noqa: E731
    ids, mask, ktae = (torch.cat([pad(s[k]) for s in steps]) for k in ("ids", "mask", "ktae"))
    trl_adv = torch.cat([s["trl"] for s in steps])
    rewards = steps[0]["rewards"].nansum(dim=1)
    assert torch.equal(steps[0]["rewards"], steps[1]["rewards"]) and rewards.shape == (12,)
    group = torch.arange(12) // G
    assert torch.equal(ktae, token_advantage(ids, mask, rewards, group, rollout_advantage=trl_adv))
    want = ktae_metrics(advantages=ktae, mask=mask.bool(), rollout_advantage=trl_adv, group=group, correct=rewards > 0)
    logged = ranks[0]["logged"]
    for name in ("ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share"):
        assert logged[name] == pytest.approx(want[name], abs=1e-6), name
    assert logged["ktae/label_source/_even_majority"] == 1.0
    assert logged["ktae/backend/torch"] == 1.0 and "ktae/threads" not in logged  # the torch path over the ranks
    own = ktae_metrics(advantages=steps[0]["ktae"], mask=steps[0]["mask"].bool(), rollout_advantage=steps[0]["trl"],
                       group=group[:6], correct=rewards[:6] > 0)
    assert any(own[n] != pytest.approx(want[n], abs=1e-6) for n in want), "rank 0's rows alone would log the same"
