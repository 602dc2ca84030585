"""OpenRLHF adapter: add KTAE key-token scores to the advantages of ``RemoteExperienceMaker``.

OpenRLHF (checked against its main branch, 2026-08) computes, in the driver,
``RemoteExperienceMaker.compute_advantages_and_returns(experiences)``: per ``Experience``,
``sequences [b, S]`` (prompt + response), ``action_mask / advantages / returns [b, A]`` whose action
tokens are the last ``A`` columns of ``sequences``, ``rewards [b]`` and ``index`` (each rollout's
position in the rollout batch; a group is ``n_samples_per_prompt`` consecutive positions). Its CLI
accepts only its own estimator names, so KTAE rides on top of a group estimator (``group_norm``,
``dr_grpo``, ``rloo``, ``reinforce_baseline``, ``reinforce``): after OpenRLHF's own computation,
``advantages += weight * score[group, token]`` on action tokens (KTAE's ``A_i + weight * score`` with
OpenRLHF's advantage as ``A_i``; ``config.baseline`` is not used). ``returns`` are left as computed.

OpenRLHF does not install without CUDA (flash-attn), so this module imports it only in ``install``;
``add_key_token_scores`` and the mixin are tested against the contract above.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..api import token_advantage
from ..config import KTAEConfig

#: OpenRLHF estimators with a per-group outcome advantage that KTAE can refine.
ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")


def add_key_token_scores(experiences: Sequence[Any], *, n_samples_per_prompt: int, config: KTAEConfig,
                         backend: str = "auto") -> Tensor:
    """Add ``weight * score`` to each experience's ``advantages`` in place; returns the float32 ``[B, A_max]``
    score term of the experiences' rows concatenated in order (0 off the action mask).

    A rollout is correct when its ``rewards`` entry is > ``config.correct_threshold`` (after
    OpenRLHF's length penalties, which it applies to ``rewards`` in place).
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"`n_samples_per_prompt` must be >= 1, got {n_samples_per_prompt}")
    widths = [e.action_mask.shape[1] for e in experiences]
    width = max(widths, default=0)
    ids = torch.cat([_pad(e.sequences[:, e.sequences.shape[1] - a:], width) for e, a in zip(experiences, widths)])
    mask = torch.cat([_pad(e.action_mask.bool(), width) for e in experiences])
    rewards = torch.cat([e.rewards.reshape(-1) for e in experiences])
    group = torch.tensor([i // n_samples_per_prompt for e in experiences for i in e.index], dtype=torch.int64)
    term = token_advantage(ids, mask, rewards, group, config=config, backend=backend,
                           rollout_advantage=torch.zeros(rewards.shape[0], dtype=torch.float64))
    start = 0
    for e, a in zip(experiences, widths):
        rows = term[start:start + e.action_mask.shape[0], :a]
        e.advantages = e.advantages + rows.to(e.advantages.device, e.advantages.dtype)
        start += rows.shape[0]
    return term


def _pad(t: Tensor, width: int) -> Tensor:
    """Right-pad ``[b, a]`` with zeros to ``[b, width]``."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


class KTAEExperienceMakerMixin:
    """``class Maker(KTAEExperienceMakerMixin, RemoteExperienceMaker)``: OpenRLHF's advantages, then
    ``add_key_token_scores``. Settings: the class attributes ``ktae_config`` and ``ktae_backend``."""

    ktae_config: KTAEConfig = KTAEConfig()
    ktae_backend: str = "auto"

    def compute_advantages_and_returns(self, experiences: list) -> list:
        experiences = super().compute_advantages_and_returns(experiences)  # type: ignore[misc]
        args = self.strategy.args
        estimator = args.algo.advantage.estimator
        if estimator not in ESTIMATORS:
            raise ValueError(f"KTAE needs a group outcome estimator, one of {ESTIMATORS}; "
                             f"--algo.advantage.estimator is {estimator!r}")
        add_key_token_scores(experiences, n_samples_per_prompt=args.rollout.n_samples_per_prompt,
                             config=self.ktae_config, backend=self.ktae_backend)
        return experiences


def install(config: KTAEConfig | None = None, backend: str = "auto") -> type:
    """Make OpenRLHF's PPO trainer build a KTAE experience maker; returns that class.

    Call it in the process that constructs the trainer (OpenRLHF's ``PPOTrainer`` Ray actor), e.g. with
    ``ray.init(runtime_env={"worker_process_setup_hook": "ktae_kernels.integrations.openrlhf.install"})``
    in a launcher that then runs ``openrlhf.cli.train_ppo_ray``.
    """
    from openrlhf.trainer import ppo_trainer

    base = ppo_trainer.RemoteExperienceMaker
    if issubclass(base, KTAEExperienceMakerMixin):  # installed before: rebuild on OpenRLHF's class
        base = base.__bases__[1]
    maker = type("KTAERemoteExperienceMaker", (KTAEExperienceMakerMixin, base),
                 {"ktae_config": config or KTAEConfig(), "ktae_backend": backend, "__module__": __name__})
    ppo_trainer.RemoteExperienceMaker = maker
    return maker
