"""TRL adapter against the installed TRL: a real GRPO training step on CPU with a tiny locally built
model and tokenizer, and the Liger refusal. Groups split across processes: tests/test_distributed.py."""
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
    return GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=G,
                      max_completion_length=6, max_steps=1, learning_rate=1e-2, report_to="none", use_cpu=True,
                      logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0, **extra)


class _Recording(KTAEGRPOTrainer):
    """Keeps what went into and came out of each advantage computation."""

    seen: list

    def ktae_advantages(self, output):
        result = super().ktae_advantages(output)
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


def test_liger_kernel_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use_liger_kernel"):
        KTAEGRPOTrainer(_model(), reward_funcs=_even_majority, args=_args(tmp_path, use_liger_kernel=True),
                        processing_class=_tokenizer())
