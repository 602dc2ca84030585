"""TRL adapter against the installed TRL: real GRPO training steps on CPU with a tiny locally built
model and tokenizer: token advantages, ktae/ metrics in TRL's _metrics, the completions table, the
sequence-level branches of OPSM and VESPO, and Liger (layer kernels only in TRL >= 1.16). Groups
split across processes: tests/test_distributed.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="trl not installed: pip install -e '.[trl]'")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from ktae_kernels import KTAEConfig, token_advantage  # noqa: E402
from ktae_kernels.integrations.trl import KTAEGRPOTrainer  # noqa: E402

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
                          "trl": output["advantages"].clone(), "rewards": self._ktae_rewards_per_func.clone(),
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


class _SequenceBranches(_Recording):
    """Records the advantages TRL's sequence-level branches (OPSM mask, VESPO weights) receive."""

    branch: list

    def get_off_policy_mask(self, advantages, *args, **kwargs):
        out = super().get_off_policy_mask(advantages, *args, **kwargs)
        self.branch.append(("opsm", advantages, self._ktae_sequence(advantages), out))
        return out

    def get_gamma_weights(self, advantages, *args, **kwargs):
        out = super().get_gamma_weights(advantages, *args, **kwargs)
        self.branch.append(("vespo", advantages, self._ktae_sequence(advantages), out))
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


def test_liger_layer_kernels_keep_ktae_advantages(tmp_path, monkeypatch):
    """TRL 1.16 with use_liger_kernel applies Liger's layer kernels only (stand-in here: they need a GPU)
    and keeps its own loss, so KTAE's [B, T] advantages reach the loss unchanged: nothing to refuse."""
    import transformers.trainer

    from ktae_kernels.integrations.trl import liger_loss_takes_sequence_advantages

    if liger_loss_takes_sequence_advantages():
        pytest.skip("this TRL routes the loss through Liger's fused GRPO loss: refused (tested below)")
    applied = []
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel",
                        lambda model, config: applied.append(dict(config or {})), raising=False)
    trainer = _Recording(_model(), reward_funcs=_even_majority, args=_args(tmp_path, use_liger_kernel=True),
                         train_dataset=_prompts(), processing_class=_tokenizer())
    trainer.seen = []
    losses = []
    original = trainer._compute_loss
    monkeypatch.setattr(trainer, "_compute_loss", lambda model, inputs: losses.append(inputs["advantages"]) or
                        original(model, inputs))
    trainer.train()
    assert applied and applied[0].get("fused_linear_cross_entropy") is False
    assert losses and all(a.dim() == 2 for a in losses)
    assert torch.equal(torch.cat(losses).sort(0).values, torch.cat([s["ktae"] for s in trainer.seen]).sort(0).values)


def test_liger_loss_of_older_trl_is_refused(tmp_path, monkeypatch):
    class OldTRL(KTAEGRPOTrainer):
        def compute_liger_loss(self, *args, **kwargs):  # what TRL < 1.16 had
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="use_liger_kernel"):
        OldTRL(_model(), reward_funcs=_even_majority, args=_args(tmp_path, use_liger_kernel=True),
               processing_class=_tokenizer())


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
