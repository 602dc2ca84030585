"""OpenRLHF adapter: add KTAE key-token scores to the advantages of ``RemoteExperienceMaker``.

OpenRLHF (checked against its main branch, 2026-08) computes, in the driver,
``RemoteExperienceMaker.compute_advantages_and_returns(experiences)``: per ``Experience``,
``sequences [b, S]`` (prompt + response), ``action_mask / advantages / returns [b, A]`` whose action
tokens are the last ``A`` columns of ``sequences``, ``rewards [b]`` and ``index`` (each rollout's
position in the rollout batch; a group is ``n_samples_per_prompt`` consecutive positions). Its CLI
accepts only its own estimator names, so KTAE rides on top of a group estimator (``group_norm``,
``dr_grpo``, ``rloo``, ``reinforce_baseline``, ``reinforce``): after OpenRLHF's own computation,
``advantages += weight * score[group, token]`` on action tokens (KTAE's ``A_i + weight * score`` with
OpenRLHF's advantage as ``A_i``; ``config.baseline`` is not used). ``returns`` are left as computed.

Correct / wrong: from each experience's ``scores`` (OpenRLHF's binary task score, beside the shaped
``rewards``) when every experience has them, else from ``rewards``; ``> config.correct_threshold``.
Metrics ``ktae/*`` (``ktae_kernels.metrics``) go into ``experience.info`` as per-sample tensors holding
the step's value, which OpenRLHF averages and logs like its own ``info`` entries.

Settings reach the Ray actor that builds the trainer in one of two ways (``install`` runs there):

- ``worker_process_setup_hook=setup_hook(KTAEConfig(...), backend=..., metrics=...)``: a callable,
  which Ray pickles to every worker; carries any ``KTAEConfig``, ``ignore_token_ids`` included;
- ``worker_process_setup_hook="ktae_kernels.integrations.openrlhf.install"`` (a string, e.g. on the
  ``ray job submit`` command line) plus ``env_vars={"KTAE_OPENRLHF": '{"ignore_token_ids": [151643]}'}``:
  ``install()`` without arguments reads that JSON object (KTAEConfig fields, ``backend``, ``metrics``).

OpenRLHF does not install without CUDA (flash-attn), so this module imports it only in ``install``;
``add_key_token_scores`` and the mixin are tested against the contract above.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..api import key_token_scores, token_advantage
from ..config import KTAEConfig
from ..metrics import ktae_metrics
from . import AdapterSettings, check_metrics_mode, settings_from_mapping

#: environment variable ``install()`` reads its settings from (a JSON object) when given none.
ENV_VAR = "KTAE_OPENRLHF"

#: OpenRLHF estimators with a per-group outcome advantage that KTAE can refine.
ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")


def add_key_token_scores(experiences: Sequence[Any], *, n_samples_per_prompt: int, config: KTAEConfig,
                         backend: str = "auto", metrics: str = "off") -> Tensor:
    """Add ``weight * score`` to each experience's ``advantages`` in place; returns the float32 ``[B, A_max]``
    score term of the experiences' rows concatenated in order (0 off the action mask).

    A rollout is correct when its ``scores`` entry (else its ``rewards`` entry, after OpenRLHF's length
    penalties) is > ``config.correct_threshold``. ``metrics`` ("advantages", "scores" or "off") adds
    the step's ``ktae/*`` metrics to every experience's ``info``.
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"`n_samples_per_prompt` must be >= 1, got {n_samples_per_prompt}")
    check_metrics_mode(metrics)
    start_time = time.perf_counter()
    widths = [e.action_mask.shape[1] for e in experiences]
    width = max(widths, default=0)
    ids = torch.cat([_pad(e.sequences[:, e.sequences.shape[1] - a:], width) for e, a in zip(experiences, widths)])
    mask = torch.cat([_pad(e.action_mask.bool(), width) for e in experiences])
    rewards = torch.cat([e.rewards.reshape(-1) for e in experiences])
    task = [getattr(e, "scores", None) for e in experiences]
    correct = None
    if task and all(t is not None for t in task):
        correct = torch.cat([t.reshape(-1).to(torch.float64) for t in task]) > config.correct_threshold
    group = torch.tensor([i // n_samples_per_prompt for e in experiences for i in e.index], dtype=torch.int64)
    zero = torch.zeros(rewards.shape[0], dtype=torch.float64)
    term = token_advantage(ids, mask, rewards, group, config=config, backend=backend, rollout_advantage=zero,
                           correct=correct)
    start = 0
    for e, a in zip(experiences, widths):
        rows = term[start:start + e.action_mask.shape[0], :a]
        e.advantages = e.advantages + rows.to(e.advantages.device, e.advantages.dtype)
        start += rows.shape[0]
    if metrics != "off":
        if metrics == "scores":
            values = ktae_metrics(key_token_scores(ids, mask, rewards, group, config=config, backend=backend,
                                                   correct=correct))
        else:
            labels = correct if correct is not None else rewards.to(torch.float64) > config.correct_threshold
            values = ktae_metrics(advantages=term, mask=mask, rollout_advantage=zero, group=group, correct=labels,
                                  weight=config.weight)
        values["ktae/time_ms"] = 1000.0 * (time.perf_counter() - start_time)
        for e in experiences:
            b = e.action_mask.shape[0]
            info = e.info if e.info is not None else {}
            info.update({k: torch.full((b,), v, dtype=torch.float32) for k, v in values.items()})
            e.info = info
    return term


def _pad(t: Tensor, width: int) -> Tensor:
    """Right-pad ``[b, a]`` with zeros to ``[b, width]``."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


class KTAEExperienceMakerMixin:
    """``class Maker(KTAEExperienceMakerMixin, RemoteExperienceMaker)``: OpenRLHF's advantages, then
    ``add_key_token_scores``. Settings: the class attributes ``ktae_config``, ``ktae_backend`` and
    ``ktae_metrics``."""

    ktae_config: KTAEConfig = KTAEConfig()
    ktae_backend: str = "auto"
    ktae_metrics: str = "advantages"

    def compute_advantages_and_returns(self, experiences: list, *args: Any, **kwargs: Any) -> list:
        experiences = super().compute_advantages_and_returns(experiences, *args, **kwargs)  # type: ignore[misc]
        args_ = self.strategy.args
        estimator = args_.algo.advantage.estimator
        if estimator not in ESTIMATORS:
            raise ValueError(f"KTAE needs a group outcome estimator, one of {ESTIMATORS}; "
                             f"--algo.advantage.estimator is {estimator!r}")
        add_key_token_scores(experiences, n_samples_per_prompt=args_.rollout.n_samples_per_prompt,
                             config=self.ktae_config, backend=self.ktae_backend, metrics=self.ktae_metrics)
        return experiences


def settings_from_env(environ: Any = None) -> AdapterSettings:
    """``AdapterSettings`` from the JSON object in ``$KTAE_OPENRLHF`` (defaults when unset)."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return AdapterSettings()
    try:
        section = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"${ENV_VAR} must hold a JSON object of KTAEConfig fields: {err}") from None
    return settings_from_mapping(section, where=f"${ENV_VAR}")


def install(config: KTAEConfig | None = None, backend: str | None = None, metrics: str | None = None) -> type:
    """Make OpenRLHF's PPO trainer build a KTAE experience maker; returns that class.

    Call it in the process that constructs the trainer (OpenRLHF's ``PPOTrainer`` Ray actor) through
    Ray's ``worker_process_setup_hook``: ``setup_hook(config, ...)`` (a callable) or the string
    ``"ktae_kernels.integrations.openrlhf.install"``, whose settings come from ``$KTAE_OPENRLHF``.
    Arguments given here override those of ``$KTAE_OPENRLHF``.
    """
    from openrlhf.trainer import ppo_trainer

    env = settings_from_env()
    settings = AdapterSettings(config if config is not None else env.config,
                               backend if backend is not None else env.backend,
                               metrics if metrics is not None else env.metrics)
    base = ppo_trainer.RemoteExperienceMaker
    if issubclass(base, KTAEExperienceMakerMixin):  # installed before: rebuild on OpenRLHF's class
        base = base.__bases__[1]
    maker = type("KTAERemoteExperienceMaker", (KTAEExperienceMakerMixin, base),
                 {"ktae_config": settings.config, "ktae_backend": settings.backend, "ktae_metrics": settings.metrics,
                  "__module__": __name__})
    ppo_trainer.RemoteExperienceMaker = maker
    return maker


def setup_hook(config: KTAEConfig | None = None, backend: str = "auto", metrics: str = "advantages") -> Callable[[], type]:
    """A ``worker_process_setup_hook`` callable that runs ``install(config, backend, metrics)`` in each
    Ray worker: ``ray.init(runtime_env={"worker_process_setup_hook": setup_hook(KTAEConfig(...))})``."""
    AdapterSettings(config or KTAEConfig(), backend, metrics)  # fail here, not in a remote worker
    return functools.partial(install, config or KTAEConfig(), backend, metrics)
