"""The advantage stage: each masked token looks its (group, token) score up in its group's hash table.

``out[i, t] = (A_i + weight * score[group(i), responses[i, t]]) * mask[i, t]``, float32 ``[B, L]``,
computed in float64 and rounded once, as the torch backend does. One program per tile of one
rollout; lookups are plain loads (the table is read-only by now).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..types import Batch
from .tables import HashTables, find_slots

_TILE = 1024


@triton.jit
def _advantage_kernel(resp_ptr, mask_ptr, L, group_ptr, base_ptr, weight_ptr,
                      keys_ptr, offset_ptr, log_cap_ptr, slot_score_ptr, out_ptr, BLOCK: tl.constexpr):
    """Grid ``(B, cdiv(L, BLOCK))``."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = row.to(tl.int64) * L + cols
    inside = cols < L
    present = tl.load(mask_ptr + pos, mask=inside, other=0) != 0
    token = tl.load(resp_ptr + pos, mask=present, other=0).to(tl.int32)
    g = tl.load(group_ptr + row)
    base = tl.load(offset_ptr + g)
    slot = find_slots(keys_ptr, base, tl.load(log_cap_ptr + g), token, present)
    score = tl.load(slot_score_ptr + base + slot, mask=present, other=0.0)
    value = tl.load(base_ptr + row) + tl.load(weight_ptr) * score
    tl.store(out_ptr + pos, tl.where(present, value, 0.0).to(tl.float32), mask=inside)


def token_advantages(batch: Batch, tables: HashTables, slot_score: Tensor, base: Tensor, weight: float) -> Tensor:
    """float32 ``[B, L]`` advantages from the per-slot scores (``scores.score_rows``) and the float64
    ``[B]`` rollout advantages ``base``."""
    B, L = batch.responses.shape
    out = torch.empty(B, L, dtype=torch.float32, device=batch.device)
    if B and L:
        block = min(_TILE, triton.next_power_of_2(L))
        w = torch.tensor([weight], dtype=torch.float64, device=batch.device)
        _advantage_kernel[(B, triton.cdiv(L, block))](
            batch.responses.contiguous(), batch.mask.contiguous().view(torch.uint8), L, batch.group,
            base.to(torch.float64).contiguous(), w, tables.keys, tables.offset, tables.log_cap, slot_score, out,
            BLOCK=block)
    return out
