"""The conversions and checks of the caller's arguments that ``validation`` (the public functions),
``types`` (``KeyTokenScores``' methods), ``config``, ``fisher``, ``metrics`` and ``distributed`` share, so that each error
has one wording: a tensor of an ``ArrayLike``, the token-id tensor, the mask's shape and 0 / 1 values, a
real ``[B]`` vector, group ids, and the scalar tests (a finite real, an int that is not a bool). Imports
nothing of the package."""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor


def host_tensor(name: str, value: np.ndarray | Sequence) -> Tensor:
    """A CPU tensor of the caller's numpy array or (nested) list ``name`` (a numpy array copied to native byte
    order and plain strides where torch cannot take it as it is: a reversed view, a field of a record array; a list of no number int64, not numpy's
    float64); ValueError naming it for a ragged nested list, a value that is not a number, or an array torch
    cannot hold."""
    try:
        array = np.asarray(value)
    except ValueError:
        raise ValueError(f"`{name}` must be a rectangular array (every row of one length), got a ragged nested "
                         f"list; pad the rows to one length (and set `response_mask` to 0 on the padding)") from None
    if array.dtype == object or (array.dtype == np.float64 and not isinstance(value, np.ndarray)):
        array = _python_numbers(name, value, array)
    if array.size == 0 and not isinstance(value, np.ndarray) and array.dtype == np.float64:
        array = array.astype(np.int64)  # e.g. responses [[], []]: B rows of no token, no float among them
    plain = all(stride >= 0 and stride % array.itemsize == 0 for stride in array.strides)
    if array.dtype.kind in "biufc" and not (array.dtype.isnative and plain):
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    try:
        return torch.as_tensor(array)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`{name}` must be a tensor or a numeric array: {err}") from None


def _python_numbers(name: str, value: np.ndarray | Sequence, array: np.ndarray) -> np.ndarray:
    """``array`` (numpy's reading of ``value``) typed where numpy could not: an object array of numbers
    as numpy types a list of them, and integers alone (which numpy makes float64 past int64, object past
    uint64) as int64, else uint64; ValueError naming ``name`` for a value that is no number or an int
    past 64 bits."""
    items = (array if array.dtype == object else np.asarray(value, dtype=object)).reshape(-1)
    if array.dtype != object and not all(plain_int(v) for v in items):
        return array  # floats among the numbers: float64 is their type
    for v in items:
        if not isinstance(v, (int, float, np.number, bool, np.bool_)):
            raise ValueError(f"`{name}` must hold numbers, found {v!r} ({type(v).__name__}); "
                             f"replace missing values before the call")
    if not all(plain_int(v) for v in items):
        return np.array(items.tolist()).reshape(array.shape)
    for dtype in (np.int64, np.uint64):
        try:
            return np.array(items.tolist(), dtype=dtype).reshape(array.shape)
        except OverflowError:
            pass
    ints = [int(v) for v in items]
    raise ValueError(f"`{name}` must hold integers that one 64-bit type holds (int64 or uint64), found "
                     f"{min(ints)} and {max(ints)}")


def as_tensor(name: str, value: Any) -> Tensor:
    """``value`` as a tensor: a tensor as it is, a numpy array or list on the CPU (``host_tensor``);
    ValueError naming ``name`` for anything else."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (np.ndarray, list, tuple)):
        return host_tensor(name, value)
    raise ValueError(f"`{name}` must be a torch.Tensor, numpy array or list, got {type(value).__name__}")


def check_token_tensor(responses: Tensor) -> None:
    """ValueError naming ``responses`` unless it is 2-D ``[B, L]`` of an integer dtype (any int, not bool)."""
    if responses.dim() != 2:
        raise ValueError(f"`responses` must be 2-D [B, L], got shape {tuple(responses.shape)}")
    if responses.dtype == torch.bool or responses.dtype.is_floating_point or responses.dtype.is_complex:
        raise ValueError(f"`responses` must hold integer token ids, got dtype {responses.dtype}; "
                         f"convert with `responses.long()`")


def check_mask_shape(mask: Tensor, shape: tuple[int, ...]) -> None:
    """ValueError naming ``response_mask`` unless it has the shape of ``responses`` (``shape``), saying when
    one of the two looks transposed."""
    if tuple(mask.shape) != shape:
        transposed = "; one of the two is transposed: both are [B, L]" if tuple(mask.shape) == shape[::-1] else ""
        raise ValueError(f"`response_mask` must have the shape of `responses` {shape}, got {tuple(mask.shape)}"
                         f"{transposed}")


def check_flag_dtype(name: str, t: Tensor, fix: str) -> None:
    """ValueError naming ``name`` and ``fix`` for a complex tensor of flags (0 / 1 values must be real)."""
    if t.dtype.is_complex:
        raise ValueError(f"`{name}` must be bool or hold only 0 and 1, got {t.dtype}; {fix}")


def zero_one_flags(name: str, t: Tensor, fix: str) -> Tensor:
    """bool from bool, or from real numbers that are all 0 or 1 (their values read); ValueError naming
    ``name``, the first other value and ``fix`` else."""
    if t.dtype == torch.bool:
        return t
    check_flag_dtype(name, t, fix)
    if not zeros_and_ones(t):
        raise ValueError(f"`{name}` must be bool or hold only 0 and 1, {first_other_value(t)}; {fix}")
    return t != 0


def first_other_value(t: Tensor) -> str:
    """Where a 1-D or 2-D real tensor first holds a value other than 0 and 1, e.g. "found 2 at row 3,
    column 7 (5 values are neither 0 nor 1)"."""
    bad = torch.nonzero((t != 0) & (t != 1))
    first = bad[0].tolist()
    value = t[tuple(first)].item()
    where = ", ".join(f"{axis} {i}" for axis, i in zip(("row", "column"), first))
    more = f" ({bad.shape[0]} values are neither 0 nor 1)" if bad.shape[0] > 1 else ""
    return f"found {value!r} at {where}{more}"


def zeros_and_ones(t: Tensor) -> bool:
    """Whether a non-bool real tensor holds only 0 and 1: for integers one min / max pass (verl's int64
    response mask: no [B, L] temporary), for floats an exact test."""
    if t.numel() == 0:
        return True
    if t.dtype.is_floating_point:
        return bool(((t == 0) | (t == 1)).all())
    low, high = torch.aminmax(t)
    return int(low) >= 0 and int(high) <= 1


def check_real_rows(name: str, t: Tensor, batch_size: int) -> None:
    """ValueError naming ``name`` unless ``t`` is real (not complex, not bool) with shape ``[B]``."""
    if t.dtype.is_complex or t.dtype == torch.bool or tuple(t.shape) != (batch_size,):
        raise ValueError(f"`{name}` must be real with shape [B] = [{batch_size}], got {t.dtype} {tuple(t.shape)}")


def check_finite_rows(name: str, t: Tensor) -> None:
    """ValueError naming ``name`` and the first row of the float ``[B]`` ``t`` that holds NaN or inf (one
    read of a device tensor)."""
    finite = np.isfinite(t.numpy()).all() if t.device.type == "cpu" else bool(torch.isfinite(t).all())
    if not finite:
        bad = torch.nonzero(~torch.isfinite(t)).reshape(-1)
        more = f" ({bad.numel()} rows are not finite)" if bad.numel() > 1 else ""
        raise ValueError(f"`{name}` must be finite, found {float(t[bad[0]])} at row {int(bad[0])}{more}")


def finite_real(value: object) -> bool:
    """Whether ``value`` is a finite real number: a Python or numpy int or float, not a bool, and not an
    int past float64's range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def plain_int(value: object) -> bool:
    """Whether ``value`` is an int (anything with ``__index__``: a Python or numpy int), not a bool."""
    return not isinstance(value, (bool, np.bool_)) and hasattr(value, "__index__")


def index_tensor(index: Tensor, name: str = "index") -> Tensor:
    """The caller's tensor of group ids (the argument ``name``), checked: integers, not on the meta device."""
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(f"`{name}` as a tensor must hold integers, got {index.dtype}; convert with `{name}.long()`")
    if index.device.type == "meta":
        raise ValueError(f"`{name}` is a meta tensor with no values; pass real group ids")
    return index.detach()


def check_index_shape(shape: tuple[int, ...], batch_size: int, name: str = "index") -> None:
    """ValueError naming ``name`` unless group ids of ``shape`` are 1-D of length ``batch_size``."""
    if len(shape) != 1 or shape[0] != batch_size:
        raise ValueError(f"`{name}` must be 1-D of length B = {batch_size}, got shape {tuple(shape)}")


def index_values(index: Any, name: str = "index") -> np.ndarray:
    """The caller's group ids (the argument ``name``) as a numpy array on the host, all ints or all strings
    (ValueError naming ``name`` else); the shape is the caller's."""
    if isinstance(index, Tensor):
        index = index_tensor(index, name)
        return index.numpy() if index.device.type == "cpu" else index.cpu().numpy()
    if isinstance(index, np.ndarray):
        values = index
    elif isinstance(index, (list, tuple)):
        try:
            values = np.asarray(index)
        except ValueError:
            raise ValueError(f"{_ONE_KIND.format(name=name)}, got a ragged nested list") from None
        if values.dtype.kind in "US":  # numpy writes ints as text beside strings: the items say which they were
            check_one_kind(index, name)
        if values.dtype.kind == "f" and all(map(plain_int, index)):  # ints past int64 beside others: numpy's float64
            values = np.asarray(index, dtype=object)
    else:
        raise ValueError(f"`{name}` must be a tensor, numpy array or list of group ids, got {type(index).__name__}")
    if values.size == 0:
        return values.astype(np.int64)  # numpy makes `[]` a float array: no id to refuse
    if values.dtype.kind in "fcb":
        fix = "; convert float ids with `.astype(np.int64)`" if values.dtype.kind == "f" else ""
        raise ValueError(f"{_ONE_KIND.format(name=name)}, got {values.dtype} values{fix}")
    return values


#: the start of the error for group ids that are not all ints or all strings.
_ONE_KIND = "`{name}` must hold group ids of one kind, all ints or all strings"


def label_kind(label_type: type) -> str | None:
    """"int", "str" or "bytes": the kind of group id a label of ``label_type`` is; None: it is none."""
    if issubclass(label_type, (bool, np.bool_)):
        return None
    return next((kind for kind, types in (("int", (int, np.integer)), ("str", str), ("bytes", bytes))
                 if issubclass(label_type, types)), None)


def check_one_kind(items: Any, name: str) -> set[type]:
    """The types of the caller's labels ``items``; ValueError naming ``name`` unless they are of one kind
    (``label_kind``)."""
    types = set(map(type, items))
    kinds = {label_kind(t) for t in types}
    if len(kinds) > 1 or None in kinds:
        mix = " and ".join(sorted(t.__name__ for t in types))
        raise ValueError(f"{_ONE_KIND.format(name=name)}, got {'a mix of ' if len(types) > 1 else ''}{mix}"
                         f"{'' if len(types) > 1 else ' values'}")
    return types
