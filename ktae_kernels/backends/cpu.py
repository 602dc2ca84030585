"""Native CPU backend: the C++17 kernel of ``csrc/cpu/ktae_cpu.cpp`` (module ``ktae_kernels._cpu``).

groups (``method.group_counts``, ``[B]``-sized) -> for small groups, the statistics of every table the
groups can have (``method.full_grid_statistics``, cached per group shape and config) -> one kernel
call that, per group and on one thread, counts the tokens into a table indexed by token id, scores
each distinct id from its table's statistics plus its BM25 term, and writes the group's advantages
while its ids are still in cache. Groups run in parallel on ``ExecutionOptions.threads`` threads (default
``torch.get_num_threads()``; fewer for small batches): the calling thread and worker threads of the
kernel's own (``csrc/cpu/workers.h``), which claim groups one at a time and join only while groups are
left, so that a worker the operating system does not schedule (a node shared with other processes)
holds no call back. The result does not depend on the thread count.

In exact mode, when the full grid of tables is large (big groups), the kernel computes the statistics
of each distinct table it meets itself (the same float64 formulas) and memoises them across groups
and calls. With ``fisher="upstream"`` (whose p-value depends on the rows present), whatever the group
sizes, a first kernel call lists the rows, ``method.distinct_tables`` computes exactly the tables they
use, and the fused call finds each row's table among their sorted grid entries by binary search:
memory grows with the rows, not with the ``(n_c + 1)(n_w + 1)`` tables a group could have (16 million
for one group of 8,000 rollouts). ``key_token_scores`` uses the row listing and ``method.score_rows``.
Token ids are range-checked inside the kernels (the registry declares ``checks_token_ids``); the
kernel checks its arrays' dtype, shape, strides and device itself.
"""
from __future__ import annotations

import functools
import importlib
import math
import sys
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from .. import caches, method
from ..config import KTAEConfig
from ..options import DEFAULT_OPTIONS, ExecutionOptions
from ..primitives import group_sum, repeat_counts, row_counts
from ..types import Batch, KeyTokenScores
from ..validation import check_token_ids

EXTENSION = "ktae_kernels._cpu"  # the compiled kernel's module name
BUILD_HINT = ("`pip install .` builds it on a machine with a C++17 compiler (g++ or clang++); "
              "reinstall with one on PATH, e.g. `pip install --force-reinstall --no-deps .` "
              "(with --no-build-isolation, `pip install nanobind` first)")


def load_extension() -> ModuleType:
    """The compiled kernel module; ImportError when it was not built."""
    return importlib.import_module(EXTENSION)


def unavailable_reason() -> str | None:
    """None when the native kernel is built, else why not and how to build it."""
    try:
        load_extension()
    except ImportError as err:
        return f"the native CPU kernel {EXTENSION} is not built ({err}); {BUILD_HINT}"
    return None


class _Inputs:
    """Kernel-ready numpy views of a batch (see ``_host``): int64 ids and bool mask with unit column
    stride, rollouts sorted by group (``order``, int64 ``[B]``; group ``g`` is
    ``order[start[g]:start[g + 1]]``) and bool correct flags."""

    def __init__(self, batch: Batch, counts: method.GroupCounts):
        self.batch = batch
        self.ids = _host(_unit_column_stride(batch.responses))
        self.mask = _host(_unit_column_stride(batch.mask))
        self.order = np.argsort(batch.group.numpy(), kind="stable")
        self.start = np.zeros(batch.n_groups + 1, dtype=np.int64)
        np.cumsum(counts.size.numpy(), out=self.start[1:])
        self.correct = _host(counts.correct)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The kernel's ``batch`` argument: ids, mask, order, start, correct."""
        return self.ids, self.mask, self.order, self.start, self.correct


def _host(t: Tensor) -> np.ndarray:
    """A CPU tensor as the kernel receives it: a numpy view of its memory. The binding takes any DLPack
    array, but torch's ``__dlpack__`` costs more than ``.numpy()``, and a call has twelve arrays: a
    trainer's micro-batch sees the difference."""
    return t.detach().numpy()


def _unit_column_stride(t: Tensor) -> Tensor:
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


#: positions per thread below which more threads cost more (waking them) than they save.
POSITIONS_PER_THREAD = 1 << 16


def kernel_threads(batch: Batch, threads: int | None) -> int:
    """The kernel's threads: ``threads`` (``ExecutionOptions.threads``; None:
    ``torch.get_num_threads()``), fewer for small batches (at most one per group and per
    ``POSITIONS_PER_THREAD`` positions)."""
    B, L = batch.responses.shape
    wanted = torch.get_num_threads() if threads is None else threads
    return max(1, min(wanted, batch.n_groups, B * L // POSITIONS_PER_THREAD))


@functools.lru_cache(maxsize=16)
def _ignored_ids(ids: tuple[int, ...]) -> np.ndarray:
    """int64 ``[len(ids)]``: the kernel's ``ignore`` argument (never written to; the binding takes only
    writable arrays)."""
    return np.array(ids, dtype=np.int64)


@caches.on_clear
def _clear() -> None:
    """This module's memo and, when the kernel was loaded, its statistics cache and output pool."""
    _ignored_ids.cache_clear()
    kernel = sys.modules.get(EXTENSION)
    if kernel is not None:
        kernel.clear_statistics_cache()
        kernel.clear_output_pool()


def _raise_bad_ids(batch: Batch) -> None:
    check_token_ids(batch.responses, batch.mask)  # raises the ValueError naming `responses`
    raise AssertionError("the CPU kernel flagged a token id out of range that the API check accepts")


def _list_rows(inputs: _Inputs, threads: int) -> tuple[method.Rows, Tensor, Tensor]:
    """Every group's rows, sorted by (group, token), and ``T_c, T_w`` (int64 ``[n_groups]``)."""
    batch = inputs.batch
    n = batch.n_groups
    per_group = group_sum(batch.group, n, row_counts(batch.mask))
    offset = torch.cumsum(per_group, 0) - per_group  # a group has at most as many rows as masked tokens
    cols = torch.empty(5, int(per_group.sum()), dtype=torch.int64)
    totals = torch.zeros(3, n, dtype=torch.int64)
    if not load_extension().rows(inputs.arrays(), _host(offset), _host(cols), _host(totals),
                                 threads=threads):
        _raise_bad_ids(batch)
    n_rows, T_c, T_w = totals.unbind(0)
    shift = offset - (torch.cumsum(n_rows, 0) - n_rows)  # group g's rows start at offset[g] in `cols`
    keep = torch.arange(int(n_rows.sum())) + repeat_counts(shift, n_rows)
    token, a, b, f_c, f_w = cols[:, keep].unbind(0)
    group = repeat_counts(torch.arange(n, dtype=torch.int64), n_rows)
    return method.Rows(group=group, token=token, a=a, b=b, f_c=f_c, f_w=f_w), T_c, T_w


def _grid_for(inputs: _Inputs, counts: method.GroupCounts, config: KTAEConfig,
              threads: int) -> tuple[np.ndarray, ...] | None:
    """The kernel's ``grid`` argument: ``offset, stride, strength, h`` of the whole grid of tables when it
    is small (``method.full_grid_statistics``); None (the kernel computes and memoises the tables it
    meets) for big groups in exact mode; in upstream mode ``offset, stride, strength, h, entries`` of
    exactly the tables of the rows listed first (``method.distinct_tables``: float64 / int64 ``[K]``,
    O(rows) memory), which the kernel finds by binary search in the sorted ``entries``."""
    full = method.full_grid_statistics(counts.n_c, counts.n_w, config)
    if full is not None:
        return full.offset, full.stride, full.strength, full.h
    if config.fisher == "exact":
        return None
    rows, _, _ = _list_rows(inputs, threads)
    tables = method.distinct_tables(rows, counts.n_c, counts.n_w, config)
    grid, stats = tables.grid, tables.stats
    return (_host(grid.offset), _host(grid.stride), _host(stats.strength), _host(stats.h),
            _host(tables.entries))


def _method(config: KTAEConfig):
    """The kernel's ``method`` argument: the scalars of ``config`` (``bound``: the largest float64 below
    ``top``, which the score stays inside)."""
    return load_extension().Method(k1=config.k1, b=config.b, alpha=config.alpha, beta=config.beta, top=config.top,
                                   bound=math.nextafter(config.top, 0.0), weight=config.weight, use_tf=config.use_tf)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None,
                    options: ExecutionOptions = DEFAULT_OPTIONS) -> Tensor:
    counts = method.group_counts(batch, config)
    threads = kernel_threads(batch, options.threads)
    if out is None:
        out = new_output(batch.responses.shape, threads)
    if batch.n_groups == 0 or batch.responses.shape[1] == 0:
        return out.zero_()
    inputs = _Inputs(batch, counts)
    grid = _grid_for(inputs, counts, config, threads)
    base = method.rollout_advantage(batch.rewards, batch.group, counts.size, config, given).contiguous()
    ignore = _ignored_ids(config.ignore_token_ids)
    ok = load_extension().advantage(inputs.arrays(), _host(base), ignore, _host(out), _method(config), grid=grid,
                                    threads=threads)
    if not ok:
        _raise_bad_ids(batch)
    return out


#: outputs of at least this many bytes come from the extension's output pool. glibc's heap gives a freed
#: chunk of this size back to the OS when it tops the heap, so a caller that holds one output while the next
#: is made (a trainer) would pay the page faults of a micro-batch's output at every call. A pool block is
#: at least 2 MB and serves outputs of at least half its size: smaller ones are ``torch.empty``.
POOL_MIN_BYTES = 1 << 20


def new_output(shape: tuple[int, int], threads: int) -> Tensor:
    """A float32 ``shape`` (``[B, L]``) tensor for a call without ``out=``: from ``csrc/cpu/output_pool.h``
    (memory of outputs torch has freed, kept mapped: no page faults; a new block is mapped on
    ``threads`` threads) when it is large, else ``torch.empty``."""
    B, L = shape
    if B * L * 4 < POOL_MIN_BYTES:
        return torch.empty((B, L), dtype=torch.float32)
    return load_extension().new_output(B, L, threads=threads)


def release_output_pool() -> int:
    """Free the memory of outputs kept for reuse (at most two); returns the bytes freed."""
    return load_extension().clear_output_pool()


def key_token_scores(batch: Batch, config: KTAEConfig, options: ExecutionOptions = DEFAULT_OPTIONS) -> KeyTokenScores:
    counts = method.group_counts(batch, config)
    rows, T_c, T_w = _list_rows(_Inputs(batch, counts), kernel_threads(batch, options.threads))
    return method.score_rows(rows, counts.n_c, counts.n_w, T_c, T_w, config, batch.group_labels)
