"""The verl adapter's settings: the ``algorithm.ktae`` section of verl's trainer config, read and checked
(unknown keys, bad values, a section misspelled close to ``ktae``)."""
from __future__ import annotations

import difflib
from typing import Any

from ..shared import AdapterSettings, settings_from_mapping
from .framework import check_framework, config_get

ESTIMATOR = "ktae"
SECTION = "algorithm.ktae"


def ktae_settings(config: Any) -> AdapterSettings:
    """Settings from verl's ``algorithm`` config (DictConfig, AlgoConfig or None): its ``ktae``
    section, and ``norm_adv_by_std_in_grpo=False`` as ``baseline="mean"`` unless the section sets one.
    Raises ValueError naming ``algorithm.ktae`` for an unknown key or a bad value."""
    if config is None:
        return settings_from_mapping(None, where=SECTION)
    norm = config_get(config, "norm_adv_by_std_in_grpo", True)
    return settings_from_mapping(config_get(config, "ktae"), where=SECTION, default_baseline=None if norm else "mean")


def is_ktae(adv_estimator: Any) -> bool:
    """Whether verl's ``adv_estimator`` (a str or an Enum) names this estimator."""
    return getattr(adv_estimator, "value", adv_estimator) == ESTIMATOR


def misspelled_sections(algorithm: Any) -> list[str]:
    """Keys of verl's ``algorithm`` config that look like a misspelled ``ktae`` section (``ktea``, ``kate``,
    or a setting written beside it: ``ktae_weight``, ``ktae_config``...)."""
    keys = [str(k) for k in (algorithm.keys() if hasattr(algorithm, "keys") else vars(algorithm))]
    return [k for k in keys if k != ESTIMATOR and (k.lower().startswith(ESTIMATOR)
                                                   or difflib.get_close_matches(k.lower(), [ESTIMATOR], cutoff=0.6))]


def _check_estimator_name(name: str) -> None:
    """Raise for an estimator name close to "ktae" that verl does not know (verl would fail only at the
    first advantage step)."""
    from verl.trainer.ppo import core_algos

    if name not in core_algos.ADV_ESTIMATOR_REGISTRY and difflib.get_close_matches(name.lower(), [ESTIMATOR], cutoff=0.6):
        raise ValueError(f"algorithm.adv_estimator={name!r} is not a verl estimator; did you mean {ESTIMATOR!r}?")


def check_trainer_config(config: Any) -> AdapterSettings | None:
    """Check the KTAE part of verl's whole trainer config; the settings, or None unless
    ``algorithm.adv_estimator`` is "ktae". For "ktae" it also checks the installed verl
    (``framework.check_framework``: the version, and the trainer the config runs still has what KTAE
    wraps). Called by the wrapped ``validate_config`` at start-up and by
    ``python -m ktae_kernels.integrations.verl --check``; call it in a custom launcher."""
    algorithm = config_get(config, "algorithm")
    estimator = config_get(algorithm, "adv_estimator") if algorithm is not None else None
    if estimator is not None and not is_ktae(estimator):
        _check_estimator_name(str(getattr(estimator, "value", estimator)))
    if algorithm is None or not is_ktae(estimator):
        return None
    typos = misspelled_sections(algorithm)
    if typos:
        raise ValueError(f"algorithm.{typos[0]} looks like a misspelled {SECTION} section (KTAE reads its settings "
                         f"from {SECTION} only): rename it, e.g. +{SECTION}.weight=... instead of "
                         f"+algorithm.{typos[0]}.weight=...")
    settings = ktae_settings(algorithm)
    check_framework(config)
    return settings
