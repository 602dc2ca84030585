"""The CUDA backend: hand-written kernels (csrc/), one thread block per group of rollouts.

Each block builds its group's (token id -> a, b, f_c, f_w) hash table in shared memory from one read
of the tokens, scores every slot (exact float64 Fisher, IG, direction, squash) and then writes either
the group's rows sorted by token (``key_token_scores``) or its ``[B, L]`` advantages
(``token_advantage``). A group whose distinct ids overflow the shared table is redone with a table in
global memory sized to it. Group counts and the rollout advantage come from ``torch_backend``;
``fisher="upstream"`` takes its float32 p-values from ``fisher.upstream_pvalue`` on the CPU, as the
published code computed them.

The compiled module ``ktae_kernels._C`` is imported on first use, so this module imports without it.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterator

import torch
from torch import Tensor

from . import method
from . import torch_backend as tb
from .api import MAX_TOKEN_ID
from .backends import BackendUnavailableError
from .config import KTAEConfig
from .fisher import log_factorial_table
from .types import Batch, KeyTokenScores

#: how to build ``ktae_kernels._C`` (on a machine with nvcc and a CUDA build of torch).
BUILD_COMMAND = 'TORCH_CUDA_ARCH_LIST="9.0" KTAE_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation'

# Kernel modes and constants, as in csrc/ktae_kernels.h.
COUNT, ROWS, ADVANTAGE = 0, 1, 2
MAX_THREADS = 512
UNROLL = 4
#: fewest threads per block and fewest slots of an automatically sized table.
MIN_THREADS = 64
MIN_CAPACITY = 32
#: most masked tokens one group may hold (keeps slot indices and counters in 32 bits).
MAX_GROUP_TOKENS = 2**30


def max_keys(capacity: int) -> int:
    """Most distinct ids a table of ``capacity`` slots takes before it counts as overflowed (3/4)."""
    return capacity - capacity // 4


def table_capacity(n_keys: int) -> int:
    """Smallest power-of-two table of at least ``MIN_CAPACITY`` slots that holds ``n_keys`` ids."""
    capacity = MIN_CAPACITY
    while max_keys(capacity) < n_keys:
        capacity *= 2
    return capacity


def presence_words(max_group_size: int) -> int:
    """32-bit presence words per slot: one bit per rollout of the largest group."""
    return max(1, -(-max_group_size // 32))


def header_bytes(words: int) -> int:
    """Per-block shared header: two counters and the correct-rollout bitmask, 8-byte aligned."""
    return (8 + 4 * words + 7) // 8 * 8


def shared_table_bytes(capacity: int, words: int) -> int:
    """Dynamic shared memory of a block whose table of ``capacity`` slots lives in shared memory."""
    return header_bytes(words) + capacity * (12 + 4 * words)


def choose_shared_capacity(max_group_tokens: int, words: int, shared_limit: int) -> int:
    """Slots of the shared-memory tables: enough for every id of the largest group if that fits in
    ``shared_limit`` bytes, else the largest power of two that fits; 0 when not even
    ``MIN_CAPACITY`` slots fit (every group then uses a global-memory table)."""
    capacity = table_capacity(max_group_tokens)
    while capacity >= MIN_CAPACITY and shared_table_bytes(capacity, words) > shared_limit:
        capacity //= 2
    return capacity if capacity >= MIN_CAPACITY else 0


def block_threads(length: int) -> int:
    """Threads per block for rollouts of ``length`` positions.

    Each pass of a block covers ``threads * UNROLL`` positions of one rollout: use as few passes as
    ``MAX_THREADS`` allows, split evenly, in whole warps, and at least ``MIN_THREADS``.
    """
    passes = max(1, -(-length // (MAX_THREADS * UNROLL)))
    per_pass = -(-length // (passes * UNROLL))
    return min(MAX_THREADS, max(MIN_THREADS, -(-per_pass // 32) * 32))


def key_token_scores(batch: Batch, config: KTAEConfig, *, table_slots: int | None = None,
                     extension: ModuleType | None = None) -> KeyTokenScores:
    """Per (group, token) statistics, rows sorted by (group, token).

    ``table_slots``: force the shared-memory table size (a power of two >= 2); groups with more
    than 3/4 as many distinct ids use the global-memory fallback. ``extension``: the compiled module
    (default ``ktae_kernels._C``; the tests pass the CPU emulator build).
    """
    with _device_context(batch.device):
        plan = _prepare(extension or load_extension(), batch, config, table_slots)
        return _scores(plan, batch, config)[0]


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None, *,
                    table_slots: int | None = None, extension: ModuleType | None = None) -> Tensor:
    """float32 ``[B, L]``: ``(A_i + weight * score[group(i), token]) * mask`` (arguments as above;
    ``given``: optional float64 ``[B]`` rollout advantage replacing ``config.baseline``), in ``out`` when given."""
    with _device_context(batch.device):
        plan = _prepare(extension or load_extension(), batch, config, table_slots)
        result = _advantage(plan, batch, config, given)
    return result if out is None else out.copy_(result)


def load_extension() -> ModuleType:
    """``ktae_kernels._C``; BackendUnavailableError saying how to build it when it is missing."""
    try:
        return importlib.import_module("ktae_kernels._C")
    except ImportError as err:
        raise BackendUnavailableError(
            f"the cuda backend needs the compiled extension ktae_kernels._C, which cannot be imported "
            f"({err}). Build it on a machine with the CUDA toolkit (nvcc) and a CUDA build of torch: "
            f"`{BUILD_COMMAND}` (set TORCH_CUDA_ARCH_LIST to your GPU's compute capability)."
        ) from None


@dataclass(frozen=True)
class _Plan:
    """One call's inputs in kernel layout and its launch geometry.

    common: the ``launch`` arguments every pass shares. group_tokens: masked tokens per group
    (host ints, bounds of the distinct ids). capacity: slots of the shared tables (0: none).
    """

    ext: ModuleType
    common: dict
    stats: tb.GroupStats
    n_groups: int
    group_tokens: list[int]
    words: int
    capacity: int


def _prepare(ext: ModuleType, batch: Batch, config: KTAEConfig, table_slots: int | None) -> _Plan:
    device = batch.device
    stats = tb.group_stats(batch, config)
    n = batch.n_groups
    starts = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(stats.size, 0, out=starts[1:])
    group_tokens = (stats.T_c + stats.T_w).tolist()
    max_size = int(stats.size.max()) if n else 0
    max_tokens = max(group_tokens, default=0)
    if max_tokens > MAX_GROUP_TOKENS:
        raise ValueError(f"`responses`: the cuda backend takes at most 2**30 masked tokens per group, "
                         f"a group holds {max_tokens}")
    words = presence_words(max_size)
    limit = ext.max_shared_bytes(_device_index(device))
    if table_slots is None:
        capacity = choose_shared_capacity(max_tokens, words, limit)
    else:
        capacity = _check_table_slots(table_slots, words, limit)
    ignore = [i for i in config.ignore_token_ids if i <= MAX_TOKEN_ID]
    common = dict(
        responses=batch.responses.contiguous(),
        mask=batch.mask.contiguous(),
        members=torch.argsort(batch.group, stable=True),
        starts=starts,
        correct=stats.correct.contiguous(),
        group_counts=torch.stack([stats.n_c, stats.n_w, stats.T_c, stats.T_w]).contiguous(),
        log_fact=log_factorial_table(max_size, device),
        ignore_ids=torch.tensor(ignore, dtype=torch.int64, device=device),
        words=words,
        shared_capacity=capacity,
        params=[config.alpha, config.beta, config.k1, config.b, config.top, config.weight],
        use_tf=config.use_tf,
        threads=block_threads(batch.responses.shape[1]),
        stream=torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0,
    )
    return _Plan(ext, common, stats, n, group_tokens, words, capacity)


def _check_table_slots(slots: object, words: int, limit: int) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2 or slots & (slots - 1):
        raise ValueError(f"`table_slots` must be a power of two >= 2, got {slots!r}")
    if shared_table_bytes(slots, words) > limit:
        raise ValueError(f"`table_slots` = {slots} needs {shared_table_bytes(slots, words)} bytes of "
                         f"shared memory, the device allows {limit}")
    return slots


def _launch(plan: _Plan, mode: int, groups: list[int] | None, status: Tensor, *,
            capacities: list[int] | None = None, **outputs: Tensor | None) -> None:
    """One kernel pass over ``groups`` (None: every group) with shared-memory tables, or with
    global-memory tables of the given ``capacities`` (one per group)."""
    device = status.device
    if groups is None:
        block_group = torch.arange(plan.n_groups, dtype=torch.int64, device=device)
    else:
        block_group = torch.tensor(groups, dtype=torch.int64, device=device)
    if block_group.numel() == 0:
        return
    workspace: dict[str, Tensor | None] = dict.fromkeys(("ws_keys", "ws_counts", "ws_presence", "ws_offset", "ws_capacity"))
    if capacities is None:
        shared_bytes = shared_table_bytes(plan.capacity, plan.words)
    else:
        slots = sum(capacities)
        offsets = list(itertools.accumulate(capacities, initial=0))[:-1]
        workspace = dict(
            ws_keys=torch.empty(slots, dtype=torch.int32, device=device),
            ws_counts=torch.empty(slots, dtype=torch.int64, device=device),
            ws_presence=torch.empty(slots * plan.words, dtype=torch.int32, device=device),
            ws_offset=torch.tensor(offsets, dtype=torch.int64, device=device),
            ws_capacity=torch.tensor(capacities, dtype=torch.int64, device=device),
        )
        shared_bytes = header_bytes(plan.words)
    args = dict.fromkeys(("row_offset", "row_ints", "row_reals", "base", "advantage", "given_token", "given_score"))
    args.update(outputs)
    plan.ext.launch(mode=mode, shared_table=capacities is None, block_group=block_group, status=status,
                    shared_bytes=shared_bytes, **plan.common, **workspace, **args)


def _table_pass(plan: _Plan, mode: int, spill_capacity: Callable[[int], int], shared_groups: list[int] | None = None,
                **outputs: Tensor | None) -> tuple[Tensor, list[int]]:
    """Run ``mode`` on every group: ``shared_groups`` (None: all) with shared-memory tables first,
    then the rest and those that overflowed with global tables of ``spill_capacity(g)`` slots.
    Returns the distinct ids per group and the groups that took a global table."""
    status = torch.full((plan.n_groups,), -1, dtype=torch.int64, device=plan.common["starts"].device)
    if plan.capacity:
        _launch(plan, mode, shared_groups, status, **outputs)
    spilled = torch.nonzero(status < 0).flatten().tolist()
    _launch(plan, mode, spilled, status, capacities=[spill_capacity(g) for g in spilled], **outputs)
    if spilled and bool((status < 0).any()):
        raise RuntimeError("ktae_kernels.cuda: a global-memory table overflowed (internal error)")
    return status, spilled


def _scores(plan: _Plan, batch: Batch, config: KTAEConfig) -> tuple[KeyTokenScores, Tensor, list[int]]:
    """The rows, their offsets per group (int64 ``[n_groups + 1]``) and the groups that need a
    global-memory table."""
    device = plan.common["starts"].device
    counts, spilled = _table_pass(plan, COUNT, lambda g: table_capacity(plan.group_tokens[g]))
    row_offset = torch.zeros(plan.n_groups + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=row_offset[1:])
    n_rows = int(row_offset[-1])
    ints = torch.empty(8, n_rows, dtype=torch.int64, device=device)
    reals = torch.empty(5, n_rows, dtype=torch.float64, device=device)
    host_counts = counts.tolist()
    fits = sorted(set(range(plan.n_groups)) - set(spilled))
    status, _ = _table_pass(plan, ROWS, lambda g: table_capacity(host_counts[g]), fits,
                            row_offset=row_offset, row_ints=ints, row_reals=reals)
    if not torch.equal(status, counts):
        raise RuntimeError("ktae_kernels.cuda: the rows pass found other tokens than the count pass (internal error)")
    stats = plan.stats
    scores = KeyTokenScores(
        group=ints[0], token=ints[1], a=ints[2], b=ints[3], c=ints[4], d=ints[5], f_c=ints[6], f_w=ints[7],
        p_value=reals[0], F=reals[1], IG=reals[2], x=reals[3], score=reals[4],
        n_c=stats.n_c, n_w=stats.n_w, T_c=stats.T_c, T_w=stats.T_w, group_labels=batch.group_labels,
    )
    if config.fisher == "upstream":
        scores = _with_upstream_fisher(scores, config)
    return scores, row_offset, fits


def _with_upstream_fisher(s: KeyTokenScores, config: KTAEConfig) -> KeyTokenScores:
    """The rows' statistics with the published float32 p-values (``method.score_rows``)."""
    rows = method.Rows(group=s.group, token=s.token, a=s.a, b=s.b, f_c=s.f_c, f_w=s.f_w)
    return method.score_rows(rows, s.n_c, s.n_w, s.T_c, s.T_w, config, s.group_labels)


def _advantage(plan: _Plan, batch: Batch, config: KTAEConfig, given: Tensor | None) -> Tensor:
    outputs: dict[str, Tensor] = dict(
        base=tb.rollout_advantage(batch, plan.stats, config, given).contiguous(),
        advantage=torch.empty(batch.responses.shape, dtype=torch.float32, device=batch.device),
    )
    fits = None
    if config.fisher == "upstream":
        scores, row_offset, fits = _scores(plan, batch, config)
        outputs.update(row_offset=row_offset, given_token=scores.token.contiguous(),
                       given_score=scores.score.contiguous())
    _table_pass(plan, ADVANTAGE, lambda g: table_capacity(plan.group_tokens[g]), fits, **outputs)
    return outputs["advantage"]


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def _device_context(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the launches (the binding launches on the current device)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
