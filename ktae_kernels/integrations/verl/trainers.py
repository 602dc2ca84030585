"""Wrappers of the places verl's trainers build the estimator's inputs, for "ktae" only: v1
``PPOTrainer._compute_advantage`` (every v1 mode inherits it), the legacy ``compute_advantage``,
``metric_utils.compute_data_metrics`` (the legacy trainer and the experimental ones that inherit
``SeparateRayPPOTrainer`` log the ``ktae/*`` metrics through it), and ``validate_config`` (the settings
are checked at start-up). ``PATCHES`` maps each verl module to the patch applied when it is imported;
a module that took one of these functions by name before the patch gets the wrapped one too.

A patch whose target verl moved records it in ``framework.PATCH_PROBLEMS`` instead of raising (see
``framework``)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
from torch import Tensor

from .estimator import StepInputs, fit_width, provide_step
from .framework import (CONFIG_MODULE, LEGACY_MODULE, METRICS_MODULE, PATCH_PROBLEMS, SEPARATION_MODULE, TARGETS,
                        V1_MODULE, attribute)
from .settings import check_trainer_config, is_ktae, ktae_settings

#: the v1 TransferQueue fields the estimator needs beside those verl fetches itself.
V1_FIELDS = ["responses", "rm_scores", "extra_fields"]


def wrap_once(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a wrapper factory so that wrapping an already wrapped function returns it unchanged."""
    @functools.wraps(make)
    def factory(original: Callable[..., Any], *args: Any) -> Callable[..., Any]:
        if getattr(original, "ktae_wrapped", False):
            return original
        wrapped = functools.wraps(original)(make(original, *args))
        wrapped.ktae_wrapped = True  # type: ignore[attr-defined]
        return wrapped
    return factory


def _item(value: Any) -> Any:
    """One row's value of a non-tensor TransferQueue field: a ``NonTensorData``'s payload, else the value
    (numpy scalars kept: their ``.data`` is a buffer)."""
    return value if isinstance(value, (np.generic, np.ndarray, Tensor)) else getattr(value, "data", value)


def reward_extra_columns(extra_fields: Any) -> dict[str, list[Any]]:
    """v1 rows' ``extra_fields["reward_extra_info"]`` (verl's reward loop) as per-row columns; a row
    without a key holds None there."""
    records = []
    for value in list(extra_fields):
        value = _item(value)
        info = value.get("reward_extra_info", None) if hasattr(value, "get") else None
        records.append(info if hasattr(info, "get") else {})
    names = {name for record in records for name in record}
    return {name: [record.get(name, None) for record in records] for name in names}


def _width(t: Tensor) -> int:
    return int(t.to_padded_tensor(padding=0).shape[1]) if t.is_nested else int(t.shape[1])


@wrap_once
def wrap_v1_compute_advantage(original: Callable[..., Any], tq_of: Callable[[], Any]) -> Callable[..., Any]:
    """verl v1 ``PPOTrainer._compute_advantage(self, batch, metrics)`` that, for "ktae", fetches the
    response ids, the task scores (``rm_scores``, which verl's method turns into ``token_level_scores``)
    and the reward extra info (the agent loop's ``extra_fields["reward_extra_info"]``; a colocated reward
    model writes each key as a field of its own, and that field wins), and keeps the batch keys, the
    padding flags of the batch's tags and the metrics dict for the estimator."""
    def _compute_advantage(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        if not is_ktae(self.config.algorithm.adv_estimator):
            return original(self, batch, metrics, *args, **kwargs)
        correct_key = ktae_settings(self.config.algorithm).correct_key
        own = [] if correct_key is None or correct_key in V1_FIELDS else [str(correct_key)]
        data = tq_of().kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=V1_FIELDS + own)
        present = set(data.keys())
        scores = data["rm_scores"] if "rm_scores" in present else None
        extra = reward_extra_columns(data["extra_fields"]) if "extra_fields" in present else None
        if own and own[0] in present:  # written by verl's colocated reward model
            extra = {**(extra or {}), own[0]: [_item(v) for v in list(data[own[0]])]}
        tags = getattr(batch, "tags", None)
        step = StepInputs(responses=fit_width(data["responses"], _width(data["responses"])),
                          scores=None if scores is None else fit_width(scores, _width(scores)), extra=extra,
                          keys=list(batch.keys), metrics=metrics,
                          padding=None if tags is None else [bool(tag.get("is_padding", False)) for tag in tags])
        with provide_step(step):
            return original(self, batch, metrics, *args, **kwargs)
    return _compute_advantage


@wrap_once
def with_responses(compute_advantage: Callable[..., Any]) -> Callable[..., Any]:
    """Legacy trainer: ``ray_trainer.compute_advantage(data, adv_estimator, ...)`` that, for "ktae",
    hands the estimator ``data.batch["responses"]``, ``["token_level_scores"]`` and the reward extra
    info (verl puts it in ``non_tensor_batch``); the step's metrics ride in ``meta_info["ktae_metrics"]``."""
    def wrapped(data: Any, *args: Any, **kwargs: Any) -> Any:
        estimator = kwargs.get("adv_estimator", args[0] if args else None)
        if not is_ktae(estimator) or "responses" not in data.batch.keys():
            return compute_advantage(data, *args, **kwargs)
        scores = data.batch["token_level_scores"] if "token_level_scores" in data.batch.keys() else None
        step = StepInputs(responses=data.batch["responses"], scores=scores, extra=dict(data.non_tensor_batch))
        with provide_step(step):
            out = compute_advantage(data, *args, **kwargs)
        if step.logged:
            out.meta_info["ktae_metrics"] = step.logged
        return out
    return wrapped


@wrap_once
def with_ktae_metrics(compute_data_metrics: Callable[..., dict]) -> Callable[..., dict]:
    """Legacy trainer: ``compute_data_metrics(batch=...)`` plus the ``ktae/*`` metrics of that batch."""
    def wrapped(*args: Any, **kwargs: Any) -> dict:
        metrics = compute_data_metrics(*args, **kwargs)
        batch = kwargs.get("batch", args[0] if args else None)
        extra = getattr(batch, "meta_info", {}).pop("ktae_metrics", None)
        return {**metrics, **extra} if extra else metrics
    return wrapped


@wrap_once
def with_ktae_check(validate_config: Callable[..., Any]) -> Callable[..., Any]:
    """``verl.utils.config.validate_config(config, ...)`` that also runs ``check_trainer_config``."""
    def wrapped(config: Any, *args: Any, **kwargs: Any) -> Any:
        check_trainer_config(config)
        return validate_config(config, *args, **kwargs)
    return wrapped


def _patched(module: Any, wrap: Callable[[Any], None]) -> None:
    """Apply ``wrap`` to ``module``'s target, or record in ``PATCH_PROBLEMS`` that verl moved it."""
    name = module.__name__
    if not callable(attribute(module, TARGETS[name][0])):
        PATCH_PROBLEMS[name] = f"{name} has no {TARGETS[name][0]}"
        return
    PATCH_PROBLEMS.pop(name, None)
    wrap(module)


def _wrap_v1(trainer_base: Any) -> None:
    cls = trainer_base.PPOTrainer
    cls._compute_advantage = wrap_v1_compute_advantage(cls._compute_advantage, lambda: trainer_base.tq)


def _wrap_legacy(ray_trainer: Any) -> None:
    ray_trainer.compute_advantage = with_responses(ray_trainer.compute_advantage)
    if hasattr(ray_trainer, "compute_data_metrics"):
        ray_trainer.compute_data_metrics = with_ktae_metrics(ray_trainer.compute_data_metrics)


def _wrap_metrics(metric_utils: Any) -> None:
    metric_utils.compute_data_metrics = with_ktae_metrics(metric_utils.compute_data_metrics)


def _wrap_separation(separation: Any) -> None:
    separation.compute_data_metrics = with_ktae_metrics(separation.compute_data_metrics)
    if callable(getattr(separation, "compute_advantage", None)):
        separation.compute_advantage = with_responses(separation.compute_advantage)


def _wrap_config(config_module: Any) -> None:
    config_module.validate_config = with_ktae_check(config_module.validate_config)


#: module -> patch applied right after verl imports it (or at once, when it already has).
PATCHES: dict[str, Callable[[Any], None]] = {
    V1_MODULE: lambda module: _patched(module, _wrap_v1),
    LEGACY_MODULE: lambda module: _patched(module, _wrap_legacy),
    CONFIG_MODULE: lambda module: _patched(module, _wrap_config),
    METRICS_MODULE: lambda module: _patched(module, _wrap_metrics),
    SEPARATION_MODULE: lambda module: _patched(module, _wrap_separation),
}
