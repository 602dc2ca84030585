"""The advantage stage: each masked token looks its (group, token) score up in its group's hash table.

``out[i, t] = (A_i + weight * score[group(i), responses[i, t]]) * mask[i, t]``, float32 ``[B, L]``,
computed in float64 and rounded once, as the torch backend does. One program per tile of 1024
positions (``tables.tile_shape``); lookups are plain loads (the table is read-only by now).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...types import Batch
from .scores import WEIGHT
from .tables import HashTables, find_slots, tile_shape


@triton.jit
def _advantage_kernel(resp_ptr, mask_ptr, B, L, group_ptr, base_ptr, const_ptr,
                      keys_ptr, offset_ptr, log_cap_ptr, slot_score_ptr, out_ptr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
    """A ``[ROWS, COLS]`` tile of rollouts x positions; grid ``(cdiv(B, ROWS), cdiv(L, COLS))``."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    pos = row.to(tl.int64) * L + col
    real = row < B
    inside = real & (col < L)
    present = tl.load(mask_ptr + pos, mask=inside, other=0) != 0
    token = tl.load(resp_ptr + pos, mask=present, other=0).to(tl.int32)
    g = tl.load(group_ptr + row, mask=real, other=0)
    base = tl.load(offset_ptr + g, mask=real, other=0)
    slot = find_slots(keys_ptr, base, tl.load(log_cap_ptr + g, mask=real, other=4), token, present)
    score = tl.load(slot_score_ptr + base + slot, mask=present, other=0.0)
    value = tl.load(base_ptr + row, mask=real, other=0.0) + tl.load(const_ptr + WEIGHT) * score
    tl.store(out_ptr + pos, tl.where(present, value, 0.0).to(tl.float32), mask=inside)


def token_advantages(batch: Batch, tables: HashTables, slot_score: Tensor, base: Tensor, consts: Tensor,
                     out: Tensor | None = None) -> Tensor:
    """float32 ``[B, L]`` advantages from the per-slot scores (``scores.score_rows``) and the float64
    ``[B]`` rollout advantages ``base``, written into ``out`` (contiguous float32 ``[B, L]``) when given."""
    B, L = batch.responses.shape
    if out is None:
        out = torch.empty(B, L, dtype=torch.float32, device=batch.device)
    if B and L:
        rows, cols = tile_shape(L)
        _advantage_kernel[(triton.cdiv(B, rows), triton.cdiv(L, cols))](
            batch.responses.contiguous(), batch.mask.contiguous().view(torch.uint8), B, L, batch.group,
            base.to(torch.float64).contiguous(), consts, tables.keys, tables.offset, tables.log_cap, slot_score, out,
            ROWS=rows, COLS=cols, enable_fp_fusion=False)
    return out
