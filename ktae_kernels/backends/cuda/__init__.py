"""The CUDA backend: hand-written kernels (``ktae_kernels.cu``), one thread block per group of rollouts.

``token_advantage`` is one ``pipeline.advantage`` call sized from ``B``, ``L`` and the number of groups
alone (``static_plan``), which enqueues: a scan pass (masked tokens, extents, the id-range flag), the
groups passes (correct flags, offsets, counts, ``A_i``), a shared-memory pass in which each block builds
its group's (token id -> a, b, f_c, f_w) hash table, scores every slot (its table's statistics from the
device grid, ``device.DeviceState.grid``, computed by the statistics kernel; groups past
``device.GRID_MAX_GROUP`` compute theirs per slot) and writes the group's advantages; then a
global-memory pass that takes the groups whose distinct ids overflowed their shared table, splitting
their ids into hash partitions until each fits (its blocks exit at once when none overflowed). The
kernels size each group's table on the device, by the distinct ids the earlier calls of this layout
held (``DeviceState.learnt``, ``device.learnt_key``). Before the call nothing is read: the members sorted by
group come with the group ids (``Batch.members``), and the input values are checked on the device
(``Batch.unchecked``); after it, one read of the flags (``Flags``: the id range and the values, the API's
checks folded in; the sizes learnt), skipped while a CUDA graph
captures (``capture``, refused before a call of the layout completed: ``TokenAdvantagePlan.check``
reads them after a replay). A bad input leaves ``out`` untouched (the table passes write nothing once
a flag is set), or, in a replay of a captured call, NaN everywhere.

``key_token_scores``, and the rows whose float32 p-values ``fisher="upstream"`` computes on the host
before its advantage call, come from the same passes in two other modes: ``COUNT`` (each group's
distinct ids), one device -> host copy of those sizes, then ``ROWS`` (each group's rows, which the host
sorts by (group, token)).

The kernels are compiled at first use by NVRTC (``runtime``: cached on disk) and launched from Python on
torch's current stream (``pipeline``); every function takes the ``launcher`` that runs them (default: the
device's ``runtime.DriverLauncher``; the tests pass the CPU emulator).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ... import method
from ...config import KTAEConfig
from ...options import DEFAULT_OPTIONS, CudaTuning, ExecutionOptions, KernelVariant
from ...types import Batch, KeyTokenScores, ValueCheck
from ...validation import MAX_TOKEN_ID, check_id_range, invalid_on_device, raise_unchecked
from .. import device as device_state
from ..base import BackendUnavailableError, CapturedCall, GraphCaptureError
from ..device import MAX_GROUP_TOKENS, GridTables, baseline_code, grid_bound, on_device, statistics_constants
from . import abi, pipeline, runtime
from .pipeline import Launcher, advantage_workspace_size, header_bytes, shared_table_bytes

# The table passes' modes and the kernels' constants (ktae_args.h, read by ``abi``).
ADVANTAGE, COUNT, ROWS = abi.CONSTANTS["kAdvantage"], abi.CONSTANTS["kCount"], abi.CONSTANTS["kRows"]
MAX_THREADS = abi.CONSTANTS["kMaxThreads"]
#: fewest threads per block and fewest slots of an automatically sized table.
MIN_THREADS = 64
MIN_CAPACITY = abi.CONSTANTS["kMinCapacity"]
#: most blocks of the global-memory pass: each block owns one slice and takes its groups one after another.
FALLBACK_BLOCKS = 64
#: most masked tokens of a group for the packed 12-byte slot (16-bit counters).
PACKED_MAX_TOKENS = abi.CONSTANTS["kPackedMaxTokens"]
#: most bytes of the global-memory tables of ``token_advantage``'s static-bound pass (sized without
#: knowing the groups: every block of the pass owns one slice, and splits a group's ids into hash
#: partitions until each fits it).
STATIC_FALLBACK_BYTES = 128 * 2**20
#: entries at the head of ``advantage``'s workspace (``kAdvantageFlags``; ``Flags``)
ADVANTAGE_FLAGS = abi.CONSTANTS["kAdvantageFlags"]


@dataclass(frozen=True)
class Flags:
    """The flags a call leaves at the head of its workspace (ktae_args.h ``Flag``), read back once:
    ``low`` / ``high``, the least id below 0 and the excess of the largest past ``MAX_TOKEN_ID`` (0: none);
    ``distinct``, the most distinct ids a completed group held; ``shared_need``, the most shared memory a
    completed group's table needed; ``left``, the groups the shared pass left to the global one;
    ``most_tokens``, the masked tokens of a group past ``MAX_GROUP_TOKENS`` (0: none); ``bad_values``,
    non-zero when an input value is out of its domain (rewards or the rollout advantage not finite, a
    0/1 input holding another value)."""

    low: int
    high: int
    distinct: int
    shared_need: int
    left: int
    most_tokens: int
    bad_values: int

    @classmethod
    def of(cls, values: list[int]) -> "Flags":
        """The flags from the workspace's first ``ADVANTAGE_FLAGS`` entries, read back."""
        at = abi.CONSTANTS
        return cls(low=values[at["kFlagLowId"]], high=values[at["kFlagHighId"]], distinct=values[at["kFlagDistinct"]],
                   shared_need=values[at["kFlagSharedNeed"]], left=values[at["kFlagLeft"]],
                   most_tokens=values[at["kFlagMostTokens"]], bad_values=values[at["kFlagBadValues"]])

    def raise_input_errors(self, checks: tuple[ValueCheck, ...]) -> None:
        """The API's ValueError for a bad input, in the order the API reports them: the mask, the ids, the
        other values (``checks``, the value checks of the call, run again on the host: one read each, on
        this error path only), a group past ``MAX_GROUP_TOKENS``."""
        if self.bad_values:
            raise_unchecked(tuple(c for c in checks if c.name == "response_mask"))
        check_id_range(self.low, MAX_TOKEN_ID + self.high)
        if self.bad_values:
            raise_unchecked(tuple(c for c in checks if c.name != "response_mask"))
            raise ValueError(f"{', '.join(f'`{c.name}`' for c in checks)}: a value was out of its domain when the "
                             f"kernels read it (NaN or inf, or not 0 or 1), and is not now: the tensors changed "
                             f"after the call")
        if self.most_tokens:
            raise ValueError(f"`responses`: a group holds {self.most_tokens} masked tokens; the cuda backend takes at "
                             f"most {MAX_GROUP_TOKENS} per group")


def value_checks(batch: Batch, given: Tensor | None) -> tuple[ValueCheck, ...]:
    """The value checks of a call, in the API's order: those validation left (``Batch.unchecked``; the
    rewards always: the groups pass checks them), then the rollout advantage when given."""
    checks = batch.unchecked or (ValueCheck("rewards", batch.rewards, "finite"),)
    return checks + (() if given is None else (ValueCheck("rollout_advantage", given, "finite"),))


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


def shared_limit(opt_in_bytes: int, blocks_per_sm: int) -> int:
    """Shared memory a block may take so that ``blocks_per_sm`` blocks fit an SM, from the opt-in
    limit per block (an SM holds the opt-in limit plus 1 KB, and each block reserves 1 KB, on sm_80
    and sm_90)."""
    if blocks_per_sm <= 1:
        return opt_in_bytes
    return (opt_in_bytes + 1024) // blocks_per_sm - 1024


def occupancy(blocks_per_sm: int | None, need: int | None, opt_in_bytes: int) -> int:
    """Blocks per SM of ``token_advantage``'s shared-table pass: ``blocks_per_sm`` when set
    (``CudaTuning``), else 2 when ``need`` (the most shared memory one group's table took in the shape's
    calls so far, ``device.expected_shared_bytes``) fits ``shared_limit(opt_in_bytes, 2)``, else 1
    (nothing known yet, or too big)."""
    if blocks_per_sm is not None:
        return blocks_per_sm
    return 2 if need is not None and need <= shared_limit(opt_in_bytes, 2) else 1


def most_threads(max_threads: int, blocks_per_sm: int) -> int:
    """Most threads a block may have: ``max_threads`` (``CudaTuning``), at most 512 when two blocks share
    an SM (their registers must fit it too)."""
    return min(max_threads, MAX_THREADS if blocks_per_sm <= 1 else 512)


def block_threads(length: int, max_threads: int | None = None, unroll: int = KernelVariant().unroll) -> int:
    """Threads per block for rollouts of ``length`` positions.

    Each pass of a block covers ``threads * unroll`` positions of one rollout (``KernelVariant.unroll``):
    use as few passes as ``max_threads`` (default ``MAX_THREADS``) allows, split evenly, in whole warps,
    and at least ``MIN_THREADS``.
    """
    most = MAX_THREADS if max_threads is None else max_threads
    passes = max(1, -(-length // (most * unroll)))
    per_pass = -(-length // (passes * unroll))
    return min(most, max(MIN_THREADS, -(-per_pass // 32) * 32))


def key_token_scores(batch: Batch, config: KTAEConfig, options: ExecutionOptions = DEFAULT_OPTIONS, *,
                     launcher: Launcher | None = None) -> KeyTokenScores:
    """Per (group, token) statistics, rows sorted by (group, token).

    ``launcher``: what runs the kernels (default ``load_launcher``; the tests pass the CPU emulator).
    """
    with on_device(batch.device):
        return _scores(launcher_for(batch.device, options.cuda, launcher), batch, config, options.cuda)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None,
                    options: ExecutionOptions = DEFAULT_OPTIONS, *, launcher: Launcher | None = None) -> Tensor:
    """float32 ``[B, L]``: ``(A_i + weight * score[group(i), token]) * mask`` (arguments as above;
    ``given``: optional float64 ``[B]`` rollout advantage replacing ``config.baseline``), in ``out`` when given.
    Raises the API's ValueError for a bad input, ``out`` untouched."""
    with on_device(batch.device):  # first: loading the kernels makes the device's context current
        ext = launcher_for(batch.device, options.cuda, launcher)
        rows = None
        if config.fisher != "exact":  # the rows' float32 p-values come from the host first
            rows = _given_rows(_scores(ext, batch, config, options.cuda))
        plan = static_plan(ext, batch, config, options.cuda)
        out, workspace = enqueue(plan, batch, config, given, out, rows)
        if workspace is not None:
            flags = Flags.of(workspace[:ADVANTAGE_FLAGS].tolist())  # the one read, after every launch
            flags.raise_input_errors(value_checks(batch, given))
            device_state.state(batch.device).learn(plan.key, distinct=flags.distinct, shared_need=flags.shared_need)
        return out


def capture(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
            options: ExecutionOptions = DEFAULT_OPTIONS, *,
            launcher: Launcher | None = None) -> tuple[Tensor, CapturedCall]:
    """``token_advantage`` (exact) enqueued while a CUDA graph captures, nothing read back;
    GraphCaptureError before a call of this layout completed (``device.learnt_key``). Its tables cannot
    overflow (the global pass takes any group), so a replay completes unless an input is bad, and then
    writes NaN over ``out``; the returned ``CapturedCall`` holds the cached tensors the graph reads and
    reads a replay's flags."""
    learnt = device_state.state(batch.device).learnt(device_state.learnt_key("cuda", batch))
    if learnt is None and batch.responses.numel():
        raise GraphCaptureError(device_state.WARM_UP)
    with on_device(batch.device):
        ext = launcher_for(batch.device, options.cuda, launcher)
        plan = static_plan(ext, batch, config, options.cuda)
        out, workspace = enqueue(plan, batch, config, given, out, None, nan_on_error=True)
        keep = _cached_inputs(plan, config, batch.device)
        if workspace is None:
            return out, CapturedCall(keep=keep, check=lambda: None)
        flags, checks = workspace[:ADVANTAGE_FLAGS], value_checks(batch, given)
        return out, CapturedCall(keep=keep, check=lambda: Flags.of(flags.tolist()).raise_input_errors(checks))


def unavailable_reason() -> str | None:
    """None when the kernels compile (or are cached) for the current GPU's arch and its driver loads them,
    else why not and the fix (cuda-core or NVRTC missing, an arch NVRTC does not know, a failed compile, a
    driver that refuses NVRTC's code). A failure is kept: later calls answer at once."""
    try:
        load_launcher(torch.device("cuda", torch.cuda.current_device()))
    except RuntimeError as err:  # BackendUnavailableError, or a driver call that failed
        return str(err)
    return None


def load_launcher(device: torch.device, variant: KernelVariant = KernelVariant()) -> runtime.DriverLauncher:
    """The kernels of ``variant`` loaded on ``device`` (compiled at first use); BackendUnavailableError
    naming the fix when they cannot be."""
    return runtime.launcher(_device_index(device), variant)


def launcher_for(device: torch.device, tuning: CudaTuning, launcher: Launcher | None) -> Launcher:
    """What runs a call's kernels: ``launcher`` when given (ValueError unless it runs ``tuning.variant``),
    else ``load_launcher(device, tuning.variant)``."""
    if launcher is None:
        return load_launcher(device, tuning.variant)
    runs = getattr(launcher, "variant", None)
    if runs != tuning.variant:
        raise ValueError(f"`launcher` runs the kernels of {runs}, `options.cuda.variant` asks for {tuning.variant}")
    return launcher


def _check_table_slots(slots: int, words: int, limit: int, packed: bool) -> int:
    if shared_table_bytes(slots, words, packed) > limit:
        raise ValueError(f"`table_slots` = {slots} needs {shared_table_bytes(slots, words, packed)} bytes of "
                         f"shared memory, the device allows {limit}")
    return slots


def _scores(ext: Launcher, batch: Batch, config: KTAEConfig, tuning: CudaTuning) -> KeyTokenScores:
    """The rows (the passes in ``COUNT`` mode, one read of the rows' sizes and the flags, the passes in
    ``ROWS`` mode, the rows sorted by (group, token)), scored by ``method.score_rows``."""
    device, n = batch.device, batch.n_groups
    plan = static_plan(ext, batch, config, tuning)
    _, workspace = enqueue(plan, batch, config, None, None, None, mode=COUNT)
    counts, n_rows = torch.zeros(n, dtype=torch.int64, device=device), 0
    if workspace is not None:
        views = workspace_views(workspace, batch.responses.shape[0], n)
        counts = views["status"].clone()
        read = torch.cat([views["flags"], counts]).tolist()  # sizes the rows: the one read
        Flags.of(read[:ADVANTAGE_FLAGS]).raise_input_errors(value_checks(batch, None))
        n_rows = sum(read[ADVANTAGE_FLAGS:])
    row_offset = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=row_offset[1:])
    ints = torch.empty(abi.CONSTANTS["kRowInts"], n_rows, dtype=torch.int64, device=device)
    if n_rows:
        _, workspace = enqueue(plan, batch, config, None, None, None, mode=ROWS, row_out=(row_offset, ints))
        if not torch.equal(workspace_views(workspace, batch.responses.shape[0], n)["status"], counts):
            raise RuntimeError("ktae_kernels.cuda: the rows pass found other tokens than the count pass (internal error)")
        ints = ints[:, torch.argsort(ints[0] << 31 | ints[1])]  # each group's rows came in slot order
    stats = method.group_stats(batch, config)
    rows = method.Rows(group=ints[0], token=ints[1], a=ints[2], b=ints[3], f_c=ints[6], f_w=ints[7])
    return method.score_rows(rows, stats.n_c, stats.n_w, stats.T_c, stats.T_w, config, batch.group_labels)


def _given_rows(scores: KeyTokenScores) -> dict[str, Tensor]:
    """The ``advantage`` binding's given rows: each group's first row (int64 ``[n_groups + 1]``; the rows are
    sorted by group), and the rows' tokens and scores."""
    groups = torch.arange(scores.n_c.shape[0] + 1, device=scores.group.device)
    return dict(row_offset=torch.searchsorted(scores.group, groups), given_token=scores.token.contiguous(),
                given_score=scores.score.contiguous())


@dataclass(frozen=True)
class GridKernel:
    """The statistics kernel as a ``device.StatisticsKernel`` (equal per launcher: the device cache key)."""

    ext: Launcher

    def __call__(self, grid: GridTables, alpha: float, beta: float) -> Tensor:
        device = grid.cells.device
        out = torch.empty(5, grid.size, dtype=torch.float64, device=device)
        constants = statistics_constants(alpha, beta)
        pipeline.table_statistics(self.ext, grid.cells, grid.log_factorial, grid.angle, constants, out)
        return out


# ------------------------------------------------------------------ token_advantage from static bounds
@dataclass(frozen=True)
class StaticPlan:
    """``token_advantage``'s launch choices from the batch's shape alone (``B``, ``L``, the number of
    groups), nothing read from the device: every group has at most ``largest = B - n_groups + 1``
    rollouts and ``largest * L`` masked tokens; the kernels size each group's table on the device.

    bound: the statistics grid's bound (None: none; groups past it compute their tables' statistics
    per slot from ``log_factorial``). shared_bytes: dynamic shared memory of the shared-table pass.
    max_capacity: most slots of a shared table (``CudaTuning.table_slots``, or the table for the distinct
    ids this layout's groups held before). fallback_blocks / fallback_bytes: the global-memory pass (0:
    every group surely completes in shared memory). key: where the call's largest distinct count and
    shared-memory need are learnt (``DeviceState.learn``). blocks_per_sm: the shared pass's blocks per
    SM that ``shared_bytes`` and ``threads`` allow. largest_first: ``CudaTuning.largest_first``.
    """

    ext: Launcher
    largest: int
    bound: int | None
    shared_bytes: int
    max_capacity: int
    packed: bool
    fallback_blocks: int
    fallback_bytes: int
    threads: int
    slot_index: bool = False
    key: tuple = ()
    blocks_per_sm: int = 1
    largest_first: bool = False


def static_plan(ext: Launcher, batch: Batch, config: KTAEConfig, tuning: CudaTuning = CudaTuning()) -> StaticPlan:
    """The static-bound plan of ``token_advantage`` (host arithmetic only).

    Once a call of this ``(B, n_groups)`` has completed, the shared tables are sized for the most
    distinct ids a group held then (``DeviceState.learnt``), not for the masked tokens; a group
    holding more overflows into the global-memory pass, which is then launched. With the default
    ``CudaTuning.blocks_per_sm`` (None), once the most shared memory a group's table needed in this
    layout fits half an SM, the shared pass reserves just that, with at most 512 threads a block, so
    that two blocks share an SM (``occupancy``); a group that needs more (more rollouts, a wider slot,
    more distinct ids) leaves the shared pass, and the global-memory pass, launched whenever the
    shared bytes are below the largest possible group's table, redoes it."""
    B, L = batch.responses.shape
    n = batch.n_groups
    largest = B - n + 1 if n else 0
    bound = grid_bound(min(largest, device_state.GRID_MAX_GROUP))
    words = presence_words(largest)
    opt_in = ext.max_shared_bytes()
    widest = table_capacity(largest * L)  # the table of the largest possible group
    key = device_state.learnt_key("cuda", batch)
    if tuning.table_slots is None:
        learnt = device_state.state(batch.device).learnt(key)
        seen_need = learnt.shared_need if learnt is not None and learnt.shared_need > 0 else None
        blocks_per_sm = occupancy(tuning.blocks_per_sm, seen_need, opt_in)
        max_capacity = 2**30 if learnt is None else table_capacity(learnt.distinct)
        shared_bytes = min(shared_limit(opt_in, blocks_per_sm), shared_table_bytes(min(widest, max_capacity), words))
        if tuning.blocks_per_sm is None and blocks_per_sm == 2:
            shared_bytes = min(shared_bytes, seen_need)  # what the tables took: the rest may stay L1 cache
    else:  # forces the shared tables only
        blocks_per_sm = tuning.blocks_per_sm or 1
        max_capacity = _check_table_slots(tuning.table_slots, 1, opt_in, True)
        shared_bytes = min(opt_in, shared_table_bytes(min(widest, max_capacity), words))
    if shared_table_bytes(2, 1, True) > shared_bytes:
        shared_bytes = 0
    fallback_blocks = fallback_bytes = 0
    if widest > max_capacity or shared_table_bytes(widest, words) > shared_bytes:
        fallback_blocks = max(1, min(n, FALLBACK_BLOCKS))
        mask_bytes = (4 * words + 7) // 8 * 8
        need = mask_bytes + widest * (12 + 4 * words)
        least = mask_bytes + 2 * (12 + 4 * words)
        slice_bytes = max(least, min(need, STATIC_FALLBACK_BYTES // fallback_blocks))
        fallback_bytes = fallback_blocks * (-(-slice_bytes // 8) * 8)
    threads = block_threads(L, most_threads(tuning.max_threads, blocks_per_sm), tuning.variant.unroll)
    return StaticPlan(ext, largest, bound, shared_bytes, max_capacity, tuning.packed, fallback_blocks,
                      fallback_bytes, threads, tuning.slot_index and shared_bytes > 0, key, blocks_per_sm,
                      tuning.largest_first)


def workspace_views(workspace: Tensor, B: int, n_groups: int) -> dict[str, Tensor]:
    """The named parts of an ``enqueue`` workspace (for tests): ``flags, status, starts, group_counts,
    lengths, extent, base, correct`` (``pipeline.layout``)."""
    n, at = n_groups, pipeline.layout(B, n_groups, 0)
    part = lambda start, size: workspace[start:start + size]  # noqa: E731
    return dict(flags=workspace[:ADVANTAGE_FLAGS], status=part(at.status, n), starts=part(at.starts, n + 1),
                group_counts=part(at.group_counts, 4 * n).view(4, n), lengths=part(at.lengths, B),
                extent=part(at.extent, B), base=part(at.base, B).view(torch.float64),
                correct=part(at.correct, (B + 7) // 8).view(torch.bool)[:B])


def _cached_inputs(plan: StaticPlan, config: KTAEConfig, device: torch.device) -> tuple[Tensor | None, Tensor | None,
                                                                                        Tensor]:
    """The kernels' inputs that live in the device state: the grid's h and strength rows (None without a
    grid), the log-factorials of groups past it (None when none can be), the ignored ids."""
    state = device_state.state(device)
    values = None
    if plan.bound is not None:
        values = state.grid(GridKernel(plan.ext), config.alpha, config.beta, plan.bound)[3:5]
    log_factorial = None
    if plan.bound is None or plan.largest > plan.bound:
        log_factorial = state.log_factorials(plan.largest)
    ignore = state.constant(config.ignore_token_ids, torch.int64)
    return values, log_factorial, ignore


def enqueue(plan: StaticPlan, batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
            rows: dict[str, Tensor] | None, nan_on_error: bool = False, mode: int = ADVANTAGE,
            row_out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor | None, Tensor | None]:
    """Everything ``token_advantage`` sends to the device, in one ``pipeline.advantage`` call:
    the scan pass, the groups pass, the shared-table pass and the global-memory one; before it, the
    device checks of ``batch.unchecked`` (the rewards left to the groups pass), two allocations, and a
    stable argsort of the group ids when the batch has no ``members``. Nothing is read back. ``rows``: the given rows
    (``_given_rows``) in place of the device grid. ``nan_on_error``: a bad input writes NaN over ``out``
    (a captured call's replay), else nothing. ``mode``: ``ADVANTAGE``, or ``COUNT`` (the distinct ids
    into the status) or ``ROWS`` (the rows into ``row_out`` = (row_offset int64 ``[n_groups + 1]``,
    ints int64 ``[8, n_rows]``)), which write no ``out``. Returns ``out`` (None unless ``ADVANTAGE``) and
    the workspace (``workspace_views``; None for an empty batch)."""
    device = batch.device
    B, L = batch.responses.shape
    if out is None and mode == ADVANTAGE:
        out = torch.empty((B, L), dtype=torch.float32, device=device)
    if B == 0 or L == 0:
        return out, None
    n = batch.n_groups
    values, log_factorial, ignore = _cached_inputs(plan, config, device) if mode == ADVANTAGE else (
        None, None, torch.empty(0, dtype=torch.int64, device=device))
    if rows is not None:
        values = log_factorial = None
    positions = B * L if plan.slot_index and mode == ADVANTAGE else 0
    workspace = torch.empty(advantage_workspace_size(B, n, plan.fallback_bytes, positions), dtype=torch.int64,
                            device=device)
    inputs = pipeline.AdvantageInputs(responses=batch.responses.contiguous(), mask=batch.mask.contiguous(),
                  group=batch.group.contiguous(), rewards=batch.rewards.contiguous(),
                  members=torch.argsort(batch.group, stable=True) if batch.members is None else batch.members,
                  invalid=invalid_on_device(tuple(c for c in batch.unchecked if c.name != "rewards")),
                  correct=None if batch.correct is None else batch.correct.contiguous(),
                  given=None if given is None else given.contiguous(), n_groups=n, workspace=workspace, out=out,
                  mode=mode, **dict(zip(("row_offset", "row_ints"), row_out or ())))
    scoring = pipeline.Scoring(table_values=values, grid_bound=plan.bound or 0, log_factorial=log_factorial,
                   ignore_ids=ignore, params=[config.alpha, config.beta, config.k1, config.b, config.top, config.weight],
                   constants=statistics_constants(config.alpha, config.beta)[:4], use_tf=config.use_tf,
                   threshold=config.correct_threshold, baseline=baseline_code(config, given), eps=config.eps,
                   **(rows or {}))
    shape = pipeline.AdvantageLaunch(shared_bytes=plan.shared_bytes, max_capacity=plan.max_capacity,
                                     allow_packed=plan.packed, fallback_blocks=plan.fallback_blocks,
                                     fallback_bytes=plan.fallback_bytes, slot_index=positions > 0,
                                     threads=plan.threads, nan_on_error=nan_on_error,
                                     largest_first=plan.largest_first)
    pipeline.advantage(plan.ext, inputs, scoring, shape)
    return out, workspace


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()
