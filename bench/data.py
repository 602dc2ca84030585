"""Realistic synthetic training batches for the benchmarks (any device, seeded).

A batch looks like a DAPO/GRPO step of a Qwen2.5-Math model: ``prompts`` groups of ``G`` rollouts,
responses of ragged length right-padded to ``L`` with the pad id, a mask that is a prefix of ones.

- Token ids follow a truncated Zipf law over the vocabulary (frequency of rank ``r`` ~ ``r^-s``,
  ``s = 1.2``), mixed with a per-prompt "topic" vocabulary (a quarter of the tokens come from 512
  ids drawn for that prompt, Zipf within), so a group holds a few thousand distinct ids, as real
  responses to one problem do. Ranks map to ids through a fixed random permutation of the vocabulary.
- Lengths are log-normal around ``0.35 L`` (about 7% reach ``L`` and are truncated); a finished
  response ends with the end-of-turn id, and positions after it hold the pad id (masked out).
- Rewards are 1 (correct) or 0; each prompt draws its own accuracy from Beta(0.6, 0.6), and a
  group that came out all-correct or all-wrong gets one rollout flipped: every group is mixed, as in
  a DAPO batch after its dynamic-sampling filter (uniform groups score 0 and cost every
  implementation almost nothing, so they would only flatter the loops on small batches).

Two variants (``Shape`` fields) stress the native kernel: ``spread_ids`` maps the ranks to ids spread
over ``[0, 2**31)`` instead of the vocabulary (past its dense map), and ``masked`` replaces the prefix
mask by responses of full length ``L`` whose positions are masked out at random with that
probability (e.g. tool outputs in a multi-turn rollout).

Each prompt's rollouts come from their own seed, so the first groups of a shape do not depend on how
many prompts are drawn. Token ids are drawn with torch on the target device; lengths and rewards on
the host with numpy, so ``batch_tokens`` counts a batch's real tokens without drawing it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

#: Qwen2.5 vocabulary size (the paper's setting).
QWEN_VOCAB = 151_936
#: Qwen2.5's <|endoftext|> (verl's pad id for Qwen) and <|im_end|> (end of an assistant turn).
PAD_ID = 151_643
EOS_ID = 151_645
#: size of each prompt's topic vocabulary and the share of tokens drawn from it.
TOPIC_IDS = 512
TOPIC_SHARE = 0.25


#: the id range of ``Shape.spread_ids`` batches: every id a 31-bit token id may take.
SPREAD_IDS = 2**31


@dataclass(frozen=True)
class Shape:
    """A benchmark shape: ``prompts`` groups of ``G`` rollouts, responses padded to ``L``; ``spread_ids``:
    ids spread over ``[0, 2**31)``; ``masked``: full-length responses with this share of positions
    masked out at random (0: the usual ragged prefix mask)."""

    G: int
    prompts: int
    L: int
    spread_ids: bool = False
    masked: float = 0.0

    @property
    def family(self) -> tuple:
        """Everything but ``prompts``: shapes of one family share their first groups."""
        return self.G, self.L, self.spread_ids, self.masked

    @property
    def B(self) -> int:
        return self.G * self.prompts

    @property
    def positions(self) -> int:
        """``B * L``: entries of the ``[B, L]`` tensors."""
        return self.B * self.L

    @property
    def variant(self) -> str:
        """" ids<2^31" and / or " 60% masked", or "" for the usual batch."""
        return (" ids<2^31" if self.spread_ids else "") + (f" {self.masked:.0%} masked" if self.masked else "")

    def __str__(self) -> str:
        return f"G={self.G} P={self.prompts} L={self.L}{self.variant}"


@dataclass(frozen=True)
class BenchBatch:
    """responses int64 ``[B, L]``, mask bool ``[B, L]``, rewards float32 ``[B]``, index int64 ``[B]``
    (rows of one prompt are contiguous: ``index = arange(prompts).repeat_interleave(G)``)."""

    shape: Shape
    responses: Tensor
    mask: Tensor
    rewards: Tensor
    index: Tensor
    _host: list = field(default_factory=list, compare=False, repr=False)

    @property
    def tokens(self) -> int:
        """Real (masked) response tokens."""
        return int(self.mask.sum())

    def first_groups(self, k: int) -> "BenchBatch":
        """The batch restricted to its first ``k`` prompts (views, no copy; a host copy made
        earlier by ``on_host`` is restricted too)."""
        rows = k * self.shape.G
        host = [self._host[0].first_groups(k)] if self._host else []
        return BenchBatch(replace(self.shape, prompts=k), self.responses[:rows], self.mask[:rows],
                          self.rewards[:rows], self.index[:rows], host)

    def on_host(self) -> "BenchBatch":
        """This batch on the CPU: itself there, else a copy made once and kept."""
        if self.responses.device.type == "cpu":
            return self
        if not self._host:
            self._host.append(BenchBatch(self.shape, self.responses.cpu(), self.mask.cpu(), self.rewards.cpu(),
                                         self.index.cpu()))
        return self._host[0]

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(responses, mask, rewards, index)`` as ``token_advantage`` takes them."""
        return self.responses, self.mask, self.rewards, self.index


def make_batch(shape: Shape, *, prompts: int | None = None, vocab: int = QWEN_VOCAB, seed: int = 0,
               device: str | torch.device = "cpu", zipf_s: float = 1.2) -> BenchBatch:
    """A seeded synthetic batch of ``shape`` on ``device`` (see the module docstring).

    ``prompts``: materialise only the first ``prompts`` groups (all by default). Each prompt's
    rollouts are drawn from their own seed ``(seed, G, L, prompt)``, so the first groups of a shape
    are the same whatever ``prompts`` or ``shape.prompts`` is.
    """
    if shape.G < 1 or shape.prompts < 1 or shape.L < 1:
        raise ValueError(f"`shape` must have G, prompts, L >= 1, got {shape}")
    if vocab <= EOS_ID:
        raise ValueError(f"`vocab` must exceed the special ids ({EOS_ID}), got {vocab}")
    prompts = shape.prompts if prompts is None else prompts
    if not 1 <= prompts <= shape.prompts:
        raise ValueError(f"`prompts` must be in [1, {shape.prompts}], got {prompts}")
    device = torch.device(device)
    G, L = shape.G, shape.L
    out = replace(shape, prompts=prompts)
    rank_to_id = _rank_to_id(vocab, shape.spread_ids, seed).to(device)
    responses = torch.empty((out.B, L), dtype=torch.int64, device=device)
    for p in range(prompts):
        gen = torch.Generator(device=device).manual_seed(_prompt_seed(seed, G, L, p))
        responses[p * G:(p + 1) * G] = _prompt_tokens(G, L, rank_to_id, vocab, zipf_s, gen, device,
                                                           shape.spread_ids)
    lengths, rewards = _lengths_and_rewards(out, seed)
    lengths = torch.as_tensor(lengths, device=device)
    mask = torch.arange(L, device=device)[None, :] < lengths[:, None]
    if shape.masked:
        mask &= torch.as_tensor(_random_mask(out, seed), device=device)
    finished = lengths < L
    responses[finished, lengths[finished] - 1] = EOS_ID
    responses.masked_fill_(~mask, PAD_ID)
    index = torch.arange(out.B, device=device) // G
    return BenchBatch(out, responses, mask, torch.as_tensor(rewards, device=device), index)


def batch_tokens(shape: Shape, seed: int = 0) -> int:
    """Real (masked) tokens of ``make_batch(shape, seed=seed)``, without drawing the tokens."""
    if shape.masked:
        return int(_random_mask(shape, seed).sum())
    return int(_lengths_and_rewards(shape, seed)[0].sum())


def _rank_to_id(vocab: int, spread: bool, seed: int) -> Tensor:
    """int64 ``[vocab]``: the id of each Zipf rank, a permutation of the vocabulary or (``spread``)
    distinct ids drawn from ``[0, 2**31)``."""
    gen = torch.Generator().manual_seed(seed)
    if not spread:
        return torch.randperm(vocab, generator=gen)
    ids = torch.unique(torch.randint(0, SPREAD_IDS, (2 * vocab,), generator=gen))
    return ids[torch.randperm(ids.numel(), generator=gen)[:vocab]]


def _random_mask(shape: Shape, seed: int) -> np.ndarray:
    """bool ``[B, L]``: each position kept with probability ``1 - shape.masked``, per prompt from its own seed."""
    G, L = shape.G, shape.L
    rows = [np.random.default_rng([_prompt_seed(seed, G, L, p), 1]).random((G, L)) >= shape.masked
            for p in range(shape.prompts)]
    return np.concatenate(rows) if rows else np.zeros((0, L), dtype=bool)


def _prompt_seed(seed: int, G: int, L: int, prompt: int) -> int:
    return int(np.random.SeedSequence([seed, G, L, prompt]).generate_state(1)[0])


def _prompt_tokens(G: int, L: int, rank_to_id: Tensor, vocab: int, zipf_s: float, gen: torch.Generator,
                   device: torch.device, spread: bool = False) -> Tensor:
    """int64 ``[G, L]`` token ids of one prompt's rollouts: global Zipf, a quarter from its topic ids."""
    topic = torch.randint(0, vocab, (TOPIC_IDS,), generator=gen, device=device)
    if spread:
        topic = rank_to_id[topic]
    tokens = rank_to_id[_zipf_ranks((G, L), vocab, zipf_s, gen, device)]
    from_topic = torch.rand((G, L), generator=gen, device=device) < TOPIC_SHARE
    return torch.where(from_topic, topic[_zipf_ranks((G, L), TOPIC_IDS, zipf_s, gen, device)], tokens)


def _lengths_and_rewards(shape: Shape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 lengths in ``[1, L]`` (log-normal, median ``0.35 L``, sigma 0.7) and float32 0/1 rewards
    (each prompt's accuracy ~ Beta(0.6, 0.6), every group of G > 1 mixed), ``[B]`` each, on the host,
    each prompt from its own seed."""
    G, L = shape.G, shape.L
    lengths, rewards = np.empty((shape.prompts, G)), np.empty((shape.prompts, G), dtype=bool)
    for p in range(shape.prompts):
        rng = np.random.default_rng(_prompt_seed(seed, G, L, p))
        lengths[p] = np.clip(np.round(np.exp(np.log(0.35 * L) + 0.7 * rng.standard_normal(G))), 1, L)
        if shape.masked:
            lengths[p] = L
        rewards[p] = rng.random(G) < rng.beta(0.6, 0.6)
        if G > 1 and (rewards[p].all() or not rewards[p].any()):  # DAPO keeps mixed groups: flip one
            rewards[p, rng.integers(G)] ^= True
    return lengths.reshape(-1).astype(np.int64), rewards.reshape(-1).astype(np.float32)


def _zipf_ranks(size: tuple[int, int], n: int, s: float, gen: torch.Generator, device: torch.device) -> Tensor:
    """int64 ranks in ``[0, n)`` with ``P(r) ~ (r + 1)^-s`` (inverse CDF of a truncated Pareto, floored)."""
    u = torch.rand(size, generator=gen, device=device)
    tail = 1.0 - n ** (1.0 - s)
    x = (1.0 - u * tail).pow_(-1.0 / (s - 1.0))
    return x.floor_().clamp_(1, n).to(torch.int64).sub_(1)
