"""Drop-in adapters for RL frameworks: ``verl`` (estimator "ktae"), ``trl`` (GRPOTrainer subclass),
``openrlhf`` (experience-maker hook). Each module imports its framework; this package imports none."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..config import KTAEConfig

#: keys of a framework's "ktae" settings section besides the KTAEConfig fields.
EXTRA_KEYS = ("backend", "metrics")
#: what an adapter logs under ``ktae/`` (see ``ktae_kernels.metrics``): "advantages" (default: derived
#: from the advantages, no extra pass), "scores" (one more ``key_token_scores`` call, adds
#: ``distinct_tokens_per_group``) or "off".
METRICS_MODES = ("advantages", "scores", "off")


@dataclass(frozen=True)
class AdapterSettings:
    """A framework's KTAE settings: the method's ``config``, the ``backend`` and the ``metrics`` mode."""

    config: KTAEConfig = KTAEConfig()
    backend: str = "auto"
    metrics: str = "advantages"

    def __post_init__(self) -> None:
        if not isinstance(self.config, KTAEConfig):
            raise ValueError(f"`config` must be a KTAEConfig, got {type(self.config).__name__}")
        check_metrics_mode(self.metrics)


def check_metrics_mode(mode: Any, where: str = "metrics") -> str:
    if mode not in METRICS_MODES:
        raise ValueError(f"{where} must be one of {METRICS_MODES}, got {mode!r}")
    return mode


def settings_from_mapping(section: Mapping[str, Any] | None, *, where: str,
                          default_baseline: str | None = None) -> AdapterSettings:
    """``AdapterSettings`` from a framework's settings mapping (dict, OmegaConf DictConfig).

    Keys: any ``KTAEConfig`` field, plus ``backend`` (default "auto") and ``metrics`` (default
    "advantages"). ``default_baseline`` applies when the mapping names no ``baseline``. ``where``
    names the section in error messages (every error is a ValueError).
    """
    if section is not None and not hasattr(section, "keys"):
        raise ValueError(f"{where} must be a mapping of KTAEConfig fields, got {section!r}")
    values = {str(k): section[k] for k in section} if section is not None else {}
    known = {f.name for f in fields(KTAEConfig)}
    unknown = sorted(set(values) - known - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; expected KTAEConfig fields {sorted(known)}, "
                         f"'backend' or 'metrics'")
    backend = str(values.pop("backend", "auto"))
    metrics = check_metrics_mode(values.pop("metrics", "advantages"), f"{where}.metrics")
    if default_baseline is not None:
        values.setdefault("baseline", default_baseline)
    if "ignore_token_ids" in values:
        ids = values["ignore_token_ids"]
        values["ignore_token_ids"] = (ids,) if isinstance(ids, int) else tuple(ids)
    try:
        config = KTAEConfig(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    return AdapterSettings(config, backend, metrics)


def config_from_mapping(section: Mapping[str, Any] | None, *, where: str,
                        default_baseline: str | None = None) -> tuple[KTAEConfig, str]:
    """``(KTAEConfig, backend)`` of ``settings_from_mapping``."""
    s = settings_from_mapping(section, where=where, default_baseline=default_baseline)
    return s.config, s.backend
