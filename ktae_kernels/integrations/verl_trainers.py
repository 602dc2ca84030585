"""Wire the "ktae" estimator into verl's trainers; import it where verl computes advantages.

``VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl_trainers`` makes ``import verl`` load it in
every process, the trainer's included. On import it:

- registers "ktae" (as the ``verl.plugins`` entry point does);
- legacy trainer (``trainer.use_v1=False``): wraps ``verl.trainer.ppo.ray_trainer.compute_advantage``
  so that "ktae" gets ``data.batch["responses"]``;
- v1 trainer: registers ``ktae_sync``, ``ktae_colocate_async`` and ``ktae_separate_async``, verl's
  trainer modes with ``KTAEResponsesMixin``; select one with ``trainer.v1.trainer_mode=ktae_sync``.
  Skipped when the v1 trainer cannot be imported (it needs ``transfer_queue``).
"""
from __future__ import annotations

from verl.trainer.ppo import ray_trainer

from .verl import KTAEResponsesMixin, register, with_responses

register()
ray_trainer.compute_advantage = with_responses(ray_trainer.compute_advantage)

try:
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync, register_trainer
except ImportError:  # no transfer_queue: only the legacy trainer can run here
    V1_TRAINERS: dict[str, type] = {}
else:
    @register_trainer("ktae_sync")
    class KTAEPPOTrainerSync(KTAEResponsesMixin, PPOTrainerSync):
        """verl's ``sync`` trainer with response ids for the "ktae" estimator."""

    @register_trainer("ktae_colocate_async")
    class KTAEPPOTrainerColocateAsync(KTAEResponsesMixin, PPOTrainerColocateAsync):
        """verl's ``colocate_async`` trainer with response ids for the "ktae" estimator."""

    @register_trainer("ktae_separate_async")
    class KTAEPPOTrainerSeparateAsync(KTAEResponsesMixin, PPOTrainerSeparateAsync):
        """verl's ``separate_async`` trainer with response ids for the "ktae" estimator."""

    V1_TRAINERS = {"ktae_sync": KTAEPPOTrainerSync, "ktae_colocate_async": KTAEPPOTrainerColocateAsync,
                   "ktae_separate_async": KTAEPPOTrainerSeparateAsync}
