"""TRL adapter: ``GRPOTrainer`` with KTAE token-level advantages ``[B, T]``.

``KTAEGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), ..., ktae_config=KTAEConfig())`` is a
drop-in ``GRPOTrainer``. It overrides ``_generate_and_score_completions`` (TRL has no advantage hook;
its maintainers advise this override) and returns ``advantages`` of shape ``[B, T]``, which TRL's
loss accepts (``_compute_loss`` unsqueezes only 1-D advantages).

Groups: TRL gathers the rewards of all processes, forms groups of ``num_generations`` consecutive
rows of that gathered batch and keeps this process's slice, so a group can straddle processes. The
per-token statistics of such a group are merged across processes with
``token_advantage(..., process_group=WORLD)`` (``ktae_kernels.distributed``), which needs the
"auto" / "torch" backend when ``num_processes > 1``.

Loss types. TRL's per-token losses (grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo) take the ``[B, T]``
advantages token by token; PPO clipping and SAPO's temperature then follow each token's sign, as
KTAE intends. Two places in TRL are sequence-level by design and branch on the sign of "the"
advantage: the off-policy sequence mask (``off_policy_mask_threshold``, OPSM: keep a sequence if its
advantage is >= 0 or its KL is small) and VESPO's sequence weight ``phi`` (``k``/``lambda`` by sign).
There the mixin passes the rollout's own advantage ``A_i`` (TRL's, or ``ktae_config.baseline``'s), so
a sequence is kept or weighted as a whole, as TRL defines it; the per-token KTAE advantages still
multiply the loss.

Liger: TRL >= 1.16 applies only Liger's layer kernels with ``use_liger_kernel=True`` (the loss stays
TRL's own ``_compute_loss``), so KTAE works with it. Older TRL 1.x routed the loss through Liger's
fused GRPO loss, which takes ``(B,)`` advantages only: that combination is refused.

Logging: ``ktae/*`` metrics (``ktae_kernels.metrics``) go to TRL's ``_metrics`` (averaged per logging
step like TRL's own); ``ktae_metrics="scores"`` adds one ``key_token_scores`` call and
``ktae/distinct_tokens_per_group``, "off" logs nothing. The completions table's ``advantage`` column
shows each completion's mean KTAE advantage over its tokens, not TRL's per-sequence value.
"""
from __future__ import annotations

import inspect
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from trl import GRPOTrainer

from .. import method
from ..api import key_token_scores
from ..config import KTAEConfig
from ..metrics import ktae_metrics
from . import check_metrics_mode
from .gathered import grpo_groups, grpo_token_advantages

__all__ = ["KTAEGRPOMixin", "KTAEGRPOTrainer", "grpo_token_advantages", "liger_loss_takes_sequence_advantages"]

#: extra key of the ``_generate_and_score_completions`` output: the ``[B]`` rollout advantages ``A_i``.
ROLLOUT_KEY = "ktae_rollout_advantages"


def liger_loss_takes_sequence_advantages(trainer_cls: type = GRPOTrainer) -> bool:
    """Whether this TRL's ``use_liger_kernel=True`` routes the loss through Liger's fused GRPO loss
    (TRL 1.x before 1.16), which takes ``(B,)`` advantages only."""
    return any(hasattr(trainer_cls, name) for name in ("compute_liger_loss", "_compute_liger_loss"))


class KTAEGRPOMixin:
    """Turns a ``GRPOTrainer`` (sub)class into a KTAE one: ``class T(KTAEGRPOMixin, MyGRPOTrainer)``.

    Keywords: ``ktae_config`` (``KTAEConfig()`` when None), ``ktae_backend`` ("auto"),
    ``ktae_use_trl_advantage`` (True: ``A_i`` is TRL's own advantage, following its ``scale_rewards``
    and ``multi_objective_aggregation``; False: ``ktae_config.baseline`` on the weighted reward) and
    ``ktae_metrics`` ("advantages", "scores" or "off"; see the module docstring).
    A rollout is correct when its weighted reward is > ``ktae_config.correct_threshold``.
    """

    def __init__(self, *args: Any, ktae_config: KTAEConfig | None = None, ktae_backend: str = "auto",
                 ktae_use_trl_advantage: bool = True, ktae_metrics: str = "advantages", **kwargs: Any) -> None:
        training_args = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments.get("args")
        if (training_args is not None and getattr(training_args, "use_liger_kernel", False)
                and liger_loss_takes_sequence_advantages(type(self))):
            raise ValueError("KTAEGRPOTrainer: `args.use_liger_kernel=True` is not supported with this TRL version: "
                             "its Liger GRPO loss takes per-sequence (B,) advantages, KTAE's are per token (B, T). "
                             "Upgrade to TRL >= 1.16 (Liger layer kernels only) or set use_liger_kernel=False")
        if ktae_config is not None and not isinstance(ktae_config, KTAEConfig):
            raise ValueError(f"`ktae_config` must be a KTAEConfig or None, got {type(ktae_config).__name__}")
        self.ktae_config = ktae_config or KTAEConfig()
        self.ktae_backend = ktae_backend
        self.ktae_use_trl_advantage = ktae_use_trl_advantage
        self.ktae_metrics = check_metrics_mode(ktae_metrics, "`ktae_metrics`")
        self._ktae_rewards_per_func: Tensor | None = None
        self._ktae_sequence_advantages: Tensor | None = None
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------------------------------- advantages
    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # type: ignore[misc]
        self._ktae_rewards_per_func = rewards_per_func  # gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        start = time.perf_counter()
        base = self._ktae_rollout_advantages(output)
        advantages = self.ktae_advantages(output, rollout_advantage=base)
        elapsed = time.perf_counter() - start
        output[ROLLOUT_KEY] = base.to(advantages.device, torch.float32)
        self._ktae_log(output, advantages, base, elapsed)
        output["advantages"] = advantages
        return output

    def ktae_advantages(self, output: dict[str, Any], rollout_advantage: Tensor | None = None) -> Tensor:
        """``[B, T]`` advantages for one ``_generate_and_score_completions`` output; ``A_i`` is
        ``rollout_advantage`` when given, else as ``ktae_use_trl_advantage`` says."""
        if rollout_advantage is None and self.ktae_use_trl_advantage:
            rollout_advantage = output["advantages"]
        several = self.accelerator.num_processes > 1
        return grpo_token_advantages(
            output["completion_ids"], self._ktae_mask(output), self._ktae_rewards_per_func, self.reward_weights,
            rollout_advantage, process_index=self.accelerator.process_index,
            num_generations=self._ktae_num_generations(), config=self.ktae_config, backend=self.ktae_backend,
            process_group=dist.group.WORLD if several else None,
        )

    def _ktae_mask(self, output: dict[str, Any]) -> Tensor:
        mask = output["completion_mask"]
        return mask * output["tool_mask"] if output.get("tool_mask") is not None else mask

    def _ktae_num_generations(self) -> int:
        return self.num_generations if self.model.training else self.num_generations_eval

    def _ktae_rollout_advantages(self, output: dict[str, Any]) -> Tensor:
        """float64 ``[B]`` ``A_i`` of this process's rows (TRL's, or ``ktae_config.baseline`` over the
        gathered groups exactly as ``grpo_token_advantages`` forms them)."""
        if self.ktae_use_trl_advantage:
            return output["advantages"].detach().to(torch.float64)
        B = output["completion_ids"].shape[0]
        rewards, group, _ = grpo_groups(self._ktae_rewards_per_func, self.reward_weights,
                                        num_generations=self._ktae_num_generations())
        _, dense = torch.unique(group, return_inverse=True)
        size = torch.bincount(dense)
        base = method.rollout_advantage(rewards.to(torch.float64), dense, size, self.ktae_config, None)
        start = self.accelerator.process_index * B
        return base[start:start + B]

    # ------------------------------------------------------------------------------- logging
    def _ktae_log(self, output: dict[str, Any], advantages: Tensor, base: Tensor, elapsed: float) -> None:
        mode = "train" if self.model.training else "eval"
        mask = self._ktae_mask(output)
        B = advantages.shape[0]
        start = self.accelerator.process_index * B
        rewards, group, unscorable = grpo_groups(self._ktae_rewards_per_func, self.reward_weights,
                                                 num_generations=self._ktae_num_generations())
        # the completions table: each completion's mean KTAE advantage instead of TRL's stale (B,) value
        lengths = mask.sum(1).clamp(min=1)
        mean = (advantages * mask).sum(1) / lengths
        gathered = self.accelerator.gather(mean.float()) if self.accelerator.num_processes > 1 else mean
        column = self._logs["advantages"]
        n = min(len(gathered), len(column))
        for i, value in enumerate(gathered[len(gathered) - n:].tolist()):
            column[len(column) - n + i] = value
        if self.ktae_metrics == "off":
            return
        correct = rewards > self.ktae_config.correct_threshold
        local = slice(start, start + B)
        if self.ktae_metrics == "scores":
            t0 = time.perf_counter()
            kts = key_token_scores(output["completion_ids"], mask.bool() & ~unscorable[local, None],
                                   rewards[local], group[local], config=self.ktae_config, backend=self.ktae_backend)
            values = ktae_metrics(kts, elapsed_s=elapsed + time.perf_counter() - t0)
        else:
            values = ktae_metrics(advantages=advantages, mask=mask.bool() & ~unscorable[local, None],
                                  rollout_advantage=base, group=group[local], correct=correct[local],
                                  weight=self.ktae_config.weight, elapsed_s=elapsed)
        for name, value in values.items():
            self._metrics[mode][name].append(value)

    # ------------------------------------------------------------------- sequence-level branches
    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        self._ktae_sequence_advantages = inputs.get(ROLLOUT_KEY)
        try:
            return super()._compute_loss(model, inputs)  # type: ignore[misc]
        finally:
            self._ktae_sequence_advantages = None

    def _ktae_sequence(self, advantages: Tensor) -> Tensor:
        """``[B, 1]`` rollout advantages in place of ``[B, T]`` token ones, where TRL branches per sequence."""
        seq = self._ktae_sequence_advantages
        if seq is None or advantages.dim() != 2 or advantages.shape[1] == 1:
            return advantages
        return seq.to(advantages.device, advantages.dtype).reshape(-1, 1)

    def get_off_policy_mask(self, advantages: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return super().get_off_policy_mask(self._ktae_sequence(advantages), *args, **kwargs)  # type: ignore[misc]

    def get_gamma_weights(self, advantages: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return super().get_gamma_weights(self._ktae_sequence(advantages), *args, **kwargs)  # type: ignore[misc]


class KTAEGRPOTrainer(KTAEGRPOMixin, GRPOTrainer):
    """``GRPOTrainer`` with KTAE token-level advantages (see ``KTAEGRPOMixin`` for the keywords)."""
