"""Host/device helpers the GPU backends share: a device guard, non-blocking uploads and the device
copies of the per-table statistics grid (``method.full_grid_statistics``), cached per grid."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Iterator, Optional

import torch
from torch import Tensor

from .. import method
from ..config import KTAEConfig


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the launches (Triton and the CUDA binding launch on the current device)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def upload(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (CPU) on ``device``, without waiting for the device's queue (a pinned, non-blocking copy)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


#: device copies of recently used grids (a training run sees the same few sets of group shapes again).
_GRID_CACHE: "OrderedDict[tuple, tuple[Tensor, Optional[torch.cuda.Event]]]" = OrderedDict()
_GRID_CACHE_SIZE = 64


def grid_statistics(n_c: Tensor, n_w: Tensor, config: KTAEConfig, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """``method.full_grid_statistics`` on ``device``: ``index`` int64 ``[2, n_groups]`` (each group's grid
    offset and stride ``n_w + 1``) and ``values`` float64 ``[5, size]`` (``p_value, F, IG, h,
    strength``); the table ``(a, b)`` of group ``g`` is column ``index[0, g] + a * index[1, g] + b``.

    ``n_c, n_w``: int64 CPU ``[n_groups]``. None where the statistics must come from the rows. The
    device copy of a grid is cached, so a call usually costs the host lookup and one pinned,
    non-blocking upload of ``index``.
    """
    full = method.full_grid_statistics(n_c, n_w, config)
    if full is None:
        return None
    offset, stride, table = full
    shapes = tuple(sorted(set(zip(n_c.tolist(), n_w.tolist()))))  # the grid's blocks, in its order
    key = (config, shapes, str(device))
    hit = _GRID_CACHE.get(key)
    if hit is None:
        values = upload(torch.stack([table.p_value, table.F, table.IG, table.h, table.strength]).contiguous(), device)
        ready = None
        if device.type == "cuda":  # later calls may come on other streams: they wait for the upload
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        hit = (values, ready)
        _GRID_CACHE[key] = hit
        while len(_GRID_CACHE) > _GRID_CACHE_SIZE:
            _GRID_CACHE.popitem(last=False)
    else:
        _GRID_CACHE.move_to_end(key)
    values, ready = hit
    if ready is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(ready)
        values.record_stream(stream)  # not reused while this stream may still read it
    return upload(torch.stack([offset, stride]).contiguous(), device), values
