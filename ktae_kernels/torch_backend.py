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
from .types import Batch, KeyTokenScores

#: the constant the published code adds to both TF denominators.
TF_EPS = 1e-5


@dataclass(frozen=True)
class GroupStats:
    """Per-rollout ``correct`` (bool ``[B]``) and per-group counts (int64 ``[n_groups]``)."""

    correct: Tensor
    size: Tensor
    n_c: Tensor
    n_w: Tensor
    T_c: Tensor
    T_w: Tensor


@dataclass(frozen=True)
class Tables:
    """Sparse contingency tables, one row per (group, token) present: int64 ``[U]`` tensors, and
    ``row_of`` (int64 ``[N]``): the row of each masked position, positions in ``flat_pos`` order."""

    group: Tensor
    token: Tensor
    a: Tensor
    b: Tensor
    f_c: Tensor
    f_w: Tensor
    row_of: Tensor
    flat_pos: Tensor


def group_stats(batch: Batch, config: KTAEConfig) -> GroupStats:
    """Correct flags and ``n_c, n_w, T_c, T_w`` per group."""
    correct = batch.rewards > config.correct_threshold
    lengths = batch.mask.sum(dim=1)
    g, n = batch.group, batch.n_groups
    size = torch.bincount(g, minlength=n)
    n_c = torch.zeros(n, dtype=torch.int64, device=g.device).index_add_(0, g, correct.long())
    T_c = torch.zeros_like(n_c).index_add_(0, g, lengths * correct)
    T_all = torch.zeros_like(n_c).index_add_(0, g, lengths)
    return GroupStats(correct, size, n_c, size - n_c, T_c, T_all - T_c)


def build_tables(batch: Batch, correct: Tensor) -> Tables:
    """(group, token) tables from one stable sort of packed ``group << bits | token`` keys.

    The sort is stable and positions start in row-major order, so inside a (group, token) run the
    positions of one rollout are adjacent: a new rollout starts wherever the rollout id changes.
    """
    B, L = batch.responses.shape
    flat_pos = torch.nonzero(batch.mask.reshape(-1)).squeeze(1)
    tokens = batch.responses.reshape(-1)[flat_pos]
    rollout = flat_pos // max(L, 1)
    group = batch.group[rollout]
    token_bits = max(int(tokens.max()).bit_length(), 1) if tokens.numel() else 1
    group_bits = max(batch.n_groups - 1, 1).bit_length()
    key_dtype = torch.int32 if token_bits + group_bits <= 31 else torch.int64
    keys = (group << token_bits) | tokens
    _, order = torch.sort(keys.to(key_dtype), stable=True)
    keys, rollout = keys[order], rollout[order]
    n = keys.shape[0]
    new_row = torch.ones(n, dtype=torch.bool, device=keys.device)
    new_row[1:] = keys[1:] != keys[:-1]
    new_rollout = new_row.clone()
    new_rollout[1:] |= rollout[1:] != rollout[:-1]
    is_c = correct[rollout]
    starts = torch.nonzero(new_row).squeeze(1)
    f_c, f_all = _segment_sums(is_c, starts, n), _segment_sums(torch.ones_like(is_c), starts, n)
    a = _segment_sums(is_c & new_rollout, starts, n)
    b = _segment_sums(~is_c & new_rollout, starts, n)
    row_keys = keys[starts]
    row_of = torch.empty_like(order)
    row_of[order] = torch.cumsum(new_row.long(), 0) - 1
    return Tables(
        group=row_keys >> token_bits,
        token=row_keys & ((1 << token_bits) - 1),
        a=a, b=b, f_c=f_c, f_w=f_all - f_c, row_of=row_of, flat_pos=flat_pos,
    )


def _segment_sums(flags: Tensor, starts: Tensor, n: int) -> Tensor:
    """int64 sums of bool ``flags [n]`` over the runs that begin at ``starts``."""
    csum = torch.zeros(n + 1, dtype=torch.int64, device=flags.device)
    torch.cumsum(flags.long(), 0, out=csum[1:])
    ends = torch.cat([starts[1:], starts.new_tensor([n])])
    return csum[ends] - csum[starts]


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
    return p[inv], F[inv], IG[inv], cohen_h(ua, ub, unc, unw)[inv]


def upstream_width(a: Tensor, b: Tensor, n_c: Tensor, group: Tensor) -> Tensor:
    """Per group, the published code's Fisher grid width: the largest ``min(a + b, n_c)``, plus one."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    width = torch.zeros(n_groups, dtype=torch.int64, device=a.device)
    return width.scatter_reduce_(0, group, torch.minimum(a + b, n_c), reduce="amax") + 1


def unique_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct rows of a non-negative int64 ``[T, k]`` tensor and the inverse map ``[T]``.

    Rows are packed into one int64 key (mixed radix) when that fits, which sorts far faster than
    ``torch.unique(dim=0)``.
    """
    if rows.shape[0] == 0:
        return rows, torch.zeros(0, dtype=torch.int64, device=rows.device)
    radix = rows.max(dim=0).values + 1
    if sum(int(r).bit_length() for r in radix.tolist()) > 62:
        return torch.unique(rows, dim=0, return_inverse=True)
    key = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
    for j in range(rows.shape[1]):
        key = key * radix[j] + rows[:, j]
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


def bm25_tf(f: Tensor, T: Tensor, avg: Tensor, config: KTAEConfig) -> Tensor:
    """BM25 saturated frequency of one pooled document of ``T`` tokens holding ``f`` occurrences."""
    q = f.double() / T.double().clamp(min=1)
    K = config.k1 * (1.0 - config.b + config.b * T.double() / avg.clamp(min=1e-300))
    return torch.where(f > 0, q * (config.k1 + 1.0) / (q + K), 0.0)


def cohen_h(a: Tensor, b: Tensor, n_c: Tensor, n_w: Tensor) -> Tensor:
    """``asin(sqrt(a / n_c)) - asin(sqrt(b / n_w))`` (0 for an empty side); float64."""
    return torch.asin(torch.sqrt(a.double() / n_c.clamp(min=1))) - torch.asin(torch.sqrt(b.double() / n_w.clamp(min=1)))


def tf_ratio(f_c: Tensor, f_w: Tensor, T_c: Tensor, T_w: Tensor, config: KTAEConfig) -> Tensor:
    """``tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)`` with BM25 ``tf`` of the pooled correct / wrong
    rollouts; float64."""
    avg = (T_c + T_w).double() / 2.0
    tf_c, tf_w = bm25_tf(f_c, T_c, avg, config), bm25_tf(f_w, T_w, avg, config)
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
    n_c, n_w = stats.n_c[g], stats.n_w[g]
    p, F, IG, x = table_statistics(a, b, n_c, n_w, g, config)
    if config.use_tf:
        x = x + tf_ratio(f_c, f_w, stats.T_c[g], stats.T_w[g], config)
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
    """float32 ``[B, L]``: ``A_i + weight * score`` at masked positions (float64 sum, rounded once), 0 elsewhere."""
    B, L = batch.responses.shape
    out = torch.zeros(B * L, dtype=torch.float32, device=base.device)
    rollout = tables.flat_pos // max(L, 1)
    out[tables.flat_pos] = (base[rollout] + weight * row_score[tables.row_of]).to(torch.float32)
    return out.view(B, L)


def key_token_scores(batch: Batch, config: KTAEConfig) -> KeyTokenScores:
    stats = group_stats(batch, config)
    return score_tables(build_tables(batch, stats.correct), stats, config, batch.group_labels)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None) -> Tensor:
    stats = group_stats(batch, config)
    tables = build_tables(batch, stats.correct)
    scores = score_tables(tables, stats, config, batch.group_labels)
    base = rollout_advantage(batch, stats, config, given)
    return combine(batch, base, scores.score, tables, config.weight)
