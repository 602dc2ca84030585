"""Data-movement primitives of the torch backend over ``[B, L]``-sized data.

On the CPU they run through numpy views of the same memory (numpy's boolean selection, repeat,
take, prefix sum and count are several times faster there than torch's CPU kernels, with identical
results; docs/benchmarks.md); elsewhere they are the plain torch ops.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def _on_cpu(t: Tensor) -> bool:
    return t.device.type == "cpu"


def row_counts(mask: Tensor) -> Tensor:
    """Number of True entries per row of a bool ``[B, L]`` mask; int64 ``[B]``."""
    if _on_cpu(mask):
        return torch.from_numpy(np.count_nonzero(mask.numpy(), axis=1).astype(np.int64))
    return mask.sum(dim=1)


def masked_values(x: Tensor, mask: Tensor) -> Tensor:
    """``x[mask]`` in row-major order, ``[N]``."""
    if _on_cpu(x):
        return torch.from_numpy(x.numpy()[mask.numpy()])
    return x.masked_select(mask)


def repeat_counts(values: Tensor, counts: Tensor) -> Tensor:
    """``values[i]`` repeated ``counts[i]`` times, concatenated."""
    if _on_cpu(values):
        return torch.from_numpy(values.numpy().repeat(counts.numpy()))
    return values.repeat_interleave(counts)


def gather(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` for a 1-D ``values``."""
    if _on_cpu(values):
        return torch.from_numpy(values.numpy().take(index.numpy()))
    return values[index]


def flat_nonzero(flags: Tensor) -> Tensor:
    """Indices of the True entries of a 1-D bool tensor; int64."""
    if _on_cpu(flags):
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return torch.nonzero(flags).squeeze(1)


def group_sum(group: Tensor, n_groups: int, values: Tensor | None = None) -> Tensor:
    """Per-group sums ``[n_groups]`` of ``values [B]`` (bool, int < 2**53 or float; None: ones) over
    int64 group ids ``[B]``, added in order of ``B`` as ``index_add_`` adds them: float64 for float
    values, int64 otherwise."""
    floating = values is not None and values.dtype.is_floating_point
    if _on_cpu(group):
        ids = group.numpy()
        if values is not None and values.dtype == torch.bool:  # a count: no float weights to convert back
            counts = np.bincount(ids[values.numpy()], minlength=n_groups)
            return torch.from_numpy(counts.astype(np.int64, copy=False))
        weights = None if values is None else values.numpy()
        sums = np.bincount(ids, weights=weights, minlength=n_groups)
        return torch.from_numpy(sums.astype(np.float64 if floating else np.int64, copy=False))
    dtype = torch.float64 if floating else torch.int64
    source = torch.ones_like(group) if values is None else values.to(dtype)
    return torch.zeros(n_groups, dtype=dtype, device=group.device).index_add_(0, group, source)


def prefix_sums(flags: Tensor) -> Tensor:
    """int32 ``[n + 1]``: 0 then the running count of a 1-D bool ``[n]`` (n < 2**31)."""
    out = torch.zeros(flags.shape[0] + 1, dtype=torch.int32, device=flags.device)
    if _on_cpu(flags):
        np.cumsum(flags.numpy(), dtype=np.int32, out=out.numpy()[1:])
    else:
        torch.cumsum(flags, 0, dtype=torch.int32, out=out[1:])
    return out


def scatter_masked(mask: Tensor, values: Tensor, out: Tensor | None = None) -> Tensor:
    """``values [N]`` at the masked positions (row-major) of a zero tensor of ``mask``'s shape: a new one,
    or ``out`` (contiguous, ``values``' dtype) overwritten."""
    if out is None:
        out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    else:
        out.zero_()
    if _on_cpu(values):
        out.numpy()[mask.numpy()] = values.numpy()
        return out
    return out.masked_scatter_(mask, values)
