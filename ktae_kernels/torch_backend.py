"""Vectorised torch backend: the four KTAE stages over all groups at once, on CPU or CUDA.

groups -> tables (one stable sort of (group, token) keys) -> statistics -> advantage.
No Python loop over groups or tokens; working memory is O(B * L), independent of the vocabulary.
The group, statistics and rollout-advantage stages are shared by the GPU backends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import KTAEConfig
from .fisher import exact_pvalue_flat, fisher_weight, upstream_fisher_weight, upstream_pvalue
from .primitives import flat_nonzero, gather, masked_values, prefix_sums, repeat_counts, row_counts, scatter_masked
from .types import Batch, KeyTokenScores

#: the constant the published code adds to both TF denominators.
TF_EPS = 1e-5


@dataclass(frozen=True)
class GroupStats:
    """Per rollout: ``correct`` (bool ``[B]``) and ``lengths`` (masked tokens, int64 ``[B]``); per group:
    counts (int64 ``[n_groups]``)."""

    correct: Tensor
    lengths: Tensor
    size: Tensor
    n_c: Tensor
    n_w: Tensor
    T_c: Tensor
    T_w: Tensor


@dataclass(frozen=True)
class Runs:
    """The masked positions sorted by (group, token): one run of positions per row.

    order: int64 ``[N]``, the row-major (``masked_select``) index of each sorted position;
    rollout: int32 ``[N]``, its rollout; length: int64 ``[R]``, the run lengths;
    row: int64 ``[R]``, the table row of each run, or None when run ``r`` is row ``r``.
    """

    order: Tensor
    rollout: Tensor
    length: Tensor
    row: Tensor | None = None


@dataclass(frozen=True)
class Tables:
    """Sparse contingency tables, one row per (group, token) present: int64 ``[U]`` tensors, and the
    sorted masked positions that built them."""

    group: Tensor
    token: Tensor
    a: Tensor
    b: Tensor
    f_c: Tensor
    f_w: Tensor
    runs: Runs


def group_stats(batch: Batch, config: KTAEConfig) -> GroupStats:
    """Correct flags and ``n_c, n_w, T_c, T_w`` per group."""
    correct = batch.rewards > config.correct_threshold
    lengths = row_counts(batch.mask)
    g, n = batch.group, batch.n_groups
    size = torch.bincount(g, minlength=n)
    n_c = torch.zeros(n, dtype=torch.int64, device=g.device).index_add_(0, g, correct.long())
    T_c = torch.zeros_like(n_c).index_add_(0, g, lengths * correct)
    T_all = torch.zeros_like(n_c).index_add_(0, g, lengths)
    return GroupStats(correct, lengths, size, n_c, size - n_c, T_c, T_all - T_c)


def build_tables(batch: Batch, stats: GroupStats) -> Tables:
    """(group, token) tables from one stable sort of packed ``group << bits | token`` keys.

    The sort is stable and positions start in row-major order, so inside a (group, token) run the
    positions of one rollout are adjacent: a new rollout starts wherever the rollout id changes.
    Counts are differences of int32 prefix sums at the run starts (N < 2**31 masked positions).
    """
    lengths = stats.lengths
    tokens = masked_values(batch.responses, batch.mask)
    token_bits = max(int(tokens.max()).bit_length(), 1) if tokens.numel() else 1
    group_bits = max(batch.n_groups - 1, 1).bit_length()
    key_dtype = torch.int32 if token_bits + group_bits <= 31 else torch.int64
    keys = repeat_counts(batch.group.to(key_dtype) << token_bits, lengths) | tokens.to(key_dtype)
    keys, order = torch.sort(keys, stable=True)
    rollout = gather(repeat_counts(torch.arange(lengths.shape[0], dtype=torch.int32, device=batch.device), lengths), order)
    n = keys.shape[0]
    new_row = torch.ones(n, dtype=torch.bool, device=keys.device)
    torch.ne(keys[1:], keys[:-1], out=new_row[1:])
    new_rollout = new_row.clone()
    new_rollout[1:] |= rollout[1:] != rollout[:-1]
    is_c = gather(stats.correct, rollout)
    starts = flat_nonzero(new_row)
    ends = torch.cat([starts[1:], starts.new_tensor([n])])
    f_c = _run_sums(is_c, starts, ends)
    a = _run_sums(is_c & new_rollout, starts, ends)
    row_keys = keys[starts].long()
    return Tables(
        group=row_keys >> token_bits,
        token=row_keys & ((1 << token_bits) - 1),
        a=a, b=_run_sums(new_rollout, starts, ends) - a, f_c=f_c, f_w=(ends - starts) - f_c,
        runs=Runs(order=order, rollout=rollout, length=ends - starts),
    )


def _run_sums(flags: Tensor, starts: Tensor, ends: Tensor) -> Tensor:
    """int64 sums of bool ``flags [n]`` over the runs ``[starts, ends)``."""
    csum = prefix_sums(flags)
    return (gather(csum, ends) - gather(csum, starts)).long()


def table_statistics(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor, group: Tensor,
                     config: KTAEConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fisher p-value, ``F``, ``IG`` and Cohen's ``h`` (float64 ``[U]``) of the tables
    ``[[a, b], [n_c - a, n_w - b]]``.

    They depend on the table only, and a batch of G-rollout groups holds at most O(G^3) distinct
    tables, so each distinct table is evaluated once and the results are gathered back.
    """
    columns = [a, b, n_c, n_w]
    if config.fisher == "upstream":  # the p-value also depends on the group's grid width
        columns.append(upstream_width(a, b, n_c, group)[group])
    uniq, inv = unique_rows(torch.stack(columns, dim=1))
    ua, ub, unc, unw = uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3]
    if config.fisher == "exact":
        p = exact_pvalue_flat(ua, ub, unc - ua, unw - ub)
        F = fisher_weight(p)
    else:
        p32 = upstream_pvalue(ua, ub, unc - ua, unw - ub, uniq[:, 4])
        p, F = p32.double(), upstream_fisher_weight(p32)
    IG = information_gain(ua, ub, unc, unw)
    return gather(p, inv), gather(F, inv), gather(IG, inv), gather(cohen_h(ua, ub, unc, unw), inv)


def upstream_width(a: Tensor, b: Tensor, n_c: Tensor, group: Tensor) -> Tensor:
    """Per group, the published code's Fisher grid width: the largest ``min(a + b, n_c)``, plus one."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    width = torch.zeros(n_groups, dtype=torch.int64, device=a.device)
    return width.scatter_reduce_(0, group, torch.minimum(a + b, n_c), reduce="amax") + 1


def unique_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct rows of a non-negative int64 ``[T, k]`` tensor (in sorted order) and the inverse map ``[T]``.

    Rows are packed into one int64 key (mixed radix) when that fits; a small key space (KTAE's
    tables: at most (G + 1)^4 keys) is then deduplicated with a presence table, no sort at all.
    """
    if rows.shape[0] == 0:
        return rows, torch.zeros(0, dtype=torch.int64, device=rows.device)
    radix = (rows.max(dim=0).values + 1).tolist()
    if sum(int(r).bit_length() for r in radix) > 62:
        return torch.unique(rows, dim=0, return_inverse=True)
    key = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
    for j, r in enumerate(radix):
        key = key * r + rows[:, j]
    space = math.prod(radix)
    if space <= max(1 << 22, rows.shape[0]):
        present = torch.zeros(space, dtype=torch.bool, device=rows.device)
        present[key] = True
        uniq_key = torch.nonzero(present).squeeze(1)
        inv = gather(prefix_sums(present), key + 1).long() - 1
    else:
        uniq_key, inv = torch.unique(key, return_inverse=True)
    uniq = torch.empty(uniq_key.shape[0], rows.shape[1], dtype=torch.int64, device=rows.device)
    for j in reversed(range(rows.shape[1])):
        uniq[:, j] = uniq_key % radix[j]
        uniq_key = uniq_key // radix[j]
    return uniq, inv


def binary_entropy(p: Tensor) -> Tensor:
    """``H2(p)`` in bits with ``0 log 0 = 0``; float64."""
    q = 1.0 - p
    return -(torch.xlogy(p, p) + torch.xlogy(q, q)) / math.log(2.0)


def information_gain(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """``H(Y) - H(Y | X)`` in bits for presence X and correctness Y; float64, >= 0."""
    a, b, n_c, n_w = (t.double() for t in (a, b, n_c, n_w))
    c, d = n_c - a, n_w - b
    n = n_c + n_w
    present, absent = a + b, c + d
    h_y = binary_entropy(n_c / n)
    h_present = torch.where(present > 0, present / n * binary_entropy(a / present.clamp(min=1)), 0.0)
    h_absent = torch.where(absent > 0, absent / n * binary_entropy(c / absent.clamp(min=1)), 0.0)
    return (h_y - h_present - h_absent).clamp(min=0.0)


def bm25_tf(f: Tensor, T: Tensor, K: Tensor, config: KTAEConfig) -> Tensor:
    """BM25 saturated frequency ``q (k1 + 1) / (q + K)``, ``q = f / T``, of a pooled document of ``T``
    tokens holding ``f`` occurrences (0 where ``f = 0``); float64."""
    q = f.double() / T.double().clamp(min=1)
    return torch.where(f > 0, q * (config.k1 + 1.0) / (q + K), 0.0)


def bm25_norm(T: Tensor, avg: Tensor, config: KTAEConfig) -> Tensor:
    """BM25 length normalisation ``K = k1 (1 - b + b T / avg)``; float64."""
    return config.k1 * (1.0 - config.b + config.b * T.double() / avg.clamp(min=1e-300))


def cohen_h(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """``asin(sqrt(a / n_c)) - asin(sqrt(b / n_w))`` (0 for an empty side); float64."""
    return torch.asin(torch.sqrt(a.double() / n_c.clamp(min=1))) - torch.asin(torch.sqrt(b.double() / n_w.clamp(min=1)))


def tf_ratio(f_c: Tensor, f_w: Tensor, group: Tensor, T_c: Tensor, T_w: Tensor, config: KTAEConfig) -> Tensor:
    """``tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)`` per row, with BM25 ``tf`` of the pooled correct /
    wrong rollouts of the row's group (``T_c, T_w``: per group); float64."""
    avg = (T_c + T_w).double() / 2.0
    K_c, K_w = gather(bm25_norm(T_c, avg, config), group), gather(bm25_norm(T_w, avg, config), group)
    tf_c, tf_w = bm25_tf(f_c, gather(T_c, group), K_c, config), bm25_tf(f_w, gather(T_w, group), K_w, config)
    return tf_c / (tf_w + TF_EPS) - tf_w / (tf_c + TF_EPS)


def squash(F: Tensor, IG: Tensor, x: Tensor, scorable: Tensor, config: KTAEConfig) -> Tensor:
    """``top * tanh(key / 2)`` (= ``top * (2 sigmoid(key) - 1)``), strictly inside ``(-top, top)``, with
    ``key = (alpha F + beta IG) x / (alpha + beta)``; 0 where not ``scorable``."""
    key = (config.alpha * F + config.beta * IG) * x / (config.alpha + config.beta)
    bound = math.nextafter(config.top, 0.0)  # keep the open interval even where tanh rounds to 1
    return torch.where(scorable, (config.top * torch.tanh(key / 2.0)).clamp(-bound, bound), 0.0)


def informative_rows(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """Tables that carry information: a mixed group and a token missing from some rollout.
    Elsewhere ``F``, ``IG`` and the score are 0."""
    return (n_c > 0) & (n_w > 0) & (a + b < n_c + n_w)


def ignored_rows(token: Tensor, config: KTAEConfig) -> Tensor:
    """Rows of ``config.ignore_token_ids``, whose score is forced to 0."""
    ids = torch.tensor(config.ignore_token_ids, dtype=token.dtype, device=token.device)
    return torch.isin(token, ids)


def score_tables(tables: Tables, stats: GroupStats, config: KTAEConfig, labels) -> KeyTokenScores:
    """Statistics stage over all rows at once."""
    g = tables.group
    a, b, f_c, f_w = tables.a, tables.b, tables.f_c, tables.f_w
    n_c, n_w = gather(stats.n_c, g), gather(stats.n_w, g)
    p, F, IG, x = table_statistics(a, b, n_c, n_w, g, config)
    if config.use_tf:
        x = x + tf_ratio(f_c, f_w, g, stats.T_c, stats.T_w, config)
    informative = informative_rows(a, b, n_c, n_w)
    F, IG = torch.where(informative, F, 0.0), torch.where(informative, IG, 0.0)
    scorable = informative & ~ignored_rows(tables.token, config)
    return KeyTokenScores(
        group=g, token=tables.token, a=a, b=b, c=n_c - a, d=n_w - b, f_c=f_c, f_w=f_w,
        p_value=p, F=F, IG=IG, x=x, score=squash(F, IG, x, scorable, config),
        n_c=stats.n_c, n_w=stats.n_w, T_c=stats.T_c, T_w=stats.T_w, group_labels=labels,
    )


def rollout_advantage(batch: Batch, stats: GroupStats, config: KTAEConfig, given: Tensor | None) -> Tensor:
    """``A_i`` (float64 ``[B]``): ``given``, or the baseline of ``config`` within each group.

    As verl's GRPO: unbiased std, ``(r - mean) / (std + eps)``; a group of one rollout has mean 0
    and std 1.
    """
    if given is not None:
        return given
    r = batch.rewards
    if config.baseline == "none":
        return r.clone()
    g, size = batch.group, stats.size.double()
    mean = torch.zeros_like(size).index_add_(0, g, r) / size
    mean = torch.where(stats.size > 1, mean, 0.0)
    centred = r - mean[g]
    if config.baseline == "mean":
        return centred
    var = torch.zeros_like(size).index_add_(0, g, centred * centred) / (size - 1).clamp(min=1)
    std = torch.where(stats.size > 1, var.sqrt(), 1.0)
    return centred / (std[g] + config.eps)


def combine(batch: Batch, base: Tensor, row_score: Tensor, tables: Tables, weight: float) -> Tensor:
    """float32 ``[B, L]``: ``A_i + weight * score`` at masked positions (float64 sum, rounded once), 0 elsewhere.

    Computed in the sorted order, where each row's score is one contiguous run, then put back.
    """
    runs = tables.runs
    run_score = row_score if runs.row is None else row_score[runs.row]
    sorted_values = repeat_counts(run_score, runs.length).mul_(weight).add_(gather(base, runs.rollout)).to(torch.float32)
    values = torch.empty_like(sorted_values).index_copy_(0, runs.order, sorted_values)
    return scatter_masked(batch.mask, values)


def key_token_scores(batch: Batch, config: KTAEConfig) -> KeyTokenScores:
    stats = group_stats(batch, config)
    return score_tables(build_tables(batch, stats), stats, config, batch.group_labels)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None) -> Tensor:
    stats = group_stats(batch, config)
    tables = build_tables(batch, stats)
    scores = score_tables(tables, stats, config, batch.group_labels)
    base = rollout_advantage(batch, stats, config, given)
    return combine(batch, base, scores.score, tables, config.weight)
