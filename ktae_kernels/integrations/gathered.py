"""Advantages in the layout of frameworks that gather every process's rewards and form groups of
``num_generations`` consecutive rows of the gathered batch (TRL's ``GRPOTrainer``).

Kept free of framework imports so it can run (and be tested) anywhere.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..api import token_advantage
from ..config import KTAEConfig
from ..options import ExecutionOptions


def grpo_groups(rewards_per_func: Tensor, reward_weights: Tensor, *, num_generations: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(rewards, group, unscorable)`` of the gathered ``[N]`` rows: the weighted ``nansum`` reward (as
    TRL logs it), the group id (``row // num_generations``; a row that no reward function scored, all
    NaN, is a group of its own with a negative id) and the unscorable flags."""
    N = rewards_per_func.shape[0]
    rows = torch.arange(N, device=rewards_per_func.device)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    group = torch.where(unscorable, -(rows + 1), rows // num_generations)
    return rewards, group, unscorable


def grpo_token_advantages(completion_ids: Tensor, loss_mask: Tensor, rewards_per_func: Tensor, reward_weights: Tensor,
                          advantages: Tensor | None, *, process_index: int, num_generations: int,
                          config: KTAEConfig, backend: str = "auto", process_group: Any = None,
                          correct: Tensor | None = None, options: ExecutionOptions | None = None) -> Tensor:
    """float32 ``[B, T]`` KTAE advantages of this process's rows in TRL's layout.

    Args:
        completion_ids, loss_mask: this process's ``[B, T]`` completions and loss mask.
        rewards_per_func: ``[N, n_funcs]`` rewards of all processes (TRL gathers them), NaN where a
            function did not score; a row's reward is the weighted ``nansum``, as TRL logs it.
        reward_weights: ``[n_funcs]``.
        advantages: this process's ``[B]`` rollout advantages ``A_i`` (TRL's); None: ``config.baseline``.
        process_index, num_generations: this process's slice is rows ``process_index * B ...`` of the
            gathered batch, and a group is ``num_generations`` consecutive gathered rows.
        process_group: the group of all processes when there are several, else None.
        correct: bool ``[N]`` labels of the gathered rows; None: weighted reward > ``correct_threshold``.
        options: as ``token_advantage``.
    Rows that no reward function scored (all NaN) get advantage 0 and take no part in any group.
    """
    B = completion_ids.shape[0]
    start = process_index * B
    rewards, group, unscorable = grpo_groups(rewards_per_func, reward_weights, num_generations=num_generations)
    own = slice(start, start + B)
    mask = loss_mask.bool() & ~unscorable[own, None].to(loss_mask.device)
    return token_advantage(completion_ids, mask, rewards[own], group[own], config=config, backend=backend,
                           rollout_advantage=advantages, process_group=process_group,
                           correct=None if correct is None else correct[own], options=options)
