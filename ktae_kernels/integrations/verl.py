"""verl adapter: the "ktae" advantage estimator, fed with what verl does not pass to estimators.

Setup (from a clone; the package is not on PyPI): ``pip install -e ".[verl]"``, then only ``algorithm.adv_estimator=ktae`` (plus optional
``+algorithm.ktae.<KTAEConfig field>=...``, ``+algorithm.ktae.backend=...``,
``+algorithm.ktae.metrics=advantages|scores|off``). Keep verl's own trainer, any
``trainer.v1.trainer_mode`` (sync, colocate_async, separate_async) or the legacy trainer.

Loading: the package's ``verl.plugins`` entry point imports this module at every ``import verl``
(verl >= 0.9.0; switch: ``VERL_USE_EXTERNAL_PLUGINS``). verl 0.6-0.8: set
``VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl``. On import it:

- registers ``compute_ktae_advantage`` under "ktae" with ``core_algos.register_adv_est``;
- when verl's trainer modules are imported (never earlier, so verl's worker processes pay nothing),
  wraps, for "ktae" only, the one place each trainer builds the estimator's inputs:
  v1 ``PPOTrainer._compute_advantage`` (the base of every v1 mode; the wrapper also fetches
  ``responses`` from the TransferQueue and keeps the batch keys, which name each agent session), and
  the legacy ``ray_trainer.compute_advantage`` (``data.batch`` has ``responses``). Other estimators
  pass through untouched, and verl's trainer classes and mode registry are not changed;
- wraps ``verl.utils.config.validate_config`` so a bad ``algorithm.ktae`` section (a typo such as
  ``alhpa``) fails when ``main_ppo`` starts, before any worker or generation.

What the estimator computes, per verl batch:

- correct / wrong rollouts from the task score ``token_level_scores`` (verl's reward before any KL
  penalty) summed over tokens, ``> correct_threshold``; ``A_i`` from ``token_level_rewards`` as
  verl's GRPO (``algorithm.norm_adv_by_std_in_grpo=False``: mean-centred, Dr. GRPO);
- multi-output agent loops (v1 keys ``{uid}_{session}_{index}``): as verl's GRPO, groups hold each
  session's final output only (the highest ``index``); its ``A_i`` is broadcast to the session's
  other outputs, whose tokens get the scores of the (uid, token) tables built from the final outputs
  (0 for a token id absent from them);
- metrics ``ktae/*`` (``ktae_kernels.metrics``) into verl's step metrics (v1: the trainer's metrics
  dict; legacy: merged into ``compute_data_metrics``). ``metrics=advantages`` (default) derives them
  from the advantages in one element-wise pass; ``scores`` adds one ``key_token_scores`` call and
  ``ktae/distinct_tokens_per_group``; ``off`` logs nothing.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import Tensor
from verl.trainer.ppo import core_algos

from .. import method
from ..api import key_token_scores, token_advantage
from ..config import KTAEConfig
from ..metrics import ktae_metrics
from . import AdapterSettings, settings_from_mapping

ESTIMATOR = "ktae"
SECTION = "algorithm.ktae"


# ------------------------------------------------------------------------------------------ settings
def ktae_settings(config: Any) -> AdapterSettings:
    """Settings from verl's ``algorithm`` config (DictConfig, AlgoConfig or None): its ``ktae``
    section, and ``norm_adv_by_std_in_grpo=False`` as ``baseline="mean"`` unless the section sets one.
    Raises ValueError naming ``algorithm.ktae`` for an unknown key or a bad value."""
    if config is None:
        return settings_from_mapping(None, where=SECTION)
    get = getattr(config, "get", None)
    section = get("ktae", None) if get is not None else getattr(config, "ktae", None)
    norm = get("norm_adv_by_std_in_grpo", True) if get is not None else getattr(config, "norm_adv_by_std_in_grpo", True)
    return settings_from_mapping(section, where=SECTION, default_baseline=None if norm else "mean")


def ktae_config(config: Any) -> tuple[KTAEConfig, str]:
    """``(KTAEConfig, backend)`` of ``ktae_settings``."""
    s = ktae_settings(config)
    return s.config, s.backend


def is_ktae(adv_estimator: Any) -> bool:
    """Whether verl's ``adv_estimator`` (a str or an Enum) names this estimator."""
    return getattr(adv_estimator, "value", adv_estimator) == ESTIMATOR


def check_trainer_config(config: Any) -> None:
    """Validate the whole trainer config's KTAE part: no-op unless ``algorithm.adv_estimator`` is "ktae".
    Called by the wrapped ``validate_config`` at start-up; call it in a custom launcher."""
    algorithm = config.get("algorithm", None) if hasattr(config, "get") else getattr(config, "algorithm", None)
    if algorithm is not None and is_ktae(algorithm.get("adv_estimator", None) if hasattr(algorithm, "get")
                                         else getattr(algorithm, "adv_estimator", None)):
        ktae_settings(algorithm)


# -------------------------------------------------------------------------- what verl does not pass
@dataclass
class StepInputs:
    """What a trainer hands the estimator for one advantage call beside verl's arguments.

    responses: int ``[bs, T]`` response ids (required); scores: ``[bs, T]`` task scores
    (``token_level_scores``) or None; keys: v1 batch keys ``{uid}_{session}_{index}`` or None;
    metrics: a dict to update with ``ktae/*`` or None.
    """

    responses: Tensor | None = None
    scores: Tensor | None = None
    keys: list[str] | None = None
    metrics: dict | None = None
    logged: dict = field(default_factory=dict)


_STEP: ContextVar[StepInputs | None] = ContextVar("ktae_verl_step", default=None)


@contextmanager
def provide_step(step: StepInputs) -> Iterator[StepInputs]:
    """Within the block, the "ktae" estimator takes what verl does not pass from ``step``."""
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def provide_responses(responses: Tensor, scores: Tensor | None = None):
    """``provide_step`` with the response ids (and task scores) only."""
    return provide_step(StepInputs(responses=responses, scores=scores))


# ------------------------------------------------------------------------------------------ estimator
def compute_ktae_advantage(token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray | None = None,
                           config: Any = None, responses: Tensor | None = None,
                           token_level_scores: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """verl estimator contract: ``(advantages, returns)``, both float32 ``[bs, T]`` (equal, as GRPO).

    Args:
        token_level_rewards: ``[bs, T]``; each rollout's reward (for ``A_i``) is its sum over T.
        response_mask: ``[bs, T]``, 1 on response tokens.
        index: ``[bs]`` numpy object array of uid strings (verl's ``non_tensor_batch["uid"]``).
        config: verl's ``algorithm`` config (DictConfig or AlgoConfig) or None; see ``ktae_settings``.
        responses, token_level_scores: ``[bs, T]``; when None, those of the enclosing ``provide_step``
            (the trainer wrappers set it). Without scores, correctness comes from the rewards.
        kwargs: other estimator extras verl passes (ignored).
    """
    step = _STEP.get() or StepInputs()
    responses = responses if responses is not None else step.responses
    scores = token_level_scores if token_level_scores is not None else step.scores
    if responses is None:
        raise ValueError(
            "the 'ktae' estimator needs the response token ids, which verl does not pass to estimators. Import "
            "ktae_kernels.integrations.verl before verl's trainer (automatic with verl >= 0.9 and ktae_kernels "
            "pip-installed; verl 0.6-0.8: VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl), or call it "
            "inside provide_step(...)")
    if index is None:
        raise ValueError("the 'ktae' estimator needs `index` (verl's uid per rollout) to form groups")
    settings = ktae_settings(config)
    advantages, metrics = ktae_step(responses, response_mask, token_level_rewards, index, settings,
                                    scores=scores, keys=step.keys)
    step.logged = metrics
    if step.metrics is not None:
        step.metrics.update(metrics)
    return advantages, advantages


def ktae_step(responses: Tensor, response_mask: Tensor, token_level_rewards: Tensor, index: Any,
              settings: AdapterSettings, *, scores: Tensor | None = None,
              keys: list[str] | None = None) -> tuple[Tensor, dict[str, float]]:
    """float32 ``[bs, T]`` advantages and the ``ktae/*`` metrics of one verl batch (see the module doc)."""
    start = time.perf_counter()
    config, backend = settings.config, settings.backend
    mask = response_mask
    responses = _fit_width(responses, mask.shape[1]).to(mask.device)
    rewards = token_level_rewards.detach().to(torch.float64).sum(-1)
    correct = None if scores is None else scores.detach().to(torch.float64).sum(-1) > config.correct_threshold
    labels = correct if correct is not None else rewards > config.correct_threshold
    final = final_outputs(keys, mask.shape[0])
    kts = None
    if final is None:  # every row is its session's only output: the common case
        base = rollout_baseline(rewards, index, config)
        advantages = token_advantage(responses, mask, rewards, index, config=config, backend=backend,
                                     rollout_advantage=base, correct=correct)
        if settings.metrics == "scores":
            kts = key_token_scores(responses, mask, rewards, index, config=config, backend=backend, correct=correct)
    else:
        rows, session_final = final
        f_index = np.asarray(index)[rows.numpy()]
        base = rollout_baseline(rewards[rows], f_index, config)[session_final]
        kts = key_token_scores(responses[rows], mask[rows], rewards[rows], f_index, config=config, backend=backend,
                               correct=None if correct is None else correct[rows])
        advantages = _lookup_advantages(kts, responses, mask, index, base, config.weight)
    if settings.metrics == "off":
        return advantages, {}
    if kts is not None:
        metrics = ktae_metrics(kts)
    else:
        metrics = ktae_metrics(advantages=advantages, mask=mask, rollout_advantage=base, group=index,
                               correct=labels, weight=config.weight)
    metrics["ktae/time_ms"] = 1000.0 * (time.perf_counter() - start)
    return advantages, metrics


def rollout_baseline(rewards: Tensor, index: Any, config: KTAEConfig) -> Tensor:
    """float64 ``[bs]`` ``A_i`` of ``config.baseline`` within the groups of ``index`` (verl's GRPO for "grpo")."""
    _, dense = np.unique(np.asarray(index), return_inverse=True)
    group = torch.as_tensor(dense.reshape(-1), dtype=torch.int64, device=rewards.device)
    size = torch.bincount(group, minlength=int(group.max()) + 1 if group.numel() else 0)
    return method.rollout_advantage(rewards, group, size, config, None)


def final_outputs(keys: list[str] | None, batch_size: int) -> tuple[Tensor, Tensor] | None:
    """For v1 batch keys ``{uid}_{session}_{index}``: ``(rows, session_final)``, the rows of each
    session's final output (highest index) and, per row, the position in ``rows`` of its session's
    final output. None when there are no keys or every session has one output."""
    if keys is None:
        return None
    if len(keys) != batch_size:
        raise ValueError(f"verl batch has {batch_size} rows but {len(keys)} keys")
    best: dict[str, tuple[int, int]] = {}
    sessions = []
    for row, key in enumerate(keys):
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3:
            raise ValueError(f"unexpected verl batch key {key!r} (expected '<uid>_<session>_<index>')")
        session, output = f"{parts[0]}_{parts[1]}", int(parts[2])
        sessions.append(session)
        if session not in best or best[session][0] < output:
            best[session] = (output, row)
    if len(best) == batch_size:
        return None
    position = {s: i for i, s in enumerate(best)}
    rows = torch.tensor([r for _, r in best.values()], dtype=torch.int64)
    return rows, torch.tensor([position[s] for s in sessions], dtype=torch.int64)


def _lookup_advantages(kts: Any, responses: Tensor, mask: Tensor, index: Any, base: Tensor, weight: float) -> Tensor:
    """``(base_i + weight * score[uid(i), token]) * mask``; score 0 for (uid, token) pairs with no row."""
    labels = {lab: i for i, lab in enumerate(kts.group_labels.tolist())}
    group = torch.tensor([labels.get(lab, -1) for lab in np.asarray(index).tolist()], dtype=torch.int64)
    width = int(max(int(kts.token.max()) if len(kts) else 0, int(responses.max()) if responses.numel() else 0)) + 1
    table_keys = kts.group.cpu() * width + kts.token.cpu()
    ids = responses.cpu().long().clamp(min=0)
    queries = group[:, None] * width + ids
    pos = torch.searchsorted(table_keys, queries).clamp(max=max(len(kts) - 1, 0))
    found = (table_keys[pos] == queries) & (group[:, None] >= 0) if len(kts) else torch.zeros_like(queries, dtype=torch.bool)
    score = torch.where(found, kts.score.cpu()[pos], 0.0) if len(kts) else torch.zeros(queries.shape, dtype=torch.float64)
    values = (base.cpu().to(torch.float64)[:, None] + weight * score) * mask.cpu().to(torch.float64)
    return values.to(torch.float32).to(mask.device)


def _fit_width(responses: Tensor, width: int) -> Tensor:
    """Right-pad with 0 or cut ``[bs, T']`` response ids to ``[bs, width]`` (verl pads both from the right)."""
    if responses.is_nested:
        responses = responses.to_padded_tensor(padding=0)
    if responses.shape[1] >= width:
        return responses[:, :width]
    return torch.nn.functional.pad(responses, (0, width - responses.shape[1]))


# ------------------------------------------------------------------------------------ trainer plumbing
def wrap_v1_compute_advantage(original: Callable[..., Any], tq_of: Callable[[], Any]) -> Callable[..., Any]:
    """verl v1 ``PPOTrainer._compute_advantage(self, batch, metrics)`` that, for "ktae", fetches the
    response ids and the task scores (``rm_scores``, which verl's method turns into
    ``token_level_scores``) and keeps the batch keys and the metrics dict for the estimator."""
    if getattr(original, "ktae_wrapped", False):
        return original

    @functools.wraps(original)
    def _compute_advantage(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        if not is_ktae(self.config.algorithm.adv_estimator):
            return original(self, batch, metrics, *args, **kwargs)
        data = tq_of().kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                    select_fields=["responses", "rm_scores"])
        width = _max_width(data["responses"])
        scores = data["rm_scores"] if "rm_scores" in data.keys() else None  # verl's token_level_scores
        step = StepInputs(responses=_fit_width(data["responses"], width),
                          scores=None if scores is None else _fit_width(scores, _max_width(scores)),
                          keys=list(batch.keys), metrics=metrics)
        with provide_step(step):
            return original(self, batch, metrics, *args, **kwargs)

    _compute_advantage.ktae_wrapped = True  # type: ignore[attr-defined]
    return _compute_advantage


def _max_width(t: Tensor) -> int:
    return int(t.to_padded_tensor(padding=0).shape[1]) if t.is_nested else int(t.shape[1])


def with_responses(compute_advantage: Callable[..., Any]) -> Callable[..., Any]:
    """Legacy trainer: wrap ``ray_trainer.compute_advantage(data, adv_estimator, ...)`` so that, for
    "ktae", the estimator gets ``data.batch["responses"]`` and ``["token_level_scores"]``, and the
    step's metrics ride in ``data.meta_info["ktae_metrics"]``. Other estimators pass through."""
    if getattr(compute_advantage, "ktae_wrapped", False):
        return compute_advantage

    @functools.wraps(compute_advantage)
    def wrapped(data: Any, *args: Any, **kwargs: Any) -> Any:
        estimator = kwargs.get("adv_estimator", args[0] if args else None)
        if not is_ktae(estimator) or "responses" not in data.batch.keys():
            return compute_advantage(data, *args, **kwargs)
        scores = data.batch["token_level_scores"] if "token_level_scores" in data.batch.keys() else None
        with provide_step(StepInputs(responses=data.batch["responses"], scores=scores)) as step:
            out = compute_advantage(data, *args, **kwargs)
        if step.logged:
            out.meta_info["ktae_metrics"] = step.logged
        return out

    wrapped.ktae_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def with_ktae_metrics(compute_data_metrics: Callable[..., dict]) -> Callable[..., dict]:
    """Legacy trainer: ``compute_data_metrics(batch=...)`` plus the ``ktae/*`` metrics of that batch."""
    if getattr(compute_data_metrics, "ktae_wrapped", False):
        return compute_data_metrics

    @functools.wraps(compute_data_metrics)
    def wrapped(*args: Any, **kwargs: Any) -> dict:
        metrics = compute_data_metrics(*args, **kwargs)
        batch = kwargs.get("batch", args[0] if args else None)
        extra = getattr(batch, "meta_info", {}).pop("ktae_metrics", None)
        return {**metrics, **extra} if extra else metrics

    wrapped.ktae_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def with_ktae_check(validate_config: Callable[..., Any]) -> Callable[..., Any]:
    """``verl.utils.config.validate_config(config, ...)`` that also runs ``check_trainer_config``."""
    if getattr(validate_config, "ktae_wrapped", False):
        return validate_config

    @functools.wraps(validate_config)
    def wrapped(config: Any, *args: Any, **kwargs: Any) -> Any:
        check_trainer_config(config)
        return validate_config(config, *args, **kwargs)

    wrapped.ktae_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def _patch_v1(trainer_base: Any) -> None:
    cls = trainer_base.PPOTrainer
    cls._compute_advantage = wrap_v1_compute_advantage(cls._compute_advantage, lambda: trainer_base.tq)


def _patch_legacy(ray_trainer: Any) -> None:
    ray_trainer.compute_advantage = with_responses(ray_trainer.compute_advantage)
    if hasattr(ray_trainer, "compute_data_metrics"):
        ray_trainer.compute_data_metrics = with_ktae_metrics(ray_trainer.compute_data_metrics)


def _patch_config(config_module: Any) -> None:
    if hasattr(config_module, "validate_config"):
        config_module.validate_config = with_ktae_check(config_module.validate_config)


#: module -> patch applied right after verl imports it (or now, when it already has).
PATCHES: dict[str, Callable[[Any], None]] = {
    "verl.trainer.ppo.v1.trainer_base": _patch_v1,
    "verl.trainer.ppo.ray_trainer": _patch_legacy,
    "verl.utils.config": _patch_config,
}


# --------------------------------------------------------------------------- patch when verl imports
class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the patch on the executed module."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]):
        self._loader, self._patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds modules through the other finders and patches those in ``PATCHES`` once loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if type(finder).__name__ == "_AfterImport" or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def install_patches() -> None:
    """Patch the verl trainer modules already imported, and the others when they are. Idempotent."""
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(type(f).__name__ == "_AfterImport" for f in sys.meta_path):  # also across a reload
        sys.meta_path.insert(0, _AfterImport())


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


register()
install_patches()
