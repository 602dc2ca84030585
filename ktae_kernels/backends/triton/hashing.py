"""The hash-table primitives of the Triton kernels: the home slot of an id, the claim of a free slot, a
popcount, and the tile a program reads.

A group's table is a power-of-two slice of a flat int32 key array, probed linearly from the id's
Fibonacci-hash home slot; an empty slot holds ``EMPTY`` and is claimed by a compare-and-swap.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

#: the key of an empty slot (ids are >= 0)
EMPTY = -1
_EMPTY = tl.constexpr(EMPTY)
#: a compare value no slot ever holds (keys are >= EMPTY): a compare-and-swap with it never writes
_NEVER = tl.constexpr(-2)
#: positions a program reads: ``[1, TILE]`` of one rollout, or ``[R, L]`` of R short rollouts
TILE = 1024


def tile_shape(L: int) -> tuple[int, int]:
    """``(rows, cols)`` of the ``TILE``-position tiles over ``[B, L]``: whole short rollouts, or one
    rollout's ``TILE`` positions."""
    cols = min(TILE, triton.next_power_of_2(L))
    return TILE // cols, cols


@triton.jit
def home_slot(token, log_cap):
    """Fibonacci hash of int32 ``token`` to ``[0, 2**log_cap)``: the top ``log_cap`` bits of
    ``token * 2654435761 mod 2**32``."""
    h = token.to(tl.uint32) * 2654435761
    return (h >> (32 - log_cap).to(tl.uint32)).to(tl.int32)


@triton.jit
def _cas_predicated(ptr, token, need):
    """``atomicCAS(ptr, EMPTY, token)`` on the lanes of ``need`` only (inline PTX: ``tl.atomic_cas``
    has no mask); other lanes return ``_NEVER``."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.s32 p, $4, 0;
        mov.b32 $0, 0xFFFFFFFE;
        @p atom.global.relaxed.gpu.cas.b32 $0, [$1], $2, $3;
        }""",
        constraints="=r,l,r,r,r",
        args=[ptr, tl.full(token.shape, _EMPTY, tl.int32), token, need.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def claim(keys_ptr, base, slot, spare, token, need, PREDICATED: tl.constexpr):
    """Old key of ``slot`` after a compare-and-swap ``EMPTY -> token`` on the lanes of ``need``.

    Without predication (the interpreter) every lane issues the atomic: the others compare against
    ``_NEVER`` (no write) at the distinct slot ``spare``, so they never queue on a hot slot.
    """
    if PREDICATED:
        old = _cas_predicated(keys_ptr + base + slot, token, need)
    else:
        target = keys_ptr + base + tl.where(need, slot, spare)
        old = tl.atomic_cas(target, tl.where(need, _EMPTY, _NEVER), token, sem="relaxed")
    return old


@triton.jit
def popcount(x):
    """Set bits of each int32 lane (SWAR; no popc intrinsic in the interpreter)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(popcount, InterpretedFunction)
