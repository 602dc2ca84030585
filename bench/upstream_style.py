"""The published KTAE algorithm as it ran, written from its description (../shared/ktae-method.md).

Per group: split rollouts by reward, loop in Python over the group's unique tokens to fill a
vocabulary-sized float32 table ``[V + 1, 4]``, then float32 Fisher (lgamma over a ``[V + 1, K]``
support grid, no tie tolerance), information gain, BM25 and Cohen-h over every vocabulary row,
a sigmoid squash, and a gather back to ``[B, L]``. CPU tensors, as in the trainer's driver process.
It is the speed baseline of ``python -m bench`` and an independent check of ``fisher="upstream"``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ktae_kernels.config import KTAEConfig


def upstream_token_advantage(responses: Tensor, mask: Tensor, rewards: Tensor, index, config: KTAEConfig | None = None) -> Tensor:
    """float32 ``[B, L]`` advantages the published way; ``rewards`` ``[B]``, ``index`` ``[B]`` labels."""
    config = config or KTAEConfig(fisher="upstream")
    responses, mask, rewards = responses.cpu(), mask.cpu().float(), rewards.cpu().float()
    labels = np.asarray(index.cpu() if isinstance(index, Tensor) else index)
    vocab_top = int(responses.max())
    advantages = torch.zeros(responses.shape, dtype=torch.float32)
    for label in dict.fromkeys(labels.tolist()):
        rows = torch.as_tensor(np.flatnonzero(labels == label))
        r = rewards[rows]
        if len(rows) > 1:
            mean, std = r.mean(), r.std()
            table = _key_token_table(responses[rows], mask[rows], r, vocab_top, config)
        else:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
            table = torch.zeros(vocab_top + 1)
        base = (r - mean) / (std + config.eps)
        advantages[rows] = base[:, None] * mask[rows] + config.weight * table[responses[rows]] * mask[rows]
    return advantages


def _key_token_table(responses: Tensor, mask: Tensor, rewards: Tensor, vocab_top: int, config: KTAEConfig) -> Tensor:
    """float32 score of every id ``0..vocab_top`` for one group."""
    correct = rewards > config.correct_threshold
    scores = torch.zeros(vocab_top + 1, dtype=torch.float32)
    if correct.all() or not correct.any():
        return scores
    n_c, n_w = int(correct.sum()), int((~correct).sum())
    in_correct = _rollouts_containing(responses[correct], mask[correct])
    in_wrong = _rollouts_containing(responses[~correct], mask[~correct])
    table = torch.zeros(vocab_top + 1, 4, dtype=torch.float32)
    for token in set(responses.flatten().tolist()):
        a, b = in_correct.get(token, 0), in_wrong.get(token, 0)
        if a + b:
            table[token] = torch.tensor([a, b, n_c - a, n_w - b], dtype=torch.float32)
    p = _fisher_float32(table)
    F = torch.where(p != 1.0, torch.exp(-2 * p), torch.tensor(0.0))
    IG = _information_gain_float32(table)
    a_rate = table[:, 0] / (table[:, 0] + table[:, 2] + 1e-10)
    b_rate = table[:, 1] / (table[:, 1] + table[:, 3] + 1e-10)
    x = torch.asin(torch.sqrt(a_rate.clamp(0, 1))) - torch.asin(torch.sqrt(b_rate.clamp(0, 1)))
    if config.use_tf:
        tf_c, tf_w = _tf_float32(responses, mask, correct, vocab_top, config)
        x = x + (tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5))
    key = (config.alpha * F + config.beta * IG) * x / (config.alpha + config.beta)
    scores = (torch.sigmoid(key) - 0.5) * 2 * config.top
    scores[list(i for i in config.ignore_token_ids if i <= vocab_top)] = 0.0
    return scores


def _rollouts_containing(responses: Tensor, mask: Tensor) -> dict[int, int]:
    """token id -> number of these rollouts that hold it under the mask (Python loop over ids)."""
    rollout_of = torch.arange(responses.shape[0])[:, None].expand_as(responses)
    keep = mask.flatten() == 1
    values, rollouts = responses.flatten()[keep], rollout_of.flatten()[keep]
    ids, inverse = torch.unique(values, return_inverse=True)
    return {tok: len(torch.unique(rollouts[inverse == i])) for i, tok in enumerate(ids.tolist())}


def _log_binom(n: Tensor, k: Tensor) -> Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def _fisher_float32(table: Tensor) -> Tensor:
    a, b, c, d = torch.unbind(table, dim=1)
    r1, c1 = a + b, a + c
    n = r1 + c + d
    low = torch.max(torch.tensor(0.0), r1 + c1 - n)
    high = torch.min(r1, c1)
    k = torch.tile(torch.arange(int(high.max()) + 1, dtype=torch.float32), (table.shape[0], 1))
    support = (k >= low[:, None]) & (k <= high[:, None])
    c1k, r1k, nk = c1[:, None].expand_as(k), r1[:, None].expand_as(k), n[:, None].expand_as(k)
    p_k = torch.exp(_log_binom(c1k, k) + _log_binom(nk - c1k, r1k - k) - _log_binom(nk, r1k)) * support.float()
    p_obs = torch.exp(_log_binom(c1, a) + _log_binom(n - c1, r1 - a) - _log_binom(n, r1))
    return torch.sum(torch.where((p_k <= p_obs[:, None]) & support, p_k, 0.0), dim=1)


def _information_gain_float32(table: Tensor) -> Tensor:
    a, b, c, d = torch.unbind(table, dim=1)
    n = a + b + c + d

    def plogp(p: Tensor) -> Tensor:
        return -p * torch.where(p > 0, torch.log2(p), torch.tensor(0.0))

    def branch(x: Tensor, y: Tensor) -> Tensor:
        s = x + y
        return torch.where(s > 0, plogp(x / s) + plogp(y / s), torch.tensor(0.0))

    ig = plogp((a + c) / n) + plogp((b + d) / n) - ((a + b) / n * branch(a, b) + (c + d) / n * branch(c, d))
    ig[n == 0] = 0.0
    return ig


def _tf_float32(responses: Tensor, mask: Tensor, correct: Tensor, vocab_top: int, config: KTAEConfig) -> tuple[Tensor, Tensor]:
    tok_c = responses[correct][mask[correct] == 1]
    tok_w = responses[~correct][mask[~correct] == 1]
    T_c, T_w = tok_c.numel(), tok_w.numel()
    avg = (T_c + T_w) / 2
    out = []
    for toks, T in ((tok_c, T_c), (tok_w, T_w)):
        q = torch.bincount(toks, minlength=vocab_top + 1).float() / T
        K = config.k1 * (1 - config.b + config.b * (T / avg))
        out.append(q * (config.k1 + 1) / (q + K))
    return out[0], out[1]
