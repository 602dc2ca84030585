"""The reference backend: numpy + scipy, one group at a time, written to be read.

This is the source of truth every other backend is tested against, and the baseline of the
benchmarks. It follows the method (README, "The method") line by line and calls
``scipy.stats.fisher_exact`` itself. With ``fisher="upstream"`` it uses the published code's float32
Fisher (``fisher.upstream_pvalue``), the one piece it shares with the fast backends.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
from scipy.stats import fisher_exact
from torch import Tensor

from .config import KTAEConfig
from .fisher import P_ONE, upstream_pvalue
from .options import DEFAULT_OPTIONS, ExecutionOptions
from .types import Batch, KeyTokenScores

TF_EPS = 1e-5
_COLUMNS = ("group", "token", "a", "b", "c", "d", "f_c", "f_w", "p_value", "F", "IG", "x", "score")


def key_token_scores(batch: Batch, config: KTAEConfig, options: ExecutionOptions = DEFAULT_OPTIONS) -> KeyTokenScores:
    responses, mask, rewards, group = _numpy(batch)
    correct = batch.correct.cpu().numpy() if batch.correct is not None else rewards > config.correct_threshold
    rows: list[tuple] = []
    per_group = []
    for g in range(batch.n_groups):
        members = np.flatnonzero(group == g)
        group_rows, counts = _score_group(g, responses[members], mask[members], correct[members], config)
        rows.extend(group_rows)
        per_group.append(counts)
    columns = list(zip(*rows)) if rows else [()] * len(_COLUMNS)
    out = {}
    for name, values in zip(_COLUMNS, columns):
        dtype = torch.float64 if name in ("p_value", "F", "IG", "x", "score") else torch.int64
        out[name] = torch.tensor(values, dtype=dtype, device=batch.device)
    n_c, n_w, T_c, T_w = (torch.tensor(v, dtype=torch.int64, device=batch.device).reshape(-1) for v in zip(*per_group)) \
        if per_group else (torch.zeros(0, dtype=torch.int64, device=batch.device),) * 4
    return KeyTokenScores(**out, n_c=n_c, n_w=n_w, T_c=T_c, T_w=T_w, group_labels=batch.group_labels)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None = None,
                    options: ExecutionOptions = DEFAULT_OPTIONS) -> Tensor:
    responses, mask, rewards, group = _numpy(batch)
    scores = key_token_scores(batch, config)
    lookup = {(int(g), int(t)): s for g, t, s in zip(scores.group.tolist(), scores.token.tolist(), scores.score.tolist())}
    base = given.cpu().numpy() if given is not None else rollout_advantage(rewards, group, config)
    values = np.zeros(responses.shape, dtype=np.float64)
    for i in range(responses.shape[0]):
        for t in np.flatnonzero(mask[i]):
            values[i, t] = base[i] + config.weight * lookup[(int(group[i]), int(responses[i, t]))]
    result = torch.from_numpy(values.astype(np.float32)).to(batch.device)
    return result if out is None else out.copy_(result)


def rollout_advantage(rewards: np.ndarray, group: np.ndarray, config: KTAEConfig) -> np.ndarray:
    """``A_i`` per rollout, float64 ``[B]``; a group of one rollout has mean 0 and std 1 (as verl)."""
    out = np.empty_like(rewards)
    for g in np.unique(group):
        members = group == g
        r = rewards[members]
        if config.baseline == "none":
            out[members] = r
            continue
        mean, std = (r.mean(), r.std(ddof=1)) if r.size > 1 else (0.0, 1.0)
        out[members] = r - mean if config.baseline == "mean" else (r - mean) / (std + config.eps)
    return out


def _numpy(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return (batch.responses.cpu().numpy(), batch.mask.cpu().numpy(),
            batch.rewards.cpu().numpy(), batch.group.cpu().numpy())


def _score_group(g: int, responses: np.ndarray, mask: np.ndarray, correct: np.ndarray, config: KTAEConfig):
    """Rows ``(group, token, a, b, c, d, f_c, f_w, p, F, IG, x, score)`` of one group (``correct``: its
    rollouts' bool labels), sorted by token, and the group's ``(n_c, n_w, T_c, T_w)``."""
    n_c, n_w = int(correct.sum()), int((~correct).sum())
    tokens = [responses[i][mask[i]] for i in range(len(responses))]
    T_c = sum(len(t) for t, ok in zip(tokens, correct) if ok)
    T_w = sum(len(t) for t, ok in zip(tokens, correct) if not ok)
    presence = {True: Counter(), False: Counter()}
    occurrences = {True: Counter(), False: Counter()}
    for toks, ok in zip(tokens, correct):
        presence[bool(ok)].update(np.unique(toks).tolist())
        occurrences[bool(ok)].update(toks.tolist())
    vocab = sorted(set(presence[True]) | set(presence[False]))
    a = [presence[True][v] for v in vocab]
    b = [presence[False][v] for v in vocab]
    p = _fisher_pvalues(a, b, n_c, n_w, config)
    rows = []
    for v, a_v, b_v, p_v in zip(vocab, a, b, p):
        f_c, f_w = occurrences[True][v], occurrences[False][v]
        informative = n_c > 0 and n_w > 0 and a_v + b_v < n_c + n_w  # mixed group, token not everywhere
        F = _fisher_weight(p_v, config) if informative else 0.0
        IG = _information_gain(a_v, b_v, n_c, n_w) if informative else 0.0
        scorable = informative and v not in config.ignore_token_ids
        x = _direction(a_v, b_v, f_c, f_w, n_c, n_w, T_c, T_w, config)
        key = (config.alpha * F + config.beta * IG) * x / (config.alpha + config.beta)
        score = _squash(key, config.top) if scorable else 0.0
        rows.append((g, v, a_v, b_v, n_c - a_v, n_w - b_v, f_c, f_w, p_v, F, IG, x, score))
    return rows, (n_c, n_w, T_c, T_w)


def _squash(key: float, top: float) -> float:
    """``top * (2 sigmoid(key) - 1) = top * tanh(key / 2)``, kept strictly inside ``(-top, top)``."""
    bound = math.nextafter(top, 0.0)
    return max(-bound, min(bound, top * math.tanh(key / 2.0))) + 0.0  # no -0.0 scores


def _fisher_pvalues(a: list[int], b: list[int], n_c: int, n_w: int, config: KTAEConfig) -> list[float]:
    if config.fisher == "upstream":
        if not a:
            return []
        ta, tb = torch.tensor(a), torch.tensor(b)
        width = torch.full_like(ta, int(torch.minimum(ta + tb, torch.tensor(n_c)).max()) + 1)
        return upstream_pvalue(ta, tb, n_c - ta, n_w - tb, width).double().tolist()
    cache: dict[tuple[int, int], float] = {}
    for key in zip(a, b):
        if key not in cache:
            table = [[key[0], key[1]], [n_c - key[0], n_w - key[1]]]
            cache[key] = float(fisher_exact(table, alternative="two-sided").pvalue)
    return [cache[key] for key in zip(a, b)]


def _fisher_weight(p: float, config: KTAEConfig) -> float:
    if config.fisher == "upstream":
        return 0.0 if p == 1.0 else math.exp(-2.0 * p)  # the float32 sum, compared exactly, as upstream
    return 0.0 if p >= P_ONE else math.exp(-2.0 * p)


def _entropy(p: float) -> float:
    return -sum(q * math.log2(q) for q in (p, 1.0 - p) if q > 0)


def _information_gain(a: int, b: int, n_c: int, n_w: int) -> float:
    n = n_c + n_w
    c, d = n_c - a, n_w - b
    h_y_x = sum((m / n) * _entropy(k / m) for k, m in ((a, a + b), (c, c + d)) if m > 0)
    return max(_entropy(n_c / n) - h_y_x, 0.0)


def _direction(a: int, b: int, f_c: int, f_w: int, n_c: int, n_w: int, T_c: int, T_w: int, config: KTAEConfig) -> float:
    h = math.asin(math.sqrt(a / max(n_c, 1))) - math.asin(math.sqrt(b / max(n_w, 1)))
    if not config.use_tf:
        return h
    avg = (T_c + T_w) / 2

    def tf(f: int, T: int) -> float:
        if f == 0:
            return 0.0
        q = f / T
        return q * (config.k1 + 1) / (q + config.k1 * (1 - config.b + config.b * T / avg))

    tf_c, tf_w = tf(f_c, T_c), tf(f_w, T_w)
    return h + (tf_c / (tf_w + TF_EPS) - tf_w / (tf_c + TF_EPS))
