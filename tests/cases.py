"""Shared batch generators and comparison helpers for every backend's tests.

A case is ``(name, responses [B, L] int64, mask [B, L] bool, rewards [B] float32, index [B])``.
``random_cases`` draws realistic batches; ``adversarial_cases`` covers the corners the method
defines specially. ``small=True`` keeps shapes fit for the Triton CPU interpreter.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from scipy.stats import fisher_exact

from ktae_kernels.types import KeyTokenScores

ROW_INT_FIELDS = ("group", "token", "a", "b", "c", "d", "f_c", "f_w")
ROW_FLOAT_FIELDS = ("p_value", "F", "IG", "x", "score")
GROUP_FIELDS = ("n_c", "n_w", "T_c", "T_w")


def make_batch(rng: np.random.Generator, group_sizes, length: int, vocab: int, *, zipf: bool = False,
               mask_rate: float = 0.2, p_correct: float = 0.5, shuffle: bool = False):
    """A batch of groups of the given sizes; rollouts of a group are interleaved when ``shuffle``."""
    B = int(sum(group_sizes))
    if zipf:
        responses = np.minimum(rng.zipf(1.2, size=(B, length)) - 1, vocab - 1)
    else:
        responses = rng.integers(0, vocab, size=(B, length))
    lengths = rng.integers(0, length + 1, size=B) if mask_rate > 0 else np.full(B, length)
    mask = np.arange(length)[None, :] < lengths[:, None]
    mask &= rng.random((B, length)) >= mask_rate / 4
    rewards = (rng.random(B) < p_correct).astype(np.float32)
    index = np.repeat(np.arange(len(group_sizes)), group_sizes)
    if shuffle:
        perm = rng.permutation(B)
        responses, mask, rewards, index = responses[perm], mask[perm], rewards[perm], index[perm]
    return (torch.as_tensor(responses, dtype=torch.int64), torch.as_tensor(mask),
            torch.as_tensor(rewards), torch.as_tensor(index, dtype=torch.int64))


def as_uids(index, prefix: str = "u"):
    """Group ids as the uid strings verl and the adapters see (numpy object ``[B]``)."""
    return np.array([f"{prefix}{int(g)}" for g in index], dtype=object)


def random_cases(seed: int = 0, small: bool = False):
    """Named random batches: G in {2, 4, 16, 64}, small and large vocabularies, mixed group sizes."""
    rng = np.random.default_rng(seed)
    if small:
        specs = [
            ("G2-small-vocab", [2] * 4, 16, 8, False, False),
            ("G4-mixed-shuffled", [4, 3, 1, 4], 24, 30, False, True),
            ("G16-zipf", [16, 16], 32, 151936, True, False),
        ]
    else:
        specs = [
            ("G2-small-vocab", [2] * 16, 64, 8, False, False),
            ("G4-mixed-shuffled", [4, 3, 5, 1, 4, 2], 128, 50, False, True),
            ("G16-zipf-qwen-vocab", [16] * 4, 512, 151936, True, True),
            ("G16-long", [16] * 2, 4096, 151936, True, False),
            ("G64-large", [64] * 2, 256, 2000, False, True),
            ("G64-zipf", [64, 33], 300, 151936, True, True),
        ]
    return [(name, *make_batch(rng, sizes, length, vocab, zipf=zipf, shuffle=shuffle))
            for name, sizes, length, vocab, zipf, shuffle in specs]


def adversarial_cases(small: bool = False):
    """Named corner cases: degenerate groups, all-masked rollouts, universal tokens, Fisher ties,
    huge occurrence counts and token ids up to 2**31 - 1."""
    rng = np.random.default_rng(1234)
    L = 16 if small else 64
    cases = []

    r, m, w, i = make_batch(rng, [4, 4, 4], L, 10)
    w[:4] = 1.0
    w[4:8] = 0.0
    w[8:] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    cases.append(("all-correct-and-all-wrong-groups", r, m, w, i))

    r, m, w, i = make_batch(rng, [1, 1, 3, 1], L, 12)
    cases.append(("one-rollout-groups", r, m, w, i))

    r, m, w, i = make_batch(rng, [4, 4], L, 12)
    m[1] = False
    m[6] = False
    w[:] = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    cases.append(("all-masked-rollouts", r, m, w, i))

    r, m, w, i = make_batch(rng, [6, 6], L, 20)
    r[:, 0] = 5
    m[:, 0] = True
    w[:] = torch.tensor([1.0, 0.0] * 6)
    cases.append(("token-in-every-rollout", r, m, w, i))

    # symmetric tables: n_c == n_w and every presence pattern, so the Fisher support has ties
    G = 8
    r = torch.zeros(G, L, dtype=torch.int64)
    for j in range(G):
        r[j] = 100 + torch.arange(L) % (j + 2)
    m = torch.ones(G, L, dtype=torch.bool)
    w = torch.tensor([1.0, 0.0] * (G // 2))
    cases.append(("fisher-ties", r, m, w, torch.zeros(G, dtype=torch.int64)))

    big = 2**31 - 1
    r, m, w, i = make_batch(rng, [4, 4], L, 5)
    r = r + (big - 4)
    r[0, :3] = 0
    w[:] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    cases.append(("token-ids-near-2^31", r, m, w, i))

    n_long = 4096 if small else 100_000
    r = torch.zeros(4, n_long, dtype=torch.int64)
    r[:, ::7] = 3
    r[2:, ::3] = 9
    m = torch.ones(4, n_long, dtype=torch.bool)
    cases.append(("huge-counts", r, m, torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.int64)))

    r, m, w, i = make_batch(rng, [5, 5], L, 15)
    w[:] = torch.tensor([0.7, -0.2, 0.0, 1.0, 2.5, 0.0, 0.0, 0.1, -1.0, 0.0])
    cases.append(("graded-rewards", r, m, w, i))

    r, m, w, i = make_batch(rng, [3, 3], L, 15)
    m[:] = False
    cases.append(("everything-masked", r, m, w, i))
    return cases


def zero_strength_case():
    """One group of 4 rollouts (2 correct) where token 7 sits in one correct and one wrong rollout: its
    table has p = 1, so strength 0, and a negative direction (more of it in the wrong rollout), the score
    ``0 * x < 0``. With ``rollout_advantage`` -0.0 the method gives +0.0 there (``method.squash`` adds
    0.0). (responses, mask, rewards, index, rollout_advantage) tensors."""
    responses = torch.tensor([[7, 1, 2, 3], [4, 5, 6, 8], [7, 7, 7, 9], [10, 11, 12, 13]])
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    return responses, mask, rewards, torch.zeros(4, dtype=torch.int64), torch.full((4,), -0.0, dtype=torch.float64)


def assert_same_signs(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Equal values and equal sign bits (``torch.equal`` holds -0.0 == 0.0)."""
    assert torch.equal(expected, actual)
    assert torch.equal(torch.signbit(expected), torch.signbit(actual)), (expected, actual)


def distinct_and_repeated_groups():
    """Two groups of 4 rollouts x 40: group 0 holds 160 distinct ids (past any first table slice),
    group 1 only ids 0-2; rewards 1, 0, 1, 0 in each. (responses, mask, rewards, index) tensors."""
    rng = np.random.default_rng(8)
    G, L = 4, 40
    responses = torch.as_tensor(np.concatenate([rng.permutation(10**5)[:G * L].reshape(G, L),
                                                rng.integers(0, 3, size=(G, L))]))
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0] * 2)
    index = torch.arange(2 * G) // G
    return responses, mask, rewards, index


def assert_scores_match(expected: KeyTokenScores, actual: KeyTokenScores, *, p_rtol: float = 1e-9,
                        atol: float = 1e-9) -> None:
    """Same rows, identical integer columns, float columns within tolerance (p-values relative)."""
    assert len(expected) == len(actual), (len(expected), len(actual))
    for name in ROW_INT_FIELDS + GROUP_FIELDS:
        e, a = getattr(expected, name).cpu(), getattr(actual, name).cpu()
        assert torch.equal(e, a), f"{name} differs at {torch.nonzero(e != a).flatten()[:5].tolist()}"
    torch.testing.assert_close(actual.p_value.cpu(), expected.p_value.cpu(), rtol=p_rtol, atol=0.0)
    for name in ("F", "IG", "x", "score"):
        torch.testing.assert_close(getattr(actual, name).cpu().double(), getattr(expected, name).cpu().double(),
                                   rtol=1e-9, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def triton_devices() -> list[str]:
    """Devices the Triton kernels can be tested on: CUDA, else the CPU under TRITON_INTERPRET=1, else none."""
    if torch.cuda.is_available():
        return ["cuda"]
    return ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []


def ragged_batch(gen: torch.Generator, B: int, L: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform ids below ``vocab``, a prefix mask of random length, 0/1 float64 rewards (on the CPU)."""
    responses = torch.randint(0, vocab, (B, L), generator=gen)
    mask = torch.arange(L)[None, :] < torch.randint(1, L + 1, (B, 1), generator=gen)
    rewards = (torch.rand(B, generator=gen) < 0.5).double()
    return responses, mask, rewards


def cuda_graph_of(call) -> "torch.cuda.CUDAGraph":
    """``call()`` captured in a CUDA graph, after two warm-up calls on a side stream (they fill the
    backends' caches and the allocator's pools, as every capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def assert_replays_match_torch(graph: "torch.cuda.CUDAGraph", inputs, out: torch.Tensor, draw, index,
                               replays: int = 3) -> None:
    """Each replay of ``graph`` on a new batch ``draw()`` (responses, mask, rewards on the CPU) copied into
    its captured ``inputs`` leaves the torch backend's result for ``index`` in ``out``."""
    from ktae_kernels import token_advantage

    for _ in range(replays):
        new = draw()
        for captured, value in zip(inputs, new):
            captured.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu(), token_advantage(*new, index, backend="torch"), rtol=0.0, atol=1e-6)


def scipy_pvalues(tables: np.ndarray) -> np.ndarray:
    """``scipy.stats.fisher_exact`` two-sided p-values of ``[T, 4]`` tables ``(a, b, c, d)``."""
    return np.array([fisher_exact([[a, b], [c, d]], alternative="two-sided").pvalue for a, b, c, d in tables])


def ktae_tables(max_rollouts: int = 16) -> np.ndarray:
    """Every table a group of up to ``max_rollouts`` rollouts can produce: ``[T, 4]``."""
    return np.array([(a, b, nc - a, n - nc - b) for n in range(1, max_rollouts + 1) for nc in range(n + 1)
                     for a in range(nc + 1) for b in range(n - nc + 1)])


def symmetric_tie_tables(rng: np.random.Generator, count: int, max_margin: int) -> np.ndarray:
    """``3 * count`` tables whose support holds exact mirror images of the observed table (ties)."""
    tables = []
    for _ in range(count):
        n, m = rng.integers(1, max_margin, size=2)
        k = rng.integers(0, n + 1)
        tables += [(k, n - k, n - k, k), (k, m, m, k), (k, n - k, k, n - k)]
    return np.array(tables)
