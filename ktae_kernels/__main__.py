"""`python -m ktae_kernels`: a small built-in example, its key tokens and advantages, and a timing."""
from __future__ import annotations

import time

import torch

from . import KTAEConfig, available_backends, key_token_scores, token_advantage


def demo_batch(seed: int = 0, groups: int = 2, rollouts: int = 8, length: int = 12, vocab: int = 20):
    """A toy batch where token 7 appears mostly in correct rollouts and token 13 in wrong ones."""
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, vocab, (groups * rollouts, length), generator=gen)
    rewards = (torch.arange(groups * rollouts) % rollouts < rollouts // 2).float()
    responses[:, 0] = torch.where(rewards > 0, 7, 13)
    mask = torch.ones_like(responses, dtype=torch.bool)
    mask[:, length - 3:] = torch.rand(groups * rollouts, 3, generator=gen) > 0.5
    index = torch.arange(groups * rollouts) // rollouts
    return responses, mask, rewards, index


def main() -> None:
    responses, mask, rewards, index = demo_batch()
    config = KTAEConfig()
    scores = key_token_scores(responses, mask, rewards, index, config=config)
    adv = token_advantage(responses, mask, rewards, index, config=config)
    print("ktae_kernels demo: 2 groups x 8 rollouts x 12 tokens; backends here:", ", ".join(available_backends()))
    print("\nstrongest key tokens of group 0 (token: a/b of 4/4 correct/wrong rollouts, p, score)")
    rows = torch.nonzero(scores.group == 0).flatten()
    for i in rows[torch.argsort(scores.score[rows].abs(), descending=True)[:4]].tolist():
        print(f"  token {int(scores.token[i]):3d}: a={int(scores.a[i])} b={int(scores.b[i])} "
              f"p={scores.p_value[i]:.4f} score={scores.score[i]:+.4f}")
    torch.set_printoptions(precision=3, sci_mode=False, linewidth=120)
    print("\nadvantages of rollout 0 (correct) and rollout 4 (wrong):")
    print(adv[[0, 4]])
    print("\ntime of one call (after a warm-up call):")
    for backend in ("reference", "torch"):
        token_advantage(responses, mask, rewards, index, config=config, backend=backend)
        start = time.perf_counter()
        token_advantage(responses, mask, rewards, index, config=config, backend=backend)
        print(f"{backend:>10}: {1e3 * (time.perf_counter() - start):.2f} ms")
    print("\nNext: `python -m bench` compares every backend with the scipy reference and the "
          "upstream-style loop on realistic batches.")


if __name__ == "__main__":
    main()
