"""Public entry points: validate and normalise the inputs, then dispatch to a backend."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from .backends import get_backend
from .config import KTAEConfig
from .types import Batch, KeyTokenScores

#: token ids must fit a signed 32-bit int (every vocabulary does; the GPU kernels rely on it).
MAX_TOKEN_ID = 2**31 - 1


def token_advantage(
    responses: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    index: Any,
    *,
    config: KTAEConfig | None = None,
    backend: str = "auto",
    rollout_advantage: Tensor | None = None,
    correct: Tensor | None = None,
    process_group: Any = None,
    out: Tensor | None = None,
) -> Tensor:
    """KTAE token-level advantages.

    Args:
        responses: integer ``[B, L]`` response token ids (``0 <= id < 2**31`` where the mask is 1).
        response_mask: ``[B, L]`` bool / int / float of 0 and 1; 1 on real response tokens.
        rewards: ``[B]`` sequence rewards, or verl's ``token_level_rewards [B, L]`` (summed over L).
        index: ``[B]`` group ids: an int tensor, a numpy int array, a numpy object array of uid
            strings (as verl passes it) or a list.
        config: hyper-parameters; ``KTAEConfig()`` when None.
        backend: "auto", "reference", "torch", "cpu", "triton" or "cuda" (see ``available_backends()``).
        rollout_advantage: optional ``[B]`` caller-given rollout advantage ``A_i``, used instead of
            ``config.baseline``.
        correct: optional ``[B]`` bool (or 0/1) labels splitting each group into correct and wrong
            rollouts, used instead of ``rewards > config.correct_threshold`` (e.g. the task score when
            ``rewards`` carry a KL penalty). ``rewards`` still give the baseline ``A_i``.
        process_group: a ``torch.distributed`` group whose ranks each hold part of the batch (a
            group's rollouts may be spread over ranks): every rank passes its own rows and gets, for
            them, exactly the one-process result on all ranks' rows concatenated in rank order.
            Collective: every rank of the group must call. Runs the torch path (``backend`` "auto"
            or "torch"); see ``ktae_kernels.distributed``. None (default): this batch alone.
        out: optional preallocated contiguous float32 ``[B, L]`` tensor on the device of
            ``responses``, overwritten with the result (a trainer can reuse it every step).
    Returns:
        float32 ``[B, L]`` on the device of ``responses`` (``out`` when given):
        ``(A_i + weight * score[group(i), responses[i, t]]) * response_mask[i, t]``.
    """
    config = _check_config(config)
    impl = None if process_group is not None else get_backend(backend, _device_of(responses))
    batch = normalise_batch(responses, response_mask, rewards, index, correct=correct,
                            check_ids=not getattr(impl, "CHECKS_TOKEN_IDS", False))
    base = _check_rollout_advantage(rollout_advantage, batch)
    out = _check_out(out, batch)
    if impl is None:
        from . import distributed
        return distributed.token_advantage(batch, config, base, process_group, backend, out)
    return impl.token_advantage(batch, config, base, out)


def key_token_scores(
    responses: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    index: Any,
    *,
    config: KTAEConfig | None = None,
    backend: str = "auto",
    correct: Tensor | None = None,
    process_group: Any = None,
) -> KeyTokenScores:
    """Per (group, token id) KTAE statistics (tables, p-values, F, IG, direction, score).

    Same inputs as ``token_advantage``. Returns a ``KeyTokenScores`` whose row tensors cover only the
    (group, token) pairs that occur under the mask, sorted by (group, token). With a
    ``process_group``: the rows of every group with a rollout on this rank, group ids dense over all
    ranks' labels (``ktae_kernels.distributed.key_token_scores``).
    """
    config = _check_config(config)
    impl = None if process_group is not None else get_backend(backend, _device_of(responses))
    batch = normalise_batch(responses, response_mask, rewards, index, correct=correct,
                            check_ids=not getattr(impl, "CHECKS_TOKEN_IDS", False))
    if impl is None:
        from . import distributed
        return distributed.key_token_scores(batch, config, process_group, backend)
    return impl.key_token_scores(batch, config)


def _device_of(responses: Any) -> torch.device:
    return responses.device if isinstance(responses, Tensor) else torch.device("cpu")


def _check_config(config: KTAEConfig | None) -> KTAEConfig:
    if config is None:
        return KTAEConfig()
    if not isinstance(config, KTAEConfig):
        raise ValueError(f"`config` must be a KTAEConfig or None, got {type(config).__name__}")
    return config


def normalise_batch(responses: Any, response_mask: Any, rewards: Any, index: Any, *, correct: Any = None,
                    check_ids: bool = True) -> Batch:
    """Validate the caller's inputs and bring them to the canonical ``Batch`` form.

    ``check_ids=False`` leaves the token-id range check to a backend that does it while counting.
    Raises ValueError naming the argument on any shape, dtype or value problem.
    """
    responses = _as_tensor("responses", responses)
    if responses.dim() != 2:
        raise ValueError(f"`responses` must be 2-D [B, L], got shape {tuple(responses.shape)}")
    if responses.dtype == torch.bool or responses.dtype.is_floating_point or responses.dtype.is_complex:
        raise ValueError(f"`responses` must hold integer token ids, got dtype {responses.dtype}")
    device = responses.device
    shape = tuple(responses.shape)
    mask = _check_mask(_as_tensor("response_mask", response_mask, device), shape)
    responses = responses.to(torch.int64)
    if check_ids:
        check_token_ids(responses, mask)
    reward = _check_rewards(_as_tensor("rewards", rewards, device), shape)
    group, labels = _normalise_index(index, shape[0], device)
    flags = None if correct is None else _check_correct(_as_tensor("correct", correct, device), shape[0])
    return Batch(responses=responses, mask=mask, rewards=reward, group=group, group_labels=labels, correct=flags)


def _check_correct(correct: Tensor, batch_size: int) -> Tensor:
    """bool ``[B]`` from bool or 0/1 labels."""
    if tuple(correct.shape) != (batch_size,):
        raise ValueError(f"`correct` must have shape [B] = [{batch_size}], got {tuple(correct.shape)}")
    if correct.dtype == torch.bool:
        return correct
    if correct.dtype.is_complex or not bool(((correct == 0) | (correct == 1)).all()):
        raise ValueError("`correct` must be bool or hold only 0 and 1")
    return correct != 0


def _check_out(out: Tensor | None, batch: Batch) -> Tensor | None:
    """The caller's output tensor, checked: contiguous float32 ``[B, L]`` on the batch's device."""
    if out is None:
        return None
    shape = tuple(batch.responses.shape)
    if not isinstance(out, Tensor):
        raise ValueError(f"`out` must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != batch.device:
        raise ValueError(f"`out` must be a float32 tensor of shape {shape} on {batch.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("`out` must be contiguous")
    if out.requires_grad:
        raise ValueError("`out` must not require grad")
    return out


def check_token_ids(responses: Tensor, mask: Tensor) -> None:
    """Ids under the mask must lie in ``[0, 2**31)``; padding under mask 0 may be anything."""
    if responses.numel() == 0:
        return
    lo, hi = torch.aminmax(responses)
    if int(lo) >= 0 and int(hi) <= MAX_TOKEN_ID:
        return  # the common case: one pass, no masked copy
    masked = responses[mask]
    if masked.numel() and int(masked.min()) < 0:
        raise ValueError(f"`responses` must hold token ids >= 0 where the mask is 1, found {int(masked.min())}")
    if masked.numel() and int(masked.max()) > MAX_TOKEN_ID:
        raise ValueError(f"`responses` token ids must be < 2**31, found {int(masked.max())}")


def _as_tensor(name: str, value: Any, device: torch.device | None = None) -> Tensor:
    if isinstance(value, Tensor):
        t = value
    elif isinstance(value, (np.ndarray, list, tuple)):
        try:
            t = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError) as err:
            raise ValueError(f"`{name}` must be a tensor or a numeric array: {err}") from None
    else:
        raise ValueError(f"`{name}` must be a torch.Tensor or numpy array, got {type(value).__name__}")
    return t if device is None else t.to(device)


def _check_mask(mask: Tensor, shape: tuple[int, ...]) -> Tensor:
    if tuple(mask.shape) != shape:
        raise ValueError(f"`response_mask` must have the shape of `responses` {shape}, got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_complex:
        raise ValueError(f"`response_mask` must be bool, int or float, got {mask.dtype}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("`response_mask` must hold only 0 and 1")
    return mask != 0


def _check_rewards(rewards: Tensor, shape: tuple[int, ...]) -> Tensor:
    if rewards.dtype.is_complex:
        raise ValueError(f"`rewards` must be real, got {rewards.dtype}")
    if rewards.dim() == 2:
        if tuple(rewards.shape) != shape:
            raise ValueError(f"`rewards` as token-level rewards must have shape {shape}, got {tuple(rewards.shape)}")
        rewards = rewards.detach().to(torch.float64).sum(dim=1)
    elif rewards.dim() != 1 or rewards.shape[0] != shape[0]:
        raise ValueError(f"`rewards` must have shape [B] = [{shape[0]}] or [B, L] = {list(shape)}, got {tuple(rewards.shape)}")
    rewards = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("`rewards` must be finite (found NaN or inf)")
    return rewards


def _normalise_index(index: Any, batch_size: int, device: torch.device) -> tuple[Tensor, np.ndarray]:
    """Dense int64 group ids ``[B]`` (sorted label order) and the labels ``[n_groups]``."""
    if isinstance(index, Tensor):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise ValueError(f"`index` as a tensor must hold integers, got {index.dtype}")
        values = index.detach().cpu().numpy()
    elif isinstance(index, (np.ndarray, list, tuple)):
        values = np.asarray(index) if not isinstance(index, np.ndarray) else index
    else:
        raise ValueError(f"`index` must be a tensor, numpy array or list of group ids, got {type(index).__name__}")
    if values.ndim != 1 or values.shape[0] != batch_size:
        raise ValueError(f"`index` must be 1-D of length B = {batch_size}, got shape {values.shape}")
    if values.dtype.kind == "f":
        if not np.all(np.isfinite(values)) or not np.all(values == np.round(values)):
            raise ValueError("`index` must hold integer or string group ids, got non-integer floats")
        values = values.astype(np.int64)
    try:
        labels, inverse = np.unique(values, return_inverse=True)
    except TypeError as err:
        raise ValueError(f"`index` group ids must be mutually comparable (all ints or all strings): {err}") from None
    group = torch.as_tensor(inverse.reshape(-1).astype(np.int64), device=device)
    return group, labels


def _check_rollout_advantage(value: Tensor | None, batch: Batch) -> Tensor | None:
    """``[B]`` float64 on the batch device, or None."""
    if value is None:
        return None
    t = _as_tensor("rollout_advantage", value, batch.device)
    if t.dtype.is_complex or tuple(t.shape) != (batch.responses.shape[0],):
        raise ValueError(f"`rollout_advantage` must be real with shape [B] = [{batch.responses.shape[0]}], got {tuple(t.shape)}")
    t = t.detach().to(torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise ValueError("`rollout_advantage` must be finite (found NaN or inf)")
    return t
