"""The public entry points: validate the inputs (``validation``), pick a backend (``registry``, or the
data-parallel path for a ``process_group``) and call it through the backend contract."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from .backends.base import Backend
from .config import KTAEConfig
from .options import ExecutionOptions
from .registry import resolve
from .types import ArrayLike, KeyTokenScores
from .validation import check_config, check_options, check_out, check_rollout_advantage, normalise_batch


def token_advantage(
    responses: ArrayLike,
    response_mask: ArrayLike,
    rewards: ArrayLike,
    index: Any,
    *,
    config: KTAEConfig | None = None,
    backend: str = "auto",
    rollout_advantage: ArrayLike | None = None,
    correct: ArrayLike | None = None,
    process_group: Any = None,
    out: Tensor | None = None,
    options: ExecutionOptions | None = None,
) -> Tensor:
    """KTAE token-level advantages.

    Args:
        responses: integer ``[B, L]`` response token ids (``0 <= id < 2**31`` where the mask is 1): a
            tensor, numpy array or nested list.
        response_mask: ``[B, L]`` bool / int / float of 0 and 1; 1 on real response tokens.
        rewards: ``[B]`` sequence rewards, or verl's ``token_level_rewards [B, L]`` (summed over L).
        index: ``[B]`` group ids, all ints or all strings (not floats, bools or a mix): an int tensor, a
            numpy int array, a numpy object array of uid strings (as verl passes it) or a list.
        config: hyper-parameters; ``KTAEConfig()`` when None.
        backend: "auto", "reference", "torch", "cpu", "triton" or "cuda" (see ``available_backends()``).
        rollout_advantage: optional ``[B]`` caller-given rollout advantage ``A_i``, used instead of
            ``config.baseline``.
        correct: optional ``[B]`` bool (or 0/1) labels splitting each group into correct and wrong
            rollouts, used instead of ``rewards > config.correct_threshold`` (e.g. the task score when
            ``rewards`` carry a KL or length penalty). ``rewards`` still give the baseline ``A_i``.
        process_group: a ``torch.distributed`` group whose ranks each hold part of the batch (a
            group's rollouts may be spread over ranks): every rank passes its own rows and gets, for
            them, exactly the one-process result on all ranks' rows concatenated in rank order.
            Collective: every rank of the group must call, with the same config, and every rank or
            none a ``rollout_advantage`` / ``correct`` (else ValueError on every rank; so too when one
            rank's arguments are refused). Runs the torch path (``backend`` "auto"
            or "torch"); see ``ktae_kernels.distributed``. None (default): this batch alone.
        out: optional preallocated contiguous float32 ``[B, L]`` tensor on the device of
            ``responses``, overwritten with the result (a trainer can reuse it every step); its memory
            must not overlap any input tensor's or array's (refused before anything is written). After a
            ValueError for an out-of-range token id its contents are unspecified on the cpu
            backend, which checks ids while it counts and raises after; the cuda and triton backends
            check every id on the device before they write and leave ``out`` untouched (cuda checks
            the other inputs' values there too, so its call reads the device once, after its kernels).
        options: how the call runs (``ExecutionOptions``: per-backend tuning that never changes the
            result); ``ExecutionOptions()`` when None.

    Returns:
        float32 ``[B, L]`` on the device of ``responses`` (``out`` when given):
        ``(A_i + weight * score[group(i), responses[i, t]]) * response_mask[i, t]``. Finite inputs can
        still overflow, with no error: rewards past about 1e154 in magnitude (their squares overflow the
        "grpo" std in float64: ``A_i`` 0) or past about 1e308 (their group sum: inf), and advantages past
        float32's 3.4e38 (e.g. ``KTAEConfig(weight=1e300)``) give 0, inf or NaN; checking the result would
        cost a pass over ``[B, L]`` and, on a GPU, a wait for the device.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or values; the message names it
            and the fix (e.g. float ids: "convert with `responses.long()`"). On the cpu backend a
            token id out of range may be reported after ``out`` was partly written (see ``out``).
        BackendUnavailableError: ``backend`` cannot run here or on these tensors' device; the
            message says why and what to do.

    Example:
        >>> import torch
        >>> from ktae_kernels import token_advantage
        >>> responses = torch.tensor([[5, 7, 2], [5, 8, 2]])
        >>> adv = token_advantage(responses, responses != 0, torch.tensor([1.0, 0.0]), [0, 0])
        >>> adv.shape, adv.dtype
        (torch.Size([2, 3]), torch.float32)
    """
    with _checks(process_group):
        config, options = check_config(config), check_options(options)
        impl, checks_ids, checks_values = _backend(backend, responses, process_group)
        batch = normalise_batch(responses, response_mask, rewards, index, correct=correct,
                                check_ids=not checks_ids, defer_values=checks_values)
        base = check_rollout_advantage(rollout_advantage, batch, defer_values=checks_values)
        out = check_out(out, batch, dict(responses=responses, response_mask=response_mask, rewards=rewards,
                                         rollout_advantage=rollout_advantage, correct=correct))
    return impl.token_advantage(batch, config, base, out, options)


def key_token_scores(responses: ArrayLike, response_mask: ArrayLike, rewards: ArrayLike, index: Any, *,
                     config: KTAEConfig | None = None, backend: str = "auto", correct: ArrayLike | None = None,
                     process_group: Any = None, options: ExecutionOptions | None = None) -> KeyTokenScores:
    """Per (group, token id) KTAE statistics (tables, p-values, F, IG, direction, score).

    Same inputs, and the same errors, as ``token_advantage``. Returns a ``KeyTokenScores`` whose row
    tensors cover only the (group, token) pairs that occur under the mask, sorted by (group, token).
    With a ``process_group``: the rows of every group with a rollout on this rank, group ids dense
    over all ranks' labels (``ktae_kernels.distributed``).

    Raises:
        ValueError, BackendUnavailableError: as ``token_advantage``.

    Example:
        >>> import torch
        >>> from ktae_kernels import key_token_scores
        >>> responses = torch.tensor([[5, 7, 2], [5, 8, 2]])
        >>> res = key_token_scores(responses, responses != 0, torch.tensor([1.0, 0.0]), [0, 0])
        >>> res.token.tolist(), res.a.tolist(), res.b.tolist()
        ([2, 5, 7, 8], [1, 1, 1, 0], [1, 1, 0, 1])
    """
    with _checks(process_group):
        config, options = check_config(config), check_options(options)
        impl, checks_ids, checks_values = _backend(backend, responses, process_group)
        batch = normalise_batch(responses, response_mask, rewards, index, correct=correct,
                                check_ids=not checks_ids, defer_values=checks_values)
    return impl.key_token_scores(batch, config, options)


def _checks(process_group: Any) -> AbstractContextManager:
    """Where the arguments are checked: with a ``process_group``, a rank whose check raises tells the
    other ranks (``distributed.refusing``) so that they raise too instead of waiting for it."""
    if process_group is None:
        return nullcontext()
    from .distributed import refusing

    return refusing(process_group)


def _backend(name: str, responses: Any, process_group: Any) -> tuple[Backend, bool, bool]:
    """The implementation to call, whether it checks token ids itself and whether it checks the values
    on the device (``BackendSpec.checks_token_ids``, ``checks_values``)."""
    if process_group is not None:
        from .distributed import DataParallel

        return DataParallel(process_group, name), False, False
    spec = resolve(name, responses.device if isinstance(responses, Tensor) else torch.device("cpu"))
    return spec.load(), spec.checks_token_ids, spec.checks_values
