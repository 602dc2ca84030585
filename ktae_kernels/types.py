"""The two data types every backend shares: a validated batch and the per-(group, token) result; and
``ArrayLike``, what the public functions take for a tensor (converted by ``checks.as_tensor``).
``KeyTokenScores``' methods check their arguments with ``checks``, as ``validation`` checks the API's."""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from .checks import (as_tensor, check_finite_rows, check_index_shape, check_mask_shape, check_one_kind, check_real_rows,
                     check_token_tensor, finite_real, index_values, plain_int, zero_one_flags)

#: what the public functions accept for a tensor argument: a tensor, a numpy array or a (nested) list.
ArrayLike = Union[Tensor, np.ndarray, Sequence]


def _token_ids(responses: Any) -> Tensor:
    """int64 ``[B, L]`` on the CPU of the caller's ``responses`` (any ids, negative ones too)."""
    ids = as_tensor("responses", responses).detach()
    check_token_tensor(ids)
    return ids.cpu().long()


def _labels(index: Any, batch_size: int) -> list:
    """The caller's ``index`` (``[B]`` group labels, all ints or all strings) as a list of Python values."""
    values = index_values(index)
    check_index_shape(values.shape, batch_size)
    labels = values.tolist()
    if values.dtype == object:
        check_one_kind(labels, "index")
    return labels


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """The group sizes a plan was built for: ``sizes[g]`` rollouts in dense group ``g`` (host ints).

    Equal by ``sizes``, hashed once (the GPU backends key what a plan's calls taught them by it)."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.sizes))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, GroupLayout) and self._hash == other._hash
                                 and self.sizes == other.sizes)

    @property
    def largest(self) -> int:
        """Rollouts of the largest group (0 without groups)."""
        return max(self.sizes, default=0)


@dataclass(frozen=True)
class ValueCheck:
    """A check of an input's values that validation left to a backend checking them on the device
    (``Batch.unchecked``): ``tensor`` (the caller's ``name``, on the batch's device) must be finite
    (``kind`` "finite") or hold only 0 and 1 ("zero_one"; ``fix`` says how)."""

    name: str
    tensor: Tensor
    kind: str
    fix: str = ""


@dataclass(frozen=True)
class Batch:
    """A validated, normalised training batch (see ``validation.normalise_batch``).

    responses: int64 ``[B, L]`` token ids (ids under ``mask == 0`` are never read).
    mask: bool ``[B, L]``.
    rewards: float64 ``[B]`` sequence rewards.
    group: int64 ``[B]`` dense group ids, ``0 .. n_groups - 1`` in sorted order of the labels.
    group_labels: numpy ``[n_groups]``, the caller's label of each dense group id.
    correct: bool ``[B]`` caller-given correct / wrong labels, or None (then ``reward > threshold``,
    see ``method.correct_flags``).
    layout: the group sizes, when a plan made the batch (its own layout, known on the host), else None.
    members: int64 ``[B]``, the rollouts in order of their dense group id (a stable argsort of ``group``),
    when validation built it with the group ids, else None.
    unchecked: the value checks validation left to the backend (``ValueCheck``, in the order the API
    reports errors); empty unless the backend checks values on the device (``BackendSpec.checks_values``).
    All tensors live on the device of the caller's ``responses``.
    """

    responses: Tensor
    mask: Tensor
    rewards: Tensor
    group: Tensor
    group_labels: np.ndarray
    correct: Tensor | None = None
    layout: GroupLayout | None = None
    members: Tensor | None = None
    unchecked: tuple[ValueCheck, ...] = ()

    @property
    def n_groups(self) -> int:
        return len(self.group_labels)

    @property
    def device(self) -> torch.device:
        return self.responses.device


@dataclass
class KeyTokenScores:
    """KTAE statistics, one row per (group, token id) present in the batch, sorted by (group, token).

    Row tensors ``[U]``: ``group``, ``token`` (int64); the contingency table ``a, b, c, d`` (correct /
    wrong rollouts containing the token, correct / wrong rollouts not containing it) and the
    occurrence counts ``f_c, f_w`` (int64); ``p_value`` (two-sided Fisher), ``F``, ``IG`` (bits),
    direction ``x`` and ``score`` in ``(-top, top)`` (float64). ``F`` and ``IG`` are 0 where the table
    carries no information (a group with one class only, or a token in every rollout); ``score`` is 0
    there and for ``config.ignore_token_ids``.
    Group tensors ``[n_groups]`` (int64): ``n_c, n_w`` (correct / wrong rollouts), ``T_c, T_w``
    (masked tokens in them). ``group_labels[g]`` is the caller's label of group ``g``.
    """

    group: Tensor
    token: Tensor
    a: Tensor
    b: Tensor
    c: Tensor
    d: Tensor
    f_c: Tensor
    f_w: Tensor
    p_value: Tensor
    F: Tensor
    IG: Tensor
    x: Tensor
    score: Tensor
    n_c: Tensor
    n_w: Tensor
    T_c: Tensor
    T_w: Tensor
    group_labels: np.ndarray

    def __len__(self) -> int:
        return int(self.group.shape[0])

    def to(self, device: torch.device | str) -> "KeyTokenScores":
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), Tensor) else getattr(self, f.name))
            for f in fields(self)
        }
        return KeyTokenScores(**moved)

    def lookup(self, group: int, token: int) -> dict[str, float]:
        """The row of one (dense group id, token id) as a dict of Python numbers; KeyError if the group has
        no row of ``token``, ValueError for a group id outside ``[0, n_groups)`` or an argument that is not
        an int."""
        group = self._dense_group(group)
        if not plain_int(token):
            raise ValueError(f"`token` must be an int token id, got {token!r}")
        token = operator.index(token)
        hit = torch.nonzero((self.group == group) & (self.token == token)).flatten()
        if hit.numel() == 0:
            raise KeyError(f"no row for group {group}, token {token}")
        i = int(hit[0])
        return {f.name: getattr(self, f.name)[i].item() for f in fields(self) if f.name in ROW_FIELDS}

    def token_scores(self, responses: Tensor, index: Sequence) -> Tensor:
        """float64 ``[B, L]``: ``score[group, responses[i, t]]`` for rollouts of any batch, the row of
        rollout ``i`` found by its caller label ``index[i]`` (in ``group_labels``) and its token; 0
        for a (group, token) pair with no row, an unknown label or a negative id. ``responses``: integer
        ``[B, L]``, ``index``: ``[B]`` (each a tensor, numpy array or list).

        Raises:
            ValueError: an argument of the wrong type or shape (the message names it).
        """
        ids = _token_ids(responses)
        labels = {label: g for g, label in enumerate(np.asarray(self.group_labels).tolist())}
        group = torch.tensor([labels.get(label, -1) for label in _labels(index, ids.shape[0])], dtype=torch.int64)
        score = torch.zeros(ids.shape, dtype=torch.float64)
        if len(self) == 0 or ids.numel() == 0:
            return score
        width = int(self.token.max()) + 1  # an id past every row's token has no row (and no int64 overflow)
        keys = self.group.cpu() * width + self.token.cpu()  # sorted: rows are in (group, token) order
        known = (group[:, None] >= 0) & (ids >= 0) & (ids < width)
        queries = group[:, None] * width + torch.where(known, ids, 0)
        pos = torch.searchsorted(keys, queries).clamp(max=len(self) - 1)
        found = (keys[pos] == queries) & known
        return torch.where(found, self.score.cpu()[pos], 0.0)

    def token_advantage(self, responses: Tensor, response_mask: Tensor, index: Sequence,
                        rollout_advantage: Tensor, weight: float = 1.0) -> Tensor:
        """float32 ``[B, L]`` on ``response_mask``'s device: ``(A_i + weight * token_scores) * mask``,
        summed in float64 and rounded once, as ``ktae_kernels.token_advantage`` gives the rows these
        scores were counted from; for other rows (e.g. earlier turns of an agent session scored by its
        final outputs) the same formula with their (group, token) lookups. ``response_mask``: ``[B, L]``
        bool or 0 / 1; ``rollout_advantage``: ``[B]`` real ``A_i`` (each a tensor, numpy array or list; on
        the CPU when ``response_mask`` is not a tensor).

        Raises:
            ValueError: an argument of the wrong type, shape or values (the message names it).
        """
        score = self.token_scores(responses, index)
        shape = tuple(score.shape)
        mask = as_tensor("response_mask", response_mask).detach()
        check_mask_shape(mask, shape)
        on = zero_one_flags("response_mask", mask.cpu(), "build it as `responses != pad_id`")
        base = as_tensor("rollout_advantage", rollout_advantage).detach()
        check_real_rows("rollout_advantage", base, shape[0])
        base = base.cpu().to(torch.float64)
        check_finite_rows("rollout_advantage", base)
        if not finite_real(weight):
            raise ValueError(f"`weight` must be a finite number, got {weight!r}")
        values = base[:, None] + float(weight) * score
        return torch.where(on, values, 0.0).to(torch.float32).to(mask.device)

    def key_rows(self, group: int, top_k: int | None = None, *, scored_only: bool = False) -> list[int]:
        """Row indices of dense group ``group``, most significant first: by Fisher p-value, then by
        ``|score|`` (descending), then by token id; at most ``top_k``; ``scored_only``: rows with a
        non-zero score only.

        Raises:
            ValueError: ``group`` is not an int in ``[0, n_groups)``, ``top_k`` not None or an int >= 0, or
                ``scored_only`` not a bool.
        """
        group = self._dense_group(group)
        if top_k is not None and (not plain_int(top_k) or operator.index(top_k) < 0):
            raise ValueError(f"`top_k` must be None or an int >= 0, got {top_k!r}")
        if not isinstance(scored_only, bool):
            raise ValueError(f"`scored_only` must be a bool, got {scored_only!r}")
        keep = self.group == group
        if scored_only:
            keep &= self.score != 0
        rows = torch.nonzero(keep).flatten().tolist()
        p, score, token = self.p_value.tolist(), self.score.tolist(), self.token.tolist()
        rows.sort(key=lambda i: (p[i], -abs(score[i]), token[i]))
        return rows if top_k is None else rows[:operator.index(top_k)]

    def _dense_group(self, group: Any) -> int:
        """``group`` as a Python int in ``[0, n_groups)``; ValueError naming the valid ids (and the dense id
        of ``group`` when it is one of the caller's labels) else."""
        n = len(self.group_labels)
        if plain_int(group) and 0 <= operator.index(group) < n:
            return operator.index(group)
        label = group.item() if isinstance(group, np.generic) else group
        labels = np.asarray(self.group_labels).tolist()
        dense = next((g for g, each in enumerate(labels) if type(each) is type(label) in (int, str) and each == label),
                     None)
        hint = "" if dense is None else f"; {group!r} is your label of group {dense}"
        raise ValueError(f"`group` must be a dense group id, an int in [0, {n}) (group_labels[g] is your label of "
                         f"group g), got {group!r}{hint}")


ROW_FIELDS: tuple[str, ...] = (
    "group", "token", "a", "b", "c", "d", "f_c", "f_w", "p_value", "F", "IG", "x", "score",
)
