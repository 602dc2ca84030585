"""Native CPU backend: the C++17 / OpenMP kernel of ``csrc/cpu/ktae_cpu.cpp`` (module ``ktae_kernels._cpu``).

groups (``method.group_counts``, ``[B]``-sized) -> statistics of every table the groups can have
(``method.table_statistics``, cached per distinct group shapes and config) -> one kernel call that, per
group and on one thread, counts the tokens into a table indexed by token id, scores each distinct id
from the table statistics plus its BM25 term, and writes the group's advantages while its ids are
still in cache. Groups run in parallel on ``torch.get_num_threads()`` threads (fewer for small
batches); the result does not depend on the thread count.

When the full grid of tables is large (big groups) or ``fisher="upstream"`` (whose p-value depends on
the rows present), a first kernel call lists the rows, ``method.row_statistics`` computes exactly the
tables they use, and the fused call follows. ``key_token_scores`` uses the row listing and
``method.score_rows``. Token ids are range-checked inside the kernels (the registry declares
``checks_token_ids``).
"""
from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch
from torch import Tensor

from .. import method
from ..config import KTAEConfig
from ..primitives import repeat_counts, row_counts
from ..types import Batch, KeyTokenScores
from ..validation import check_token_ids

BUILD_HINT = ("`pip install .` builds it on a machine with a C++17 compiler (g++ or clang++); "
              "reinstall with one on PATH, e.g. `pip install --force-reinstall --no-deps .`")


def load_extension() -> ModuleType:
    """The compiled kernel module; ImportError when it was not built."""
    return importlib.import_module("ktae_kernels._cpu")


def unavailable_reason() -> str | None:
    """None when the native kernel is built, else why not and how to build it."""
    try:
        load_extension()
    except ImportError as err:
        return f"the native CPU kernel ktae_kernels._cpu is not built ({err}); {BUILD_HINT}"
    return None


class _Inputs:
    """Kernel-ready views of a batch: int64 ids and bool mask with unit column stride, rollouts
    sorted by group (``order``, int64 ``[B]``; group ``g`` is ``order[start[g]:start[g + 1]]``) and
    uint8 correct flags. Holds the tensors whose addresses the kernel reads."""

    def __init__(self, batch: Batch, counts: method.GroupCounts):
        self.batch = batch
        self.ids = _unit_column_stride(batch.responses)
        self.mask = _unit_column_stride(batch.mask)
        self.order = torch.argsort(batch.group, stable=True)
        self.start = torch.zeros(batch.n_groups + 1, dtype=torch.int64)
        torch.cumsum(counts.size, 0, out=self.start[1:])
        self.correct = counts.correct.to(torch.uint8)

    def arguments(self) -> tuple:
        """The leading kernel arguments: ids, mask, length, order, start, n_groups, correct."""
        L = self.ids.shape[1]
        return (self.ids.data_ptr(), self.ids.stride(0), self.mask.data_ptr(), self.mask.stride(0), L,
                self.order.data_ptr(), self.start.data_ptr(), self.batch.n_groups, self.correct.data_ptr())


def _unit_column_stride(t: Tensor) -> Tensor:
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


#: positions per thread below which more threads cost more (waking them) than they save.
POSITIONS_PER_THREAD = 1 << 16


def _threads(batch: Batch) -> int:
    """``torch.get_num_threads()``, fewer for small batches (at most one per group)."""
    B, L = batch.responses.shape
    return max(1, min(torch.get_num_threads(), batch.n_groups, B * L // POSITIONS_PER_THREAD))


def _raise_bad_ids(batch: Batch) -> None:
    check_token_ids(batch.responses, batch.mask)  # raises the ValueError naming `responses`
    raise AssertionError("the CPU kernel flagged a token id out of range that the API check accepts")


def _list_rows(inputs: _Inputs) -> tuple[method.Rows, Tensor, Tensor]:
    """Every group's rows, sorted by (group, token), and ``T_c, T_w`` (int64 ``[n_groups]``)."""
    batch = inputs.batch
    n = batch.n_groups
    per_group = torch.zeros(n, dtype=torch.int64).index_add_(0, batch.group, row_counts(batch.mask))
    offset = torch.cumsum(per_group, 0) - per_group  # a group has at most as many rows as masked tokens
    capacity = int(per_group.sum())
    cols = torch.empty(5, capacity, dtype=torch.int64)
    n_rows, T_c, T_w = (torch.zeros(n, dtype=torch.int64) for _ in range(3))
    ok = load_extension().rows(*inputs.arguments(), offset.data_ptr(), *(c.data_ptr() for c in cols),
                               n_rows.data_ptr(), T_c.data_ptr(), T_w.data_ptr(), _threads(batch))
    if not ok:
        _raise_bad_ids(batch)
    shift = offset - (torch.cumsum(n_rows, 0) - n_rows)  # group g's rows start at offset[g] in `cols`
    keep = torch.arange(int(n_rows.sum())) + repeat_counts(shift, n_rows)
    token, a, b, f_c, f_w = cols[:, keep].unbind(0)
    group = repeat_counts(torch.arange(n, dtype=torch.int64), n_rows)
    return method.Rows(group=group, token=token, a=a, b=b, f_c=f_c, f_w=f_w), T_c, T_w


def _grid_for(inputs: _Inputs, counts: method.GroupCounts, config: KTAEConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per group its grid offset and stride, and the grid's ``strength`` and ``h``: the whole grid when
    it is small (``method.full_grid_statistics``), else exactly the tables of the rows listed first."""
    full = method.full_grid_statistics(counts.n_c, counts.n_w, config)
    if full is not None:
        offset, stride, stats = full
        return offset, stride, stats.strength.contiguous(), stats.h.contiguous()
    rows, _, _ = _list_rows(inputs)
    grid, stats, _ = method.row_statistics(rows, counts.n_c, counts.n_w, config)
    return grid.offset, grid.stride, stats.strength, stats.h


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None) -> Tensor:
    counts = method.group_counts(batch, config)
    if out is None:
        out = torch.empty(batch.responses.shape, dtype=torch.float32)
        load_extension().advise_huge(out.data_ptr(), out.nbytes)  # fewer page faults on the first write
    if batch.n_groups == 0 or batch.responses.shape[1] == 0:
        return out.zero_()
    inputs = _Inputs(batch, counts)
    offset, stride, strength, h = _grid_for(inputs, counts, config)
    base = method.rollout_advantage(batch.rewards, batch.group, counts.size, config, given).contiguous()
    ignore = torch.tensor(config.ignore_token_ids, dtype=torch.int64)
    ok = load_extension().advantage(
        *inputs.arguments(), offset.data_ptr(), stride.data_ptr(), strength.data_ptr(), h.data_ptr(),
        ignore.data_ptr(), ignore.numel(), base.data_ptr(), config.k1, config.b, config.alpha + config.beta,
        config.top, math.nextafter(config.top, 0.0), config.weight, config.use_tf, out.data_ptr(), _threads(batch))
    if not ok:
        _raise_bad_ids(batch)
    return out


def key_token_scores(batch: Batch, config: KTAEConfig) -> KeyTokenScores:
    counts = method.group_counts(batch, config)
    rows, T_c, T_w = _list_rows(_Inputs(batch, counts))
    return method.score_rows(rows, counts.n_c, counts.n_w, T_c, T_w, config, batch.group_labels)
