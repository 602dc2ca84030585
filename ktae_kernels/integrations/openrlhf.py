"""OpenRLHF adapter: add KTAE key-token scores to the advantages of ``RemoteExperienceMaker``.

OpenRLHF has no estimator registry and accepts only its own estimator names, so KTAE rides on a
group estimator (``ESTIMATORS``): after OpenRLHF's ``compute_advantages_and_returns`` (and so after
the batch whitening of ``reinforce`` / ``reinforce_baseline``), ``advantages += weight *
score[group, token]`` on action tokens (the last ``A`` columns of ``sequences``; groups: ``index //
n_samples_per_prompt``). Settings reach the trainer actor through Ray: ``runtime_env(...)`` sets the
named hook ``worker_setup`` and the settings as JSON in ``$KTAE_OPENRLHF``; the hook patches
``openrlhf.trainer.ppo_trainer`` only in the process that imports it (the trainer actor), so vLLM
engines and other workers import nothing more. The patch checks what it extends (``check_trainer_module``)
and the trainer checks that it built KTAE's maker: a moved target fails at start-up. Each experience
batch checks that KTAE's step ran (an OpenRLHF that stopped calling it fails at the first batch). This
module imports none of OpenRLHF. See docs/integrations.md.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
import time
from dataclasses import asdict
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..api import key_token_scores, token_advantage
from .import_hooks import patch_on_import
from .shared import (ALLOW_UNTESTED, AdapterSettings, backend_that_runs, check_baseline_unused, check_version,
                     column_values, correct_labels, missing_target, settings_from_mapping, step_metrics)

#: environment variable ``worker_setup`` / ``install`` read the settings from (a JSON object).
ENV_VAR = "KTAE_OPENRLHF"
#: OpenRLHF estimators with a per-group outcome advantage that KTAE can refine.
ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce")
#: OpenRLHF's flag that names the estimator (KTAE needs one of ``ESTIMATORS``).
ESTIMATOR_FLAG = "--algo.advantage.estimator"
#: OpenRLHF's flag that sets the rollouts per prompt: KTAE's groups (it needs >= 2).
SAMPLES_FLAG = "--rollout.n_samples_per_prompt"
#: the module whose ``RemoteExperienceMaker`` the trainer builds.
TRAINER_MODULE = "openrlhf.trainer.ppo_trainer"
#: the ``RemoteExperienceMaker`` methods KTAE extends: the batch step the trainer calls, and the advantage
#: step it calls, where KTAE adds its term.
MAKER_METHODS = ("make_experience_batch", "compute_advantages_and_returns")
#: supported OpenRLHF: >= MIN_VERSION (the dotted ``--algo.advantage.*`` flags), < BELOW_VERSION; the
#: tests run on the README whole-suite command's OpenRLHF and, in CI, again on MIN_VERSION.
MIN_VERSION = "0.10.2"
BELOW_VERSION = "0.12"
#: ``worker_process_setup_hook`` in Ray's string form.
SETUP_HOOK = f"{__name__}.worker_setup"
#: environment OpenRLHF's ``train_ppo_ray`` gives Ray when it starts it; a user's own value wins.
OPENRLHF_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def check_estimator(estimator: Any) -> str:
    """``estimator`` when it is one of ``ESTIMATORS``; else ValueError naming OpenRLHF's flag."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"KTAE refines a group outcome advantage: pass {ESTIMATOR_FLAG} one of {ESTIMATORS} "
                         f"(got {estimator!r})")
    return estimator


def check_group_size(n_samples_per_prompt: Any) -> int:
    """``n_samples_per_prompt`` when it is an int >= 2; else ValueError naming OpenRLHF's flag. With one
    rollout per prompt every group is all correct or all wrong, so KTAE's term is 0 with every estimator
    (OpenRLHF itself refuses that only for its group-baseline estimators, not for ``reinforce``)."""
    if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int) or n_samples_per_prompt < 2:
        raise ValueError(f"KTAE needs groups of rollouts: pass {SAMPLES_FLAG} >= 2 (got {n_samples_per_prompt!r}); "
                         f"with one rollout per prompt KTAE's term is 0 and training would be the estimator alone")
    return n_samples_per_prompt


def add_key_token_scores(experiences: Sequence[Any], *, n_samples_per_prompt: int,
                         settings: AdapterSettings = AdapterSettings(metrics="off"),
                         rewards: Sequence[Tensor] | None = None) -> Tensor:
    """Add ``weight * score`` to each experience's ``advantages`` in place; returns the float32
    ``[B, A_max]`` score term of the experiences' rows in order (0 off the action mask).

    ``n_samples_per_prompt``: rollouts per group (>= 2; ValueError otherwise).
    ``rewards``: each experience's ``[b]`` rewards before OpenRLHF shaped them in place (length
    penalties), as ``KTAEExperienceMakerMixin`` captures them; None: the experiences' ``rewards``.
    Correct / wrong (``> correct_threshold``), in order of preference: ``info[settings.correct_key]``
    (e.g. a reward function's extra field), OpenRLHF's binary task ``scores``, those ``rewards``.
    ``settings.metrics`` adds the step's ``ktae/*`` metrics to every experience's ``info``.
    """
    if n_samples_per_prompt < 2:
        raise ValueError(f"`n_samples_per_prompt` must be >= 2 (in groups of one rollout KTAE's term is 0), "
                         f"got {n_samples_per_prompt}")
    started = time.perf_counter()
    config = settings.config
    widths = [e.action_mask.shape[1] for e in experiences]
    width = max(widths, default=0)
    ids = torch.cat([_pad(e.sequences[:, e.sequences.shape[1] - a:], width) for e, a in zip(experiences, widths)])
    mask = torch.cat([_pad(e.action_mask.bool(), width) for e in experiences])
    rewards = torch.cat([r.reshape(-1) for r in (rewards if rewards is not None else [e.rewards for e in experiences])])
    labels = correct_labels(rewards, config.correct_threshold, [
        (str(settings.correct_key), _concat([column_values(e.info, settings.correct_key) for e in experiences])),
        ("scores", _concat([getattr(e, "scores", None) for e in experiences])),
    ])
    group = torch.tensor([i // n_samples_per_prompt for e in experiences for i in e.index], dtype=torch.int64)
    zero = torch.zeros(rewards.shape[0], dtype=torch.float64)
    term = token_advantage(ids, mask, rewards, group, config=config, backend=settings.backend, rollout_advantage=zero,
                           correct=labels.correct, options=settings.options)
    start = 0
    for e, a in zip(experiences, widths):
        rows = term[start:start + e.action_mask.shape[0], :a]
        e.advantages = e.advantages + rows.to(e.advantages.device, e.advantages.dtype)
        start += rows.shape[0]
    scores = lambda: key_token_scores(ids, mask, rewards, group, config=config, backend=settings.backend,  # noqa: E731
                                      correct=labels.correct, options=settings.options)
    values = step_metrics(settings, labels, started, backend=backend_that_runs(settings.backend, ids.device),
                          scores=scores, advantages=term, mask=mask, rollout_advantage=zero, group=group)
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
    """``class Maker(KTAEExperienceMakerMixin, RemoteExperienceMaker)``: checks the estimator and the
    rollouts per prompt (``check_group_size``) when built (at start-up); OpenRLHF's advantages, then ``add_key_token_scores`` with the class attribute
    ``ktae_settings``, labelling by the rewards as they came in (before OpenRLHF's length penalties).
    ``make_experience_batch`` raises ``FrameworkMismatchError`` when OpenRLHF made the batch without
    calling ``compute_advantages_and_returns`` (so without KTAE), whatever the metrics mode;
    ``ktae_steps`` counts the KTAE steps this maker ran."""

    ktae_settings: AdapterSettings = AdapterSettings()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        check_estimator(self.strategy.args.algo.advantage.estimator)  # type: ignore[attr-defined]
        check_group_size(self.strategy.args.rollout.n_samples_per_prompt)  # type: ignore[attr-defined]
        self.ktae_steps = 0

    def make_experience_batch(self, rollout_samples: Any, *args: Any, **kwargs: Any) -> list:
        steps = self.ktae_steps
        experiences = super().make_experience_batch(rollout_samples, *args, **kwargs)  # type: ignore[misc]
        if self.ktae_steps == steps:
            raise missing_target("OpenRLHF", installed_version() or "unknown",
                                 "RemoteExperienceMaker.make_experience_batch made a batch without calling "
                                 "compute_advantages_and_returns, so its advantages are OpenRLHF's alone",
                                 "make_experience_batch to compute the advantages through "
                                 "compute_advantages_and_returns, where KTAE adds its term")
        return experiences

    def compute_advantages_and_returns(self, experiences: list, *args: Any, **kwargs: Any) -> list:
        unshaped = [e.rewards.detach().clone() for e in experiences]  # OpenRLHF shapes them in place
        experiences = super().compute_advantages_and_returns(experiences, *args, **kwargs)  # type: ignore[misc]
        add_key_token_scores(experiences, n_samples_per_prompt=self.strategy.args.rollout.n_samples_per_prompt,  # type: ignore[attr-defined]
                             settings=self.ktae_settings, rewards=unshaped)
        self.ktae_steps += 1
        return experiences


# ----------------------------------------------------------------------------- getting into OpenRLHF
def settings_json(settings: AdapterSettings) -> str:
    """``settings`` as the JSON object ``settings_from_env`` reads."""
    values = asdict(settings.config)
    values["ignore_token_ids"] = list(values["ignore_token_ids"])
    return json.dumps({**values, "backend": settings.backend, "metrics": settings.metrics,
                       "correct_key": settings.correct_key, "threads": settings.options.threads})


def check_settings(settings: AdapterSettings) -> None:
    """ValueError for settings OpenRLHF would ignore: ``baseline`` and ``eps`` (its estimator makes ``A_i``;
    KTAE adds ``weight * score`` to it)."""
    check_baseline_unused(settings.config, "the KTAE settings", "OpenRLHF's advantage estimator "
                          "(--algo.advantage.estimator) makes the rollout advantage, and KTAE adds weight * score to it")


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


def installed_version() -> str | None:
    """OpenRLHF's installed version (its package metadata; nothing is imported), or None without it."""
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_trainer_module(ppo_trainer: Any = None) -> str:
    """Check OpenRLHF's version against the supported range and that ``ppo_trainer`` (the imported
    ``openrlhf.trainer.ppo_trainer``; imported when None) still has what KTAE extends: the class
    ``RemoteExperienceMaker`` with ``MAKER_METHODS`` and ``BasePPOTrainer``. Returns
    the version ("unknown" without package metadata); raises ``FrameworkMismatchError`` naming it."""
    version = installed_version()
    if version is not None:
        check_version("OpenRLHF", version, MIN_VERSION, BELOW_VERSION)
    version = version or "unknown"
    module = importlib.import_module(TRAINER_MODULE) if ppo_trainer is None else ppo_trainer
    maker = getattr(module, "RemoteExperienceMaker", None)
    if not isinstance(maker, type) or not all(callable(getattr(maker, name, None)) for name in MAKER_METHODS):
        raise missing_target("OpenRLHF", version, f"{TRAINER_MODULE} has no class RemoteExperienceMaker with the "
                             f"methods {' and '.join(MAKER_METHODS)}",
                             "the experience-maker class that BasePPOTrainer.__init__ builds by that name there")
    if not isinstance(getattr(module, "BasePPOTrainer", None), type):
        raise missing_target("OpenRLHF", version, f"{TRAINER_MODULE} has no class BasePPOTrainer",
                             "the trainer base class whose __init__ builds self.experience_maker")
    return version


def patch_trainer_module(ppo_trainer: Any, settings: AdapterSettings) -> type:
    """Replace ``ppo_trainer.RemoteExperienceMaker`` with a KTAE subclass of OpenRLHF's, and make
    ``BasePPOTrainer.__init__`` check that it built that class; returns the class. Raises
    ``FrameworkMismatchError`` where OpenRLHF moved what this extends (``check_trainer_module``)."""
    version = check_trainer_module(ppo_trainer)
    base = ppo_trainer.RemoteExperienceMaker
    if issubclass(base, KTAEExperienceMakerMixin):  # patched before: rebuild on OpenRLHF's class
        base = base.__bases__[1]
    maker = type("KTAERemoteExperienceMaker", (KTAEExperienceMakerMixin, base),
                 {"ktae_settings": settings, "__module__": __name__})
    ppo_trainer.RemoteExperienceMaker = maker
    trainer = ppo_trainer.BasePPOTrainer
    trainer.__init__ = _checking_maker(trainer.__init__, version)
    return maker


def _checking_maker(init: Callable[..., None], version: str) -> Callable[..., None]:
    """``BasePPOTrainer.__init__`` that raises unless it built KTAE's experience maker (an OpenRLHF that
    builds its maker another way would otherwise train without KTAE, silently)."""
    if getattr(init, "ktae_checked", False):
        return init

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        maker = getattr(self, "experience_maker", None)
        if not isinstance(maker, KTAEExperienceMakerMixin):
            raise missing_target("OpenRLHF", version, f"BasePPOTrainer.__init__ built self.experience_maker as "
                                 f"{type(maker).__name__}, not KTAE's subclass of RemoteExperienceMaker",
                                 f"BasePPOTrainer.__init__ to build it through the name RemoteExperienceMaker "
                                 f"of {TRAINER_MODULE}")

    __init__.ktae_checked = True  # type: ignore[attr-defined]
    return __init__


def install(settings: AdapterSettings | None = None) -> None:
    """Make OpenRLHF's trainer build a KTAE experience maker in this process, when (if ever) it imports
    ``openrlhf.trainer.ppo_trainer``; settings from ``$KTAE_OPENRLHF`` when None."""
    settings = settings_from_env() if settings is None else settings
    check_settings(settings)
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
    and ``base`` set nothing else; ``$KTAE_ALLOW_UNTESTED`` when ``environ`` sets it."""
    check_settings(settings)
    environ = os.environ if environ is None else environ
    base = dict(base or {})
    hook = base.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK, worker_setup):
        raise ValueError(f"runtime_env already has worker_process_setup_hook={hook!r}; KTAE needs {SETUP_HOOK!r} there")
    env_vars = {name: environ.get(name, default) for name, default in OPENRLHF_ENV_DEFAULTS.items()}
    if environ.get(ALLOW_UNTESTED):  # the trainer actor checks OpenRLHF's version too
        env_vars[ALLOW_UNTESTED] = environ[ALLOW_UNTESTED]
    env_vars.update(base.get("env_vars") or {})
    env_vars[ENV_VAR] = settings_json(settings)
    return {**base, "worker_process_setup_hook": SETUP_HOOK, "env_vars": env_vars}
