"""verl adapter: the "ktae" advantage estimator and the plumbing that hands it the response ids.

Importing this module registers ``compute_ktae_advantage`` under "ktae" with verl's
``register_adv_est``; the package's ``verl.plugins`` entry point makes every ``import verl`` do so
(unless ``VERL_USE_EXTERNAL_PLUGINS`` is "none" or a list without "ktae"). Then
``algorithm.adv_estimator=ktae`` selects it; settings come from ``+algorithm.ktae.<KTAEConfig field>``
(and ``backend``), and ``algorithm.norm_adv_by_std_in_grpo=False`` means ``baseline="mean"``.

verl calls a registered estimator with ``token_level_rewards``, ``response_mask``, ``config`` and
``index`` only, never the response ids. ``provide_responses`` hands them over for one call;
``ktae_kernels.integrations.verl_trainers`` (load it with ``VERL_USE_EXTERNAL_MODULES``) wires that
into verl's trainers.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import numpy as np
from torch import Tensor
from verl.trainer.ppo import core_algos

from ..api import token_advantage
from ..config import KTAEConfig
from . import config_from_mapping

ESTIMATOR = "ktae"
_RESPONSES: ContextVar[Tensor | None] = ContextVar("ktae_verl_responses", default=None)


def compute_ktae_advantage(token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray | None = None,
                           config: Any = None, responses: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """verl estimator contract: ``(advantages, returns)``, both float32 ``[bs, T]`` (equal, as GRPO).

    Args:
        token_level_rewards: ``[bs, T]``; each rollout's reward is its sum over T.
        response_mask: ``[bs, T]``, 1 on response tokens.
        index: ``[bs]`` numpy object array of uid strings (verl's ``non_tensor_batch["uid"]``).
        config: verl's ``algorithm`` config (DictConfig or AlgoConfig) or None; see ``ktae_config``.
        responses: int ``[bs, T]`` response ids; when None, those of the enclosing ``provide_responses``.
        kwargs: other estimator extras verl passes (ignored).
    """
    responses = responses if responses is not None else _RESPONSES.get()
    if responses is None:
        raise ValueError(
            "the 'ktae' estimator needs the response token ids, which verl does not pass to estimators: "
            "run verl with VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl_trainers (and, with the v1 "
            "trainer, trainer.v1.trainer_mode=ktae_<mode>), or call it inside provide_responses(responses)")
    if index is None:
        raise ValueError("the 'ktae' estimator needs `index` (verl's uid per rollout) to form groups")
    ktae, backend = ktae_config(config)
    advantages = token_advantage(responses, response_mask, token_level_rewards, index, config=ktae, backend=backend)
    return advantages, advantages


def ktae_config(config: Any) -> tuple[KTAEConfig, str]:
    """``(KTAEConfig, backend)`` from verl's algorithm config: its ``ktae`` section, and
    ``norm_adv_by_std_in_grpo=False`` as ``baseline="mean"`` unless the section sets ``baseline``."""
    if config is None:
        return KTAEConfig(), "auto"
    get = getattr(config, "get", None)
    section = get("ktae", None) if get is not None else getattr(config, "ktae", None)
    norm = get("norm_adv_by_std_in_grpo", True) if get is not None else getattr(config, "norm_adv_by_std_in_grpo", True)
    return config_from_mapping(section, where="algorithm.ktae", default_baseline=None if norm else "mean")


@contextmanager
def provide_responses(responses: Tensor) -> Iterator[None]:
    """Within the block, the "ktae" estimator uses these ``[bs, T]`` response ids when verl passes none."""
    token = _RESPONSES.set(responses)
    try:
        yield
    finally:
        _RESPONSES.reset(token)


def is_ktae(adv_estimator: Any) -> bool:
    """Whether verl's ``adv_estimator`` (a str or an Enum) names this estimator."""
    return getattr(adv_estimator, "value", adv_estimator) == ESTIMATOR


def with_responses(compute_advantage: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap verl's ``compute_advantage(data, adv_estimator, ...)`` so that, for "ktae", the
    estimator gets ``data.batch["responses"]``. Other estimators pass through untouched."""
    if getattr(compute_advantage, "ktae_wrapped", False):
        return compute_advantage

    @functools.wraps(compute_advantage)
    def wrapped(data: Any, *args: Any, **kwargs: Any) -> Any:
        estimator = kwargs.get("adv_estimator", args[0] if args else None)
        if not is_ktae(estimator) or "responses" not in data.batch.keys():
            return compute_advantage(data, *args, **kwargs)
        with provide_responses(data.batch["responses"]):
            return compute_advantage(data, *args, **kwargs)

    wrapped.ktae_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def register() -> None:
    """Register "ktae" with verl. Idempotent, also across a reload of this module; raises ValueError
    only when another package registered a different estimator under "ktae"."""
    existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR)
    if existing is not None and existing is not compute_ktae_advantage:
        if getattr(existing, "__qualname__", None) != compute_ktae_advantage.__qualname__ or \
                getattr(existing, "__module__", None) != __name__:
            raise ValueError(f"verl estimator {ESTIMATOR!r} is already registered to {existing!r}")
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(ESTIMATOR)
    core_algos.register_adv_est(ESTIMATOR)(compute_ktae_advantage)


class KTAEResponsesMixin:
    """Mixin for verl's v1 ``PPOTrainer``: with ``adv_estimator=ktae``, ``_compute_advantage`` also
    fetches the response ids from the TransferQueue and hands them to the estimator.

    ``class MyTrainer(KTAEResponsesMixin, PPOTrainerSync)``; ready-made classes and trainer modes
    ``ktae_<mode>`` are in ``ktae_kernels.integrations.verl_trainers``.
    """

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if not is_ktae(self.config.algorithm.adv_estimator):
            return super()._compute_advantage(batch, metrics)  # type: ignore[misc]
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["responses"])
        responses = data["responses"]
        if responses.is_nested:  # jagged rows, padded as verl pads response_mask
            responses = responses.to_padded_tensor(padding=0)
        with provide_responses(responses):
            return super()._compute_advantage(batch, metrics)  # type: ignore[misc]


register()
