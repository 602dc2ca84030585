"""Input validation: the caller's tensors, arrays or lists checked and brought to a ``Batch``.

Used by the public API and by every backend that checks token ids itself (one wording of every
error, naming the argument and the fix: the conversions and checks ``KeyTokenScores`` makes too live in
``checks``). Imports nothing of the package but ``checks``, ``config``, ``options`` and ``types``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from .checks import (as_tensor, check_finite_rows, check_flag_dtype, check_index_shape, check_mask_shape,
                     check_one_kind, check_real_rows, check_token_tensor, index_tensor, index_values, zero_one_flags)
from .config import MAX_TOKEN_ID, KTAEConfig  # the id range, here for the backends that check ids
from .options import DEFAULT_OPTIONS, ExecutionOptions
from .types import ArrayLike, Batch, ValueCheck

_DEFAULT_CONFIG = KTAEConfig()


def check_config(config: KTAEConfig | None) -> KTAEConfig:
    """``config``, or ``KTAEConfig()`` when None; ValueError for anything else."""
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, KTAEConfig):
        raise ValueError(f"`config` must be a KTAEConfig or None, got {type(config).__name__}; "
                         f"build one with KTAEConfig(...)")
    return config


def check_options(options: ExecutionOptions | None) -> ExecutionOptions:
    """``options``, or ``ExecutionOptions()`` when None; ValueError for anything else."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, ExecutionOptions):
        raise ValueError(f"`options` must be an ExecutionOptions or None, got {type(options).__name__}; "
                         f"build one with ExecutionOptions(...)")
    return options


def normalise_batch(responses: ArrayLike, response_mask: ArrayLike, rewards: ArrayLike, index: Any, *,
                    correct: ArrayLike | None = None, check_ids: bool = True, defer_values: bool = False) -> Batch:
    """Validate the caller's inputs and bring them to the canonical ``Batch`` form.

    ``check_ids=False`` leaves the token-id range check to a backend that does it while counting.
    ``defer_values=True`` leaves the value checks (rewards finite, the mask and ``correct`` 0 and 1) to a
    backend that makes them on the device (``Batch.unchecked``): nothing of theirs is read back here.
    Raises ValueError naming the argument (and the fix) on any shape, dtype or value problem.
    """
    pending: list[ValueCheck] | None = [] if defer_values else None
    responses, mask, reward = _checked_tensors(responses, response_mask, rewards, check_ids=check_ids, read=True,
                                               pending=pending)
    ids = group_ids(index, responses.shape[0], responses.device)
    return _batch(responses, mask, reward, ids.group, ids.labels, correct, read=True, pending=pending,
                  members=ids.members)


def planned_batch(responses: ArrayLike, response_mask: ArrayLike, rewards: ArrayLike, ids: GroupIds, *,
                  correct: ArrayLike | None = None, check_ids: bool = True, read: bool = True,
                  defer_values: bool = False) -> Batch:
    """``normalise_batch`` for group ids already made dense (``group_ids``, on the batch's device).

    ``read=False`` (while a CUDA graph captures) reads no value back to the host: the tensors must
    already be on the group ids' device, the mask (and ``correct``) bool; rewards are checked for
    NaN / inf only by a backend that checks values on the device (``defer_values``), and token ids are
    left to a backend that checks them on the device (``check_ids=False``).
    """
    pending: list[ValueCheck] | None = [] if defer_values and read else None
    responses, mask, reward = _checked_tensors(responses, response_mask, rewards, check_ids=check_ids, read=read,
                                               pending=pending)
    group = ids.group
    if responses.device != group.device or responses.shape[0] != group.shape[0]:
        raise ValueError(f"`responses` must have B = {group.shape[0]} rows on {group.device}, as planned, got "
                         f"{tuple(responses.shape)} on {responses.device}")
    return _batch(responses, mask, reward, group, ids.labels, correct, read=read, pending=pending,
                  members=ids.members)


def _checked_tensors(responses: ArrayLike, response_mask: ArrayLike, rewards: ArrayLike, *, check_ids: bool,
                     read: bool, pending: list[ValueCheck] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """int64 responses ``[B, L]``, bool mask ``[B, L]`` and float64 rewards ``[B]``, checked (values
    too when ``read``, or listed in ``pending`` for the device) in the order the errors are reported."""
    responses = _as_tensor("responses", responses, read=read)
    check_token_tensor(responses)
    device = responses.device
    shape = tuple(responses.shape)
    mask = _check_mask(_as_tensor("response_mask", response_mask, device, read), shape, read, pending)
    unsigned = responses.dtype == torch.uint64
    responses = responses.to(torch.int64)
    if unsigned and read:
        _check_wrapped_ids(responses, mask)
    if check_ids:
        check_token_ids(responses, mask)
    reward = _check_rewards(_as_tensor("rewards", rewards, device, read), shape, read, pending)
    return responses, mask, reward


def _batch(responses: Tensor, mask: Tensor, rewards: Tensor, group: Tensor, labels: np.ndarray,
           correct: ArrayLike | None, *, read: bool, pending: list[ValueCheck] | None,
           members: Tensor | None) -> Batch:
    flags = None if correct is None else _check_correct(_as_tensor("correct", correct, responses.device, read),
                                                        responses.shape[0], read, pending)
    return Batch(responses=responses, mask=mask, rewards=rewards, group=group, group_labels=labels, correct=flags,
                 members=members, unchecked=tuple(pending or ()))


def check_token_ids(responses: Tensor, mask: Tensor) -> None:
    """Ids under the mask must lie in ``[0, 2**31)``; padding under mask 0 may be anything."""
    if responses.numel() == 0:
        return
    lo, hi = torch.aminmax(responses)
    if int(lo) >= 0 and int(hi) <= MAX_TOKEN_ID:
        return  # the common case: one pass, no masked copy
    masked = responses[mask]
    if masked.numel():
        check_id_range(int(masked.min()), int(masked.max()))


def check_id_range(low: int, high: int) -> None:
    """Raise the API's error for the smallest and largest token id seen under the mask (a kernel that
    checks ids while counting reports these two numbers)."""
    if low < 0:
        raise ValueError(f"`responses` must hold token ids >= 0 where the mask is 1, found {low}; "
                         f"set `response_mask` to 0 on padding")
    if high > MAX_TOKEN_ID:
        raise ValueError(f"`responses` token ids must be < 2**31, found {high}")


def _check_wrapped_ids(responses: Tensor, mask: Tensor) -> None:
    """The API's id error for uint64 ids from 2**63 on under the mask, with their true value: ``responses``
    (int64, cast from uint64) holds them wrapped to negative ids (one read, for this dtype only)."""
    wrapped = responses[mask & (responses < 0)]
    if wrapped.numel():
        check_id_range(0, int(wrapped.max()) + 2**64)


def check_out(out: Tensor | None, batch: Batch, inputs: Mapping[str, Any]) -> Tensor | None:
    """The caller's output tensor, checked: contiguous float32 ``[B, L]`` on the batch's device, sharing no
    memory with ``inputs`` (the caller's arguments by name, as given: the result would overwrite them while
    they are read). Pointer arithmetic only: nothing is read, so a CUDA graph may capture the check."""
    if out is None:
        return None
    shape = tuple(batch.responses.shape)
    if not isinstance(out, Tensor):
        raise ValueError(f"`out` must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != batch.device:
        raise ValueError(f"`out` must be a float32 tensor of shape {shape} on {batch.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}; allocate it with "
                         f"torch.empty(responses.shape, dtype=torch.float32, device=responses.device)")
    if not out.is_contiguous():
        raise ValueError("`out` must be contiguous; pass a fresh torch.empty(...) buffer")
    if out.requires_grad:
        raise ValueError("`out` must not require grad")
    span = _memory_span(out)
    for name, value in inputs.items():
        other = _memory_span(value)
        if span and other and span[0] == other[0] and span[1] < other[2] and other[1] < span[2]:
            raise ValueError(f"`out` must not overlap `{name}` in memory (the result would overwrite it while it "
                             f"is read); pass a separate buffer, e.g. torch.empty(responses.shape, "
                             f"dtype=torch.float32, device=responses.device)")
    return out


def _memory_span(value: Any) -> tuple[torch.device, int, int] | None:
    """(device, first byte, one past the last byte) of the elements of a tensor or numpy array, from its
    pointer, shape and strides (nothing read); None for another value (a sparse tensor, one with no
    storage) or no element. A strided view's range can enclose bytes it does not use: an ``out`` there
    is refused too, the safe side."""
    if isinstance(value, Tensor) and value.numel() and value.layout == torch.strided and value.device.type != "meta":
        try:
            start = value.data_ptr()
        except RuntimeError:  # a tensor with no storage of its own (a fake or functional wrapper)
            return None
        size, device = value.element_size(), value.device
        if value.is_contiguous():  # the common case, in a few attribute reads (a call on the cuda path)
            return device, start, start + value.numel() * size
        strides = [stride * size for stride in value.stride()]
    elif isinstance(value, np.ndarray) and value.size:
        size, start, device, strides = value.itemsize, value.__array_interface__["data"][0], _HOST, value.strides
    else:
        return None
    steps = [(n - 1) * stride for n, stride in zip(value.shape, strides)]  # bytes; numpy's may be negative
    return device, start + sum(min(step, 0) for step in steps), start + sum(max(step, 0) for step in steps) + size


_HOST = torch.device("cpu")


def check_rollout_advantage(value: ArrayLike | None, batch: Batch, read: bool = True,
                            defer_values: bool = False) -> Tensor | None:
    """``[B]`` float64 on the batch device, or None (checked finite when ``read``, unless ``defer_values``:
    a backend that checks values on the device checks it, and raises after its read)."""
    if value is None:
        return None
    t = _as_tensor("rollout_advantage", value, batch.device, read)
    check_real_rows("rollout_advantage", t, batch.responses.shape[0])
    return _finite_float64("rollout_advantage", t, read and not defer_values)


def raise_unchecked(checks: tuple[ValueCheck, ...]) -> None:
    """Run on the host the value checks a backend made on the device (``Batch.unchecked``), in order,
    raising the API's ValueError for the first that fails (reads each tensor)."""
    for check in checks:
        if check.kind == "finite":
            _finite_float64(check.name, check.tensor)
        else:
            _zero_one_flags(check.name, check.tensor, check.fix)


def invalid_on_device(checks: tuple[ValueCheck, ...]) -> Tensor | None:
    """0-dim bool on the checks' device, True when a value check of ``checks`` fails (nothing read back;
    None when there are none)."""
    found = [_invalid(check) for check in checks]
    if not found:
        return None
    return found[0] if len(found) == 1 else torch.stack(found).any()


def _invalid(check: ValueCheck) -> Tensor:
    t = check.tensor
    if check.kind == "finite":
        return ~torch.isfinite(t).all()
    if t.dtype.is_floating_point:
        return ((t != 0) & (t != 1)).any()
    return (t & -2).any() if t.dtype.is_signed else (t > 1).any()  # any bit but the lowest: not 0 or 1


def _finite_float64(name: str, t: Tensor, read: bool = True) -> Tensor:
    """``t`` (``[B]``) detached as float64; ValueError naming ``name`` and the first row holding NaN or inf
    (checked when ``read``)."""
    t = t.detach().to(torch.float64)
    if read:
        check_finite_rows(name, t)
    return t


def _as_tensor(name: str, value: Any, device: torch.device | None = None, read: bool = True) -> Tensor:
    """``value`` as a tensor on ``device`` (where it is, when None). Not ``read`` (a CUDA graph
    capturing): only a tensor already there, nothing copied from the host or across devices."""
    if not read and not (isinstance(value, Tensor) and (device is None or value.device == device)):
        where = "" if device is None else f" on {device}"
        got = f"a tensor on {value.device}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"`{name}` must be a tensor{where} while a CUDA graph captures (nothing may be "
                         f"copied from the host then), got {got}")
    t = as_tensor(name, value)
    return t if device is None else t.to(device)


def _check_mask(mask: Tensor, shape: tuple[int, ...], read: bool = True,
                pending: list[ValueCheck] | None = None) -> Tensor:
    check_mask_shape(mask, shape)
    return _zero_one_flags("response_mask", mask, "build it as `responses != pad_id`", read, pending)


def _zero_one_flags(name: str, t: Tensor, fix: str, read: bool = True,
                    pending: list[ValueCheck] | None = None) -> Tensor:
    """bool from bool, or from numbers that are all 0 or 1 (bool only when not ``read``: the values
    cannot be checked; listed in ``pending`` when given); ValueError naming ``name`` and ``fix`` else."""
    if t.dtype == torch.bool:
        return t
    if not read:
        raise ValueError(f"`{name}` must be bool while a CUDA graph captures (its values cannot be checked "
                         f"then), got {t.dtype}; {fix}")
    if pending is None:
        return zero_one_flags(name, t, fix)
    check_flag_dtype(name, t, fix)
    pending.append(ValueCheck(name, t, "zero_one", fix))
    return t != 0


def _check_rewards(rewards: Tensor, shape: tuple[int, ...], read: bool = True,
                   pending: list[ValueCheck] | None = None) -> Tensor:
    if rewards.dtype.is_complex or rewards.dtype == torch.bool:
        raise ValueError(f"`rewards` must be real numbers, got {rewards.dtype}; convert with `rewards.float()`")
    if rewards.dim() == 2:
        if tuple(rewards.shape) != shape:
            raise ValueError(f"`rewards` as token-level rewards must have shape {shape}, got {tuple(rewards.shape)}")
        rewards = float64_row_sums(rewards.detach())
    elif rewards.dim() == 1 and rewards.shape[0] == shape[1] != shape[0]:
        raise ValueError(f"`responses` must be [B, L], one row per rollout, got shape {shape}, and `rewards` has "
                         f"{shape[1]} values, one per column: the batch looks transposed; pass `responses.T` "
                         f"and `response_mask.T`")
    elif rewards.dim() != 1 or rewards.shape[0] != shape[0]:
        raise ValueError(f"`rewards` must have shape [B] = [{shape[0]}] or [B, L] = {list(shape)}, "
                         f"got {tuple(rewards.shape)}")
    rewards = _finite_float64("rewards", rewards, read and pending is None)
    if pending is not None:
        pending.append(ValueCheck("rewards", rewards, "finite"))
    return rewards


#: rows a CPU ``float64_row_sums`` takes at a time.
ROW_SUM_ROWS = 256


def float64_row_sums(t: Tensor) -> Tensor:
    """float64 ``[B]``: ``t.to(torch.float64).sum(-1)`` of a real ``[B, T]`` tensor, the same bits. On the
    CPU it runs over blocks of ``ROW_SUM_ROWS`` rows (each row is summed the same way), which is
    many times faster than one pass over a paper-sized batch (docs/benchmarks.md)."""
    if t.device.type != "cpu" or t.shape[0] <= ROW_SUM_ROWS:
        return t.to(torch.float64).sum(-1)
    out = torch.empty(t.shape[0], dtype=torch.float64)
    for start in range(0, t.shape[0], ROW_SUM_ROWS):
        out[start:start + ROW_SUM_ROWS] = t[start:start + ROW_SUM_ROWS].to(torch.float64).sum(-1)
    return out


def _check_correct(correct: Tensor, batch_size: int, read: bool = True,
                   pending: list[ValueCheck] | None = None) -> Tensor:
    """bool ``[B]`` from bool or 0/1 labels."""
    if tuple(correct.shape) != (batch_size,):
        raise ValueError(f"`correct` must have shape [B] = [{batch_size}], got {tuple(correct.shape)}")
    return _zero_one_flags("correct", correct, "e.g. `correct=task_score > 0`", read, pending)


def correct_flags(correct: ArrayLike, batch_size: int, device: torch.device) -> Tensor:
    """The caller's ``correct`` labels as the API checks them: bool ``[B]`` on ``device`` (their values read
    there); ValueError naming ``correct``."""
    return _check_correct(_as_tensor("correct", correct, device), batch_size)


@dataclass(frozen=True)
class GroupIds:
    """The caller's ``index`` made dense: ``group`` int64 ``[B]`` (``0 .. n_groups - 1`` in sorted order of
    the labels), ``labels`` numpy ``[n_groups]``, ``members`` int64 ``[B]`` (the rollouts in order of their
    group, a stable argsort of ``group``); the tensors on the batch's device."""

    group: Tensor
    labels: np.ndarray
    members: Tensor


#: index dtypes that ``torch.sort`` sorts on every device, with their labels' numpy dtype (others go
#: through numpy on the host).
_SORTABLE = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
             torch.uint8: np.uint8}


def group_ids(index: Any, batch_size: int, device: torch.device, name: str = "index") -> GroupIds:
    """``GroupIds`` of the caller's ``index`` (ints, uid strings; a tensor, numpy array or list); errors
    name the argument ``name``.

    A GPU tensor index is made dense where it lives (``tensor_group_ids``); a host index on the host
    (numpy is several times faster there for a trainer's few hundred rollouts), its ids then copied to
    ``device`` without waiting for the device."""
    on_device = isinstance(index, Tensor) and index.device.type not in ("cpu", "meta")
    if on_device and index_tensor(index, name).dtype in _SORTABLE:
        check_index_shape(tuple(index.shape), batch_size, name)
        return tensor_group_ids(index.detach(), device)
    values = index_values(index, name)
    check_index_shape(values.shape, batch_size, name)
    labels, inverse = _unique(values, name)
    group = inverse.reshape(-1).astype(np.int64, copy=False)
    contiguous = bool((group[1:] >= group[:-1]).all())
    members = np.arange(len(group)) if contiguous else np.argsort(group, kind="stable")  # TRL's layout: no sort
    if device.type != "cuda":
        return GroupIds(group=torch.from_numpy(group).to(device), labels=labels,
                        members=torch.from_numpy(members).to(device))
    both = torch.from_numpy(np.stack([group, members])).pin_memory().to(device, non_blocking=True)  # no wait
    return GroupIds(group=both[0], labels=labels, members=both[1])


def tensor_group_ids(index: Tensor, device: torch.device) -> GroupIds:
    """``GroupIds`` of a 1-D integer tensor (a dtype of ``_SORTABLE``), made on its own device: a stable
    sort (its order is ``members``), the first of each run of equal values, a cumulative sum; one read of
    the sorted values and run starts (the labels), no ``np.unique``; the tensors then moved to ``device``."""
    values, members = torch.sort(index, stable=True)
    first = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    torch.ne(values[1:], values[:-1], out=first[1:])
    group = torch.empty_like(members)
    group[members] = torch.cumsum(first, 0) - 1
    host = torch.cat([values.to(torch.int64), first.to(torch.int64)]).cpu()  # the one read
    B = values.shape[0]
    labels = host[:B][host[B:].bool()].numpy().astype(_SORTABLE[index.dtype])
    return GroupIds(group=group.to(device), labels=labels, members=members.to(device))


def dense_group_ids(index: Any, batch_size: int, device: torch.device,
                    name: str = "index") -> tuple[Tensor, np.ndarray]:
    """Dense int64 group ids ``[B]`` on ``device`` (sorted label order) and the labels ``[n_groups]``
    of the caller's ``index`` (``group_ids`` without the members; errors name ``name``)."""
    ids = group_ids(index, batch_size, device, name)
    return ids.group, ids.labels


def _unique(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of a 1-D array of ints or strings; an object array's
    labels checked to be of one kind (ValueError naming ``name``), uid strings through a dict
    (``_unique_strings``)."""
    if values.dtype != object:
        return np.unique(values, return_inverse=True)
    items = values.tolist()
    if check_one_kind(items, name) == {str}:
        return _unique_strings(items)
    return np.unique(values, return_inverse=True)


def _unique_strings(items: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of the ``str`` items of a 1-D object array (verl's uids)
    through a dict: numpy sorts an object array one Python comparison at a time, several times slower on
    a paper-sized verl batch (docs/benchmarks.md). The labels are the same: both order strings by
    Python's ``<``."""
    labels = sorted(set(items))
    rank = {label: i for i, label in enumerate(labels)}
    inverse = np.fromiter(map(rank.__getitem__, items), dtype=np.int64, count=len(items))
    return np.array(labels, dtype=object), inverse
