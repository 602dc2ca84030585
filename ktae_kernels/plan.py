"""``plan_token_advantage``: the host side of ``token_advantage`` for a fixed group layout, done once.

A trainer whose batches keep one layout (the same ``index`` and ``[B, L]`` every step) plans once and
calls the plan every step: the group ids are made dense once, not per call. On CUDA tensors with the
``cuda`` or ``triton`` backend in exact mode, a plan's call can be captured in a CUDA graph
(``torch.cuda.graph``) after a warm-up call of the plan, and replayed on new data copied into the
captured tensors; ``plan.check()`` after a replay raises if a call it replayed found a bad input or could not
complete (its ``out`` then holds NaN).
"""
from __future__ import annotations

import dataclasses
import operator
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .backends.base import BackendSpec, BackendUnavailableError, CapturedCall, GraphCaptureError
from .backends.device import capturing
from .config import KTAEConfig
from .options import ExecutionOptions
from .registry import as_device, resolve
from .types import ArrayLike, GroupLayout
from .validation import (GroupIds, check_config, check_options, check_out, check_rollout_advantage,
                         dense_group_ids, planned_batch)

#: CUDA graphs one plan may be captured in (each holds its workspace for the plan's life).
MAX_CAPTURES = 64


@dataclass(frozen=True, eq=False)
class TokenAdvantagePlan:
    """``token_advantage`` for batches of one shape and group layout (build it with ``plan_token_advantage``).

    shape: ``(B, L)``. device: where the batches live. group: int64 ``[B]`` dense group ids on ``device``.
    group_labels: numpy ``[n_groups]``, the caller's label of each dense id. spec: the backend.
    captured: one ``CapturedCall`` per CUDA graph this plan's call was captured in, in capture order.
    layout: the group sizes (``GroupLayout``, made from ``group``): what the backends size a capture by.
    Plans compare and hash by identity (each owns its captures and replay counts).
    """

    shape: tuple[int, int]
    device: torch.device
    config: KTAEConfig
    spec: BackendSpec
    group: Tensor
    group_labels: np.ndarray
    options: ExecutionOptions = field(default_factory=ExecutionOptions)
    captured: list[CapturedCall] = field(default_factory=list, compare=False, repr=False)
    layout: GroupLayout = field(init=False, compare=False, repr=False)
    #: int64 ``[B]`` on ``device``: the rollouts in order of their group (a stable argsort of ``group``).
    members: Tensor = field(init=False, compare=False, repr=False)
    #: int64 ``[1 + MAX_CAPTURES]`` on ``device``: the replays so far of all this plan's graphs, then, per
    #: captured call, that count when it last replayed (0: never). Every replay of a graph updates it.
    replays: Tensor = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        sizes = torch.bincount(self.group.cpu(), minlength=len(self.group_labels)) if self.group.numel() else []
        object.__setattr__(self, "layout", GroupLayout(tuple(int(n) for n in sizes)))
        object.__setattr__(self, "members", torch.argsort(self.group, stable=True))
        object.__setattr__(self, "replays", torch.zeros(1 + MAX_CAPTURES, dtype=torch.int64, device=self.device))
        object.__setattr__(self, "_lock", threading.Lock())
        #: the replay count ``check()`` saw last, and the captured calls it read then.
        object.__setattr__(self, "_checked", (0, ()))

    def __call__(self, responses: ArrayLike, response_mask: ArrayLike, rewards: ArrayLike, *,
                 rollout_advantage: ArrayLike | None = None, correct: ArrayLike | None = None,
                 out: Tensor | None = None) -> Tensor:
        """float32 ``[B, L]`` advantages, exactly ``token_advantage(responses, response_mask, rewards, index,
        ...)`` for the planned ``index`` (arguments as there).

        While a CUDA graph captures (``torch.cuda.graph``): the backend must be ``cuda`` or ``triton``
        and ``config.fisher`` "exact"; every argument a tensor already on the plan's device, the mask
        (and ``correct``) bool. Call the plan once outside the graph first (a warm-up, on a batch as
        diverse as the replays: it fills the backend's caches and sizes its tables). Nothing is read
        back while capturing or replaying (rewards are checked for NaN / inf on the device by ``cuda``
        only); call ``check()``
        after a replay to learn whether it found a bad input or could not complete.

        Raises:
            ValueError: an argument does not fit the plan (shape, device) or is invalid, as
                ``token_advantage`` reports it.
            BackendUnavailableError: capturing with a backend that reads back.
            GraphCaptureError: capturing a plan that has not been warmed up.
        """
        read = not capturing(self.device)
        if not read:
            self._check_capturable()
        ids = GroupIds(group=self.group, labels=self.group_labels, members=self.members)
        batch = planned_batch(responses, response_mask, rewards, ids, correct=correct,
                              check_ids=not self.spec.checks_token_ids, read=read,
                              defer_values=self.spec.checks_values)
        batch = dataclasses.replace(batch, layout=self.layout)
        if tuple(batch.responses.shape) != self.shape:
            raise ValueError(f"`responses` must have the planned shape {self.shape}, got {tuple(batch.responses.shape)}")
        base = check_rollout_advantage(rollout_advantage, batch, read, defer_values=self.spec.checks_values)
        out = check_out(out, batch, dict(responses=responses, response_mask=response_mask, rewards=rewards,
                                         rollout_advantage=rollout_advantage, correct=correct))
        if read:
            return self.spec.load().token_advantage(batch, self.config, base, out, self.options)
        with self._lock:
            slot = len(self.captured) + 1
            if slot > MAX_CAPTURES:
                raise GraphCaptureError(f"this plan was captured in {MAX_CAPTURES} CUDA graphs already, the most one "
                                        f"plan keeps; make a new plan (plan_token_advantage) for more")
            out, captured = self.spec.load().capture(batch, self.config, base, out, self.options)
            clock = self.replays[0]
            clock.add_(1)  # enqueued after the call's kernels: each replay counts itself ...
            self.replays[slot].copy_(clock)  # ... and marks this graph as the last one replayed
            self.captured.append(captured)
        return out

    def check(self, call: CapturedCall | None = None) -> None:
        """After a replay: raise if a captured call of this plan that replayed since the previous ``check()``
        (every call of the graphs replayed since, each call's last replay; with none since, the calls the
        previous ``check()`` read), or ``call`` (one of ``captured``) in its last replay, could not write
        its advantages. One read of the device; call it after the replay (in stream order: on the
        replay's stream, or after synchronising it).

        Raises:
            ValueError: the replayed batch held a token id out of range or a group past the backend's
                size limit (as ``token_advantage`` reports it); ``out`` holds NaN.
            GraphCaptureError: the replay's groups needed larger tables than the capture reserved
                (triton; ``out`` holds NaN; the message says how to warm up), or no graph (or not
                ``call``) has replayed yet, or nothing was captured.
        """
        if not self.captured:
            raise GraphCaptureError("check() reads a replay of a captured call, and no call of this plan was "
                                    "captured in a CUDA graph")
        counts = self.replays[:1 + len(self.captured)].tolist()
        if call is None:
            if counts[0] == 0:
                raise GraphCaptureError("no CUDA graph of this plan has replayed yet: call check() after "
                                        "graph.replay()")
            calls = self._replayed_since_check(counts)
        else:
            index = next((i for i, each in enumerate(self.captured) if each is call), None)
            if index is None:
                raise ValueError("`call` must be one of this plan's `captured` calls")
            if counts[1 + index] == 0:
                raise GraphCaptureError(f"captured call {index} of this plan has not replayed yet: call check() "
                                        f"after its graph's replay()")
            calls = (index,)
        for index in calls:
            self.captured[index].check()

    def _replayed_since_check(self, counts: list[int]) -> tuple[int, ...]:
        """The captured calls (indexes, in replay order) whose last replay counted past what the previous
        ``check()`` saw, remembered for the next; the previous ones when none did."""
        with self._lock:
            seen, previous = self._checked
            since = sorted((i for i, count in enumerate(counts[1:]) if count > seen), key=lambda i: counts[1 + i])
            if not since:
                return previous
            object.__setattr__(self, "_checked", (counts[0], tuple(since)))
            return tuple(since)

    def _check_capturable(self) -> None:
        if not self.spec.capturable:
            raise BackendUnavailableError(
                f"backend {self.spec.name!r} reads results back to the host and cannot be captured in a CUDA "
                f"graph; plan with backend='cuda' or backend='triton'")
        if self.config.fisher != "exact":
            raise ValueError(f"`config.fisher` must be 'exact' to capture a CUDA graph (the 'upstream' p-values "
                             f"need the rows read back), got {self.config.fisher!r}")


def plan_token_advantage(index: Any, shape: tuple[int, int], *, device: torch.device | str = "cpu",
                         config: KTAEConfig | None = None, backend: str = "auto",
                         options: ExecutionOptions | None = None) -> TokenAdvantagePlan:
    """A ``TokenAdvantagePlan`` for ``[B, L]`` batches on ``device`` whose rollouts are grouped by ``index``.

    Args:
        index: ``[B]`` group ids, as ``token_advantage`` takes them (ints or uid strings).
        shape: ``(B, L)`` of every batch the plan will see.
        device: where those batches' tensors live.
        config: hyper-parameters; ``KTAEConfig()`` when None.
        backend: as ``token_advantage`` (resolved once, here, for ``device``).
        options: as ``token_advantage``.

    Raises:
        ValueError: a bad ``index``, ``shape``, ``device``, ``config`` or backend name.
        BackendUnavailableError: the backend cannot run on ``device`` here (e.g. "cuda" on a machine where
            torch can use no CUDA GPU).

    Example:
        >>> import torch
        >>> from ktae_kernels import plan_token_advantage
        >>> plan = plan_token_advantage([0, 0], (2, 3))
        >>> responses = torch.tensor([[5, 7, 2], [5, 8, 2]])
        >>> plan(responses, responses != 0, torch.tensor([1.0, 0.0])).shape
        torch.Size([2, 3])
    """
    config, options = check_config(config), check_options(options)
    B, L = _check_shape(shape)
    device = as_device(device)
    spec = resolve(backend, device)
    group, labels = dense_group_ids(index, B, device)
    return TokenAdvantagePlan(shape=(B, L), device=device, config=config, spec=spec, group=group,
                              group_labels=labels, options=options)


def _check_shape(shape: Any) -> tuple[int, int]:
    try:
        B, L = (operator.index(n) for n in shape)
    except (TypeError, ValueError):
        raise ValueError(f"`shape` must be (B, L), two ints, got {shape!r}") from None
    if B < 0 or L < 0 or isinstance(shape, (str, bytes)):
        raise ValueError(f"`shape` must be (B, L), two non-negative ints, got {shape!r}")
    return B, L
