"""The Triton pipeline: every group's hash table built on the device without the host, then the
advantages, or the rows a caller reads back.

``ranks``    per rollout: correct flag, its rank among its group's correct (or wrong) rollouts (one
             atomic per rollout), ``n_c`` / ``n_w`` and the rewards' sum per group
``lengths``  per rollout: masked tokens (-> ``T_c`` / ``T_w``) and ``last``, one past its last masked
             position (every later kernel stops there)
``plan``     one program over the groups: each group's first table slice (a share of its masked
             tokens, at most the slice for the distinct ids a group held in earlier calls of this
             ``(B, n_groups)``), slice and presence-word offsets, statistics-grid offset and stride
             (``device.grid_index``'s closed form), the rewards' mean; the flags
``clear``    clears only the slots and presence words in use (and sums the GRPO variance)
``insert``   one read of the ids: the group tables (``hashing``), the id range check, and the
             group-local slot of each position (-1: masked out), which the advantage kernel reads
``rebuild``  a group whose first slice got over 3/4 full (or whose probes ran too long) gets a slice
             of ``2**ceil(log2(2 * tokens))`` slots after the others and its rollouts are inserted
             again (a plan, a clear and an insert that find nothing to do when no group overflowed)
``score``    per occupied slot: ``a, b`` from the presence words (correct rollouts have the low
             ranks), its table's statistics from the device grid (or computed in place for groups
             past ``device.GRID_MAX_GROUP``; with ``fisher="upstream"``, the host's for its row), the
             per-row direction and squash; the score replaces the slot's counters
``advantage`` ``(A_i + weight * score) * mask`` from each position's slot (NaN everywhere after a failed
             replay of a captured call, nothing after a failed eager call)
``rows``     (``key_token_scores`` and ``fisher="upstream"``) each occupied slot as a row

Everything is sized from ``B``, ``L`` and the number of groups; the flags (``Flags``) are read once,
after the last launch. What a call's tables could not hold sets a retry bit; ``token_advantage`` then
runs once more with every table sized for its group's masked tokens at most half full (``safe``, the
exact sizes read from the flags), which cannot retry. A plan's batch (``Batch.layout``) is sized for its
largest group from the start and learns under its own layout. While a CUDA graph captures nothing is
read: ``capture`` (refused before a call of the plan's layout completed) returns the flags for
``TokenAdvantagePlan.check``, and a replay that found a bad input or needed a retry fills ``out`` with
NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import method
from ...config import KTAEConfig
from ...method import TF_EPS
from ...options import TritonTuning
from ...types import Batch, KeyTokenScores
from ...validation import MAX_TOKEN_ID, check_id_range
from .. import device as device_state
from ..base import CapturedCall, GraphCaptureError
from ..device import MAX_GROUP_TOKENS, baseline_code
from .hashing import EMPTY, claim, home_slot, interpreting, popcount, tile_shape
from .statistics import direction, grid_statistics_kernel, squash, table_statistics

# float64 constant vector (``constants``), then the ignored ids
_ALPHA, _BETA, _TOP, _BOUND, _K1, _B, _TF_EPS, _WEIGHT, _THRESH, _EPS, _IGNORE = (tl.constexpr(i) for i in range(11))
# rows of the int64 per-group buffer ``grp`` (each ``n_groups`` long; RSUM, MEAN, VAR hold float64 bits;
# GRID_OFF: the group's block of the statistics grid, or with ``fisher="upstream"`` its first row)
(_N_C, _N_W, _T_C, _T_W, _FILL, _OFFSET, _LOG_CAP, _WORDS, _BITS_OFF, _GRID_OFF, _STRIDE, _RSUM, _MEAN,
 _VAR, _OVER) = (tl.constexpr(i) for i in range(15))
_ROWS_PER_GROUP = tl.constexpr(15)
# the flags after the rows (``Flags``)
(_BAD_LOW, _BAD_HIGH, _RETRY, _SLOTS, _WORDS_USED, _SLOTS_FROM, _WORDS_FROM, _LARGEST, _DISTINCT, _SAFE_SLOTS,
 _SAFE_WORDS, _MOST_TOKENS) = (tl.constexpr(i) for i in range(12))
_N_FLAGS = 12
#: the largest group whose rows' statistics the score kernel computes itself (past the device grid);
#: its log-factorial and angle tables take 8 (bound + 1)(bound + 4) / 2 bytes
INLINE_MAX_GROUP = 4096
#: retry bits: a group past the call's bound, tables past its allocation, a rebuilt table overflowed,
#: a group past ``MAX_GROUP_TOKENS`` (an input error, not retried)
RETRY_BIG_GROUP, RETRY_BUDGET, RETRY_OVERFLOW, RETRY_TOKENS = 1, 2, 4, 8
_BIG_GROUP, _BUDGET, _OVERFLOW, _TOKENS = (tl.constexpr(bit) for bit in (
    RETRY_BIG_GROUP, RETRY_BUDGET, RETRY_OVERFLOW, RETRY_TOKENS))
_EMPTY = tl.constexpr(EMPTY)
_MAX_ID = tl.constexpr(MAX_TOKEN_ID)
_MIN_LOG_CAP = 4
#: log2 of the slots a rebuilt or safe slice may have at most (2**40: never reached)
_MAX_LOG_CAP = 40
_UNLIMITED = 2**31 - 1
_BLOCK = 1024
_SCORE_BLOCK = 128
#: programs per group of the score and rows kernels (each loops over its share of the group's slots)
_SCORE_SPLIT = 8
#: programs of the clear kernel at most (each loops over its share)
_CLEAR_PROGRAMS = 2048


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
def _log2_ceil(need, LOW: tl.constexpr, HIGH: tl.constexpr):
    """int64 ``max(ceil(log2(need)), LOW)``, at most ``HIGH`` (exact integer comparisons)."""
    log_cap = tl.zeros_like(need) + LOW
    for e in tl.static_range(LOW, HIGH):
        log_cap += (need > (1 << e)).to(tl.int64)
    return log_cap


@triton.jit
def _plan_kernel(grp_ptr, n, slot_limit, word_limit, group_limit, token_limit, guess, distinct_log_cap,
                 SAFE: tl.constexpr, MIN_LOG_CAP: tl.constexpr, MAX_FIRST_LOG_CAP: tl.constexpr,
                 MAX_LOG_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """One program: every group's table slice, presence words, grid offset and mean; the flags.

    A first slice holds ``ceil(guess * tokens)`` slots rounded up to a power of two, at most
    ``2**distinct_log_cap``; with ``SAFE``, ``2 * tokens`` (never more than half full). The flags get
    the slots and words of the safe slices either way: a retry allocates exactly those."""
    slot_carry = tl.zeros([1], tl.int64)
    word_carry = tl.zeros([1], tl.int64)
    safe_slots = tl.zeros([1], tl.int64)
    safe_words = tl.zeros([1], tl.int64)
    retry = tl.zeros([1], tl.int64)
    largest = tl.zeros([1], tl.int64)
    most_tokens = tl.zeros([1], tl.int64)
    for c0 in range(0, n, BLOCK):
        gi = c0 + tl.arange(0, BLOCK)
        v = gi < n
        n_c = tl.load(grp_ptr + _N_C * n + gi, mask=v, other=0)
        n_w = tl.load(grp_ptr + _N_W * n + gi, mask=v, other=0)
        tokens = tl.load(grp_ptr + _T_C * n + gi, mask=v, other=0) + tl.load(grp_ptr + _T_W * n + gi, mask=v, other=0)
        size = n_c + n_w
        words = (size + 31) // 32
        safe = tl.where(v, 1 << _log2_ceil(2 * tokens, MIN_LOG_CAP, MAX_LOG_CAP), 0)
        if SAFE:
            slots = safe
        else:
            need = tl.ceil(tokens.to(tl.float64) * guess).to(tl.int64)
            log_cap = tl.minimum(_log2_ceil(need, MIN_LOG_CAP, MAX_FIRST_LOG_CAP), distinct_log_cap)
            slots = tl.where(v, 1 << log_cap, 0)
        log_cap = _log2_ceil(slots, MIN_LOG_CAP, MAX_LOG_CAP)
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
        safe_slots += tl.sum(safe, 0)
        safe_words += tl.sum(safe * words, 0)
        retry |= tl.max(tl.where(v & (size > group_limit), _BIG_GROUP, 0), 0)
        largest = tl.maximum(largest, tl.max(tl.where(v, size, 0), 0))
        most_tokens = tl.maximum(most_tokens, tl.max(tl.where(v, tokens, 0), 0))
    retry |= tl.where(most_tokens > token_limit, _TOKENS, 0)
    retry |= tl.where((slot_carry > slot_limit) | (word_carry > word_limit), _BUDGET, 0)
    flags = grp_ptr + _ROWS_PER_GROUP * n + tl.arange(0, 1)
    tl.store(flags + _RETRY, retry)
    tl.store(flags + _SLOTS, slot_carry)
    tl.store(flags + _WORDS_USED, word_carry)
    tl.store(flags + _LARGEST, largest)
    tl.store(flags + _SAFE_SLOTS, safe_slots)
    tl.store(flags + _SAFE_WORDS, safe_words)
    tl.store(flags + _MOST_TOKENS, most_tokens)


@triton.jit
def _rebuild_plan_kernel(grp_ptr, n, slot_limit, word_limit, MIN_LOG_CAP: tl.constexpr, MAX_LOG_CAP: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program: a fresh slice of ``2**ceil(log2(2 * tokens))`` slots for every group the insert
    marked, after the slices in use; the flags then say which slots to clear."""
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
        log_cap = _log2_ceil(2 * tokens, MIN_LOG_CAP, MAX_LOG_CAP)
        slots = tl.where(over, 1 << log_cap, 0)
        wslots = slots * tl.load(grp_ptr + _WORDS * n + gi, mask=over, other=0)
        tl.store(grp_ptr + _OFFSET * n + gi, slot_carry + tl.cumsum(slots, 0) - slots, mask=over)
        tl.store(grp_ptr + _BITS_OFF * n + gi, word_carry + tl.cumsum(wslots, 0) - wslots, mask=over)
        tl.store(grp_ptr + _LOG_CAP * n + gi, log_cap, mask=over)
        tl.store(grp_ptr + _FILL * n + gi, tl.zeros([BLOCK], tl.int64), mask=over)
        slot_carry += tl.sum(slots, 0)
        word_carry += tl.sum(wslots, 0)
    retry = tl.where((slot_carry > slot_limit) | (word_carry > word_limit), _BUDGET, 0).to(tl.int64)
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
    slot = home_slot(tok, log_cap)
    todo = present
    probes = 0
    while (tl.max(todo.to(tl.int32)) > 0) & (probes < probe_limit):
        cur = tl.load(tab_ptr + base + slot, mask=todo, other=_EMPTY)
        done = todo & (cur == tok)
        need = todo & (cur == _EMPTY)
        if tl.max(need.to(tl.int32)) > 0:
            old = claim(tab_ptr, base, slot, spare, tok, need, PREDICATED)
            new = need & (old == _EMPTY)
            # one atomic per lane that claimed a slot, its result used by that lane only: correct on
            # every Triton (before 3.5 a result was not broadcast to the threads holding replicas of
            # a tensor element, triton-lang/triton#7402; tests/test_triton_compile.py checks that no
            # atomic here has a replicated layout)
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
def _slot_counts(grp_ptr, n, g, tab_ptr, occ_ptr, order_at, bits_at, rows, valid, BLOCK: tl.constexpr):
    """Global slot, ``token``, ``a``, ``b`` (int32) and ``f_c``, ``f_w`` (int64) of group ``g``'s
    occupied slots ``rows`` (their places in its claim order)."""
    base = tl.load(grp_ptr + _OFFSET * n + g)
    words = tl.load(grp_ptr + _WORDS * n + g)
    bits_off = tl.load(grp_ptr + _BITS_OFF * n + g)
    n_c = tl.load(grp_ptr + _N_C * n + g)
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
        a += popcount(word & correct.to(tl.int32))
        present += popcount(word)
    return slot, token, a, present - a, f_c, f_w


@triton.jit
def _score_kernel(grp_ptr, n, tab_ptr, occ_ptr, order_at, bits_at, values_ptr, grid_size, const_ptr, n_ignore,
                  lf_ptr, angle_ptr, stat_const_ptr, USE_TF: tl.constexpr, INLINE: tl.constexpr,
                  BY_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Group ``program_id(0)``'s occupied slots, a share each of ``num_programs(1)``: the score of each
    replaces its counters (float64 bits in ``occ``); the first of each group's programs adds its
    distinct ids to the flags' largest. ``values``: float64 ``[5, grid_size]`` per grid entry, or with
    ``BY_ROW`` ``[2, grid_size]`` (``h``, ``strength``) per row, at the place ``_rows_kernel`` gave it."""
    g = tl.program_id(0)
    ok = tl.load(grp_ptr + _ROWS_PER_GROUP * n + _RETRY) == 0
    fill = tl.where(ok, tl.load(grp_ptr + _FILL * n + g), 0).to(tl.int32)
    if tl.program_id(1) == 0:
        tl.atomic_max(grp_ptr + _ROWS_PER_GROUP * n + _DISTINCT, fill.to(tl.int64), sem="relaxed")
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
        slot, token, a, b, f_c, f_w = _slot_counts(grp_ptr, n, g, tab_ptr, occ_ptr, order_at, bits_at, rows, valid,
                                                   BLOCK)
        if INLINE:  # groups past the device grid: each row's table computed here (statistics.py's maths)
            zero = tl.zeros([BLOCK], tl.int32)
            _, _, _, x, strength = table_statistics(a, b, zero + n_c.to(tl.int32), zero + n_w.to(tl.int32), valid,
                                                    lf_ptr, angle_ptr, stat_const_ptr)
        elif BY_ROW:  # fisher="upstream": the host's statistics of each row (grid_off: the group's first row)
            x = tl.load(values_ptr + grid_off + rows, mask=valid, other=0.0)
            strength = tl.load(values_ptr + grid_size + grid_off + rows, mask=valid, other=0.0)
        else:
            entry = grid_off + a.to(tl.int64) * stride + b
            x = tl.load(values_ptr + 3 * grid_size + entry, mask=valid, other=0.0)
            strength = tl.load(values_ptr + 4 * grid_size + entry, mask=valid, other=0.0)
        if USE_TF:
            x = direction(x, f_c, f_w, T_c, T_w, avg, k1, bm, eps)
        scorable = (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)
        for k in range(n_ignore):
            scorable = scorable & (token != tl.load(const_ptr + _IGNORE + k).to(tl.int32))
        score = squash(strength, x, scorable, scale, top, bound)
        tl.store(occ_ptr + slot, score.to(tl.int64, bitcast=True), mask=valid)


@triton.jit
def _rows_kernel(grp_ptr, n, tab_ptr, occ_ptr, order_at, bits_at, row_start_ptr, out_ptr, n_rows,
                 BLOCK: tl.constexpr):
    """Group ``program_id(0)``'s occupied slots as rows ``row_start[g] + i``: int64 ``[6, n_rows]``
    columns token, a, b, f_c, f_w, global slot."""
    g = tl.program_id(0)
    fill = tl.load(grp_ptr + _FILL * n + g).to(tl.int32)
    start = tl.load(row_start_ptr + g)
    for r0 in range(tl.program_id(1) * BLOCK, fill, tl.num_programs(1) * BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        valid = rows < fill
        slot, token, a, b, f_c, f_w = _slot_counts(grp_ptr, n, g, tab_ptr, occ_ptr, order_at, bits_at, rows, valid,
                                                   BLOCK)
        at = start + rows
        tl.store(out_ptr + at, token.to(tl.int64), mask=valid)
        tl.store(out_ptr + n_rows + at, a.to(tl.int64), mask=valid)
        tl.store(out_ptr + 2 * n_rows + at, b.to(tl.int64), mask=valid)
        tl.store(out_ptr + 3 * n_rows + at, f_c, mask=valid)
        tl.store(out_ptr + 4 * n_rows + at, f_w, mask=valid)
        tl.store(out_ptr + 5 * n_rows + at, slot, mask=valid)


@triton.jit
def _advantage_kernel(B, L, group_ptr, rewards_ptr, given_ptr, n, grp_ptr, tab_ptr, occ_ptr, roll_at,
                      index_at, const_ptr, out_ptr, BASELINE: tl.constexpr, REPORT: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
    """``out`` of a ``[ROWS, COLS]`` tile from the slot index. After a bad input (an id out of range, a
    group past ``MAX_GROUP_TOKENS``) or a retry nothing is written, or, with ``REPORT`` (a replay of a
    captured call: ``out`` must not keep the previous replay's values), NaN everywhere."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    roll_ptr = tab_ptr + roll_at
    flags = grp_ptr + _ROWS_PER_GROUP * n
    zero = tl.zeros_like(r)  # the flags, broadcast over the rows
    retry = tl.load(flags + _RETRY + zero)
    good = (tl.load(flags + _BAD_LOW + zero) == 0) & (tl.load(flags + _BAD_HIGH + zero) == 0) & ((retry & _TOKENS) == 0)
    if REPORT:
        tl.store(out_ptr + r.to(tl.int64) * L + col, tl.full([ROWS, COLS], float("nan"), tl.float32),
                 mask=(r < B) & (col < L) & ((~good) | (retry != 0)))
    real = (r < B) & good & (retry == 0)
    inside = real & (col < L)
    last = tl.load(roll_ptr + 2 * B + r, mask=real, other=0)
    pos = r.to(tl.int64) * L + col
    slot = tl.load(tab_ptr + index_at + pos, mask=inside & (col < last), other=-1)
    present = slot >= 0
    score = tl.load(occ_ptr + slot, mask=present, other=0).to(tl.float64, bitcast=True)
    if BASELINE == 3:  # given
        A = tl.load(given_ptr + r, mask=real, other=0.0)
    else:
        A = tl.load(rewards_ptr + r, mask=real, other=0.0)
        if BASELINE <= 1:  # grpo, mean
            g = tl.load(group_ptr + r, mask=real, other=0)
            A = A - tl.load(_f64(grp_ptr) + _MEAN * n + g, mask=real, other=0.0)
            if BASELINE == 0:
                size = tl.load(grp_ptr + _N_C * n + g, mask=real, other=0) + tl.load(grp_ptr + _N_W * n + g,
                                                                                     mask=real, other=0)
                var = tl.load(_f64(grp_ptr) + _VAR * n + g, mask=real, other=0.0) / \
                    tl.maximum(size.to(tl.float64) - 1.0, 1.0)
                std = tl.where(size > 1, tl.sqrt(var), 1.0)
                A = A / (std + tl.load(const_ptr + _EPS))
    value = A + tl.load(const_ptr + _WEIGHT) * score
    tl.store(out_ptr + pos, tl.where(present, value, 0.0).to(tl.float32), mask=inside)


#: every kernel of the pipeline, by name (what a compile report builds: tests/compile_report.py)
KERNELS = {"ranks": _ranks_kernel, "lengths": _lengths_kernel, "plan": _plan_kernel, "rebuild_plan": _rebuild_plan_kernel,
           "clear": _clear_kernel, "insert": _insert_kernel, "score": _score_kernel, "rows": _rows_kernel,
           "advantage": _advantage_kernel}


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Sizes:
    """Static sizes of one call (host ints): ``bound``, the statistics' group bound (0: no score
    kernel); ``group_limit``, the largest group the call takes; the slots and presence words its
    tables may use and where each int32 array starts in the one int32 buffer; ``max_log_cap``,
    log2 of the most slots of a group's first table; ``safe``, every table sized for its masked tokens
    at most half full (no rebuild, no probe limit)."""

    bound: int
    group_limit: int
    slots: int
    words: int
    order_at: int
    bits_at: int
    roll_at: int
    index_at: int
    int32_total: int
    max_log_cap: int
    safe: bool = False


def _layout(B: int, L: int, bound: int, group_limit: int, slots: int, words: int, max_log_cap: int,
            safe: bool) -> Sizes:
    """``Sizes`` of tables of ``slots`` slots and ``words`` presence words: the int32 buffer holds keys,
    claim order, presence words, per-rollout rank / correct / last, and the slot of each position."""
    bits_at = 2 * slots
    roll_at = bits_at + words
    index_at = roll_at + 3 * B
    return Sizes(bound, group_limit, slots, words, slots, bits_at, roll_at, index_at, index_at + B * L, max_log_cap,
                 safe)


def first_table_log_cap(keys: int | None, tuning: TritonTuning) -> int:
    """log2 of the most slots of a group's first table: the smallest power of two (at least
    ``2**_MIN_LOG_CAP``) whose 3/4 hold ``keys`` distinct ids (learnt by earlier calls), at most
    ``tuning.max_first_slots``; that cap when ``keys`` is None (sized by masked tokens)."""
    cap = tuning.max_first_slots.bit_length() - 1
    log_cap = _MIN_LOG_CAP if keys is not None else cap
    while log_cap < cap and (3 << log_cap) >> 2 < keys:
        log_cap += 1
    return log_cap


def power_of_two(largest: int) -> int:
    """The statistics bound of groups of ``largest`` rollouts: a power of two >= 16."""
    return 1 << max(4, (max(largest, 1) - 1).bit_length())


def sizes(B: int, L: int, n: int, tuning: TritonTuning, bound: int = 16, keys: int | None = None,
          score: bool = True) -> Sizes:
    """The allocations of a first try at a batch of ``B`` rollouts of ``L`` positions in ``n`` groups, its
    groups assumed to hold at most ``bound`` rollouts (a bigger group is a retry) and at most ``keys``
    distinct ids (None: sized by masked tokens); ``score``: the statistics are looked up (else the
    rows are read back and any group size is taken)."""
    largest = B - n + 1  # every group holds a rollout
    group = min(largest, power_of_two(min(largest, bound)))
    max_log_cap = first_table_log_cap(keys, tuning)
    guess = tuning.first_guess
    # a group's first slice: 2**log_cap <= max(2**MIN, 2 * ceil(guess * tokens)) (the kernel's guess is
    # float32: its ceil may be one more), at most 2**max_log_cap
    most = max(1 << _MIN_LOG_CAP, 2 * math.ceil(guess * group * L) + 2)
    slots = min(n * min(1 << max_log_cap, most), math.ceil(2 * guess * B * L) + n * ((1 << _MIN_LOG_CAP) + 4))
    # and room to rebuild groups whose first table overflows: a slice < max(16, 4 * tokens) each
    slots += min(n * max(16, 4 * group * L), 4 * B * L + 16 * n)
    words_per_slot = -(-group // 32)
    slots = min(slots, tuning.budget_bytes // (16 + 4 * words_per_slot))
    limit = power_of_two(group) if score else 2**62
    return _layout(B, L, limit if score else 0, limit, slots, slots * words_per_slot, max_log_cap, False)


def safe_sizes(B: int, L: int, flags: "Flags", score: bool = True) -> Sizes:
    """The sizes of a second try after ``flags`` asked for one: every table sized for its masked
    tokens, at most half full (the exact total the first try's plan computed), the bound covering
    the largest group."""
    bound = power_of_two(flags.largest) if score else 0
    return _layout(B, L, bound, bound if score else 2**62, flags.safe_slots, flags.safe_words, _MAX_LOG_CAP, True)


def inline(bound: int) -> bool:
    """True when groups of ``bound`` rollouts are past the device grid: the score kernel computes the
    statistics of each row's table."""
    return device_state.grid_bound(bound) is None


@dataclass(frozen=True)
class Flags:
    """The flags a call leaves on the device, read back (``Run.read``): ``low`` / ``high``, the least
    negative and the largest id past ``MAX_TOKEN_ID`` (0: none); ``retry`` bits; ``largest`` group;
    ``distinct``, the most distinct ids a group held; ``safe_slots`` / ``safe_words``, what every
    table at most half full takes; ``most_tokens`` of a group; ``slots`` / ``slots_from`` in use."""

    low: int
    high: int
    retry: int
    slots: int
    slots_from: int
    largest: int
    distinct: int
    safe_slots: int
    safe_words: int
    most_tokens: int

    @classmethod
    def of(cls, values: list[int]) -> "Flags":
        return cls(low=values[_BAD_LOW.value], high=values[_BAD_HIGH.value], retry=values[_RETRY.value],
                   slots=values[_SLOTS.value], slots_from=values[_SLOTS_FROM.value],
                   largest=values[_LARGEST.value], distinct=values[_DISTINCT.value],
                   safe_slots=values[_SAFE_SLOTS.value], safe_words=values[_SAFE_WORDS.value],
                   most_tokens=values[_MOST_TOKENS.value])

    def raise_input_errors(self) -> None:
        """The API's ValueError for an id out of range or a group past ``MAX_GROUP_TOKENS``."""
        if self.low or self.high:
            check_id_range(self.low, self.high if self.high else MAX_TOKEN_ID)
        if self.retry & RETRY_TOKENS:
            raise ValueError(f"`responses`: a group holds {self.most_tokens} masked tokens; the triton backend "
                             f"takes at most {MAX_GROUP_TOKENS} per group")


@dataclass(frozen=True)
class Run:
    """One call's device buffers: ``grp`` int64 (per-group rows, then the ``_N_FLAGS`` flags), ``tab``
    int32 (keys, claim order, presence words, per-rollout rank / correct / last, slot index per position),
    ``occ`` int64 per slot (counters, then the score's float64 bits)."""

    grp: Tensor
    tab: Tensor
    occ: Tensor
    n: int
    sizes: Sizes

    @property
    def flags(self) -> Tensor:
        return self.grp[_ROWS_PER_GROUP.value * self.n:]

    def group_row(self, row: tl.constexpr) -> Tensor:
        """int64 ``[n]``: one of the per-group rows (``_N_C`` ...)."""
        return self.grp[row.value * self.n:(row.value + 1) * self.n]

    def overflowed(self) -> Tensor:
        """int64 ``[n]``: 1 where the group's first table overflowed (it was rebuilt), else 0."""
        return self.group_row(_OVER)

    def read(self, *extra: Tensor) -> tuple[Flags, list[int]]:
        """The flags and ``extra`` int64 scalars, in one device -> host copy."""
        values = torch.cat([self.flags, *(e.reshape(1) for e in extra)]).tolist()
        return Flags.of(values), values[_N_FLAGS:]


def constants(config: KTAEConfig, device: torch.device) -> Tensor:
    """float64 ``[10 + k]``: ``alpha, beta, top``, the largest float below ``top``, ``k1, b``, the TF
    epsilon, ``weight``, ``correct_threshold``, ``eps``, then the k ignored ids; uploaded
    once per (config, device)."""
    ignore = [float(t) for t in config.ignore_token_ids]
    values = (config.alpha, config.beta, config.top, math.nextafter(config.top, 0.0), config.k1, config.b, TF_EPS,
              config.weight, config.correct_threshold, config.eps, *ignore)
    return device_state.state(device).constant(values, torch.float64)


def _statistics(config: KTAEConfig, bound: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The score kernel's ``values`` (the device grid), ``lf``, ``angle`` and statistics constants: the
    grid for groups of up to ``bound`` rollouts, or, past it, the tables the kernel computes rows from."""
    state = device_state.state(device)
    if not inline(bound):
        values = state.grid(grid_statistics_kernel, config.alpha, config.beta, bound)
        return values, values, values, values
    lf, angle, consts = state.cached(("inline", config.alpha, config.beta, bound),
                                     lambda: _inline_tables(config, bound, device))
    return lf, lf, angle, consts


def _inline_tables(config: KTAEConfig, bound: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    grid = device_state.tables_of(torch.zeros(4, 0, dtype=torch.int32, device=device), bound)
    consts = torch.tensor(device_state.statistics_constants(config.alpha, config.beta), dtype=torch.float64)
    return grid.log_factorial, grid.angle, consts.to(device)


def build(batch: Batch, config: KTAEConfig, sizes: Sizes, tuning: TritonTuning, grpo: bool = False) -> Run:
    """Enqueue the table build (ranks, lengths, plan, clear, insert, and the rebuild); no host sync.
    ``grpo``: also sum each group's reward variance (the GRPO baseline)."""
    device = batch.device
    B, L = batch.responses.shape
    n = batch.n_groups
    consts = constants(config, device)
    grp = torch.zeros(_ROWS_PER_GROUP.value * n + _N_FLAGS, dtype=torch.int64, device=device)
    tab = torch.empty(sizes.int32_total, dtype=torch.int32, device=device)
    occ = torch.empty(sizes.slots, dtype=torch.int64, device=device)
    mask = batch.mask.contiguous().view(torch.uint8)
    correct = batch.rewards if batch.correct is None else batch.correct.view(torch.uint8)
    _ranks_kernel[(triton.cdiv(B, _BLOCK),)](
        batch.group, batch.rewards, correct, consts, B, n, grp, tab, sizes.roll_at,
        HAS_CORRECT=batch.correct is not None, BLOCK=_BLOCK)
    rows, cols = tile_shape(L)
    _lengths_kernel[(triton.cdiv(B, rows),)](mask, B, L, batch.group, n, grp, tab, sizes.roll_at, ROWS=rows, COLS=cols)
    _plan_kernel[(1,)](grp, n, sizes.slots, sizes.words, sizes.group_limit, MAX_GROUP_TOKENS, tuning.first_guess,
                       sizes.max_log_cap, SAFE=sizes.safe, MIN_LOG_CAP=_MIN_LOG_CAP,
                       MAX_FIRST_LOG_CAP=tuning.max_first_slots.bit_length() - 1, MAX_LOG_CAP=_MAX_LOG_CAP,
                       BLOCK=_BLOCK)
    clear = min(triton.cdiv(max(sizes.slots, B), _BLOCK), _CLEAR_PROGRAMS)
    _clear_kernel[(clear,)](grp, n, tab, occ, sizes.bits_at, batch.group, batch.rewards, B, GRPO=grpo, BLOCK=_BLOCK)
    tiles = (triton.cdiv(B, rows), triton.cdiv(L, cols))
    insert = (batch.responses.contiguous(), mask, B, L, batch.group, n, grp, tab, occ, sizes.roll_at, sizes.order_at,
              sizes.bits_at, sizes.index_at)
    probe_limit = _UNLIMITED if sizes.safe else tuning.probe_limit
    _insert_kernel[tiles](*insert, probe_limit, ROWS=rows, COLS=cols, PREDICATED=not interpreting(), REBUILD=False)
    if not sizes.safe:  # the groups whose first table overflowed, rebuilt (nothing to do when none did)
        _rebuild_plan_kernel[(1,)](grp, n, sizes.slots, sizes.words, MIN_LOG_CAP=_MIN_LOG_CAP,
                                   MAX_LOG_CAP=_MAX_LOG_CAP, BLOCK=_BLOCK)
        _clear_kernel[(clear,)](grp, n, tab, occ, sizes.bits_at, batch.group, batch.rewards, B, GRPO=False,
                                BLOCK=_BLOCK)
        _insert_kernel[tiles](*insert, _UNLIMITED, ROWS=rows, COLS=cols, PREDICATED=not interpreting(), REBUILD=True)
    return Run(grp, tab, occ, n, sizes)


def score(run: Run, config: KTAEConfig, device: torch.device, by_row: Tensor | None = None) -> None:
    """Enqueue the score kernel: every occupied slot's score in place of its counters. ``by_row``
    (``fisher="upstream"``): float64 ``[2, U]``, each row's ``h`` and ``strength`` in ``_rows``' order,
    in place of the device grid."""
    consts = constants(config, device)
    if by_row is None:
        values, lf, angle, stat_consts = _statistics(config, run.sizes.bound, device)
    else:
        values = lf = angle = stat_consts = by_row
        run.group_row(_GRID_OFF).copy_(_row_start(run))
    if run.n:
        _score_kernel[(run.n, _SCORE_SPLIT)](
            run.grp, run.n, run.tab, run.occ, run.sizes.order_at, run.sizes.bits_at, values, values.shape[-1], consts,
            consts.shape[0] - _IGNORE.value, lf, angle, stat_consts, USE_TF=config.use_tf,
            INLINE=by_row is None and inline(run.sizes.bound), BY_ROW=by_row is not None, BLOCK=_SCORE_BLOCK,
            enable_fp_fusion=False)


def advantage(run: Run, batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor, report: bool) -> None:
    """Enqueue the advantage kernel into ``out`` (``report``: NaN after a retry, see ``_advantage_kernel``)."""
    B, L = batch.responses.shape
    rows, cols = tile_shape(L)
    _advantage_kernel[(triton.cdiv(B, rows), triton.cdiv(L, cols))](
        B, L, batch.group, batch.rewards, batch.rewards if given is None else given, run.n, run.grp, run.tab, run.occ,
        run.sizes.roll_at, run.sizes.index_at, constants(config, batch.device), out,
        BASELINE=baseline_code(config, given), REPORT=report, ROWS=rows, COLS=cols, enable_fp_fusion=False)


def first_sizes(batch: Batch, tuning: TritonTuning, score_rows: bool) -> Sizes:
    """A first try's sizes, from what earlier calls of this layout learnt (``device.learnt_key``, any
    ``L``); a plan's batch takes its own largest group as the bound."""
    B, L = batch.responses.shape
    learnt = device_state.state(batch.device).learnt(_key(batch))
    bound = batch.layout.largest if batch.layout is not None else learnt.largest if learnt is not None else 16
    keys = learnt.distinct if learnt is not None else None
    return sizes(B, L, batch.n_groups, tuning, bound, keys, score=score_rows)


def _key(batch: Batch) -> tuple:
    return device_state.learnt_key("triton", batch)


def _built(batch: Batch, config: KTAEConfig, tuning: TritonTuning, score_rows: bool,
           grpo: bool = False) -> tuple[Run, Flags, list[int]]:
    """The tables (and, with ``score_rows``, the slots' scores), built once more in safe sizes when the
    first try flagged a retry; the flags read back (with the rows' count when not ``score_rows``).
    Raises the API's errors for bad inputs. ``grpo``: sum each group's reward variance."""
    run = build(batch, config, first_sizes(batch, tuning, score_rows), tuning, grpo)
    for safe in (False, True):
        if score_rows:
            score(run, config, batch.device)
            flags, extra = run.read()
        else:
            flags, extra = run.read(run.group_row(_FILL).sum())
        flags.raise_input_errors()
        if not flags.retry:
            break
        if safe:  # cannot happen: safe tables are sized exactly and at most half full
            raise RuntimeError(f"ktae_kernels.triton: a safe table build flagged retry {flags.retry} (internal error)")
        if score_rows and flags.largest > INLINE_MAX_GROUP:
            raise ValueError(f"`index`: a group holds {flags.largest} rollouts; the triton backend takes at most "
                             f"{INLINE_MAX_GROUP} per group (backend='cuda' or 'torch' take any)")
        B, L = batch.responses.shape
        run = build(batch, config, safe_sizes(B, L, flags, score=score_rows), tuning, grpo)
    if score_rows:
        device_state.state(batch.device).learn(_key(batch), largest=flags.largest, distinct=flags.distinct)
    return run, flags, extra


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
                    tuning: TritonTuning) -> Tensor:
    """float32 ``[B, L]`` advantages (``out`` when given); one read of the flags after the last launch
    (two when a retry is needed). Raises the API's ValueError for a bad input, ``out`` untouched."""
    B, L = batch.responses.shape
    if out is None:
        out = torch.empty(B, L, dtype=torch.float32, device=batch.device)
    if B == 0 or L == 0:
        return out
    grpo = given is None and config.baseline == "grpo"
    if config.fisher == "exact":
        run, _, _ = _built(batch, config, tuning, True, grpo)
    else:  # the rows' statistics come from the host (upstream float32 p-values)
        run, rows = _rows(batch, config, tuning, grpo)
        tables = method.distinct_tables(rows, run.group_row(_N_C), run.group_row(_N_W), config)
        score(run, config, batch.device, torch.stack([tables.stats.h, tables.stats.strength])[:, tables.index])
    advantage(run, batch, config, given, out, report=False)
    return out


def _rows(batch: Batch, config: KTAEConfig, tuning: TritonTuning, grpo: bool = False) -> tuple[Run, method.Rows]:
    """The tables and their rows (``method.Rows``, each group's in claim order)."""
    run, flags, (n_rows,) = _built(batch, config, tuning, False, grpo)
    ints = torch.empty(6, n_rows, dtype=torch.int64, device=batch.device)
    if n_rows:
        _rows_kernel[(run.n, _SCORE_SPLIT)](run.grp, run.n, run.tab, run.occ, run.sizes.order_at, run.sizes.bits_at,
                                           _row_start(run), ints, n_rows, BLOCK=_SCORE_BLOCK)
    group = torch.repeat_interleave(torch.arange(run.n, device=batch.device), run.group_row(_FILL), output_size=n_rows)
    return run, method.Rows(group=group, token=ints[0], a=ints[1], b=ints[2], f_c=ints[3], f_w=ints[4])


def _row_start(run: Run) -> Tensor:
    """int64 ``[n]``: each group's first row among the rows ``_rows`` lists (its occupied slots, group
    after group)."""
    fill = run.group_row(_FILL)
    return torch.cumsum(fill, 0) - fill


def key_token_scores(batch: Batch, config: KTAEConfig, tuning: TritonTuning) -> KeyTokenScores:
    """Per (group, token) statistics, rows sorted by (group, token), by ``method.score_rows``."""
    if batch.responses.numel() == 0 or batch.n_groups == 0:
        return method.score_rows(_empty_rows(batch.device), *_group_counts(batch, config), config, batch.group_labels)
    run, rows = _rows(batch, config, tuning)
    order = torch.argsort((rows.group << 31) | rows.token)
    rows = method.Rows(*(getattr(rows, f)[order] for f in ("group", "token", "a", "b", "f_c", "f_w")))
    counts = (run.group_row(_N_C), run.group_row(_N_W), run.group_row(_T_C), run.group_row(_T_W))
    return method.score_rows(rows, *counts, config, batch.group_labels)


def _empty_rows(device: torch.device) -> method.Rows:
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return method.Rows(empty, empty, empty, empty, empty, empty)


def _group_counts(batch: Batch, config: KTAEConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    stats = method.group_stats(batch, config)
    return stats.n_c, stats.n_w, stats.T_c, stats.T_w


def capture(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
            tuning: TritonTuning) -> tuple[Tensor, CapturedCall]:
    """``token_advantage`` (exact) enqueued while a CUDA graph captures: nothing read back, tables sized by
    what the warm-up calls of this layout learnt (``device.learnt_key``; GraphCaptureError without one)
    and, for a plan's batch, for its largest group. A replay that finds a bad input or needs a retry
    writes NaN over ``out``. The returned ``CapturedCall`` holds what the graph reads from the backend's
    caches and checks a replay's flags."""
    B, L = batch.responses.shape
    if out is None:
        out = torch.empty(B, L, dtype=torch.float32, device=batch.device)
    if B == 0 or L == 0:
        return out, CapturedCall(keep=(), check=lambda: None)
    learnt = device_state.state(batch.device).learnt(_key(batch))
    if learnt is None:
        raise GraphCaptureError(device_state.WARM_UP)
    largest = batch.layout.largest if batch.layout is not None else learnt.largest
    sizes_ = sizes(B, L, batch.n_groups, tuning, largest, learnt.distinct)
    run = build(batch, config, sizes_, tuning, given is None and config.baseline == "grpo")
    score(run, config, batch.device)
    advantage(run, batch, config, given, out, report=True)
    keep = (constants(config, batch.device), *_statistics(config, sizes_.bound, batch.device))
    return out, CapturedCall(keep=keep, check=lambda: _check_replay(run))


def _check_replay(run: Run) -> None:
    """Raise when the last replay of a captured call found a bad input or needed a retry (``out`` holds
    NaN either way)."""
    flags, _ = run.read()
    flags.raise_input_errors()
    if flags.retry:
        why = {RETRY_BIG_GROUP: f"a group of {flags.largest} rollouts is past the {run.sizes.group_limit} the capture "
                                f"assumed",
               RETRY_BUDGET: "its tables need more slots than the capture reserved",
               RETRY_OVERFLOW: "a rebuilt table overflowed"}
        reasons = "; ".join(text for bit, text in why.items() if flags.retry & bit)
        raise GraphCaptureError(f"the last replay could not complete ({reasons}; its groups held up to "
                                f"{flags.distinct} distinct ids) and left NaN in `out`. {device_state.WARM_UP_MORE}")
