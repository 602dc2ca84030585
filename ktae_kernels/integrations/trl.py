"""TRL adapter: ``GRPOTrainer`` with KTAE token-level advantages ``[B, T]``.

``KTAEGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), ..., ktae_config=KTAEConfig())`` is a
drop-in ``GRPOTrainer``. It overrides ``_generate_and_score_completions`` (TRL has no advantage hook;
its maintainers advise this override) and returns ``advantages`` of shape ``[B, T]``, which TRL's
loss accepts. ``use_liger_kernel=True`` is refused: where TRL routes the loss through Liger's fused GRPO
loss (TRL 1.x before 1.16), that loss takes ``(B,)`` advantages only.

Groups: TRL gathers the rewards of all processes, forms groups of ``num_generations`` consecutive
rows of that gathered batch and keeps this process's slice, so a group can straddle processes. The
per-token statistics of such a group are merged across processes with
``token_advantage(..., process_group=WORLD)`` (``ktae_kernels.distributed``), which needs the
"auto" / "torch" backend when ``num_processes > 1``.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch import Tensor
from trl import GRPOTrainer

from ..config import KTAEConfig
from .gathered import grpo_token_advantages

__all__ = ["KTAEGRPOMixin", "KTAEGRPOTrainer", "grpo_token_advantages"]


class KTAEGRPOMixin:
    """Turns a ``GRPOTrainer`` (sub)class into a KTAE one: ``class T(KTAEGRPOMixin, MyGRPOTrainer)``.

    Keywords: ``ktae_config`` (``KTAEConfig()`` when None), ``ktae_backend`` ("auto"), and
    ``ktae_use_trl_advantage`` (True: ``A_i`` is TRL's own advantage, following its ``scale_rewards``
    and ``multi_objective_aggregation``; False: ``ktae_config.baseline`` on the weighted reward).
    A rollout is correct when its weighted reward is > ``ktae_config.correct_threshold``.
    """

    def __init__(self, *args: Any, ktae_config: KTAEConfig | None = None, ktae_backend: str = "auto",
                 ktae_use_trl_advantage: bool = True, **kwargs: Any) -> None:
        training_args = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments.get("args")
        if training_args is not None and getattr(training_args, "use_liger_kernel", False):
            raise ValueError("KTAEGRPOTrainer: `args.use_liger_kernel=True` is not supported: Liger's GRPO loss takes "
                             "per-sequence (B,) advantages, KTAE's are per token (B, T). Set use_liger_kernel=False "
                             "(for kernels TRL suggests model_init_kwargs={'use_kernels': True})")
        if ktae_config is not None and not isinstance(ktae_config, KTAEConfig):
            raise ValueError(f"`ktae_config` must be a KTAEConfig or None, got {type(ktae_config).__name__}")
        self.ktae_config = ktae_config or KTAEConfig()
        self.ktae_backend = ktae_backend
        self.ktae_use_trl_advantage = ktae_use_trl_advantage
        self._ktae_rewards_per_func: Tensor | None = None
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # type: ignore[misc]
        self._ktae_rewards_per_func = rewards_per_func  # gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        output["advantages"] = self.ktae_advantages(output)
        return output

    def ktae_advantages(self, output: dict[str, Any]) -> Tensor:
        """``[B, T]`` advantages for one ``_generate_and_score_completions`` output."""
        mode = "train" if self.model.training else "eval"
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        several = self.accelerator.num_processes > 1
        return grpo_token_advantages(
            output["completion_ids"], mask, self._ktae_rewards_per_func, self.reward_weights,
            output["advantages"] if self.ktae_use_trl_advantage else None,
            process_index=self.accelerator.process_index,
            num_generations=self.num_generations if mode == "train" else self.num_generations_eval,
            config=self.ktae_config, backend=self.ktae_backend,
            process_group=dist.group.WORLD if several else None,
        )


class KTAEGRPOTrainer(KTAEGRPOMixin, GRPOTrainer):
    """``GRPOTrainer`` with KTAE token-level advantages (see ``KTAEGRPOMixin`` for the keywords)."""
