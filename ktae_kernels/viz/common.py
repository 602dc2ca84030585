"""What the HTML report and the PNG summary share: the scores of a batch, its groups and their key tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from ..api import key_token_scores
from ..config import KTAEConfig
from ..method import correct_flags
from ..types import KeyTokenScores
from ..validation import check_config, normalise_batch

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
            max_groups: int | None, groups: Sequence[int] | None = None, backend: str = "auto",
            correct: Any = None) -> Prepared:
    """Validate the batch (``normalise_batch``: the same errors as the API), score it with
    ``key_token_scores`` and choose the groups to show: ``groups`` (dense ids) when given, else up to
    ``max_groups`` groups, those with both correct and wrong rollouts first (the others score 0
    everywhere), in id order. ``correct``: optional ``[B]`` labels, as in ``token_advantage``."""
    config = check_config(config)
    batch = normalise_batch(responses, mask, rewards, index, correct=correct)
    scores = key_token_scores(batch.responses, batch.mask, batch.rewards, batch.group, config=config,
                              backend=backend, correct=batch.correct).to("cpu")
    scores.group_labels = batch.group_labels  # the dense ids above number the caller's labels in order
    shown = _shown_groups(scores, groups, max_groups)
    cols = {name: getattr(scores, name).tolist() for name in ROW_NAMES}
    rows = {(g, t): i for i, (g, t) in enumerate(zip(cols["group"], cols["token"]))}
    return Prepared(batch.responses.cpu(), batch.mask.cpu(), batch.rewards.cpu(), batch.group.cpu(),
                    correct_flags(batch, config).cpu(), scores, config, rows, shown, cols)


def _shown_groups(scores: KeyTokenScores, groups: Sequence[int] | None, max_groups: int | None) -> list[int]:
    """The dense group ids to draw, in drawing order."""
    n_groups = len(scores.group_labels)
    if groups is not None:
        shown = [int(g) for g in groups]
        bad = [g for g in shown if not 0 <= g < n_groups]
        if bad:
            raise ValueError(f"`groups` must hold dense group ids in [0, {n_groups}), got {bad}")
        return shown
    if max_groups is not None and max_groups < 1:
        raise ValueError(f"`max_groups` must be >= 1 or None, got {max_groups}")
    mixed = [g for g in range(n_groups) if int(scores.n_c[g]) > 0 and int(scores.n_w[g]) > 0]
    seen = set(mixed)
    return (mixed + [g for g in range(n_groups) if g not in seen])[:max_groups]


def key_rows(prepared: Prepared, g: int, top_k: int) -> list[int]:
    """Rows of ``prepared.scores`` for group ``g`` with a non-zero score, most significant first
    (``KeyTokenScores.key_rows``); at most ``top_k``."""
    return prepared.scores.key_rows(g, top_k, scored_only=True)
