"""``token_advantage`` without the host on the critical path: ten kernels, no device -> host copy
before the last one, every allocation sized from ``B``, ``L`` and the number of groups.

The host computes no group statistic. It allocates (from static bounds), launches, and reads its
flags at the end (skipped while a CUDA graph is being captured):

``ranks``    per rollout: correct flag, its rank among its group's correct (or wrong) rollouts (one
             atomic per rollout, a lane each), ``n_c`` / ``n_w`` and the rewards' sum per group
``lengths``  per rollout: masked tokens (-> ``T_c`` / ``T_w``) and ``last``, one past its last masked
             position (every later kernel stops there)
``plan``     one program over the groups: first table slice (``tables.first_log_cap``'s rule, exact
             integer log2, at most the slice for the distinct ids a group held in the earlier calls
             of this ``(B, n_groups)``, ``device.expected_keys``), slice and presence-word offsets
             (prefix sums), statistics-grid offset
             and stride (``device.grid_index``'s closed form), the rewards' mean; flags what this
             path cannot take (below)
``clear``    clears only the slots and presence words the plan uses (and sums the GRPO variance)
``insert``   one read of the ids: the group tables (``tables``' hashing and claiming), the id
             range check, and a compact int32 slot index per position (-1: masked out) that the
             gather reads instead of the int64 ids
``score``    one program per (group, split): each occupied slot's ``a, b`` from its presence words
             (correct rollouts have the low ranks, so no correct mask is read), its table's
             statistics from the device grid, BM25 direction, squash; the score replaces the
             slot's counters
``advantage`` ``(A_i + weight * score) * mask`` from the slot index; it writes nothing when an id
             was out of range or the plan could not complete (the flags), so ``out`` is untouched
             on every error.

Presence words are per group (``ceil(size / 32)``) and correct rollouts take ranks ``0 .. n_c - 1``,
so ``a`` is the popcount of the words' low ``n_c`` bits. Past ``device.GRID_MAX_GROUP`` rollouts
(up to ``INLINE_MAX_GROUP``) the score kernel computes each row's table statistics itself
(``statistics.table_statistics``). Otherwise the statistics of every table of groups of
up to ``bound`` rollouts come from the device grid (``device.grid_statistics``, cached here per
(alpha, beta, bound, device) so that a call costs no torch op for it). ``bound`` is 16 for a new
shape; a batch with a bigger group flags it (and its size), is redone by the synchronising path, and
its shape assumes that size from then on.

A group whose first table overflows is rebuilt on the device, without the host: a rebuild plan
(one program) gives every marked group a slice of ``2**ceil(log2(2 * tokens))`` slots after the
slices in use, a second clear and a second insert pass (only the marked groups' rollouts) fill
them; with no overflow these three launches find nothing to do. The score kernel puts the most
distinct ids a group held in the flags, and the host remembers it for the next call of this
``(B, n_groups)`` (``device.remember_keys``): its first slices are then sized for that many ids
(at most 3/4 full) where that is less than the share of the masked tokens. When that was so far
off that the rebuilds pass the budget (``RETRY_REBUILD``), the call is redone by the synchronising
path and the count is forgotten (the next call sizes by tokens again).

What this path does not take sets a flag instead, and the call is redone by the synchronising path
(``tables.build_hash_tables`` ...) whose result is returned: a group of more than ``bound``
rollouts (or than ``INLINE_MAX_GROUP``), tables past ``TABLE_BUDGET_BYTES``, a group of more than ``tables.MAX_GROUP_TOKENS``
masked tokens. The shape ``(B, L, n_groups, device)`` is then remembered (``_BOUNDS``,
``_SYNC_SHAPES``). While a CUDA graph is being captured nothing is read back: a replay whose batch
breaks one of those conditions, or holds an out-of-range id, leaves ``out`` as it was (``Run.flags``
tell it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...config import KTAEConfig
from ...method import TF_EPS
from ...types import Batch
from ...validation import MAX_TOKEN_ID, check_id_range
from .. import device as device_helpers
from ..device import upload
from .scores import _direction, _squash
from .statistics import grid_statistics_kernel, table_statistics
from . import tables
from .tables import _claim, _home_slot, _popcount, interpreting, tile_shape

# float64 constant vector (``constants``)
_ALPHA, _BETA, _TOP, _BOUND, _K1, _B, _TF_EPS, _WEIGHT, _THRESH, _EPS, _IGNORE = (tl.constexpr(i) for i in range(11))
# rows of the int64 per-group buffer ``grp`` (each ``n_groups`` long; RSUM, MEAN, VAR hold float64 bits)
(_N_C, _N_W, _T_C, _T_W, _FILL, _OFFSET, _LOG_CAP, _WORDS, _BITS_OFF, _GRID_OFF, _STRIDE, _RSUM, _MEAN,
 _VAR, _OVER) = (tl.constexpr(i) for i in range(15))
_ROWS_PER_GROUP = tl.constexpr(15)
# the flags after the rows: out-of-range ids (least negative, largest past MAX_TOKEN_ID; 0: none), why
# the path cannot complete (a bit set), slots and presence words the tables use, where the slices
# still to clear start (0, then the rebuilt groups' slices), the largest group, and the most
# distinct ids a group held (which sizes the next call's first tables)
(_BAD_LOW, _BAD_HIGH, _RETRY, _SLOTS, _WORDS_USED, _SLOTS_FROM, _WORDS_FROM, _LARGEST,
 _DISTINCT) = (tl.constexpr(i) for i in range(9))
_N_FLAGS = 9
#: the largest group whose rows' statistics the score kernel computes itself (past the device grid's
#: ``GRID_MAX_GROUP``); its log-factorial and angle tables take 8 (bound + 1)(bound + 4) / 2 bytes
INLINE_MAX_GROUP = 4096
#: retry reasons (bits of the flag); RETRY_REBUILD: the rebuilt groups' slices pass the budget
RETRY_BIG_GROUP, RETRY_BUDGET, RETRY_OVERFLOW, RETRY_TOKENS, RETRY_REBUILD = 1, 2, 4, 8, 16
_BIG_GROUP, _BUDGET, _OVERFLOW, _TOKENS, _REBUILD = (tl.constexpr(bit) for bit in (
    RETRY_BIG_GROUP, RETRY_BUDGET, RETRY_OVERFLOW, RETRY_TOKENS, RETRY_REBUILD))  # the same bits, in the kernels
_EMPTY = tl.constexpr(tables.EMPTY)
_MAX_ID = tl.constexpr(MAX_TOKEN_ID)
#: the most bytes the tables (keys, claim order, counters, presence words) may take; a batch whose
#: first tables need more takes the synchronising path. The paper batch's take ~335 MB.
TABLE_BUDGET_BYTES = 512 * 2**20
_BLOCK = 1024
_SCORE_BLOCK = 128
#: programs per group of the score kernel (each loops over its share of the group's slots)
_SCORE_SPLIT = 8
#: programs of the clear kernel at most (each loops over its share)
_CLEAR_PROGRAMS = 2048
GIVEN, NONE, MEAN, GRPO = 0, 1, 2, 3
_BASELINES = {"none": NONE, "mean": MEAN, "grpo": GRPO}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _f64(ptr):
    return ptr.to(tl.pointer_type(tl.float64), bitcast=True)


@triton.jit
def _ranks_kernel(group_ptr, rewards_ptr, correct_ptr, const_ptr, B, n, grp_ptr, tab_ptr, roll_at,
                  HAS_CORRECT: tl.constexpr, BLOCK: tl.constexpr):
    """Per rollout (a lane each): correct flag, rank among its group's correct / wrong rollouts."""
    roll_ptr = tab_ptr + roll_at
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = i < B
    g = tl.load(group_ptr + i, mask=real, other=0)
    r = tl.load(rewards_ptr + i, mask=real, other=0.0)
    if HAS_CORRECT:
        c = tl.load(correct_ptr + i, mask=real, other=0) != 0
    else:
        c = r > tl.load(const_ptr + _THRESH)
    wrong = 1 - c.to(tl.int64)
    rank = tl.atomic_add(grp_ptr + wrong * n + g, 1, mask=real, sem="relaxed")
    tl.atomic_add(_f64(grp_ptr) + _RSUM * n + g, r, mask=real, sem="relaxed")
    tl.store(roll_ptr + i, rank.to(tl.int32), mask=real)
    tl.store(roll_ptr + B + i, c.to(tl.int32), mask=real)


@triton.jit
def _lengths_kernel(mask_ptr, B, L, group_ptr, n, grp_ptr, tab_ptr, roll_at, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Per rollout: masked tokens (added to its group's ``T_c`` / ``T_w``) and one past its last masked position."""
    roll_ptr = tab_ptr + roll_at
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    real = r < B
    row = r.to(tl.int64)[:, None]
    count = tl.zeros([ROWS, COLS], tl.int32)
    last = tl.zeros([ROWS, COLS], tl.int32)
    for c0 in range(0, L, COLS):
        col = c0 + tl.arange(0, COLS)[None, :]
        m = tl.load(mask_ptr + row * L + col, mask=real[:, None] & (col < L), other=0) != 0
        count += m.to(tl.int32)
        last = tl.maximum(last, tl.where(m, col + 1, 0))
    length = tl.sum(count, 1)
    g = tl.load(group_ptr + r, mask=real, other=0)
    wrong = 1 - tl.load(roll_ptr + B + r, mask=real, other=0).to(tl.int64)
    tl.atomic_add(grp_ptr + (_T_C + wrong) * n + g, length.to(tl.int64), mask=real, sem="relaxed")
    tl.store(roll_ptr + 2 * B + r, tl.max(last, 1), mask=real)


@triton.jit
def _plan_kernel(grp_ptr, n, slot_limit, word_limit, group_limit, token_limit, guess, distinct_log_cap,
                 MIN_LOG_CAP: tl.constexpr, MAX_LOG_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """One program: every group's table slice (by its masked tokens, at most ``2**distinct_log_cap``
    slots), presence words, grid offset and mean; the flags."""
    slot_carry = tl.zeros([1], tl.int64)
    word_carry = tl.zeros([1], tl.int64)
    retry = tl.zeros([1], tl.int64)
    largest = tl.zeros([1], tl.int64)
    for c0 in range(0, n, BLOCK):
        gi = c0 + tl.arange(0, BLOCK)
        v = gi < n
        n_c = tl.load(grp_ptr + _N_C * n + gi, mask=v, other=0)
        n_w = tl.load(grp_ptr + _N_W * n + gi, mask=v, other=0)
        tokens = tl.load(grp_ptr + _T_C * n + gi, mask=v, other=0) + tl.load(grp_ptr + _T_W * n + gi, mask=v, other=0)
        size = n_c + n_w
        need = tl.ceil(tokens.to(tl.float64) * guess).to(tl.int64)
        log_cap = tl.zeros([BLOCK], tl.int64) + MIN_LOG_CAP
        for e in tl.static_range(MIN_LOG_CAP, MAX_LOG_CAP):
            log_cap += (need > (1 << e)).to(tl.int64)
        log_cap = tl.minimum(log_cap, distinct_log_cap)
        slots = tl.where(v, 1 << log_cap, 0)
        words = (size + 31) // 32
        wslots = slots * words
        offset = slot_carry + tl.cumsum(slots, 0) - slots
        bits_off = word_carry + tl.cumsum(wslots, 0) - wslots
        before = (size + 3) * (size + 2) * (size + 1) * size // 24
        inside = (size + 2) * n_c * (n_c + 1) // 2 - n_c * (n_c + 1) * (2 * n_c + 1) // 6
        rsum = tl.load(_f64(grp_ptr) + _RSUM * n + gi, mask=v, other=0.0)
        mean = tl.where(size > 1, rsum / size.to(tl.float64), 0.0)
        tl.store(grp_ptr + _OFFSET * n + gi, offset, mask=v)
        tl.store(grp_ptr + _LOG_CAP * n + gi, log_cap, mask=v)
        tl.store(grp_ptr + _WORDS * n + gi, words, mask=v)
        tl.store(grp_ptr + _BITS_OFF * n + gi, bits_off, mask=v)
        tl.store(grp_ptr + _GRID_OFF * n + gi, before + inside, mask=v)
        tl.store(grp_ptr + _STRIDE * n + gi, n_w + 1, mask=v)
        tl.store(_f64(grp_ptr) + _MEAN * n + gi, mean, mask=v)
        slot_carry += tl.sum(slots, 0)
        word_carry += tl.sum(wslots, 0)
        retry |= tl.max(tl.where(v & (size > group_limit), _BIG_GROUP, 0), 0)
        largest = tl.maximum(largest, tl.max(tl.where(v, size, 0), 0))
        retry |= tl.max(tl.where(v & (tokens > token_limit), _TOKENS, 0), 0)
    retry |= tl.where((slot_carry > slot_limit) | (word_carry > word_limit), _BUDGET, 0)
    flags = grp_ptr + _ROWS_PER_GROUP * n + tl.arange(0, 1)
    tl.store(flags + _RETRY, retry)
    tl.store(flags + _SLOTS, slot_carry)
    tl.store(flags + _WORDS_USED, word_carry)
    tl.store(flags + _LARGEST, largest)


@triton.jit
def _rebuild_plan_kernel(grp_ptr, n, slot_limit, word_limit, BLOCK: tl.constexpr):
    """One program: a fresh slice of ``2**ceil(log2(2 * tokens))`` slots (at least 16) for every group
    the insert marked, after the slices in use; the flags then say which slots to clear."""
    flags = grp_ptr + _ROWS_PER_GROUP * n + tl.arange(0, 1)
    used = tl.load(flags + _SLOTS)
    words_used = tl.load(flags + _WORDS_USED)
    slot_carry = used
    word_carry = words_used
    for c0 in range(0, n, BLOCK):
        gi = c0 + tl.arange(0, BLOCK)
        over = (gi < n) & (tl.load(grp_ptr + _OVER * n + gi, mask=gi < n, other=0) != 0)
        tokens = tl.load(grp_ptr + _T_C * n + gi, mask=over, other=0) + tl.load(grp_ptr + _T_W * n + gi, mask=over,
                                                                              other=0)
        log_cap = tl.zeros([BLOCK], tl.int64) + 4
        for e in tl.static_range(4, 40):
            log_cap += (2 * tokens > (1 << e)).to(tl.int64)
        slots = tl.where(over, 1 << log_cap, 0)
        wslots = slots * tl.load(grp_ptr + _WORDS * n + gi, mask=over, other=0)
        tl.store(grp_ptr + _OFFSET * n + gi, slot_carry + tl.cumsum(slots, 0) - slots, mask=over)
        tl.store(grp_ptr + _BITS_OFF * n + gi, word_carry + tl.cumsum(wslots, 0) - wslots, mask=over)
        tl.store(grp_ptr + _LOG_CAP * n + gi, log_cap, mask=over)
        tl.store(grp_ptr + _FILL * n + gi, tl.zeros([BLOCK], tl.int64), mask=over)
        slot_carry += tl.sum(slots, 0)
        word_carry += tl.sum(wslots, 0)
    retry = tl.where((slot_carry > slot_limit) | (word_carry > word_limit), _REBUILD, 0).to(tl.int64)
    tl.atomic_or(flags + _RETRY, retry, sem="relaxed")
    tl.store(flags + _SLOTS_FROM, used)
    tl.store(flags + _WORDS_FROM, words_used)
    tl.store(flags + _SLOTS, slot_carry)
    tl.store(flags + _WORDS_USED, word_carry)


@triton.jit
def _clear_kernel(grp_ptr, n, tab_ptr, occ_ptr, bits_at, group_ptr, rewards_ptr, B,
                  GRPO: tl.constexpr, BLOCK: tl.constexpr):
    """Clear the slots and presence words the plan uses (nothing if it failed); sum the GRPO variance."""
    flags = grp_ptr + _ROWS_PER_GROUP * n
    ok = tl.load(flags + _RETRY) == 0
    used = tl.where(ok, tl.load(flags + _SLOTS), 0)
    words = tl.where(ok, tl.load(flags + _WORDS_USED), 0)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    lane = tl.arange(0, BLOCK)
    for s0 in range(tl.load(flags + _SLOTS_FROM) + start, used, step):
        s = s0 + lane
        tl.store(tab_ptr + s, tl.full([BLOCK], _EMPTY, tl.int32), mask=s < used)
        tl.store(occ_ptr + s, tl.zeros([BLOCK], tl.int64), mask=s < used)
    for w0 in range(tl.load(flags + _WORDS_FROM) + start, words, step):
        w = w0 + lane
        tl.store(tab_ptr + bits_at + w, tl.zeros([BLOCK], tl.int32), mask=w < words)
    if GRPO:
        for i0 in range(start, B, step):
            i = i0 + lane
            real = i < B
            g = tl.load(group_ptr + i, mask=real, other=0)
            centred = tl.load(rewards_ptr + i, mask=real, other=0.0) - tl.load(_f64(grp_ptr) + _MEAN * n + g,
                                                                              mask=real, other=0.0)
            tl.atomic_add(_f64(grp_ptr) + _VAR * n + g, centred * centred, mask=real, sem="relaxed")


@triton.jit
def _insert_kernel(resp_ptr, mask_ptr, B, L, group_ptr, n, grp_ptr, tab_ptr, occ_ptr, roll_at,
                   order_at, bits_at, index_at, probe_limit,
                   ROWS: tl.constexpr, COLS: tl.constexpr, PREDICATED: tl.constexpr, REBUILD: tl.constexpr):
    """A ``[ROWS, COLS]`` tile (grid ``(cdiv(B, ROWS), cdiv(L, COLS))``) into its groups' tables, up to
    each rollout's ``last``; writes each position's global slot (-1 where masked out).

    A group whose table gets over 3/4 full, or whose lanes use up ``probe_limit`` probes, is marked
    (``_OVER``) and stops. With ``REBUILD`` only the rollouts of marked groups are inserted (into the
    slices ``_rebuild_plan_kernel`` gave them, at most half full: an overflow there is a retry)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    lane = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    roll_ptr = tab_ptr + roll_at
    flags = grp_ptr + _ROWS_PER_GROUP * n
    real = (r < B) & (tl.load(flags + _RETRY + tl.zeros_like(r)) == 0)
    g = tl.load(group_ptr + r, mask=real, other=0)
    if REBUILD:
        real = real & (tl.load(grp_ptr + _OVER * n + g, mask=real, other=0) != 0)
    last = tl.load(roll_ptr + 2 * B + r, mask=real, other=0)
    inside = real & (col < last)
    pos = r.to(tl.int64) * L + col
    present = tl.load(mask_ptr + pos, mask=inside, other=0) != 0
    tok64 = tl.load(resp_ptr + pos, mask=present, other=0)
    low = present & (tok64 < 0)
    high = present & (tok64 > _MAX_ID)
    if tl.max((low | high).to(tl.int32)) > 0:
        tl.atomic_min(flags + _BAD_LOW + tl.zeros_like(lane), tok64, mask=low, sem="relaxed")
        tl.atomic_max(flags + _BAD_HIGH + tl.zeros_like(lane), tok64, mask=high, sem="relaxed")
        present = present & ~low & ~high
    tok = tok64.to(tl.int32)
    g_tile = g + tl.zeros_like(lane).to(g.dtype)
    base = tl.load(grp_ptr + _OFFSET * n + g, mask=real, other=0)
    log_cap = tl.load(grp_ptr + _LOG_CAP * n + g, mask=real, other=4).to(tl.int32)
    words = tl.load(grp_ptr + _WORDS * n + g, mask=real, other=0)
    bits_off = tl.load(grp_ptr + _BITS_OFF * n + g, mask=real, other=0)
    n_c = tl.load(grp_ptr + _N_C * n + g, mask=real, other=0).to(tl.int32)
    correct = tl.load(roll_ptr + B + r, mask=real, other=0) != 0
    rank_in = tl.load(roll_ptr + r, mask=real, other=0)
    rank = tl.where(correct, rank_in, n_c + rank_in)  # correct rollouts first: a = popcount of the low n_c bits
    cap_mask = (1 << log_cap) - 1
    full = (3 << log_cap) >> 2
    spare = lane & cap_mask
    slot = _home_slot(tok, log_cap)
    todo = present
    probes = 0
    while (tl.max(todo.to(tl.int32)) > 0) & (probes < probe_limit):
        cur = tl.load(tab_ptr + base + slot, mask=todo, other=_EMPTY)
        done = todo & (cur == tok)
        need = todo & (cur == _EMPTY)
        if tl.max(need.to(tl.int32)) > 0:
            old = _claim(tab_ptr, base, slot, spare, tok, need, PREDICATED)
            new = need & (old == _EMPTY)
            place = tl.atomic_add(grp_ptr + _FILL * n + g_tile, 1, mask=new, sem="relaxed")
            tl.store(tab_ptr + order_at + base + place, slot, mask=new)
            if REBUILD:
                tl.atomic_or(flags + _RETRY + tl.zeros_like(lane), _OVERFLOW, mask=new & (place >= full), sem="relaxed")
            else:
                tl.store(grp_ptr + _OVER * n + g_tile, 1, mask=new & (place >= full))
            done = done | new | (need & (old == tok))
        if REBUILD:
            ok = tl.load(flags + _RETRY + tl.zeros_like(lane), volatile=True) == 0
        else:
            ok = tl.load(grp_ptr + _OVER * n + g_tile, mask=real, other=0, volatile=True) == 0
        todo = todo & ~done & ok
        slot = tl.where(todo, (slot + 1) & cap_mask, slot)
        probes += 1
    if REBUILD:
        tl.atomic_or(flags + _RETRY + tl.zeros_like(lane), _OVERFLOW, mask=todo, sem="relaxed")
    else:
        tl.store(grp_ptr + _OVER * n + g, 1, mask=real & (tl.max(todo.to(tl.int32), 1)[:, None] > 0))
    found = present & ~todo
    gslot = base + slot
    inc = tl.where(correct, 1 << 32, 1) + tl.zeros_like(lane).to(tl.int64)
    tl.atomic_add(occ_ptr + gslot, inc, mask=found, sem="relaxed")
    bit = 1 << (rank & 31)
    word_ptr = tab_ptr + bits_at + bits_off + slot * words + (rank >> 5)
    have = tl.load(word_ptr, mask=found, other=0)
    tl.atomic_or(word_ptr, bit, mask=found & ((have & bit) == 0), sem="relaxed")
    tl.store(tab_ptr + index_at + pos, tl.where(found, gslot, -1).to(tl.int32), mask=inside)


@triton.jit
def _score_kernel(grp_ptr, n, tab_ptr, occ_ptr, order_at, bits_at, values_ptr, grid_size, const_ptr, n_ignore,
                  lf_ptr, angle_ptr, stat_const_ptr, USE_TF: tl.constexpr, INLINE: tl.constexpr, BLOCK: tl.constexpr):
    """Group ``program_id(0)``'s occupied slots, a share each of ``num_programs(1)``: the score of each
    replaces its counters (float64 bits in ``occ``); the first of each group's programs adds its
    distinct ids to the flags' largest."""
    g = tl.program_id(0)
    ok = tl.load(grp_ptr + _ROWS_PER_GROUP * n + _RETRY) == 0
    fill = tl.where(ok, tl.load(grp_ptr + _FILL * n + g), 0).to(tl.int32)
    if tl.program_id(1) == 0:
        tl.atomic_max(grp_ptr + _ROWS_PER_GROUP * n + _DISTINCT, fill.to(tl.int64), sem="relaxed")
    base = tl.load(grp_ptr + _OFFSET * n + g)
    words = tl.load(grp_ptr + _WORDS * n + g)
    bits_off = tl.load(grp_ptr + _BITS_OFF * n + g)
    n_c = tl.load(grp_ptr + _N_C * n + g)
    n_w = tl.load(grp_ptr + _N_W * n + g)
    grid_off = tl.load(grp_ptr + _GRID_OFF * n + g)
    stride = tl.load(grp_ptr + _STRIDE * n + g)
    T_c = tl.load(grp_ptr + _T_C * n + g)
    T_w = tl.load(grp_ptr + _T_W * n + g)
    k1 = tl.load(const_ptr + _K1)
    bm = tl.load(const_ptr + _B)
    eps = tl.load(const_ptr + _TF_EPS)
    scale = tl.load(const_ptr + _ALPHA) + tl.load(const_ptr + _BETA)
    top = tl.load(const_ptr + _TOP)
    bound = tl.load(const_ptr + _BOUND)
    avg = (T_c + T_w).to(tl.float64) / 2.0
    for r0 in range(tl.program_id(1) * BLOCK, fill, tl.num_programs(1) * BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        valid = rows < fill
        local = tl.load(tab_ptr + order_at + base + rows, mask=valid, other=0).to(tl.int64)
        slot = base + local
        token = tl.load(tab_ptr + slot, mask=valid, other=0)
        occ = tl.load(occ_ptr + slot, mask=valid, other=0)
        f_c = occ >> 32
        f_w = occ - (f_c << 32)
        a = tl.zeros([BLOCK], tl.int32)
        present = tl.zeros([BLOCK], tl.int32)
        for w in range(words):
            word = tl.load(tab_ptr + bits_at + bits_off + local * words + w, mask=valid, other=0)
            low = n_c - 32 * w  # correct rollouts are ranks 0 .. n_c - 1
            correct = tl.where(low >= 32, -1, tl.where(low <= 0, 0, (1 << tl.minimum(tl.maximum(low, 1), 31)) - 1))
            a += _popcount(word & correct.to(tl.int32))
            present += _popcount(word)
        b = present - a
        if INLINE:  # groups past the device grid: each row's table computed here (statistics.py's maths)
            zero = tl.zeros([BLOCK], tl.int32)
            _, _, _, x, strength = table_statistics(a, b, zero + n_c.to(tl.int32), zero + n_w.to(tl.int32), valid,
                                                    lf_ptr, angle_ptr, stat_const_ptr)
        else:
            entry = grid_off + a.to(tl.int64) * stride + b
            x = tl.load(values_ptr + 3 * grid_size + entry, mask=valid, other=0.0)
            strength = tl.load(values_ptr + 4 * grid_size + entry, mask=valid, other=0.0)
        if USE_TF:
            x = _direction(x, f_c, f_w, T_c, T_w, avg, k1, bm, eps)
        scorable = (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)
        for k in range(n_ignore):
            scorable = scorable & (token != tl.load(const_ptr + _IGNORE + k).to(tl.int32))
        score = _squash(strength, x, scorable, scale, top, bound)
        tl.store(occ_ptr + slot, score.to(tl.int64, bitcast=True), mask=valid)


@triton.jit
def _advantage_kernel(B, L, group_ptr, rewards_ptr, given_ptr, n, grp_ptr, tab_ptr, occ_ptr, roll_at,
                      index_at, const_ptr, out_ptr, BASELINE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``out`` of a ``[ROWS, COLS]`` tile from the slot index, or nothing when a flag is set."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    roll_ptr = tab_ptr + roll_at
    flags = grp_ptr + _ROWS_PER_GROUP * n
    zero = tl.zeros_like(r)
    ok = (tl.load(flags + _BAD_LOW + zero) == 0) & (tl.load(flags + _BAD_HIGH + zero) == 0) & \
        (tl.load(flags + _RETRY + zero) == 0)
    real = (r < B) & ok
    inside = real & (col < L)
    last = tl.load(roll_ptr + 2 * B + r, mask=real, other=0)
    pos = r.to(tl.int64) * L + col
    slot = tl.load(tab_ptr + index_at + pos, mask=inside & (col < last), other=-1)
    present = slot >= 0
    score = tl.load(occ_ptr + slot, mask=present, other=0).to(tl.float64, bitcast=True)
    if BASELINE == 0:
        A = tl.load(given_ptr + r, mask=real, other=0.0)
    else:
        A = tl.load(rewards_ptr + r, mask=real, other=0.0)
        if BASELINE >= 2:
            g = tl.load(group_ptr + r, mask=real, other=0)
            A = A - tl.load(_f64(grp_ptr) + _MEAN * n + g, mask=real, other=0.0)
            if BASELINE == 3:
                size = tl.load(grp_ptr + _N_C * n + g, mask=real, other=0) + tl.load(grp_ptr + _N_W * n + g,
                                                                                     mask=real, other=0)
                var = tl.load(_f64(grp_ptr) + _VAR * n + g, mask=real, other=0.0) / \
                    tl.maximum(size.to(tl.float64) - 1.0, 1.0)
                std = tl.where(size > 1, tl.sqrt(var), 1.0)
                A = A / (std + tl.load(const_ptr + _EPS))
    value = A + tl.load(const_ptr + _WEIGHT) * score
    tl.store(out_ptr + pos, tl.where(present, value, 0.0).to(tl.float32), mask=inside)


# ----------------------------------------------------------------------------- host side

#: float64 constant vectors, per (config, device)
_CONSTANTS: dict = {}
#: the device grid's statistics per (alpha, beta, bound, device): values, and the event a first
#: use on another stream must wait for (dropped once it has completed)
_VALUES: dict = {}
#: shapes ``(B, L, n_groups, device)`` that needed the synchronising path: later calls go there at once
_SYNC_SHAPES: set = set()
#: the grid bound each shape assumes, once a group past 16 rollouts was seen at that shape (16, 32, 64)
_BOUNDS: dict = {}


def constants(config: KTAEConfig, device: torch.device) -> Tensor:
    """float64 ``[10 + k]``: ``alpha, beta, top``, the largest float below ``top``, ``k1, b``, the TF
    epsilon, ``weight``, ``correct_threshold``, ``eps``, then the k ignored ids that can occur;
    uploaded once per (config, device)."""
    key = (config, device)
    hit = _CONSTANTS.get(key)
    if hit is None:
        ignore = [float(t) for t in config.ignore_token_ids if t <= MAX_TOKEN_ID]
        values = [config.alpha, config.beta, config.top, math.nextafter(config.top, 0.0), config.k1, config.b,
                  TF_EPS, config.weight, config.correct_threshold, config.eps, *ignore]
        hit = _CONSTANTS[key] = upload(torch.tensor(values, dtype=torch.float64), device)
        while len(_CONSTANTS) > 64:
            _CONSTANTS.pop(next(iter(_CONSTANTS)))
    return hit


def _grid_values(config: KTAEConfig, bound: int, device: torch.device) -> Tensor:
    key = (config.alpha, config.beta, bound, device)
    hit = _VALUES.get(key)
    if hit is None:
        dummy = torch.zeros(1, dtype=torch.int64, device=device)
        _, values = device_helpers.grid_statistics(dummy, dummy, bound, config, device, grid_statistics_kernel)
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        hit = _VALUES[key] = [values, ready]
        while len(_VALUES) > 16:
            _VALUES.pop(next(iter(_VALUES)))
    if hit[1] is not None:  # until the grid is computed, a call on another stream waits for it
        if hit[1].query():
            hit[1] = None
        else:
            torch.cuda.current_stream(device).wait_event(hit[1])
    return hit[0]


@dataclass(frozen=True)
class Sizes:
    """Static sizes of one call (host ints from ``B``, ``L``, ``n_groups``): the grid bound, slots and
    presence words the tables may use, where each int32 array starts in the one int32 buffer, and
    ``max_log_cap``, log2 of the most slots of a group's first table (``first_table_log_cap``)."""

    bound: int
    slots: int
    words: int
    order_at: int
    bits_at: int
    roll_at: int
    index_at: int
    int32_total: int
    max_log_cap: int = tables._MAX_FIRST_LOG_CAP


def first_table_log_cap(keys: int | None) -> int:
    """log2 of the most slots of a group's first table: the smallest power of two (at least
    ``2**tables._MIN_LOG_CAP``) whose 3/4 hold ``keys`` distinct ids (``device.expected_keys``), at
    most ``2**tables._MAX_FIRST_LOG_CAP``; that cap when ``keys`` is None (sized by masked tokens)."""
    log_cap = tables._MIN_LOG_CAP if keys is not None else tables._MAX_FIRST_LOG_CAP
    while log_cap < tables._MAX_FIRST_LOG_CAP and (3 << log_cap) >> 2 < keys:
        log_cap += 1
    return log_cap


def sizes(B: int, L: int, n: int, bound: int = 16, keys: int | None = None) -> Sizes | None:
    """The allocations of a batch of ``B`` rollouts of ``L`` positions in ``n`` groups whose groups
    are assumed to hold at most ``bound`` rollouts (the statistics grid's bound; a bigger group sets
    a retry flag), first tables sized for ``keys`` distinct ids a group (None: by masked tokens);
    None when this path cannot take it (a bound past ``device.GRID_MAX_GROUP``)."""
    largest = B - n + 1  # every group holds a rollout
    bound = _power_of_two(min(largest, bound))
    if bound > INLINE_MAX_GROUP:
        return None
    group = min(largest, bound)
    # a group's first slice: 2**log_cap <= max(2**MIN, ceil(2 * guess * tokens) * 2 - 1), at most 2**MAX
    per_group = 1 << tables._MAX_FIRST_LOG_CAP
    guess = 2 * tables._FIRST_GUESS
    # (2 more per group: the kernel's guess is float32, its ceil may be one more)
    most = max(1 << tables._MIN_LOG_CAP, 2 * math.ceil(guess * group * L) + 2)
    slots = min(n * min(per_group, most), math.ceil(2 * guess * B * L) + n * ((1 << tables._MIN_LOG_CAP) + 4))
    # and room to rebuild groups whose first table overflows: a slice < max(16, 4 * tokens) each
    slots += min(n * max(16, 4 * group * L), 4 * B * L + 16 * n)
    words_per_slot = -(-group // 32)
    budget = TABLE_BUDGET_BYTES // (16 + 4 * words_per_slot)
    slots = min(slots, budget)
    words = slots * words_per_slot
    order_at = slots
    bits_at = 2 * slots
    roll_at = bits_at + words
    index_at = roll_at + 3 * B
    return Sizes(bound, slots, words, order_at, bits_at, roll_at, index_at, index_at + B * L,
                 first_table_log_cap(keys))


def _power_of_two(largest: int) -> int:
    """The bound of groups of ``largest`` rollouts: a power of two >= 16 (``device.grid_bound``'s rule)."""
    bound = 16
    while bound < largest:
        bound *= 2
    return bound


def inline(bound: int) -> bool:
    """True when groups of ``bound`` rollouts are past the device grid: the score kernel computes the
    statistics of each row's table."""
    return device_helpers.grid_bound(bound) is None


def _inline_tables(config: KTAEConfig, bound: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-factorials and angles up to ``bound`` and the statistics constants, cached per device."""
    key = ("inline", config.alpha, config.beta, bound, device)
    hit = _VALUES.get(key)
    if hit is None:
        grid = device_helpers.tables_of(torch.zeros(4, 0, dtype=torch.int32, device=device), bound)
        consts = upload(torch.tensor(device_helpers.statistics_constants(config.alpha, config.beta),
                                     dtype=torch.float64), device)
        hit = _VALUES[key] = (grid.log_factorial, grid.angle, consts)
        while len(_VALUES) > 16:
            _VALUES.pop(next(iter(_VALUES)))
    return hit


@dataclass(frozen=True)
class Run:
    """One call's device buffers: ``grp`` int64 (per-group rows, then the ``_N_FLAGS`` flags), ``tab``
    int32 (keys, claim order, presence words, per-rollout rank / correct / last, slot index per position),
    ``occ`` int64 per slot (counters, then the score's float64 bits), ``out``."""

    grp: Tensor
    tab: Tensor
    occ: Tensor
    out: Tensor
    n: int

    @property
    def flags(self) -> Tensor:
        return self.grp[_ROWS_PER_GROUP.value * self.n:]


def run(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None, plan: Sizes) -> Run:
    """Enqueue the seven kernels (no host sync); ``out`` written unless a flag is set."""
    device = batch.device
    B, L = batch.responses.shape
    n = batch.n_groups
    consts = constants(config, device)
    if inline(plan.bound):
        lf, angle, stat_consts = _inline_tables(config, plan.bound, device)
        values = lf
    else:
        values = _grid_values(config, plan.bound, device)
        lf = angle = stat_consts = values
    grp = torch.zeros(_ROWS_PER_GROUP.value * n + _N_FLAGS, dtype=torch.int64, device=device)
    tab = torch.empty(plan.int32_total, dtype=torch.int32, device=device)
    occ = torch.empty(plan.slots, dtype=torch.int64, device=device)
    if out is None:
        out = torch.empty(B, L, dtype=torch.float32, device=device)
    responses = batch.responses if batch.responses.is_contiguous() else batch.responses.contiguous()
    mask = batch.mask if batch.mask.is_contiguous() else batch.mask.contiguous()
    mask = mask.view(torch.uint8)
    correct = batch.rewards if batch.correct is None else batch.correct.view(torch.uint8)
    _ranks_kernel[(triton.cdiv(B, _BLOCK),)](
        batch.group, batch.rewards, correct, consts, B, n, grp, tab, plan.roll_at,
        HAS_CORRECT=batch.correct is not None, BLOCK=_BLOCK)
    rows, cols = tile_shape(L)
    _lengths_kernel[(triton.cdiv(B, rows),)](mask, B, L, batch.group, n, grp, tab, plan.roll_at, ROWS=rows, COLS=cols)
    _plan_kernel[(1,)](grp, n, plan.slots, plan.words, plan.bound, tables.MAX_GROUP_TOKENS,
                       2 * tables._FIRST_GUESS, plan.max_log_cap, MIN_LOG_CAP=tables._MIN_LOG_CAP,
                       MAX_LOG_CAP=tables._MAX_FIRST_LOG_CAP, BLOCK=_BLOCK)
    clear = min(triton.cdiv(max(plan.slots, B), _BLOCK), _CLEAR_PROGRAMS)
    baseline = GIVEN if given is not None else _BASELINES[config.baseline]
    _clear_kernel[(clear,)](grp, n, tab, occ, plan.bits_at, batch.group, batch.rewards, B,
                            GRPO=baseline == GRPO, BLOCK=_BLOCK)
    tiles = (triton.cdiv(B, rows), triton.cdiv(L, cols))
    insert = (responses, mask, B, L, batch.group, n, grp, tab, occ, plan.roll_at, plan.order_at, plan.bits_at,
              plan.index_at)
    _insert_kernel[tiles](*insert, tables._FIRST_PROBE_LIMIT, ROWS=rows, COLS=cols,
                          PREDICATED=not interpreting(), REBUILD=False)
    # the groups whose first table overflowed, rebuilt on the device (nothing to do when none did)
    _rebuild_plan_kernel[(1,)](grp, n, plan.slots, plan.words, BLOCK=_BLOCK)
    _clear_kernel[(clear,)](grp, n, tab, occ, plan.bits_at, batch.group, batch.rewards, B, GRPO=False, BLOCK=_BLOCK)
    _insert_kernel[tiles](*insert, tables._UNLIMITED, ROWS=rows, COLS=cols,
                          PREDICATED=not interpreting(), REBUILD=True)
    _score_kernel[(n, _SCORE_SPLIT)](
        grp, n, tab, occ, plan.order_at, plan.bits_at, values, values.shape[-1], consts, consts.shape[0] - 10,
        lf, angle, stat_consts, USE_TF=config.use_tf, INLINE=inline(plan.bound), BLOCK=_SCORE_BLOCK,
        enable_fp_fusion=False)
    _advantage_kernel[tiles](
        B, L, batch.group, batch.rewards, given if given is not None else batch.rewards, n, grp, tab, occ, plan.roll_at,
        plan.index_at, consts, out, BASELINE=baseline, ROWS=rows, COLS=cols, enable_fp_fusion=False)
    return Run(grp, tab, occ, out, n)


def capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on ``device``'s current stream (nothing may be read back)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None) -> Tensor | None:
    """float32 ``[B, L]`` advantages (``out`` when given) by the seven kernels and one read of the
    flags at the end; None when the synchronising path must compute them (``out`` untouched).
    Raises the API's ValueError for an out-of-range id, ``out`` untouched."""
    B, L = batch.responses.shape
    n = batch.n_groups
    if config.fisher != "exact" or B == 0 or L == 0:
        return None
    key = (B, L, n, batch.device)
    if key in _SYNC_SHAPES:
        return None
    memory = device_helpers.distinct_key("triton", batch.device, B, n)
    keys = device_helpers.expected_keys(memory)
    plan = sizes(B, L, n, _BOUNDS.get(key, 16), keys)
    if plan is None:
        _SYNC_SHAPES.add(key)
        return None
    done = run(batch, config, given, out, plan)
    if capturing(batch.device):
        return done.out
    flags = done.flags.tolist()  # the one device -> host copy, after the last launch
    low, high, retry, largest = flags[0], flags[1], flags[2], flags[_LARGEST.value]
    if retry == RETRY_REBUILD and keys is not None:
        # the remembered count was far too small (too many groups rebuilt): size by tokens again
        device_helpers.forget_keys(memory)
        return None
    if retry:
        # (a group past the bound also overruns the presence words sized for it: RETRY_BUDGET with it)
        if retry & RETRY_BIG_GROUP and _power_of_two(largest) <= INLINE_MAX_GROUP:
            _BOUNDS[key] = _power_of_two(largest)  # the next call of this shape assumes its largest group
        else:
            _SYNC_SHAPES.add(key)
        return None
    device_helpers.remember_keys(memory, flags[_DISTINCT.value])
    if low or high:
        check_id_range(low, high if high else MAX_TOKEN_ID)
    return done.out
