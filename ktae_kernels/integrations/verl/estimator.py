"""The "ktae" estimator under verl's estimator contract, and the step inputs verl does not pass to
estimators (response ids, task scores, reward extra info, batch keys, the metrics dict), which the
trainer wrappers provide through ``provide_step``."""
from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor

from ...api import key_token_scores, token_advantage
from ...validation import float64_row_sums
from ..shared import AdapterSettings, backend_that_runs, column_values, correct_labels, rollout_baseline, step_metrics
from .framework import raise_if_moved
from .settings import ktae_settings

#: label source name of verl's task score ``token_level_scores`` (the reward before any KL penalty).
TASK_SCORE = "token_level_scores"


@dataclass
class StepInputs:
    """What a trainer hands the estimator for one advantage call beside verl's arguments.

    responses: int ``[bs, T]`` response ids (required); scores: ``[bs, T]`` task scores
    (``token_level_scores``) or None; extra: the reward manager's ``reward_extra_info`` as per-row
    columns (``{"acc": [...], ...}``) or None; keys: v1 batch keys ``{uid}_{session}_{index}`` or None;
    metrics: a dict to update with ``ktae/*`` or None; padding: per row, whether verl appended it to make
    the batch divisible (v1 ``is_padding`` tags; no tokens, its own uid) or None. ``logged``: the metrics
    of the call.
    """

    responses: Tensor | None = None
    scores: Tensor | None = None
    extra: Mapping[str, Any] | None = None
    keys: list[str] | None = None
    metrics: dict | None = None
    padding: list[bool] | None = None
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
            (the trainer wrappers set it).
        kwargs: other estimator extras verl passes (ignored).
    """
    step = _STEP.get() or StepInputs()
    responses = responses if responses is not None else step.responses
    scores = token_level_scores if token_level_scores is not None else step.scores
    if responses is None:
        raise_if_moved()
        raise ValueError(
            "the 'ktae' estimator needs the response token ids, which verl does not pass to estimators. Import "
            "ktae_kernels.integrations.verl before verl's trainer (automatic with verl >= 0.9 and ktae_kernels "
            "pip-installed; verl 0.6-0.8: VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl), or call it "
            "inside provide_step(...)")
    if index is None:
        raise ValueError("the 'ktae' estimator needs `index` (verl's uid per rollout) to form groups")
    settings = ktae_settings(config)
    if step.padding is not None and any(step.padding):
        advantages, metrics = _without_padding(step, responses, response_mask, token_level_rewards, index, settings,
                                               scores)
    else:
        advantages, metrics = ktae_step(responses, response_mask, token_level_rewards, index, settings,
                                        scores=scores, extra=step.extra, keys=step.keys)
    step.logged = metrics
    if step.metrics is not None:
        step.metrics.update(metrics)
    return advantages, advantages


def _without_padding(step: StepInputs, responses: Tensor, response_mask: Tensor, token_level_rewards: Tensor,
                     index: Any, settings: AdapterSettings,
                     scores: Tensor | None) -> tuple[Tensor, dict[str, float]]:
    """``ktae_step`` on the rows verl did not append as padding (so that they count in no metric); the
    padding rows, which have no response token, get advantage 0."""
    real = [i for i, pad in enumerate(step.padding) if not pad]
    rows = torch.tensor(real, dtype=torch.int64)
    take = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
    columns = {} if step.extra is None else {k: list(v) for k, v in step.extra.items()}
    extra = None if step.extra is None else {k: [column[i] for i in real] for k, column in columns.items()}
    keys = None if step.keys is None else [step.keys[i] for i in real]
    kept, metrics = ktae_step(take(responses), take(response_mask), take(token_level_rewards),
                              np.asarray(index)[real], settings, scores=take(scores), extra=extra, keys=keys)
    advantages = torch.zeros(response_mask.shape, dtype=kept.dtype, device=kept.device)
    advantages[rows.to(kept.device)] = kept
    return advantages, metrics


def ktae_step(responses: Tensor, response_mask: Tensor, token_level_rewards: Tensor, index: Any,
              settings: AdapterSettings, *, scores: Tensor | None = None, extra: Mapping[str, Any] | None = None,
              keys: list[str] | None = None) -> tuple[Tensor, dict[str, float]]:
    """float32 ``[bs, T]`` advantages and the ``ktae/*`` metrics of one verl batch.

    Correct / wrong: ``extra[settings.correct_key]`` (the reward manager's record of task correctness,
    e.g. ``acc``) when every row has it, else the task score ``scores`` summed over T, else the rewards;
    ``> correct_threshold``. ``A_i``: ``config.baseline`` on the rewards (verl's GRPO for "grpo").
    Multi-output sessions (v1 ``keys``): groups hold each session's final output; the other outputs get
    their session's ``A_i`` and the (uid, token) scores of the final outputs' tables.
    """
    started = time.perf_counter()
    config, backend = settings.config, settings.backend
    mask = response_mask
    responses = fit_width(responses, mask.shape[1]).to(mask.device)
    rewards = float64_row_sums(token_level_rewards.detach())
    task = None if scores is None else float64_row_sums(scores.detach())
    labels = correct_labels(rewards, config.correct_threshold,
                            [(str(settings.correct_key), column_values(extra, settings.correct_key)), (TASK_SCORE, task)])
    final = final_outputs(keys, mask.shape[0])
    if final is None:  # every row is its session's only output: the common case
        base = rollout_baseline(rewards, index, config)
        advantages = token_advantage(responses, mask, rewards, index, config=config, backend=backend,
                                     rollout_advantage=base, correct=labels.correct, options=settings.options)
        kts = lambda: key_token_scores(responses, mask, rewards, index, config=config, backend=backend,  # noqa: E731
                                       correct=labels.correct, options=settings.options)
    else:
        rows, session_final = final
        f_index = np.asarray(index)[rows.numpy()]
        base = rollout_baseline(rewards[rows], f_index, config)[session_final]
        kts = key_token_scores(responses[rows], mask[rows], rewards[rows], f_index, config=config, backend=backend,
                               correct=labels.correct[rows], options=settings.options)
        advantages = kts.token_advantage(responses, mask, index, base, config.weight)
    metrics = step_metrics(settings, labels, started, backend=backend_that_runs(backend, mask.device), scores=kts,
                           advantages=advantages, mask=mask, rollout_advantage=base, group=index)
    return advantages, metrics


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


def fit_width(responses: Tensor, width: int) -> Tensor:
    """Right-pad with 0 or cut ``[bs, T']`` response ids (dense or nested) to ``[bs, width]``."""
    if responses.is_nested:
        responses = responses.to_padded_tensor(padding=0)
    if responses.shape[1] >= width:
        return responses[:, :width]
    return torch.nn.functional.pad(responses, (0, width - responses.shape[1]))
