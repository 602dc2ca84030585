"""GRPO / DAPO pieces: rollout advantage, overlong penalty, token log-probs and the clipped PG loss."""
from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ktae_kernels.integrations.shared import dense_groups

from .rollout import Rollouts

LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


def grpo_advantage(rewards: Tensor, group: Tensor, *, eps: float = 1e-6, norm_by_std: bool = True) -> Tensor:
    """Rollout advantage float64 ``[N]``: ``(r - mean_g) / (std_g + eps)`` within each group.

    ``std_g`` is torch's unbiased std (as verl); ``norm_by_std=False`` only centres (Dr. GRPO).
    rewards: float ``[N]``; group: int64 ``[N]`` group ids (every group needs >= 2 rollouts).
    """
    rewards = rewards.to(torch.float64)
    inverse, counts = dense_groups(group)
    inverse, counts = inverse.to(rewards.device), counts.to(rewards.device)
    if bool((counts < 2).any()):
        raise ValueError("grpo_advantage needs at least 2 rollouts per group")
    n = counts.to(torch.float64)
    total = torch.zeros_like(n).index_add_(0, inverse, rewards)
    mean = total / n
    centred = rewards - mean[inverse]
    if not norm_by_std:
        return centred
    var = torch.zeros_like(n).index_add_(0, inverse, centred**2) / (n - 1)
    return centred / (var.sqrt()[inverse] + eps)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment float64 ``[N]`` (<= 0) for response lengths int ``[N]``.

    Zero up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at ``max_len``.
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float64, device=lengths.device)
    exceed = lengths.to(torch.float64) - (max_len - buffer)
    return (-exceed / buffer * factor).clamp(max=0.0)


def token_logprobs(model: PreTrainedModel, rollouts: Rollouts, temperature: float = 1.0) -> Tensor:
    """float32 ``[N, L]`` log-prob of each response token under ``model`` (logits / temperature)."""
    attention = rollouts.attention_mask
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=rollouts.input_ids, attention_mask=attention, position_ids=positions).logits
    n_resp = rollouts.responses.shape[1]
    logits = logits[:, -n_resp - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, rollouts.responses.unsqueeze(-1)).squeeze(-1)


def aggregate(values: Tensor, mask: Tensor, how: str) -> Tensor:
    """Scalar over the masked ``[N, L]`` values: "token-mean" (DAPO: every token weighs the same) or
    "seq-mean-token-mean" (GRPO: mean per sequence, then over sequences)."""
    mask = mask.to(values.dtype)
    if how == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if how == "seq-mean-token-mean":
        return ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    raise ValueError(f"`loss_agg` must be one of {LOSS_AGGS}, got {how!r}")


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float,
                eps_high: float, loss_agg: str, ref_logp: Tensor | None = None,
                kl_coef: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """Clipped token-level policy-gradient loss (PPO surrogate), plus ``kl_coef`` x k3 KL to the reference.

    All inputs ``[N, L]`` (advantages: token-level, e.g. KTAE's, or a rollout advantage broadcast).
    ``ratio`` is clipped to ``[1 - eps_low, 1 + eps_high]`` (GRPO: equal; DAPO clip-higher: 0.2 / 0.28).
    Returns ``(loss, stats)`` with stats ``clip_frac`` and ``kl`` (token means).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": aggregate((clipped > unclipped).float(), mask, "token-mean").item()}
    if ref_logp is not None and kl_coef:
        log_r = ref_logp - logp
        kl = torch.exp(log_r) - log_r - 1.0  # k3 estimator, >= 0
        per_token = per_token + kl_coef * kl
        stats["kl"] = aggregate(kl.detach(), mask, "token-mean").item()
    return aggregate(per_token, mask, loss_agg), stats
