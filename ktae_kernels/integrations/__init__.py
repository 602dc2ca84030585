"""Drop-in adapters for RL frameworks: ``verl`` (estimator "ktae"), ``trl`` (GRPOTrainer subclass),
``openrlhf`` (experience-maker hook). Each module imports its framework; this package imports none."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from ..config import KTAEConfig

#: keys of a framework's "ktae" settings section besides the KTAEConfig fields.
EXTRA_KEYS = ("backend",)


def config_from_mapping(section: Mapping[str, Any] | None, *, where: str,
                        default_baseline: str | None = None) -> tuple[KTAEConfig, str]:
    """``(KTAEConfig, backend)`` from a framework's settings mapping (dict, OmegaConf DictConfig).

    Keys: any ``KTAEConfig`` field, plus ``backend`` (default "auto"). ``default_baseline`` applies
    when the mapping names no ``baseline``. ``where`` names the section in error messages.
    """
    values = {str(k): section[k] for k in section} if section is not None else {}
    known = {f.name for f in fields(KTAEConfig)}
    unknown = sorted(set(values) - known - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; expected KTAEConfig fields {sorted(known)} or 'backend'")
    backend = str(values.pop("backend", "auto"))
    if default_baseline is not None:
        values.setdefault("baseline", default_baseline)
    if "ignore_token_ids" in values:
        values["ignore_token_ids"] = tuple(values["ignore_token_ids"])
    return KTAEConfig(**values), backend
