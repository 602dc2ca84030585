"""Supervised warm-up (NOT RL): a few teacher-forced steps so a random tiny model starts with mixed groups.

A randomly initialised model almost never produces a correct answer, so every group would be
all-wrong and every advantage zero. A short cross-entropy phase on (prompt, answer) pairs brings the
accuracy to a middling level; RL starts from there. Skip it (``--warmup-steps 0``) for a real model.
"""
from __future__ import annotations

import random
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .loss import aggregate, token_logprobs
from .rollout import pack
from .tasks import AdditionTask
from .tokenizer import encode_prompt


def sft_warmup(policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: AdditionTask, *, steps: int,
               lr: float, batch: int, rng: random.Random,
               on_step: Callable[[float], None] | None = None) -> list[float]:
    """``steps`` AdamW steps of token-mean cross-entropy on the answer + eos; returns the losses.
    ``on_step(loss)`` is called after each step (a progress bar)."""
    device = next(policy.parameters()).device
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    policy.train()
    losses = []
    for _ in range(steps):
        problems = task.sample(rng, batch)
        prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
        answers = [tokenizer.encode(p.answer, add_special_tokens=False) + [tokenizer.eos_token_id] for p in problems]
        rollouts = pack(prompts, answers, list(range(batch)), tokenizer.pad_token_id, device)
        loss = -aggregate(token_logprobs(policy, rollouts), rollouts.response_mask, "token-mean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(losses[-1])
    return losses
