"""OpenRLHF adapter: add KTAE key-token scores to the advantages of ``RemoteExperienceMaker``.

OpenRLHF has no estimator registry and accepts only its own estimator names, so KTAE rides on a
group estimator (``ESTIMATORS``): after OpenRLHF's ``compute_advantages_and_returns``,
``advantages += weight * score[group, token]`` on action tokens (the last ``A`` columns of
``sequences``; groups: ``index // n_samples_per_prompt``). Settings reach the trainer actor through
Ray: ``runtime_env(...)`` sets the named hook ``worker_setup`` and the settings as JSON in
``$KTAE_OPENRLHF``; the hook patches ``openrlhf.trainer.ppo_trainer`` only in the process that imports
it (the trainer actor), so vLLM engines and other workers import nothing more. OpenRLHF does not
install without CUDA (flash-attn): this module imports none of it. See docs/integrations.md.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from ..api import key_token_scores, token_advantage
from .import_hooks import patch_on_import
from .shared import AdapterSettings, column_values, correct_labels, settings_from_mapping, step_metrics

#: environment variable ``worker_setup`` / ``install`` read the settings from (a JSON object).
ENV_VAR = "KTAE_OPENRLHF"
#: OpenRLHF estimators with a per-group outcome advantage that KTAE can refine.
ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")
#: OpenRLHF's flag that names the estimator (KTAE needs one of ``ESTIMATORS``).
ESTIMATOR_FLAG = "--algo.advantage.estimator"
#: the module whose ``RemoteExperienceMaker`` the trainer builds.
TRAINER_MODULE = "openrlhf.trainer.ppo_trainer"
#: ``worker_process_setup_hook`` in Ray's string form.
SETUP_HOOK = f"{__name__}.worker_setup"
#: environment OpenRLHF's ``train_ppo_ray`` gives Ray when it starts it; a user's own value wins.
OPENRLHF_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def add_key_token_scores(experiences: Sequence[Any], *, n_samples_per_prompt: int,
                         settings: AdapterSettings = AdapterSettings(metrics="off")) -> Tensor:
    """Add ``weight * score`` to each experience's ``advantages`` in place; returns the float32
    ``[B, A_max]`` score term of the experiences' rows in order (0 off the action mask).

    Correct / wrong (``> correct_threshold``), in order of preference: ``info[settings.correct_key]``
    (e.g. a reward function's extra field), OpenRLHF's binary task ``scores``, the shaped ``rewards``.
    ``settings.metrics`` adds the step's ``ktae/*`` metrics to every experience's ``info``.
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"`n_samples_per_prompt` must be >= 1, got {n_samples_per_prompt}")
    started = time.perf_counter()
    config = settings.config
    widths = [e.action_mask.shape[1] for e in experiences]
    width = max(widths, default=0)
    ids = torch.cat([_pad(e.sequences[:, e.sequences.shape[1] - a:], width) for e, a in zip(experiences, widths)])
    mask = torch.cat([_pad(e.action_mask.bool(), width) for e in experiences])
    rewards = torch.cat([e.rewards.reshape(-1) for e in experiences])
    labels = correct_labels(rewards, config.correct_threshold, [
        (str(settings.correct_key), _concat([column_values(e.info, settings.correct_key) for e in experiences])),
        ("scores", _concat([getattr(e, "scores", None) for e in experiences])),
    ])
    group = torch.tensor([i // n_samples_per_prompt for e in experiences for i in e.index], dtype=torch.int64)
    zero = torch.zeros(rewards.shape[0], dtype=torch.float64)
    term = token_advantage(ids, mask, rewards, group, config=config, backend=settings.backend, rollout_advantage=zero,
                           correct=labels.correct)
    start = 0
    for e, a in zip(experiences, widths):
        rows = term[start:start + e.action_mask.shape[0], :a]
        e.advantages = e.advantages + rows.to(e.advantages.device, e.advantages.dtype)
        start += rows.shape[0]
    scores = lambda: key_token_scores(ids, mask, rewards, group, config=config, backend=settings.backend,  # noqa: E731
                                      correct=labels.correct)
    values = step_metrics(settings, labels, started, scores=scores, advantages=term, mask=mask,
                          rollout_advantage=zero, group=group)
    for e in experiences:
        info = e.info if e.info is not None else {}
        info.update({k: torch.full((e.action_mask.shape[0],), v, dtype=torch.float32) for k, v in values.items()})
        e.info = info
    return term


def _concat(parts: list[Any]) -> Tensor | None:
    """The experiences' per-rollout values concatenated, or None when any experience lacks them."""
    if not parts or any(p is None for p in parts):
        return None
    return torch.cat([torch.as_tensor(p).reshape(-1).to(torch.float64) for p in parts])


def _pad(t: Tensor, width: int) -> Tensor:
    """Right-pad ``[b, a]`` with zeros to ``[b, width]``."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


class KTAEExperienceMakerMixin:
    """``class Maker(KTAEExperienceMakerMixin, RemoteExperienceMaker)``: OpenRLHF's advantages, then
    ``add_key_token_scores`` with the class attribute ``ktae_settings``."""

    ktae_settings: AdapterSettings = AdapterSettings()

    def compute_advantages_and_returns(self, experiences: list, *args: Any, **kwargs: Any) -> list:
        experiences = super().compute_advantages_and_returns(experiences, *args, **kwargs)  # type: ignore[misc]
        args_ = self.strategy.args
        estimator = args_.algo.advantage.estimator
        if estimator not in ESTIMATORS:
            raise ValueError(f"KTAE needs a group outcome estimator, one of {ESTIMATORS}; "
                             f"--algo.advantage.estimator is {estimator!r}")
        add_key_token_scores(experiences, n_samples_per_prompt=args_.rollout.n_samples_per_prompt,
                             settings=self.ktae_settings)
        return experiences


# ----------------------------------------------------------------------------- getting into OpenRLHF
def settings_json(settings: AdapterSettings) -> str:
    """``settings`` as the JSON object ``settings_from_env`` reads."""
    values = asdict(settings.config)
    values["ignore_token_ids"] = list(values["ignore_token_ids"])
    return json.dumps({**values, "backend": settings.backend, "metrics": settings.metrics,
                       "correct_key": settings.correct_key})


def settings_from_env(environ: Mapping[str, str] | None = None) -> AdapterSettings:
    """``AdapterSettings`` from the JSON object in ``$KTAE_OPENRLHF`` (defaults when unset)."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return AdapterSettings()
    try:
        section = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"${ENV_VAR} must hold a JSON object of KTAEConfig fields: {err}") from None
    return settings_from_mapping(section, where=f"${ENV_VAR}")


def patch_trainer_module(ppo_trainer: Any, settings: AdapterSettings) -> type:
    """Replace ``ppo_trainer.RemoteExperienceMaker`` with a KTAE subclass of OpenRLHF's; returns it."""
    base = ppo_trainer.RemoteExperienceMaker
    if issubclass(base, KTAEExperienceMakerMixin):  # patched before: rebuild on OpenRLHF's class
        base = base.__bases__[1]
    maker = type("KTAERemoteExperienceMaker", (KTAEExperienceMakerMixin, base),
                 {"ktae_settings": settings, "__module__": __name__})
    ppo_trainer.RemoteExperienceMaker = maker
    return maker


def install(settings: AdapterSettings | None = None) -> None:
    """Make OpenRLHF's trainer build a KTAE experience maker in this process, when (if ever) it imports
    ``openrlhf.trainer.ppo_trainer``; settings from ``$KTAE_OPENRLHF`` when None."""
    settings = settings_from_env() if settings is None else settings
    patch_on_import(__name__, {TRAINER_MODULE: lambda module: patch_trainer_module(module, settings)})


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook`` (string form: ``SETUP_HOOK``): ``install()`` with the
    settings of ``$KTAE_OPENRLHF``. Runs in every Ray worker; imports nothing of OpenRLHF."""
    install()


def runtime_env(settings: AdapterSettings = AdapterSettings(), base: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Ray ``runtime_env`` that installs KTAE in OpenRLHF's trainer actor: ``base`` (a user's own
    runtime_env) plus ``worker_setup`` as the setup hook and, in ``env_vars``, the settings as JSON
    and OpenRLHF's own defaults (``OPENRLHF_ENV_DEFAULTS``), where ``environ`` (the launching shell)
    and ``base`` set nothing else."""
    environ = os.environ if environ is None else environ
    base = dict(base or {})
    hook = base.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK, worker_setup):
        raise ValueError(f"runtime_env already has worker_process_setup_hook={hook!r}; KTAE needs {SETUP_HOOK!r} there")
    env_vars = {name: environ.get(name, default) for name, default in OPENRLHF_ENV_DEFAULTS.items()}
    env_vars.update(base.get("env_vars") or {})
    env_vars[ENV_VAR] = settings_json(settings)
    return {**base, "worker_process_setup_hook": SETUP_HOOK, "env_vars": env_vars}
