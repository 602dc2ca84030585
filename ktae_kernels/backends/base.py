"""The backend contract: what a backend provides, where it runs, and how the registry describes it."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, runtime_checkable

from torch import Tensor

from .. import caches
from ..config import KTAEConfig
from ..options import ExecutionOptions
from ..types import Batch, KeyTokenScores


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why and what to do."""


class GraphCaptureError(RuntimeError):
    """A CUDA graph cannot capture this call (it needs a warm-up first), or the last replay of a captured
    call could not complete; the message says why and what to do."""


@dataclass(frozen=True)
class CapturedCall:
    """What a ``token_advantage`` call recorded in a CUDA graph leaves with its plan: ``keep``, the
    backend's cached tensors the graph reads (held as long as the plan, so that no cache eviction frees
    them), and ``check``, which reads the flags the last replay left on the device and raises
    (``ValueError`` for a bad input, ``out`` untouched; ``GraphCaptureError`` when it could not complete)."""

    keep: tuple
    check: Callable[[], None]


@runtime_checkable
class Backend(Protocol):
    """The two operations every backend implements, over a validated ``Batch``."""

    def key_token_scores(self, batch: Batch, config: KTAEConfig, options: ExecutionOptions) -> KeyTokenScores:
        """One row per (group, token id) present under the mask, sorted by (group, token)."""

    def token_advantage(self, batch: Batch, config: KTAEConfig, rollout_advantage: Optional[Tensor],
                        out: Optional[Tensor], options: ExecutionOptions) -> Tensor:
        """float32 ``[B, L]`` advantages (written into ``out`` when it is not None); ``rollout_advantage``:
        float64 ``[B]`` caller-given ``A_i``, or None for ``config.baseline``."""


@runtime_checkable
class CapturableBackend(Backend, Protocol):
    """A backend whose ``token_advantage`` (exact Fisher) can be recorded in a CUDA graph."""

    def capture(self, batch: Batch, config: KTAEConfig, rollout_advantage: Optional[Tensor], out: Optional[Tensor],
                options: ExecutionOptions) -> tuple[Tensor, CapturedCall]:
        """``token_advantage`` enqueued with nothing read back, and what its graph's replays need."""


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
    checks_values: the backend checks the values of rewards, the mask, ``correct`` and
    ``rollout_advantage`` on the device (finite, 0 and 1) and raises the API's error after its one read
    (``Batch.unchecked``), so the API reads none of them back before the call.
    capturable: the module is a ``CapturableBackend``: a ``plan_token_advantage`` call may be captured
    in a CUDA graph (exact Fisher, CUDA tensors, after a warm-up call).
    """

    name: str
    module: str
    devices: tuple[str, ...]
    unavailable: Callable[[str], Optional[str]]
    auto_rank: Mapping[str, int] = field(default_factory=dict)
    checks_token_ids: bool = False
    checks_values: bool = False
    capturable: bool = False

    def load(self) -> Backend:
        """The implementation module, checked against the contract (once: the protocol check costs
        tens of microseconds, a trainer calls once per micro-batch)."""
        module = _LOADED.get(self.module)
        if module is None:
            module = importlib.import_module(self.module)
            contract = CapturableBackend if self.capturable else Backend
            if not isinstance(module, contract):
                raise TypeError(f"backend {self.name!r}: module {self.module} must define key_token_scores "
                                f"and token_advantage{' and capture' if self.capturable else ''}")
            _LOADED[self.module] = module
        return module


#: implementation modules already imported and checked, by import path (a thread that misses imports and
#: checks the module again: the same module, stored twice).
_LOADED: dict[str, Backend] = {}
caches.on_clear(_LOADED.clear)
