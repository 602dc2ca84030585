"""verl adapter: the "ktae" advantage estimator, fed with what verl does not pass to estimators.

Use: ``algorithm.adv_estimator=ktae`` plus optional ``+algorithm.ktae.<KTAEConfig field>``,
``+algorithm.ktae.backend``, ``+algorithm.ktae.metrics``, ``+algorithm.ktae.correct_key`` and
``+algorithm.ktae.threads``, with
verl's own trainer (any v1 ``trainer.v1.trainer_mode`` or the legacy trainer). Importing this package
registers the estimator and patches verl's trainers as they are imported; verl imports it through the
``verl.plugins`` entry point (>= 0.9) or ``VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl``.
``python -m ktae_kernels.integrations.verl --check [overrides]`` checks both before a launch.
Modules: ``framework`` (what KTAE expects of verl), ``settings`` (the section), ``estimator``, ``trainers``
(wrappers), ``loading``, ``check``.
"""
from __future__ import annotations

from .estimator import StepInputs, compute_ktae_advantage, ktae_step, provide_responses, provide_step
from .loading import install_patches, is_registered, register
from .settings import ESTIMATOR, SECTION, check_trainer_config, is_ktae, ktae_settings

__all__ = ["ESTIMATOR", "SECTION", "StepInputs", "check_trainer_config", "compute_ktae_advantage", "install_patches",
           "is_ktae", "is_registered", "ktae_settings", "ktae_step", "provide_responses", "provide_step", "register"]

register()
install_patches()
