"""How the adapter gets into verl: ``register`` puts the estimator in verl's registry, and
``install_patches`` applies ``trainers.PATCHES`` to verl's trainer modules when verl imports them
(never earlier, so verl's worker processes pay nothing)."""
from __future__ import annotations

from verl.trainer.ppo import core_algos

from ..import_hooks import patch_on_import
from ..shared import missing_target
from .estimator import compute_ktae_advantage
from .framework import MIN_VERSION, verl_version
from .settings import ESTIMATOR
from .trainers import PATCHES


def install_patches() -> None:
    """Patch the verl trainer modules already imported, and the others when they are. Idempotent."""
    patch_on_import(__name__, PATCHES)


def register() -> None:
    """Register "ktae" with verl. Idempotent, also across a reload; raises ValueError when another
    package registered a different estimator under "ktae", and ``FrameworkMismatchError`` when this
    verl has no estimator registry."""
    if not callable(getattr(core_algos, "register_adv_est", None)):
        raise missing_target("verl", verl_version(), "verl.trainer.ppo.core_algos has no register_adv_est",
                             f"verl's estimator registry (verl >= {MIN_VERSION})")
    existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR)
    if existing is not None and existing is not compute_ktae_advantage:
        if getattr(existing, "__qualname__", None) != compute_ktae_advantage.__qualname__ or \
                getattr(existing, "__module__", None) != compute_ktae_advantage.__module__:
            raise ValueError(f"verl estimator {ESTIMATOR!r} is already registered to {existing!r}")
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(ESTIMATOR)
    core_algos.register_adv_est(ESTIMATOR)(compute_ktae_advantage)


def is_registered() -> bool:
    """Whether verl's registry holds this adapter's estimator under "ktae"."""
    return core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR) is compute_ktae_advantage
