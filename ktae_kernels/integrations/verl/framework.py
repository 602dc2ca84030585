"""What the verl adapter expects of the installed verl: the supported versions, the attribute each
trainer patch wraps (``TARGETS``), and what the patches found moved (``PATCH_PROBLEMS``: a patch records
instead of raising, since the plugin loads at every ``import verl``, runs without KTAE included).
``check_framework`` raises it at start-up when "ktae" is selected, naming verl's version and what KTAE
expected; the estimator raises it at the first step where no start-up check ran."""
from __future__ import annotations

import importlib
import sys
from typing import Any

from ..shared import check_version, missing_target

V1_MODULE = "verl.trainer.ppo.v1.trainer_base"
LEGACY_MODULE = "verl.trainer.ppo.ray_trainer"
CONFIG_MODULE = "verl.utils.config"
METRICS_MODULE = "verl.trainer.ppo.metric_utils"
#: the base of verl's experimental trainers (``one_step_off_policy``, ``fully_async_policy``): it calls
#: the legacy ``compute_advantage`` and ``metric_utils.compute_data_metrics`` through its own names.
SEPARATION_MODULE = "verl.experimental.separation.ray_trainer"
#: per patched module: the attribute KTAE wraps there and what KTAE expected it to be.
TARGETS: dict[str, tuple[str, str]] = {
    V1_MODULE: ("PPOTrainer._compute_advantage", "the v1 trainer's advantage step, which every trainer mode "
                "inherits and which calls the estimator (KTAE hands it the response ids there)"),
    LEGACY_MODULE: ("compute_advantage", "the legacy trainer's function that calls the estimator (KTAE hands "
                    "it the response ids there)"),
    CONFIG_MODULE: ("validate_config", "the trainer config's start-up check (KTAE checks its settings there)"),
    METRICS_MODULE: ("compute_data_metrics", "the step metrics function of the legacy and experimental trainers "
                     "(KTAE adds the ktae/* metrics there)"),
    SEPARATION_MODULE: ("compute_data_metrics", "the step metrics function the experimental trainers' "
                        "SeparateRayPPOTrainer calls by this name (KTAE adds the ktae/* metrics there)"),
}
#: supported verl: >= MIN_VERSION (``register_adv_est``, ``VERL_USE_EXTERNAL_MODULES``), < BELOW_VERSION.
MIN_VERSION = "0.6"
BELOW_VERSION = "0.10"
#: module name -> what its patch found missing (verl moved it).
PATCH_PROBLEMS: dict[str, str] = {}


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a DictConfig, dict or dataclass config (verl's AlgoConfig), else ``default``."""
    get = getattr(config, "get", None)
    return get(key, default) if get is not None else getattr(config, key, default)


def attribute(owner: Any, dotted: str) -> Any:
    """``owner.a.b`` for "a.b", or None where any part is missing."""
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
    return owner


def trainer_modules(config: Any) -> tuple[str, ...]:
    """The patched modules a run with verl's trainer ``config`` goes through: the config check and the
    v1 trainer (``trainer.use_v1``) or the legacy one with its metrics; and, where this process has
    imported it (their entry points do before they validate the config), the experimental trainers' base."""
    trainer = config_get(config, "trainer")
    use_v1 = bool(config_get(trainer, "use_v1", False)) if trainer is not None else False
    experimental = (LEGACY_MODULE, METRICS_MODULE, SEPARATION_MODULE) if SEPARATION_MODULE in sys.modules else ()
    main = (V1_MODULE,) if use_v1 else (LEGACY_MODULE, METRICS_MODULE)
    return tuple(dict.fromkeys((CONFIG_MODULE, *main, *experimental)))


def verl_version() -> str:
    import verl

    return str(verl.__version__)


def check_framework(config: Any) -> str:
    """Check the installed verl for a "ktae" run with ``config``: its version against the supported range
    and, imported now, the trainer modules the run uses, patched. Returns the version; raises
    ``FrameworkMismatchError`` naming it and what KTAE expected."""
    version = verl_version()
    check_version("verl", version, MIN_VERSION, BELOW_VERSION)
    for name in trainer_modules(config):
        wrapped, expected = TARGETS[name]
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            raise missing_target("verl", version, f"there is no module {name}", f"{name}.{wrapped}: {expected}") from None
        if name in PATCH_PROBLEMS or not getattr(attribute(module, wrapped), "ktae_wrapped", False):
            raise missing_target("verl", version, PATCH_PROBLEMS.get(name, f"{name}.{wrapped} is not KTAE's wrapper"),
                                 f"{name}.{wrapped}: {expected}")
    return version


def raise_if_moved() -> None:
    """``FrameworkMismatchError`` when a trainer patch found its target gone (``PATCH_PROBLEMS``)."""
    if PATCH_PROBLEMS:
        raise missing_target("verl", verl_version(), "; ".join(PATCH_PROBLEMS.values()),
                             "the trainer code that hands the 'ktae' estimator the response ids")
