"""The cuda backend's launches: each pass's arguments checked, packed into the header's structs
(``abi``) and enqueued through a launcher (``runtime.DriverLauncher`` on a GPU: torch's current
stream; the tests' CPU emulator runs the same sequence on host threads).

``advantage`` enqueues the whole ``token_advantage``, nothing read back: zero the flags, the scan and
groups passes, a shared-table pass over every group, a global-memory pass over the groups it left
(its blocks exit at once when none is left), and, with ``nan_on_error``, a pass that writes NaN over
``out`` when the flags hold a bad input. In ``kCount`` and ``kRows`` modes (``key_token_scores``) the
table passes write each group's distinct ids, or its rows, instead of advantages.
``table_statistics`` is the statistics of a grid.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from ...options import KernelVariant
from . import abi

K = abi.CONSTANTS
#: most blocks of one launch's grid (gridDim.x).
MAX_GRID_BLOCKS = 2**31 - 1


class Launcher(Protocol):
    """Runs kernel ``name`` (``runtime.KERNELS``) of the kernels compiled in ``variant`` over ``grid`` blocks
    of ``block`` threads with ``smem`` bytes of dynamic shared memory; ``args``: its arguments as ctypes
    objects, in order."""

    variant: KernelVariant

    def launch(self, name: str, grid: int, block: int, smem: int, args: tuple) -> None: ...

    def max_shared_bytes(self) -> int: ...


def check(t: Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    """ValueError naming ``name`` unless ``t`` is a contiguous ``dtype`` tensor of ``shape`` on ``device``."""
    if t is None:
        raise ValueError(f"ktae_kernels.cuda: `{name}` must be set")
    if t.dtype != dtype:
        raise ValueError(f"ktae_kernels.cuda: `{name}` must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"ktae_kernels.cuda: `{name}` must be on {device}, got {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"ktae_kernels.cuda: `{name}` must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"ktae_kernels.cuda: `{name}` must be contiguous")


def ptr(t: Tensor | None) -> int:
    """The address of ``t``'s data (0 for None or an empty tensor: the kernels read nothing there)."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def check_threads(threads: int) -> None:
    if not (32 <= threads <= K["kMaxThreads"] and threads % 32 == 0):
        raise ValueError(f"ktae_kernels.cuda: `threads` must be a multiple of 32 in [32, {K['kMaxThreads']}], "
                         f"got {threads}")


# ------------------------------------------------------------------------------ token_advantage
@dataclass
class AdvantageInputs:
    """The batch and where the results go: responses, mask, group (dense ids), members (sorted by group),
    rewards float64 [B], correct (caller labels, bool [B]) and given (rollout advantage, float64 [B])
    when given; workspace int64 (``advantage_workspace_size``, its head the flags, then each group's
    status: its distinct ids); invalid: 0-dim bool or int64, non-zero when a value check the host
    enqueued on the device failed (``kFlagBadValues``), or None; ``mode`` (ktae_args.h ``Mode``):
    kAdvantage writes out float32 [B, L], kRows the rows into row_ints int64 [kRowInts, n_rows] from
    row_offset int64 [n_groups + 1], kCount nothing more."""

    responses: Tensor
    mask: Tensor
    group: Tensor
    members: Tensor
    rewards: Tensor
    n_groups: int
    workspace: Tensor
    out: Tensor | None = None
    correct: Tensor | None = None
    given: Tensor | None = None
    invalid: Tensor | None = None
    mode: int = K["kAdvantage"]
    row_offset: Tensor | None = None
    row_ints: Tensor | None = None


@dataclass
class Scoring:
    """Where the scores come from and the method's scalars: the device grid (table_values float64
    [2, size] for groups of up to grid_bound rollouts) and log_factorial (groups past it), or the given
    rows (row_offset, given_token, given_score: fisher="upstream"); the ignored ids; params = [alpha,
    beta, k1, b, top, weight]; constants = [log_rtol, log_err, p_one, ln2]; the baseline code."""

    ignore_ids: Tensor
    params: list
    constants: list
    table_values: Tensor | None = None
    grid_bound: int = 0
    log_factorial: Tensor | None = None
    row_offset: Tensor | None = None
    given_token: Tensor | None = None
    given_score: Tensor | None = None
    use_tf: bool = True
    threshold: float = 0.0
    baseline: int = 0
    eps: float = 0.0


@dataclass
class AdvantageLaunch:
    """The launch shape: the shared pass's bytes and slot cap, the global pass's blocks and workspace
    bytes, whether the shared pass records each position's slot, threads per block; nan_on_error: a bad
    input writes NaN over ``out`` (a captured call's replay) instead of nothing; largest_first: the table
    passes take the groups by masked tokens, most first (``group_order``)."""

    threads: int
    shared_bytes: int = 0
    max_capacity: int = 2
    allow_packed: bool = True
    fallback_blocks: int = 0
    fallback_bytes: int = 0
    slot_index: bool = False
    nan_on_error: bool = False
    largest_first: bool = False


@dataclass(frozen=True)
class Layout:
    """int64 offsets of the parts of ``advantage``'s workspace, in this order: the flags
    [kAdvantageFlags], status [n], starts [n + 1], group_counts [4 n], lengths [B], extent [B], base [B]
    (float64), correct [B] (bool, rounded up to 8 bytes), the global-memory tables (fallback_bytes),
    then, with a slot index, B * L uint16 (rounded up to 8 bytes); ``total`` entries."""

    status: int
    starts: int
    group_counts: int
    lengths: int
    extent: int
    base: int
    correct: int
    tables: int
    slot_index: int
    total: int


def layout(B: int, n_groups: int, fallback_bytes: int, index_positions: int = 0) -> Layout:
    """The workspace ``Layout`` of a batch of ``B`` rollouts in ``n_groups`` groups."""
    status = K["kAdvantageFlags"]
    starts = status + n_groups
    group_counts = starts + n_groups + 1
    lengths = group_counts + 4 * n_groups
    extent = lengths + B
    base = extent + B
    correct = base + B
    tables = correct + (B + 7) // 8
    slot_index = tables + (fallback_bytes + 7) // 8
    return Layout(status, starts, group_counts, lengths, extent, base, correct, tables, slot_index,
                  slot_index + (2 * index_positions + 7) // 8)


def advantage_workspace_size(B: int, n_groups: int, fallback_bytes: int, index_positions: int = 0) -> int:
    """int64 entries of ``advantage``'s workspace."""
    return layout(B, n_groups, fallback_bytes, index_positions).total


def _check_advantage(inputs: AdvantageInputs, scoring: Scoring, shape: AdvantageLaunch) -> Layout:
    """Every argument of ``advantage`` checked (ValueError naming it); the workspace layout."""
    device = inputs.responses.device
    if inputs.responses.dim() != 2:
        raise ValueError(f"ktae_kernels.cuda: `responses` must be [B, L], got {tuple(inputs.responses.shape)}")
    B, L = inputs.responses.shape
    n = inputs.n_groups
    if n < 0:
        raise ValueError("ktae_kernels.cuda: `n_groups` must be >= 0")
    for name, value, dtype, size in (("responses", inputs.responses, torch.int64, (B, L)),
                                     ("mask", inputs.mask, torch.bool, (B, L)), ("group", inputs.group, torch.int64, (B,)),
                                     ("members", inputs.members, torch.int64, (B,)),
                                     ("rewards", inputs.rewards, torch.float64, (B,)),
                                     ("ignore_ids", scoring.ignore_ids, torch.int64, (scoring.ignore_ids.numel(),))):
        check(value, name, dtype, size, device)
    if inputs.mode not in (K["kAdvantage"], K["kCount"], K["kRows"]):
        raise ValueError(f"ktae_kernels.cuda: `mode` must be 0 (advantage), 1 (count) or 2 (rows), got {inputs.mode}")
    if inputs.mode == K["kRows"]:
        if inputs.row_ints is None or inputs.row_offset is None:
            raise ValueError("ktae_kernels.cuda: `row_offset` and `row_ints` are required in rows mode")
        check(inputs.row_offset, "row_offset", torch.int64, (n + 1,), device)
        check(inputs.row_ints, "row_ints", torch.int64, (K["kRowInts"], inputs.row_ints.shape[-1]), device)
    advantages = inputs.mode == K["kAdvantage"]
    if advantages:
        check(inputs.out, "out", torch.float32, (B, L), device)
    elif shape.nan_on_error or shape.slot_index or scoring.given_token is not None:
        raise ValueError("ktae_kernels.cuda: `nan_on_error`, `slot_index` and the given rows go with the "
                         "advantage mode only")
    if inputs.correct is not None:
        check(inputs.correct, "correct", torch.bool, (B,), device)
    if inputs.given is not None:
        check(inputs.given, "given", torch.float64, (B,), device)
    if inputs.invalid is not None and (inputs.invalid.dim() != 0 or inputs.invalid.device != device):
        raise ValueError(f"ktae_kernels.cuda: `invalid` must be a 0-dim tensor on {device}")
    if scoring.baseline not in (K["kBaselineGrpo"], K["kBaselineMean"], K["kBaselineNone"], K["kBaselineGiven"]):
        raise ValueError(f"ktae_kernels.cuda: `baseline` must be 0 (grpo), 1 (mean), 2 (none) or 3 (given), "
                         f"got {scoring.baseline}")
    if (scoring.baseline == K["kBaselineGiven"]) != (inputs.given is not None):
        raise ValueError("ktae_kernels.cuda: `given` goes with baseline 3 (given), and only with it")
    if len(scoring.params) != 6 or len(scoring.constants) != 4:
        raise ValueError("ktae_kernels.cuda: `params` must be [alpha, beta, k1, b, top, weight] and `constants` "
                         "[log_rtol, log_err, p_one, ln2]")
    check_threads(shape.threads)
    if shape.max_capacity < 2 or shape.max_capacity & (shape.max_capacity - 1):
        raise ValueError(f"ktae_kernels.cuda: `max_capacity` must be a power of two >= 2, got {shape.max_capacity}")
    if min(shape.shared_bytes, shape.fallback_blocks, shape.fallback_bytes) < 0:
        raise ValueError("ktae_kernels.cuda: `shared_bytes`, `fallback_blocks` and `fallback_bytes` must be >= 0")
    if shape.shared_bytes == 0 and shape.fallback_blocks == 0 and n > 0:
        raise ValueError("ktae_kernels.cuda: no pass would take the groups (shared_bytes and fallback_blocks are 0)")
    if shape.fallback_blocks and shape.fallback_bytes // shape.fallback_blocks < 64:
        raise ValueError("ktae_kernels.cuda: `fallback_bytes` gives each of the `fallback_blocks` less than 64 bytes")
    parts = layout(B, n, shape.fallback_bytes, B * L if shape.slot_index else 0)
    check(inputs.workspace, "workspace", torch.int64, (inputs.workspace.numel(),), device)
    if inputs.workspace.numel() < parts.total:
        raise ValueError(f"ktae_kernels.cuda: `workspace` must hold {parts.total} int64, got {inputs.workspace.numel()}")
    largest = B - n + 1 if n > 0 else 0  # rollouts of the largest possible group
    lf_size = 0
    if scoring.log_factorial is not None:
        check(scoring.log_factorial, "log_factorial", torch.float64, (scoring.log_factorial.numel(),), device)
        lf_size = scoring.log_factorial.numel()
    if scoring.table_values is not None:
        values, bound = scoring.table_values, scoring.grid_bound
        if values.dim() != 2:
            raise ValueError(f"ktae_kernels.cuda: `table_values` must be [2, size], got {tuple(values.shape)}")
        check(values, "table_values", torch.float64, (2, values.shape[1]), device)
        # every table of a group of up to grid_bound rollouts: C(bound + 4, 4) entries
        if bound < 0 or values.shape[1] < (bound + 4) * (bound + 3) // 2 * (bound + 2) // 3 * (bound + 1) // 4:
            raise ValueError(f"ktae_kernels.cuda: `table_values` is too small for `grid_bound` {bound}")
    given_rows = (scoring.row_offset, scoring.given_token, scoring.given_score)
    if len({x is None for x in given_rows}) != 1:
        raise ValueError("ktae_kernels.cuda: `row_offset`, `given_token` and `given_score` go together")
    if scoring.given_token is not None:
        n_rows = scoring.given_token.numel()
        check(scoring.given_token, "given_token", torch.int64, (n_rows,), device)
        check(scoring.given_score, "given_score", torch.float64, (n_rows,), device)
        check(scoring.row_offset, "row_offset", torch.int64, (n + 1,), device)
    elif advantages and (scoring.table_values is None or largest > scoring.grid_bound) and lf_size <= largest:
        raise ValueError(f"ktae_kernels.cuda: `log_factorial` must hold log(k!) up to B - n_groups + 1 = {largest} "
                         f"(groups past the grid), got {lf_size} entries")
    return parts


def advantage(launcher: Launcher, inputs: AdvantageInputs, scoring: Scoring, shape: AdvantageLaunch) -> None:
    """The whole ``token_advantage`` enqueued, nothing read back (see the module docstring). The workspace
    is written; its first ``kAdvantageFlags`` entries are the flags."""
    parts = _check_advantage(inputs, scoring, shape)
    B, L = inputs.responses.shape
    n = inputs.n_groups
    ws = inputs.workspace.data_ptr()
    at = lambda offset: ws + 8 * offset  # noqa: E731  (an int64 entry's address)
    prepare = abi.PrepareArgs(
        responses=ptr(inputs.responses), mask=ptr(inputs.mask), B=B, L=L, group=ptr(inputs.group),
        members=ptr(inputs.members), n_groups=n, rewards=ptr(inputs.rewards), given=ptr(inputs.given),
        given_correct=ptr(inputs.correct), threshold=scoring.threshold, baseline=scoring.baseline, eps=scoring.eps,
        bad_ids=at(K["kFlagLowId"]), most_tokens=at(K["kFlagMostTokens"]), bad_values=at(K["kFlagBadValues"]),
        lengths=at(parts.lengths), extent=at(parts.extent), correct=at(parts.correct), starts=at(parts.starts),
        group_counts=at(parts.group_counts), base=0 if inputs.given is not None else at(parts.base),
        status=at(parts.status))
    alpha, beta, k1, b, top, weight = scoring.params
    log_rtol, log_err, p_one, ln2 = scoring.constants
    kernel = abi.KernelArgs(
        responses=prepare.responses, mask=prepare.mask, length=L, members=prepare.members, starts=prepare.starts,
        correct=prepare.correct, group_counts=prepare.group_counts, n_groups=n,
        table_values=ptr(scoring.table_values),
        table_size=0 if scoring.table_values is None else scoring.table_values.shape[1],
        grid_bound=min(scoring.grid_bound, 2**31 - 1), log_factorial=ptr(scoring.log_factorial),
        lf_size=0 if scoring.log_factorial is None else scoring.log_factorial.numel(),
        log_rtol=log_rtol, log_err=log_err, p_one=p_one, ln2=ln2,
        ignore_ids=ptr(scoring.ignore_ids), n_ignore=scoring.ignore_ids.numel(), n_items=n, mode=inputs.mode,
        alpha=alpha, beta=beta, k1=k1, bm25_b=b, top=top, weight=weight, use_tf=scoring.use_tf,
        bad_ids=prepare.bad_ids, status=at(parts.status),
        base=ptr(inputs.given) if inputs.given is not None else prepare.base,
        advantage=ptr(inputs.out), extent=prepare.extent, shared_bytes=shape.shared_bytes,
        max_capacity=shape.max_capacity, largest_keys=at(K["kFlagDistinct"]), shared_need=at(K["kFlagSharedNeed"]),
        left=at(K["kFlagLeft"]), most_tokens=prepare.most_tokens, bad_values=prepare.bad_values,
        nan_on_error=shape.nan_on_error, allow_packed=shape.allow_packed, ws_bytes=at(parts.tables),
        ws_slice_bytes=shape.fallback_bytes // shape.fallback_blocks // 8 * 8 if shape.fallback_blocks else 0,
        slot_index=at(parts.slot_index) if shape.slot_index else 0)
    if inputs.mode == K["kRows"]:
        kernel.row_offset, kernel.row_ints = ptr(inputs.row_offset), ptr(inputs.row_ints)
        kernel.n_rows = inputs.row_ints.shape[-1]
    if scoring.given_token is not None:
        kernel.use_given = True
        kernel.row_offset, kernel.given_token = ptr(scoring.row_offset), ptr(scoring.given_token)
        kernel.given_score, kernel.n_rows = ptr(scoring.given_score), scoring.given_token.numel()
    flags = inputs.workspace[:K["kAdvantageFlags"]]
    flags.zero_()  # on torch's current stream, as the launches
    if inputs.invalid is not None:
        flags[K["kFlagBadValues"]].copy_(inputs.invalid)
    counts = inputs.workspace[parts.group_counts:parts.group_counts + 4 * n].view(4, n)
    _enqueue(launcher, prepare, kernel, shape, B * L, (lambda: group_order(counts)) if shape.largest_first else None)


def groups_blocks(items: int) -> int:
    """Blocks of ``kGroupsThreads`` threads for ``items`` work items of the groups passes (grid-stride beyond)."""
    return max(1, min(65535, -(-items // K["kGroupsThreads"])))


def nan_blocks(positions: int) -> int:
    """Blocks of ``nan_on_error_kernel`` for ``positions`` (grid-stride beyond)."""
    return max(1, min(1024, -(-positions // K["kNanThreads"])))


def group_order(group_counts: Tensor) -> Tensor:
    """int64 ``[n]``: the groups by masked tokens (``T_c + T_w`` of the groups pass's int64 ``[4, n]``
    counts), most first, ties by group id; enqueued on the device, nothing read back."""
    return torch.argsort(group_counts[2] + group_counts[3], descending=True, stable=True)


def _enqueue(launcher: Launcher, prepare: abi.PrepareArgs, kernel: abi.KernelArgs, shape: AdvantageLaunch,
             positions: int, order: Callable[[], Tensor] | None = None) -> None:
    """The launches of ``advantage`` after the flags are zeroed, in order; ``order``: the table passes'
    ``group_order``, enqueued after the groups passes."""
    threads = shape.threads
    if prepare.B > 0:
        launcher.launch("ktae::scan_kernel", min(prepare.B, MAX_GRID_BLOCKS), threads, 32, (prepare,))
    launcher.launch("ktae::groups_kernel", groups_blocks(prepare.B + 1), K["kGroupsThreads"], 0, (prepare,))
    if prepare.n_groups > 0:
        launcher.launch("ktae::group_sums_kernel", groups_blocks(32 * prepare.n_groups), K["kGroupsThreads"],
                        8 * K["kGroupsThreads"], (prepare,))
    if kernel.n_items == 0:
        return
    taken = None if order is None else order()  # held until the table passes are enqueued
    kernel.group_order = ptr(taken)
    if kernel.shared_bytes > 0:
        launcher.launch("ktae::dynamic_kernel<true>", min(kernel.n_items, MAX_GRID_BLOCKS), threads,
                        kernel.shared_bytes, (kernel,))
    if shape.fallback_blocks > 0:
        launcher.launch("ktae::dynamic_kernel<false>", shape.fallback_blocks, threads, 16, (kernel,))
    if kernel.nan_on_error:
        launcher.launch("ktae::nan_on_error_kernel", nan_blocks(positions), K["kNanThreads"], 0,
                        (kernel, ctypes.c_int64(positions)))


# ------------------------------------------------------------------------------ per-table statistics
def table_statistics(launcher: Launcher, cells: Tensor, log_factorial: Tensor, angle: Tensor, constants: list,
                     out: Tensor) -> None:
    """The per-table statistics of a grid (ktae_args.h, StatsArgs): ``constants`` = [log1p(1e-14), LOG_ERR,
    P_ONE, log(2), alpha, beta]; ``out`` float64 [5, size] is written."""
    if cells.dim() != 2 or cells.shape[0] != 4:
        raise ValueError(f"ktae_kernels.cuda: `cells` must be [4, size], got {tuple(cells.shape)}")
    device, size = cells.device, cells.shape[1]
    check(cells, "cells", torch.int32, (4, size), device)
    check(log_factorial, "log_factorial", torch.float64, (log_factorial.numel(),), device)
    check(angle, "angle", torch.float64, (angle.numel(),), device)
    check(out, "out", torch.float64, (5, size), device)
    if len(constants) != 6:
        raise ValueError(f"ktae_kernels.cuda: `constants` must be [log_rtol, log_err, p_one, ln2, alpha, beta], "
                         f"got {len(constants)} values")
    if size == 0:
        return
    log_rtol, log_err, p_one, ln2, alpha, beta = constants
    args = abi.StatsArgs(cells=ptr(cells), size=size, log_factorial=ptr(log_factorial), angle=ptr(angle),
                         log_rtol=log_rtol, log_err=log_err, p_one=p_one, ln2=ln2, alpha=alpha, beta=beta, out=ptr(out))
    launcher.launch("ktae::table_statistics_kernel", -(-size // K["kStatsThreads"]), K["kStatsThreads"], 0, (args,))


# ------------------------------------------------------------------------------ table sizes (ktae_args.h)
def header_bytes(words: int) -> int:
    """Per-block shared header: two counters and the correct-rollout bitmask, 8-byte aligned."""
    return (8 + 4 * words + 7) // 8 * 8


def shared_table_bytes(capacity: int, words: int, packed: bool = False) -> int:
    """Dynamic shared memory of a block whose table of ``capacity`` slots lives in shared memory
    (``packed``: 12 bytes a slot)."""
    return header_bytes(words) + capacity * (12 if packed else 12 + 4 * words)
