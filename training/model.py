"""The policy: a tiny Qwen2-architecture causal LM built from a config, or a local checkpoint."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from .tokenizer import build_char_tokenizer, load_tokenizer

TINY = "tiny"


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, *, hidden: int = 64, layers: int = 2,
                     heads: int = 4, max_positions: int = 64) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized for CPU tests (about 0.1M parameters at the defaults).

    Same architecture family as Qwen2.5-Math, so the training code path is the one a real checkpoint
    takes. Initialisation uses torch's global RNG: seed it first for reproducible weights.
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(config)


def load_policy(model: str, device: str,
                dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``model == "tiny"``: the tiny model and the char tokenizer; else a local checkpoint directory.

    Returns ``(policy, tokenizer)`` with the policy on ``device`` in ``dtype`` (float32 for training
    the tiny model; a real checkpoint may use bfloat16 on a GPU).
    """
    if model == TINY:
        tokenizer = build_char_tokenizer()
        policy = build_tiny_model(tokenizer)
    else:
        tokenizer = load_tokenizer(model)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, local_files_only=True)
    return policy.to(device=device, dtype=dtype), tokenizer
