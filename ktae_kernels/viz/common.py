"""What the HTML report and the PNG summary share: the scores of a batch, its groups and their key tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from ..api import key_token_scores
from ..config import KTAEConfig
from ..types import KeyTokenScores

#: the ``KeyTokenScores`` row fields the report shows.
ROW_NAMES = ("group", "token", "a", "b", "f_c", "f_w", "p_value", "F", "IG", "x", "score")


@dataclass
class Prepared:
    """A batch on the CPU with its KTAE statistics.

    responses: int64 ``[B, L]``; mask: bool ``[B, L]``; rewards: float64 ``[B]`` (token-level rewards
    summed); group: int64 ``[B]`` dense group ids (the ``scores.group`` numbering); correct: bool ``[B]``;
    scores: ``key_token_scores`` of the whole batch, on the CPU; rows: ``(group, token) -> row`` of
    ``scores``; shown: the dense group ids to draw, in drawing order.
    """

    responses: Tensor
    mask: Tensor
    rewards: Tensor
    group: Tensor
    correct: Tensor
    scores: KeyTokenScores
    config: KTAEConfig
    rows: dict[tuple[int, int], int]
    shown: list[int]
    cols: dict[str, list]

    def row(self, i: int) -> dict[str, float]:
        """Row ``i`` of ``scores`` as Python numbers (the fields a reader needs)."""
        return {name: values[i] for name, values in self.cols.items()}

    @property
    def n_groups(self) -> int:
        return len(self.scores.group_labels)

    def members(self, g: int) -> list[int]:
        """Rollout indices (rows of ``responses``) of dense group ``g``, in batch order."""
        return torch.nonzero(self.group == g).flatten().tolist()

    def is_mixed(self, g: int) -> bool:
        """Whether group ``g`` has both correct and wrong rollouts (else every score in it is 0)."""
        return int(self.scores.n_c[g]) > 0 and int(self.scores.n_w[g]) > 0


def prepare(responses: Any, mask: Any, rewards: Any, index: Any, *, config: KTAEConfig | None,
            max_groups: int | None, groups: Sequence[int] | None = None, backend: str = "auto") -> Prepared:
    """Score the batch with ``key_token_scores`` (which validates every input and names the bad one)
    and choose the groups to show: ``groups`` (dense ids) when given, else up to ``max_groups`` groups,
    those with both correct and wrong rollouts first (the others score 0 everywhere), in id order."""
    config = KTAEConfig() if config is None else config
    scores = key_token_scores(responses, mask, rewards, index, config=config, backend=backend).to("cpu")
    responses_t = torch.as_tensor(np.asarray(responses) if not isinstance(responses, Tensor) else responses)
    mask_t = torch.as_tensor(np.asarray(mask) if not isinstance(mask, Tensor) else mask)
    rewards_t = torch.as_tensor(np.asarray(rewards) if not isinstance(rewards, Tensor) else rewards)
    responses_t = responses_t.detach().cpu().to(torch.int64)
    mask_t = mask_t.detach().cpu() != 0
    rewards_t = rewards_t.detach().cpu().to(torch.float64)
    if rewards_t.dim() == 2:  # verl's token_level_rewards [B, L]
        rewards_t = rewards_t.sum(dim=1)
    group = _dense_groups(index, scores.group_labels)
    rows = {(g, t): i for i, (g, t) in enumerate(zip(scores.group.tolist(), scores.token.tolist()))}
    n_groups = len(scores.group_labels)
    if groups is not None:
        shown = [int(g) for g in groups]
        bad = [g for g in shown if not 0 <= g < n_groups]
        if bad:
            raise ValueError(f"`groups` must hold dense group ids in [0, {n_groups}), got {bad}")
    else:
        if max_groups is not None and max_groups < 1:
            raise ValueError(f"`max_groups` must be >= 1 or None, got {max_groups}")
        mixed = [g for g in range(n_groups) if int(scores.n_c[g]) > 0 and int(scores.n_w[g]) > 0]
        seen = set(mixed)
        rest = [g for g in range(n_groups) if g not in seen]
        shown = (mixed + rest)[:max_groups]
    cols = {name: getattr(scores, name).tolist() for name in ROW_NAMES}
    return Prepared(responses_t, mask_t, rewards_t, group, rewards_t > config.correct_threshold, scores,
                    config, rows, shown, cols)


def _dense_groups(index: Any, labels: np.ndarray) -> Tensor:
    """int64 ``[B]``: each rollout's position in ``labels`` (the sorted unique labels that
    ``key_token_scores`` numbered its groups by)."""
    values = index.detach().cpu().numpy() if isinstance(index, Tensor) else np.asarray(index)
    if values.dtype.kind == "f":
        values = values.astype(np.int64)
    found, inverse = np.unique(values, return_inverse=True)
    if len(found) != len(labels):  # cannot happen with the same numbering; guards a future change
        raise RuntimeError("ktae_kernels.viz: group numbering differs from key_token_scores'")
    return torch.as_tensor(inverse.reshape(-1).astype(np.int64))


def key_rows(prepared: Prepared, g: int, top_k: int) -> list[int]:
    """Rows of ``prepared.scores`` for group ``g`` with a non-zero score, most significant first:
    by Fisher p-value, then by |score| (descending), then by token id; at most ``top_k``."""
    s = prepared.scores
    idx = torch.nonzero((s.group == g) & (s.score != 0)).flatten().tolist()
    idx.sort(key=lambda i: (float(s.p_value[i]), -abs(float(s.score[i])), int(s.token[i])))
    return idx[:top_k]
