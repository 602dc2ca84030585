"""The backend contract: what a backend provides, where it runs, and how the registry describes it."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, runtime_checkable

from torch import Tensor

from ..config import KTAEConfig
from ..types import Batch, KeyTokenScores


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why and what to do."""


@runtime_checkable
class Backend(Protocol):
    """The two operations every backend implements, over a validated ``Batch``."""

    def key_token_scores(self, batch: Batch, config: KTAEConfig) -> KeyTokenScores:
        """One row per (group, token id) present under the mask, sorted by (group, token)."""

    def token_advantage(self, batch: Batch, config: KTAEConfig, rollout_advantage: Optional[Tensor],
                        out: Optional[Tensor]) -> Tensor:
        """float32 ``[B, L]`` advantages (written into ``out`` when it is not None); ``rollout_advantage``:
        float64 ``[B]`` caller-given ``A_i``, or None for ``config.baseline``."""


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend.

    name: the ``backend=`` string. module: import path of a module implementing ``Backend``,
    imported only when the backend is used (a missing optional dependency matters only then).
    devices: torch device types it accepts. auto_rank: per device type, its place in the "auto"
    order (lower first; absent: never chosen automatically). unavailable: None when it can run on
    that device type, else the reason and the fix. checks_token_ids: the backend checks the
    token-id range while counting (``validation.check_id_range``), so the API skips its own pass;
    the kernels report a bad id through a flag read once, after they ran (the API documents, per
    backend, whether a caller's ``out`` may have been written before that ValueError).
    capturable: ``token_advantage`` in exact mode reads nothing back to the host on CUDA tensors once
    a shape has run (a ``plan_token_advantage`` call may be captured in a CUDA graph).
    """

    name: str
    module: str
    devices: tuple[str, ...]
    unavailable: Callable[[str], Optional[str]]
    auto_rank: Mapping[str, int] = field(default_factory=dict)
    checks_token_ids: bool = False
    capturable: bool = False

    def load(self) -> Backend:
        """The implementation module, checked against the contract (once: the protocol check costs
        tens of microseconds, a trainer calls once per micro-batch)."""
        module = _LOADED.get(self.module)
        if module is None:
            module = importlib.import_module(self.module)
            if not isinstance(module, Backend):
                raise TypeError(f"backend {self.name!r}: module {self.module} must define key_token_scores "
                                f"and token_advantage")
            _LOADED[self.module] = module
        return module


#: implementation modules already imported and checked, by import path.
_LOADED: dict[str, Backend] = {}
