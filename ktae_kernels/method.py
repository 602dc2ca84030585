"""The method's formulas, once: groups, per-table statistics, BM25 direction, squash, rollout baselines.

Every fast backend (torch, cpu, triton, cuda) counts its ``(group, token)`` tables its own way, then
uses this module:

- ``group_counts`` / ``group_stats``: correct flags, ``n_c, n_w`` and ``T_c, T_w`` per group (``[B]``-sized work);
- ``table_statistics`` / ``distinct_tables``: the Fisher p-value, ``F``, ``IG`` and Cohen's ``h`` depend
  only on the table ``(a, b, n_c, n_w)`` (and, for ``fisher="upstream"``, the group's grid width), and a
  group of ``n_c`` correct and ``n_w`` wrong rollouts has at most ``(n_c + 1)(n_w + 1)`` tables. They
  are computed once per distinct table a batch's rows use; ``TableGrid`` numbers the tables
  (``grid.offset[g] + a * grid.stride[g] + b``) for kernels that look them up by entry: among the
  sorted entries of ``distinct_tables`` (the CPU kernel in upstream mode), or in flat arrays of every
  entry (``full_grid_statistics``, for small groups);
- ``score_rows``: per ``(group, token)`` row, its table's statistics (``row_tables``: from the cached full
  grid for small groups on the CPU), the BM25 term-frequency ratio, the direction ``x`` and the squashed
  score (the only per-row maths);
- ``rollout_advantage``: the GRPO / mean / caller-given ``A_i``.

The reference backend (``reference.py``) writes the same formulas out again, per group in plain
Python, so that the two can be checked against each other.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import caches
from .config import KTAEConfig
from .fisher import exact_pvalue_flat, fisher_weight, upstream_fisher_weight, upstream_pvalue
from .primitives import flat_nonzero, gather, group_sum, prefix_sums, row_counts
from .types import Batch, KeyTokenScores

#: the constant the published code adds to both TF denominators.
TF_EPS = 1e-5


# ---------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class GroupCounts:
    """``correct``: bool ``[B]`` per rollout; per group (int64 ``[n_groups]``): ``size``, ``n_c``, ``n_w``."""

    correct: Tensor
    size: Tensor
    n_c: Tensor
    n_w: Tensor


@dataclass(frozen=True)
class GroupStats(GroupCounts):
    """``GroupCounts`` plus ``lengths`` (masked tokens per rollout, int64 ``[B]``) and ``T_c, T_w``
    (masked tokens of the correct / wrong rollouts per group, int64 ``[n_groups]``)."""

    lengths: Tensor
    T_c: Tensor
    T_w: Tensor


def correct_flags(batch: Batch, config: KTAEConfig) -> Tensor:
    """bool ``[B]``: the caller's ``correct`` labels, else ``reward > config.correct_threshold``."""
    if batch.correct is not None:
        return batch.correct
    return batch.rewards > config.correct_threshold


def group_counts(batch: Batch, config: KTAEConfig) -> GroupCounts:
    """Correct flags and the number of rollouts, correct and wrong ones per group."""
    correct = correct_flags(batch, config)
    g, n = batch.group, batch.n_groups
    size = group_sum(g, n)  # no host sync on a GPU
    n_c = group_sum(g, n, correct)
    return GroupCounts(correct, size, n_c, size - n_c)


def group_stats(batch: Batch, config: KTAEConfig) -> GroupStats:
    """``group_counts`` plus the masked lengths per rollout and ``T_c, T_w`` per group."""
    counts = group_counts(batch, config)
    lengths = row_counts(batch.mask)
    g, n = batch.group, batch.n_groups
    T_c = group_sum(g, n, lengths * counts.correct)
    T_all = group_sum(g, n, lengths)
    return GroupStats(counts.correct, counts.size, counts.n_c, counts.n_w, lengths, T_c, T_all - T_c)


# ---------------------------------------------------------------------------------- per-table statistics
@dataclass(frozen=True)
class TableGrid:
    """Where every table a group can have lives in flat per-table arrays of ``size`` entries.

    The table ``[[a, b], [n_c - a, n_w - b]]`` of group ``g`` is entry ``offset[g] + a * stride[g] + b``
    (``stride = n_w + 1``). Groups with the same ``(n_c, n_w)`` (and, in upstream mode, the same grid
    width) share one block of ``(n_c + 1) * (n_w + 1)`` entries. offset, stride: int64 ``[n_groups]``.
    """

    offset: Tensor
    stride: Tensor
    size: int

    def entry(self, group: Tensor, a: Tensor, b: Tensor) -> Tensor:
        """int64 entries of the tables ``(a, b)`` of rows in groups ``group``."""
        return gather(self.offset, group) + a * gather(self.stride, group) + b


def table_grid(n_c: Tensor, n_w: Tensor, width: Tensor | None = None) -> TableGrid:
    """The grid of per-group counts ``n_c, n_w`` (int64 ``[n_groups]``); ``width`` (upstream mode only):
    each group's Fisher grid width (``upstream_width``). ``[n_groups]``-sized work, whatever the grid's size."""
    keys = torch.stack([n_c, n_w] + ([width] if width is not None else []), dim=1).cpu()
    blocks, inverse = torch.unique(keys, dim=0, return_inverse=True) if keys.shape[0] else (keys, keys[:, 0])
    block_size = (blocks[:, 0] + 1) * (blocks[:, 1] + 1)
    block_start = torch.cumsum(block_size, 0) - block_size
    return TableGrid(offset=block_start[inverse].to(n_c.device), stride=n_w + 1, size=int(block_size.sum()))


@dataclass(frozen=True)
class TableStats:
    """float64 ``[T]`` per table: ``p_value``, ``F`` and ``IG`` (both 0 where the table is not informative),
    Cohen's ``h``, and ``strength = alpha F + beta IG``."""

    p_value: Tensor
    F: Tensor
    IG: Tensor
    h: Tensor
    strength: Tensor

    def stacked(self) -> Tensor:
        """float64 ``[5, T]``: the five in this order."""
        return torch.stack([self.p_value, self.F, self.IG, self.h, self.strength])


def table_statistics(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor, config: KTAEConfig,
                     width: Tensor | None = None) -> TableStats:
    """Statistics of the tables ``[[a, b], [n_c - a, n_w - b]]`` (int64 ``[T]`` each); ``width`` (int64
    ``[T]``, upstream mode only): each table's Fisher grid width."""
    if config.fisher == "exact":
        p = exact_pvalue_flat(a, b, n_c - a, n_w - b)
        F = fisher_weight(p)
    else:
        p32 = upstream_pvalue(a, b, n_c - a, n_w - b, width)
        p, F = p32.double(), upstream_fisher_weight(p32)
    informative = informative_rows(a, b, n_c, n_w)
    F = torch.where(informative, F, 0.0)
    IG = torch.where(informative, information_gain(a, b, n_c, n_w), 0.0)
    return TableStats(p, F, IG, cohen_h(a, b, n_c, n_w), config.alpha * F + config.beta * IG)


#: the largest grid (Fisher support points summed over its tables) that ``full_grid_statistics`` fills whole.
FULL_GRID_WORK = 1 << 20


@dataclass(frozen=True)
class FullGrid:
    """The statistics of every table a batch's groups can have: per group its grid ``offset`` and
    ``stride`` (int64 numpy ``[n_groups]``; table ``(a, b)`` of group ``g`` is entry
    ``offset[g] + a * stride[g] + b``) and per entry the tables' ``stats`` (float64 ``[size]`` each)."""

    offset: np.ndarray
    stride: np.ndarray
    stats: TableStats

    @property
    def strength(self) -> np.ndarray:
        """``alpha F + beta IG`` per entry, as the CPU kernel takes it."""
        return self.stats.strength.numpy()

    @property
    def h(self) -> np.ndarray:
        """Cohen's ``h`` per entry, as the CPU kernel takes it."""
        return self.stats.h.numpy()


def full_grid_statistics(n_c: Tensor, n_w: Tensor, config: KTAEConfig) -> FullGrid | None:
    """The statistics of every table groups of ``n_c`` correct and ``n_w`` wrong rollouts (int64 CPU
    ``[n_groups]``) can have, before any counting.

    The grid holds, for each group size ``n`` present, the blocks ``(c, n - c)`` of every split
    ``c = 0..n`` (a run sees the same sizes at every step, whatever the splits): it is computed once
    per (sizes, config) and cached with where each block starts (its size's first block plus
    ``block_offset(n, c)``), so a call costs a few ``[n_groups]`` numpy ops. None with
    ``fisher="upstream"`` (its p-value depends on the rows present), no groups, or a grid of more than
    ``FULL_GRID_WORK``.
    """
    if config.fisher != "exact" or n_c.shape[0] == 0:
        return None
    c, w = n_c.numpy(), n_w.numpy()
    n = c + w
    sizes = (int(n[0]),) if (n == n[0]).all() else tuple(int(v) for v in np.unique(n))
    grid = _size_rows(sizes, config)
    if grid is None:
        return None
    block_start, stats = grid
    return FullGrid(block_start[n, c], w + 1, stats)


def block_offset(n: np.ndarray | Tensor, c: np.ndarray | Tensor) -> np.ndarray | Tensor:
    """Where block ``(c, n - c)`` starts among the blocks ``(0, n), (1, n - 1), ..`` of groups of ``n``
    rollouts (int arrays or tensors): ``sum_{j < c} (j + 1)(n - j + 1)``, in closed form."""
    return (n + 2) * c * (c + 1) // 2 - c * (c + 1) * (2 * c + 1) // 6


@functools.lru_cache(maxsize=64)
def _size_rows(sizes: tuple[int, ...], config: KTAEConfig) -> tuple[np.ndarray, TableStats] | None:
    """The blocks of every split of each group size in ``sizes``, one size after the other: where
    block ``(c, n - c)`` starts (int64 ``[max(sizes) + 1, max(sizes) + 1]``, at ``[n, c]``) and their
    tables' statistics; None past ``FULL_GRID_WORK``."""
    blocks = [(c, n - c) for n in sizes for c in range(n + 1)]
    if sum((bc + 1) * (bw + 1) * (min(bc, bw) + 1) for bc, bw in blocks) > FULL_GRID_WORK:
        return None
    block_start = np.zeros((max(sizes) + 1, max(sizes) + 1), dtype=np.int64)
    start, splits = 0, np.arange(max(sizes) + 1)
    for n in sizes:
        block_start[n, :n + 1] = start + block_offset(n, splits[:n + 1])
        start += (n + 1) * (n + 2) * (n + 3) // 6  # sum over c of (c + 1)(n - c + 1)
    values = torch.cat([_block_statistics(bc, bw, config) for bc, bw in blocks], dim=1)
    return block_start, TableStats(*values.unbind(0))  # rows of a contiguous [5, size]: each contiguous


@functools.lru_cache(maxsize=4096)
def _block_statistics(n_c: int, n_w: int, config: KTAEConfig) -> Tensor:
    """float64 ``[5, (n_c + 1)(n_w + 1)]``: ``p_value, F, IG, h, strength`` of one block's tables."""
    entry = torch.arange((n_c + 1) * (n_w + 1))
    side = torch.full_like(entry, n_c), torch.full_like(entry, n_w)
    return table_statistics(entry // (n_w + 1), entry % (n_w + 1), *side, config).stacked()


caches.on_clear(_size_rows.cache_clear)
caches.on_clear(_block_statistics.cache_clear)


def upstream_width(a: Tensor, b: Tensor, n_c: Tensor, group: Tensor, n_groups: int) -> Tensor:
    """Per group (int64 ``[n_groups]``), the published code's Fisher grid width: the largest
    ``min(a + b, n_c)`` over the group's rows, plus one."""
    width = torch.zeros(n_groups, dtype=torch.int64, device=a.device)
    return width.scatter_reduce_(0, group, torch.minimum(a + b, gather(n_c, group)), reduce="amax") + 1


def binary_entropy(p: Tensor) -> Tensor:
    """``H2(p)`` in bits with ``0 log 0 = 0``; float64."""
    q = 1.0 - p
    return -(torch.xlogy(p, p) + torch.xlogy(q, q)) / math.log(2.0)


def information_gain(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """``H(Y) - H(Y | X)`` in bits for presence X and correctness Y; float64, >= 0."""
    a, b, n_c, n_w = (t.double() for t in (a, b, n_c, n_w))
    c, d = n_c - a, n_w - b
    n = (n_c + n_w).clamp(min=1)
    present, absent = a + b, c + d
    h_y = binary_entropy(n_c / n)
    h_present = torch.where(present > 0, present / n * binary_entropy(a / present.clamp(min=1)), 0.0)
    h_absent = torch.where(absent > 0, absent / n * binary_entropy(c / absent.clamp(min=1)), 0.0)
    return (h_y - h_present - h_absent).clamp(min=0.0)


def cohen_h(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """``asin(sqrt(a / n_c)) - asin(sqrt(b / n_w))`` (0 for an empty side); float64."""
    return torch.asin(torch.sqrt(a.double() / n_c.clamp(min=1))) - torch.asin(torch.sqrt(b.double() / n_w.clamp(min=1)))


def informative_rows(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """Tables that carry information: a mixed group and a token missing from some rollout.
    Elsewhere ``F``, ``IG`` and the score are 0."""
    return (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)


# ------------------------------------------------------------------------------------- per-row direction
def bm25_tf(f: Tensor, T: Tensor, K: Tensor, config: KTAEConfig) -> Tensor:
    """BM25 saturated frequency ``q (k1 + 1) / (q + K)``, ``q = f / T``, of a pooled document of ``T``
    tokens holding ``f`` occurrences (0 where ``f = 0``); float64."""
    q = f.double() / T.double().clamp(min=1)
    return torch.where(f > 0, q * (config.k1 + 1.0) / (q + K), 0.0)


def bm25_norm(T: Tensor, avg: Tensor, config: KTAEConfig) -> Tensor:
    """BM25 length normalisation ``K = k1 (1 - b + b T / avg)``; float64."""
    return config.k1 * (1.0 - config.b + config.b * T.double() / avg.clamp(min=1e-300))


def tf_ratio(f_c: Tensor, f_w: Tensor, group: Tensor, T_c: Tensor, T_w: Tensor, config: KTAEConfig) -> Tensor:
    """``tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)`` per row, with BM25 ``tf`` of the pooled correct /
    wrong rollouts of the row's group (``T_c, T_w``: per group); float64."""
    avg = (T_c + T_w).double() / 2.0
    K_c, K_w = gather(bm25_norm(T_c, avg, config), group), gather(bm25_norm(T_w, avg, config), group)
    tf_c, tf_w = bm25_tf(f_c, gather(T_c, group), K_c, config), bm25_tf(f_w, gather(T_w, group), K_w, config)
    return tf_c / (tf_w + TF_EPS) - tf_w / (tf_c + TF_EPS)


def squash(strength: Tensor, x: Tensor, scorable: Tensor, config: KTAEConfig) -> Tensor:
    """``top * tanh(key / 2)`` (= ``top * (2 sigmoid(key) - 1)``), strictly inside ``(-top, top)``, with
    ``key = strength * x / (alpha + beta)`` and ``strength = alpha F + beta IG``; 0 where not ``scorable``."""
    key = strength * x / (config.alpha + config.beta)
    bound = math.nextafter(config.top, 0.0)  # keep the open interval even where tanh rounds to 1
    squashed = (config.top * torch.tanh(key / 2.0)).clamp(-bound, bound) + 0.0  # + 0.0: no -0.0 scores
    return torch.where(scorable, squashed, 0.0)


def ignored_rows(token: Tensor, config: KTAEConfig) -> Tensor:
    """Rows of ``config.ignore_token_ids``, whose score is forced to 0."""
    ids = torch.tensor(config.ignore_token_ids, dtype=token.dtype, device=token.device)
    return torch.isin(token, ids)


@dataclass(frozen=True)
class Rows:
    """Sparse contingency tables, one row per (group, token) present: int64 ``[U]`` each."""

    group: Tensor
    token: Tensor
    a: Tensor
    b: Tensor
    f_c: Tensor
    f_w: Tensor


#: a grid of at most this many entries per row (plus ``DENSE_GRID_MIN``) finds the rows' distinct tables
#: with a bool mask over the grid; a bigger one (groups of thousands of rollouts) by sorting the rows' entries.
DENSE_GRID_PER_ROW = 8
DENSE_GRID_MIN = 1 << 20


@dataclass(frozen=True)
class DistinctTables:
    """The distinct tables that rows use: their ``grid``, its sorted ``entries`` (int64 ``[K]``) and their
    statistics (``stats``, ``[K]``), and where each row's table is among them (``index``, int64 ``[U]``)."""

    grid: TableGrid
    entries: Tensor
    stats: TableStats
    index: Tensor


def distinct_tables(rows: Rows, n_c: Tensor, n_w: Tensor, config: KTAEConfig) -> DistinctTables:
    """The statistics of exactly the tables the rows use, each computed once; memory O(rows), never
    O(grid) for a grid much larger than the rows (one group of 8,000 rollouts has 16 million tables)."""
    width = upstream_width(rows.a, rows.b, n_c, rows.group, n_c.shape[0]) if config.fisher == "upstream" else None
    grid = table_grid(n_c, n_w, width)
    entry = grid.entry(rows.group, rows.a, rows.b)
    entries, index = _distinct(entry, grid.size)
    first = torch.empty_like(entries).scatter_(0, index, torch.arange(entry.shape[0], device=entry.device))
    g = rows.group[first]
    stats = table_statistics(rows.a[first], rows.b[first], gather(n_c, g), gather(n_w, g), config,
                             None if width is None else gather(width, g))
    return DistinctTables(grid, entries, stats, index)


def _distinct(entry: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The sorted distinct values of int64 ``entry [U]`` (all in ``[0, size)``) and each one's index among them."""
    if size > DENSE_GRID_PER_ROW * entry.shape[0] + DENSE_GRID_MIN or size >= 2**31:  # prefix_sums: int32
        return torch.unique(entry, return_inverse=True)
    used = torch.zeros(size, dtype=torch.bool, device=entry.device)
    used[entry] = True
    return flat_nonzero(used), gather(prefix_sums(used), entry).long()  # the used entries before each


def row_tables(rows: Rows, n_c: Tensor, n_w: Tensor, config: KTAEConfig) -> tuple[TableStats, Tensor]:
    """Statistics of the rows' tables and where each row's table is among them (int64 ``[U]``): for
    CPU rows whose groups' full grid is small, that grid (cached per group shape and config: nothing is
    computed per call); else the rows' distinct tables (``distinct_tables``)."""
    full = full_grid_statistics(n_c, n_w, config) if rows.group.device.type == "cpu" else None
    if full is not None:
        grid = TableGrid(torch.from_numpy(full.offset), torch.from_numpy(full.stride), full.stats.p_value.shape[0])
        return full.stats, grid.entry(rows.group, rows.a, rows.b)
    tables = distinct_tables(rows, n_c, n_w, config)
    return tables.stats, tables.index


def score_rows(rows: Rows, n_c: Tensor, n_w: Tensor, T_c: Tensor, T_w: Tensor, config: KTAEConfig,
               labels) -> KeyTokenScores:
    """Every row's statistics, direction and score from its table's statistics and its counts.

    ``n_c, n_w, T_c, T_w``: int64 ``[n_groups]``; ``labels``: the caller's group labels.
    """
    g = rows.group
    stats, entry = row_tables(rows, n_c, n_w, config)
    x = gather(stats.h, entry)
    if config.use_tf:
        x = x + tf_ratio(rows.f_c, rows.f_w, g, T_c, T_w, config)
    scorable = informative_rows(rows.a, rows.b, gather(n_c, g), gather(n_w, g)) & ~ignored_rows(rows.token, config)
    return KeyTokenScores(
        group=g, token=rows.token, a=rows.a, b=rows.b, c=gather(n_c, g) - rows.a, d=gather(n_w, g) - rows.b,
        f_c=rows.f_c, f_w=rows.f_w, p_value=gather(stats.p_value, entry), F=gather(stats.F, entry),
        IG=gather(stats.IG, entry), x=x, score=squash(gather(stats.strength, entry), x, scorable, config),
        n_c=n_c, n_w=n_w, T_c=T_c, T_w=T_w, group_labels=labels,
    )


# -------------------------------------------------------------------------------------- rollout baseline
def rollout_advantage(rewards: Tensor, group: Tensor, size: Tensor, config: KTAEConfig, given: Tensor | None) -> Tensor:
    """``A_i`` (float64 ``[B]``): ``given``, or the baseline of ``config`` within each group.

    ``rewards``: float64 ``[B]``; ``group``: int64 ``[B]``; ``size``: int64 ``[n_groups]`` rollouts per group.
    As verl's GRPO: unbiased std, ``(r - mean) / (std + eps)``; a group of one rollout has mean 0
    and std 1. On the CPU the same operations run on numpy views (a trainer's micro-batch has a few
    hundred rollouts, where each torch op's dispatch costs more than its work).
    """
    if given is not None:
        return given
    if config.baseline == "none":
        return rewards.clone()
    if rewards.device.type == "cpu":
        return torch.from_numpy(_baseline(rewards.numpy(), group.numpy(), size.numpy(), config))
    return _baseline(rewards, group, size, config)


def _group_add(group, values, n_groups: int):
    """Per-group float64 sums of float64 ``values`` (numpy arrays, or tensors: ``group_sum``), added in order."""
    if isinstance(values, np.ndarray):
        return np.bincount(group, weights=values, minlength=n_groups)
    return group_sum(group, n_groups, values)


def _baseline(rewards, group, size, config: KTAEConfig):
    """``rollout_advantage`` for ``config.baseline`` "grpo" or "mean", on numpy arrays or tensors alike."""
    on_numpy = isinstance(rewards, np.ndarray)
    xp = np if on_numpy else torch
    n, single = (size.astype(np.float64) if on_numpy else size.double()), size <= 1
    mean = xp.where(single, 0.0, _group_add(group, rewards, len(size)) / n)
    centred = rewards - mean[group]
    if config.baseline == "mean":
        return centred
    var = _group_add(group, centred * centred, len(size)) / xp.where(single, 1.0, n - 1)
    std = xp.where(single, 1.0, xp.sqrt(var))
    return centred / (std[group] + config.eps)
