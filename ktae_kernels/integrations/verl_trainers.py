"""Kept for launch scripts that set ``VERL_USE_EXTERNAL_MODULES=ktae_kernels.integrations.verl_trainers``:
importing it is importing ``ktae_kernels.integrations.verl``, which now wires every verl trainer (all
v1 trainer modes and the legacy trainer) itself. The ``ktae_<mode>`` trainer modes are gone: keep
verl's own ``trainer.v1.trainer_mode``."""
from __future__ import annotations

from .verl import install_patches, register  # noqa: F401  (importing registers and patches)
