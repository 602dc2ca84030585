"""Sparse token-occurrence contingency tables for all groups at once: one hash table per group.

Each group ``g`` owns a power-of-two slice ``[offset[g], offset[g] + 2**log_cap[g])`` of flat
global-memory arrays (``S`` slots in all), keyed by token id with linear probing:

- ``keys``  int32 ``[S]``: the token id, or ``EMPTY``; claimed with an atomic compare-and-swap.
- ``occ``   int64 ``[S]``: ``f_c << 32 | f_w``, occurrences in correct / wrong rollouts (one atomic add).
- ``bits``  int32 ``[S, words]``: bit ``j % 32`` of word ``j // 32`` is set when the rollout of rank
  ``j`` in the group contains the token (presence, deduplicated per rollout by ``atomic_or``);
  ``a`` / ``b`` are the popcounts of ``bits & correct_bits[g]`` / ``bits & ~correct_bits[g]``.
- ``order`` int32 ``[S]``: inside each slice, the group-local slots in claim order; the first
  ``fill[g]`` entries list the group's occupied slots, so no pass ever scans the empty ones.

One program reads a tile of 1024 positions (``[1, 1024]`` of one rollout, or ``[R, L]`` of R short
rollouts). Each masked token probes its group's table with plain loads, claims an empty slot with
a compare-and-swap (predicated inline PTX on CUDA, as ``tl.atomic_cas`` has no mask; each lane that
claims a slot takes its place in ``order`` with its own atomic on ``fill``), adds to the slot's
counters with one 64-bit atomic, and sets its rollout's presence bit unless a load shows it set.

Nothing is vocabulary-sized. Slices start from a guess of ``2 * _FIRST_GUESS`` times the group's
masked tokens, at most ``2**_MAX_FIRST_LOG_CAP`` slots (a group of 1024 rollouts holds a few tens
of thousands of distinct ids, not its million tokens: without the cap, B = 16384 in groups of 1024
would clear 2.4 GB of first tables); a group whose slice gets more than 3/4 full, or whose probes run past a limit, stops
early and is rebuilt once with a slice of at least twice its masked tokens, which always suffices:
only the overflowed groups' rollouts are inserted again (``_regrow``), into slices appended after
the others, so an overflow costs in proportion to the groups that overflow.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from ...method import GroupStats
from ...types import Batch
from ...validation import MAX_TOKEN_ID, check_id_range
from ..device import upload

EMPTY = -1
_EMPTY = tl.constexpr(EMPTY)
_MAX_ID = tl.constexpr(MAX_TOKEN_ID)
#: a compare value no slot ever holds (keys are >= EMPTY): a compare-and-swap with it never writes.
_NEVER = tl.constexpr(-2)
#: first guess of a group's distinct tokens, as a fraction of its masked tokens (slice = 2x this).
_FIRST_GUESS = 0.25
_MIN_LOG_CAP = 4
#: the largest first slice, 2**16 slots (49k ids at 3/4 load); a group with more distinct ids is rebuilt.
_MAX_FIRST_LOG_CAP = 16
#: probe budget per lane on the first try; the rebuild probes without limit (its load is <= 1/2).
_FIRST_PROBE_LIMIT = 256
_UNLIMITED = 2**31 - 1
#: masked tokens per group: f_c, f_w pack into one int64 and the flat-rows grid stays within
#: CUDA's 65535 blocks on its second axis (2**26 / _FLAT_BLOCK).
MAX_GROUP_TOKENS = 2**26
_TILE = 1024
_FLAT_BLOCK = 2048
_COUNT_BLOCK = 256


@dataclass(frozen=True)
class HashTables:
    """The per-group hash tables of one batch (layout in the module docstring).

    ``offset`` int64 / ``log_cap`` int32 / ``fill`` int32 ``[n_groups]`` on the device;
    ``correct_bits`` int32 ``[n_groups, words]``. Host ints: ``largest``, the largest group's size;
    ``n_rows`` = ``fill.sum()`` and ``max_fill``, which size the passes over occupied slots.
    """

    keys: Tensor
    occ: Tensor
    bits: Tensor
    order: Tensor
    correct_bits: Tensor
    offset: Tensor
    log_cap: Tensor
    fill: Tensor
    words: int
    largest: int
    n_rows: int
    max_fill: int


@dataclass(frozen=True)
class Rows:
    """Occupied slots as flat rows: ``slot`` int64 ``[U]`` (global slot index), ``group`` int32 ``[U]``."""

    slot: Tensor
    group: Tensor


@dataclass(frozen=True)
class RowCounts:
    """Per row, int64 ``[U]``: ``token``, presence ``a`` / ``b`` and occurrences ``f_c`` / ``f_w``."""

    token: Tensor
    a: Tensor
    b: Tensor
    f_c: Tensor
    f_w: Tensor


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(_insert_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------- device functions


@triton.jit
def _home_slot(token, log_cap):
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
def _claim(keys_ptr, base, slot, spare, token, need, PREDICATED: tl.constexpr):
    """Old key of ``slot`` after a compare-and-swap ``EMPTY -> token`` on the lanes of ``need``.

    Without predication every lane issues the atomic: the others compare against ``_NEVER`` (no
    write) at the distinct slot ``spare``, so they never queue on a hot slot.
    """
    if PREDICATED:
        old = _cas_predicated(keys_ptr + base + slot, token, need)
    else:
        target = keys_ptr + base + tl.where(need, slot, spare)
        old = tl.atomic_cas(target, tl.where(need, _EMPTY, _NEVER), token, sem="relaxed")
    return old


@triton.jit
def find_slots(keys_ptr, base, log_cap, token, active):
    """Group-local slot of each ``token`` on the ``active`` lanes (which must be in the table)."""
    cap_mask = (1 << log_cap) - 1
    slot = _home_slot(token, log_cap)
    todo = active
    probes = 0
    while (tl.max(todo.to(tl.int32)) > 0) & (probes <= tl.max(cap_mask)):
        cur = tl.load(keys_ptr + base + slot, mask=todo, other=_EMPTY)
        todo = todo & (cur != token)
        slot = tl.where(todo, (slot + 1) & cap_mask, slot)
        probes += 1
    return slot


@triton.jit
def _popcount(x):
    """Set bits of each int32 lane (SWAR; no popc intrinsic in the interpreter)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def load_row_counts(keys_ptr, occ_ptr, bits_ptr, correct_bits_ptr, words, slot, group, valid):
    """``token, a, b`` (int32) and ``f_c, f_w`` (int64) of the global slots ``slot`` (int64)."""
    token = tl.load(keys_ptr + slot, mask=valid, other=0)
    occ = tl.load(occ_ptr + slot, mask=valid, other=0)
    f_c = occ >> 32
    f_w = occ - (f_c << 32)
    a = tl.zeros_like(token)
    present = tl.zeros_like(token)
    for w in range(words):
        word = tl.load(bits_ptr + slot * words + w, mask=valid, other=0)
        correct = tl.load(correct_bits_ptr + group.to(tl.int64) * words + w, mask=valid, other=0)
        a += _popcount(word & correct)
        present += _popcount(word)
    return token, a, present - a, f_c, f_w


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _insert_kernel(resp_ptr, mask_ptr, B, L, group_ptr, rank_ptr, inc_ptr,
                   keys_ptr, occ_ptr, bits_ptr, words, order_ptr,
                   offset_ptr, log_cap_ptr, fill_ptr, overflow_ptr, probe_limit, bad_ptr, row_map_ptr,
                   ROWS: tl.constexpr, COLS: tl.constexpr, PREDICATED: tl.constexpr, MAPPED: tl.constexpr):
    """A ``[ROWS, COLS]`` tile of rollouts x positions (grid ``(cdiv(B, ROWS), cdiv(L, COLS))``) into
    the rollouts' group tables; with ``MAPPED``, tile row ``r`` is rollout ``row_map[r]`` (B of them).

    ``overflow[g]`` is set, and the group's rows stop probing, once its table is over 3/4 full or a
    lane used up ``probe_limit`` probes; the host then rebuilds it larger.
    """
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    lane = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    real = r < B
    if MAPPED:
        row = tl.load(row_map_ptr + r, mask=real, other=0)
    else:
        row = r.to(tl.int64)
    pos = row * L + col
    present = tl.load(mask_ptr + pos, mask=real & (col < L), other=0) != 0
    tok64 = tl.load(resp_ptr + pos, mask=present, other=0)
    # the API's id range check, folded in: bad[0] = the least negative id, bad[1] = the largest id
    # past 2**31 - 1 (the host raises after the kernel); such positions are left out
    low = present & (tok64 < 0)
    high = present & (tok64 > _MAX_ID)
    if tl.max((low | high).to(tl.int32)) > 0:
        tl.atomic_min(bad_ptr + tl.zeros_like(lane), tok64, mask=low, sem="relaxed")
        tl.atomic_max(bad_ptr + 1 + tl.zeros_like(lane), tok64, mask=high, sem="relaxed")
        present = present & ~low & ~high
    tok = tok64.to(tl.int32)
    g = tl.load(group_ptr + row, mask=real, other=0)
    g_tile = g + tl.zeros_like(lane).to(g.dtype)  # the group of every lane, [ROWS, COLS]
    base = tl.load(offset_ptr + g, mask=real, other=0)
    log_cap = tl.load(log_cap_ptr + g, mask=real, other=4)
    cap_mask = (1 << log_cap) - 1
    full = (3 << log_cap) >> 2
    spare = lane & cap_mask
    slot = _home_slot(tok, log_cap)
    todo = present
    probes = 0
    while (tl.max(todo.to(tl.int32)) > 0) & (probes < probe_limit):
        cur = tl.load(keys_ptr + base + slot, mask=todo, other=_EMPTY)
        done = todo & (cur == tok)
        need = todo & (cur == _EMPTY)
        if tl.max(need.to(tl.int32)) > 0:
            old = _claim(keys_ptr, base, slot, spare, tok, need, PREDICATED)
            new = need & (old == _EMPTY)
            # one atomic per lane that claimed a slot, its result used by that lane only: correct on
            # every Triton (before 3.5 a result was not broadcast to the threads holding replicas of
            # a tensor element, triton-lang/triton#7402; tests/test_triton_compile.py checks that no
            # atomic here has a replicated layout)
            place = tl.atomic_add(fill_ptr + g_tile, 1, mask=new, sem="relaxed")
            tl.store(order_ptr + base + place, slot, mask=new)
            tl.store(overflow_ptr + g_tile, 1, mask=new & (place >= full))
            done = done | new | (need & (old == tok))
        ok = tl.load(overflow_ptr + g, mask=real, other=0, volatile=True) == 0
        todo = todo & ~done & ok
        slot = tl.where(todo, (slot + 1) & cap_mask, slot)
        probes += 1
    tl.store(overflow_ptr + g, 1, mask=real & (tl.max(todo.to(tl.int32), 1)[:, None] > 0))

    found = present & ~todo
    gslot = base + slot
    tl.atomic_add(occ_ptr + gslot, tl.load(inc_ptr + row, mask=real, other=0), mask=found, sem="relaxed")
    rank = tl.load(rank_ptr + row, mask=real, other=0)
    bit = 1 << (rank & 31)
    word_ptr = bits_ptr + gslot * words + (rank >> 5)
    have = tl.load(word_ptr, mask=found, other=0)
    tl.atomic_or(word_ptr, bit, mask=found & ((have & bit) == 0), sem="relaxed")


@triton.jit
def _flatten_kernel(order_ptr, offset_ptr, fill_ptr, row_start_ptr, slot_ptr, group_ptr, BLOCK: tl.constexpr):
    """Occupied slots of group ``program_id(0)`` into flat rows (grid ``(n_groups, cdiv(max_fill, BLOCK))``)."""
    g = tl.program_id(0)
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = r < tl.load(fill_ptr + g)
    base = tl.load(offset_ptr + g)
    local = tl.load(order_ptr + base + r, mask=valid, other=0)
    out = tl.load(row_start_ptr + g) + r
    tl.store(slot_ptr + out, base + local, mask=valid)
    tl.store(group_ptr + out, tl.full(r.shape, 0, tl.int32) + g, mask=valid)


@triton.jit
def _row_counts_kernel(slot_ptr, group_ptr, n_rows, keys_ptr, occ_ptr, bits_ptr, correct_bits_ptr, words,
                       token_ptr, a_ptr, b_ptr, f_c_ptr, f_w_ptr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=valid, other=0)
    group = tl.load(group_ptr + rows, mask=valid, other=0)
    token, a, b, f_c, f_w = load_row_counts(keys_ptr, occ_ptr, bits_ptr, correct_bits_ptr, words, slot, group, valid)
    tl.store(token_ptr + rows, token.to(tl.int64), mask=valid)
    tl.store(a_ptr + rows, a.to(tl.int64), mask=valid)
    tl.store(b_ptr + rows, b.to(tl.int64), mask=valid)
    tl.store(f_c_ptr + rows, f_c, mask=valid)
    tl.store(f_w_ptr + rows, f_w, mask=valid)


# ----------------------------------------------------------------------------- host side


def build_hash_tables(batch: Batch, stats: GroupStats) -> HashTables:
    """Hash tables of every group of ``batch`` (``stats`` from ``method.group_stats``)."""
    tokens = stats.T_c + stats.T_w
    guess = first_log_cap(tokens)
    safe = _log2_ceil(2 * tokens)
    n = batch.n_groups
    if n:
        largest, biggest, slots = _read_sizes(torch.stack([stats.size.max(), tokens.max(), _slots(guess)]))
    else:
        largest, biggest, slots = 1, 0, 0
    if biggest > MAX_GROUP_TOKENS:
        raise ValueError(f"the triton backend takes at most {MAX_GROUP_TOKENS} masked tokens per group, "
                         f"got a group of {biggest}")
    words = max(triton.cdiv(largest, 32), 1)
    rank, inc, correct_bits = _rollout_layout(batch, stats, words)
    tables, overflow, bad = _insert(batch, guess, slots, words, rank, inc, correct_bits, _FIRST_PROBE_LIMIT)
    grown_cap = torch.where(overflow != 0, 1 << safe.long(), 0)
    extra, low, high, *fill = torch.cat([grown_cap.sum().reshape(1), bad, tables.fill]).tolist()
    check_id_range(low, high)
    if extra:
        tables, overflow = _regrow(batch, tables, overflow, safe, grown_cap, extra, rank, inc)
        lost, *fill = torch.cat([overflow.any().reshape(1), tables.fill]).tolist()
        if lost:  # cannot happen: a slice of twice the group's tokens stays at most half full
            raise RuntimeError("triton backend: a rebuilt hash table overflowed")
    return replace(tables, largest=largest, n_rows=sum(fill), max_fill=max(fill, default=0))


def _read_sizes(sizes: Tensor) -> list[int]:
    """The device -> host copy before the insert kernel: the largest group, its masked tokens and the
    slots of the first tables (bench/host_plan.py stubs it to time the host alone)."""
    return sizes.tolist()


def first_log_cap(tokens: Tensor) -> Tensor:
    """int32 ``[n_groups]``: log2 of each group's first slice, from its masked tokens (int64), capped
    at ``_MAX_FIRST_LOG_CAP``."""
    return _log2_ceil(torch.ceil(tokens * (2 * _FIRST_GUESS)).long()).clamp(max=_MAX_FIRST_LOG_CAP)


def _slots(log_cap: Tensor) -> Tensor:
    """int64 scalar: the slots of tables of ``2**log_cap`` slots."""
    return (1 << log_cap.long()).sum()


def tile_shape(L: int) -> tuple[int, int]:
    """``(rows, cols)`` of the ``_TILE``-token tiles over ``[B, L]``: whole short rollouts, or one
    rollout's ``_TILE`` positions."""
    cols = min(_TILE, triton.next_power_of_2(L))
    return _TILE // cols, cols


def _log2_ceil(n: Tensor) -> Tensor:
    """int32 ``max(ceil(log2(n)), _MIN_LOG_CAP)`` of a non-negative int64 tensor, exact."""
    n = n.clamp(min=1 << _MIN_LOG_CAP)
    e = torch.ceil(torch.log2(n.double())).long()
    e = e + ((1 << e) < n).long() - ((1 << (e - 1)) >= n).long()
    return e.to(torch.int32)


def _rollout_layout(batch: Batch, stats: GroupStats, words: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per rollout its rank in its group (int32 ``[B]``) and occurrence increment (int64 ``[B]``:
    ``2**32`` if correct, else 1); per group the correct rollouts' presence bits (int32 ``[n, words]``)."""
    g = batch.group
    order = torch.sort(g, stable=True).indices
    start = torch.cumsum(stats.size, 0) - stats.size
    rank = torch.empty_like(g)
    rank[order] = torch.arange(g.shape[0], device=g.device) - start[g[order]]
    inc = torch.where(stats.correct, 1 << 32, 1)
    flag = torch.where(stats.correct, 1 << (rank & 31), 0)  # distinct bits: a sum is an OR
    bits = torch.zeros(batch.n_groups * words, dtype=torch.int64, device=g.device)
    bits.index_add_(0, g * words + (rank >> 5), flag)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)  # reinterpret as int32
    return rank.to(torch.int32), inc, bits.to(torch.int32).view(batch.n_groups, words)


def _insert(batch: Batch, log_cap: Tensor, slots: int, words: int, rank: Tensor, inc: Tensor, correct_bits: Tensor,
            probe_limit: int) -> tuple[HashTables, Tensor, Tensor]:
    """Fresh tables of ``2**log_cap`` slots per group (``slots`` in all), filled with every masked
    token; the per-group overflow flag (int32 ``[n]``): that group's table is incomplete; and the
    out-of-range ids (int64 ``[2]``: the least id if negative, else 0; the largest id if above
    ``MAX_TOKEN_ID``, else ``MAX_TOKEN_ID``)."""
    device = batch.device
    cap = 1 << log_cap.long()
    offset = torch.cumsum(cap, 0) - cap
    keys = torch.full((slots,), EMPTY, dtype=torch.int32, device=device)
    occ = torch.zeros(slots, dtype=torch.int64, device=device)
    bits = torch.zeros(slots * words, dtype=torch.int32, device=device)
    order = torch.empty(slots, dtype=torch.int32, device=device)
    fill = torch.zeros(batch.n_groups, dtype=torch.int32, device=device)
    overflow = torch.zeros_like(fill)
    bad = upload(torch.tensor([0, MAX_TOKEN_ID], dtype=torch.int64), device)
    B, L = batch.responses.shape
    if B and L:
        rows, cols = tile_shape(L)
        _insert_kernel[(triton.cdiv(B, rows), triton.cdiv(L, cols))](
            batch.responses.contiguous(), batch.mask.contiguous().view(torch.uint8), B, L, batch.group, rank, inc,
            keys, occ, bits, words, order, offset, log_cap, fill, overflow, probe_limit, bad, batch.group,
            ROWS=rows, COLS=cols, PREDICATED=not interpreting(), MAPPED=False)
    tables = HashTables(keys=keys, occ=occ, bits=bits, order=order, correct_bits=correct_bits, offset=offset,
                        log_cap=log_cap, fill=fill, words=words, largest=0, n_rows=0, max_fill=0)
    return tables, overflow, bad


def _regrow(batch: Batch, tables: HashTables, overflow: Tensor, safe: Tensor, grown_cap: Tensor, extra: int,
            rank: Tensor, inc: Tensor) -> tuple[HashTables, Tensor]:
    """Rebuild the groups that overflowed, and only them: each gets a fresh slice of ``2**safe[g]``
    slots appended after the others (``extra`` slots in all, ``grown_cap`` per group) and only its
    rollouts are inserted again; the other groups' tables stay as they are (the abandoned slices
    are never read again). Returns the tables and the new overflow flags."""
    device = batch.device
    over = overflow != 0
    old = tables.keys.shape[0]
    offset = torch.where(over, old + torch.cumsum(grown_cap, 0) - grown_cap, tables.offset)
    log_cap = torch.where(over, safe, tables.log_cap)
    fill = torch.where(over, 0, tables.fill).to(torch.int32)
    keys = torch.cat([tables.keys, torch.full((extra,), EMPTY, dtype=torch.int32, device=device)])
    occ = torch.cat([tables.occ, torch.zeros(extra, dtype=torch.int64, device=device)])
    bits = torch.cat([tables.bits, torch.zeros(extra * tables.words, dtype=torch.int32, device=device)])
    order = torch.cat([tables.order, torch.empty(extra, dtype=torch.int32, device=device)])
    overflow = torch.zeros_like(overflow)
    row_map = torch.nonzero(over[batch.group]).flatten()  # the overflowed groups' rollouts
    n_map, L = row_map.shape[0], batch.responses.shape[1]
    bad = upload(torch.tensor([0, MAX_TOKEN_ID], dtype=torch.int64), device)
    if n_map and L:
        rows, cols = tile_shape(L)
        _insert_kernel[(triton.cdiv(n_map, rows), triton.cdiv(L, cols))](
            batch.responses.contiguous(), batch.mask.contiguous().view(torch.uint8), n_map, L, batch.group, rank, inc,
            keys, occ, bits, tables.words, order, offset, log_cap, fill, overflow, _UNLIMITED, bad, row_map,
            ROWS=rows, COLS=cols, PREDICATED=not interpreting(), MAPPED=True)
    return replace(tables, keys=keys, occ=occ, bits=bits, order=order, offset=offset, log_cap=log_cap, fill=fill), overflow


def occupied_rows(tables: HashTables, sort: bool) -> Rows:
    """The occupied slots as flat rows, grouped by group; with ``sort``, ordered by (group, token)."""
    device = tables.keys.device
    n = tables.n_rows
    slot = torch.empty(n, dtype=torch.int64, device=device)
    group = torch.empty(n, dtype=torch.int32, device=device)
    if n:
        row_start = torch.cumsum(tables.fill.long(), 0) - tables.fill.long()
        grid = (tables.fill.shape[0], triton.cdiv(tables.max_fill, _FLAT_BLOCK))
        _flatten_kernel[grid](tables.order, tables.offset, tables.fill, row_start, slot, group, BLOCK=_FLAT_BLOCK)
    if sort and n:
        order = torch.sort((group.long() << 31) | tables.keys[slot].long()).indices
        slot, group = slot[order], group[order]
    return Rows(slot, group)


def row_counts(tables: HashTables, rows: Rows) -> RowCounts:
    """``token, a, b, f_c, f_w`` (int64 ``[U]``) of each row."""
    n = rows.slot.shape[0]
    out = [torch.empty(n, dtype=torch.int64, device=rows.slot.device) for _ in range(5)]
    if n:
        _row_counts_kernel[(triton.cdiv(n, _COUNT_BLOCK),)](
            rows.slot, rows.group, n, tables.keys, tables.occ, tables.bits, tables.correct_bits, tables.words,
            *out, BLOCK=_COUNT_BLOCK)
    return RowCounts(*out)
