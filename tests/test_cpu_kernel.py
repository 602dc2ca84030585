"""The native CPU kernel's own parts: its table statistics against ``method.table_statistics``, its
memoising cache, the shapes users meet (big groups, ids past the dense map, long responses, sparse
masks) against the reference, adversarial ids for its hash table, thread counts and every split of
the groups between threads (a worker that never runs, a forked child), the ``threads`` setting and the
typed binding's rejections."""
import ctypes
import os

import numpy as np
import pytest
import torch

import ktae_kernels.backends.cpu as cpu
from cases import assert_scores_match, make_batch
from ktae_kernels import ExecutionOptions, KTAEConfig, key_token_scores, method, token_advantage

pytestmark = pytest.mark.skipif(cpu.unavailable_reason() is not None and not os.environ.get("CI"),
                                reason="the native CPU kernel is not built (CI requires it)")

DENSE_IDS = 1 << 18  # the kernel's dense map covers ids below this
MAX_ID = 2**31 - 1


@pytest.fixture
def kernel():
    return cpu.load_extension()


def _native_statistics(kernel, tables: torch.Tensor) -> torch.Tensor:
    """float64 [4, T] (p, F, IG, h) of int64 [4, T] tables (a, b, n_c, n_w), as the kernel computes them."""
    out = torch.empty(4, tables.shape[1], dtype=torch.float64)
    kernel.table_statistics(tables.contiguous(), out)
    return out


def _method_statistics(tables: torch.Tensor) -> method.TableStats:
    return method.table_statistics(*tables, KTAEConfig())


def _random_tables(rng: np.random.Generator, count: int, max_side: int) -> torch.Tensor:
    n_c, n_w = rng.integers(0, max_side + 1, count), rng.integers(0, max_side + 1, count)
    a, b = rng.integers(0, n_c + 1), rng.integers(0, n_w + 1)
    return torch.as_tensor(np.stack([a, b, n_c, n_w]), dtype=torch.int64)


@pytest.mark.parametrize("max_side, rtol", [(16, 1e-13), (64, 1e-12), (1024, 1e-10)])
def test_native_statistics_equal_method_table_statistics(kernel, max_side, rtol):
    """IG exactly; p, F and h to float64 rounding (torch's vectorised exp/asin and summation order
    differ from libm's sequential ones in the last bits, and a log-probability of magnitude m carries
    m * 1e-16 of rounding in both); the F = 0 rule (p >= 1 - 1e-12) and ties identically."""
    tables = _random_tables(np.random.default_rng(max_side), 20_000, max_side)
    native, expected = _native_statistics(kernel, tables), _method_statistics(tables)
    assert torch.equal(native[2], expected.IG)
    for row, name in ((0, "p_value"), (1, "F"), (3, "h")):
        torch.testing.assert_close(native[row], getattr(expected, name), rtol=rtol, atol=1e-300, msg=name)
    assert torch.equal(native[1] == 0, expected.F == 0)
    assert torch.equal(native[0] == 1, expected.p_value == 1)


def test_native_statistics_match_scipy_on_ties(kernel):
    from cases import scipy_pvalues, symmetric_tie_tables

    tables = symmetric_tie_tables(np.random.default_rng(3), 300, 40)  # [T, 4] a, b, c, d
    a, b, c, d = tables.T
    ours = _native_statistics(kernel, torch.as_tensor(np.stack([a, b, a + c, b + d]), dtype=torch.int64))[0]
    np.testing.assert_allclose(ours.numpy(), np.minimum(scipy_pvalues(tables), 1.0), rtol=1e-9)


def _big_group_batch(seed: int = 11, sizes=(300, 200), length: int = 40, vocab: int = 400):
    return make_batch(np.random.default_rng(seed), list(sizes), length, vocab, zipf=True, p_correct=0.4)


def test_big_groups_use_native_statistics_and_memoise_them(kernel, monkeypatch):
    """Past ``method.FULL_GRID_WORK`` the kernel computes the tables it meets (no torch pass, no rows
    listed first), once: a second call finds them all cached and returns the same bits."""
    monkeypatch.setattr(method, "distinct_tables", _must_not_run)
    batch = _big_group_batch()
    kernel.clear_statistics_cache()
    cold = token_advantage(*batch, backend="cpu")
    cached = kernel.statistics_cache_size()
    assert cached > 0
    warm = token_advantage(*batch, backend="cpu")
    assert kernel.statistics_cache_size() == cached
    assert torch.equal(cold, warm)
    monkeypatch.undo()
    torch.testing.assert_close(warm, token_advantage(*batch, backend="reference"), rtol=0, atol=1e-6)


def _must_not_run(*args, **kwargs):
    raise AssertionError("big groups must not list rows for a torch statistics pass")


def test_native_and_grid_statistics_agree(monkeypatch):
    """The same batch through the Python grid (small groups) and the kernel's own statistics."""
    batch = make_batch(np.random.default_rng(2), [16, 12, 9, 16], 60, 300, zipf=True)
    grid = token_advantage(*batch, backend="cpu")
    monkeypatch.setattr(method, "FULL_GRID_WORK", 0)
    native = token_advantage(*batch, backend="cpu")
    torch.testing.assert_close(native, grid, rtol=0, atol=1e-6)
    assert (native == grid).double().mean() > 0.999  # float32 outputs: ulp-level statistics rarely show


# One small batch per shape class of the benchmark's "shapes" preset (bench/grid.py).
SHAPES = {
    "G16-many-prompts": dict(sizes=[16] * 24, length=48, vocab=151936),
    "G256": dict(sizes=[256, 256], length=24, vocab=2000),
    "G1024": dict(sizes=[1024], length=16, vocab=3000),
    "ids-spread-to-2^31": dict(sizes=[16] * 8, length=48, vocab=151936, spread=True),
    "long-responses": dict(sizes=[16] * 2, length=3000, vocab=151936),
    "one-micro-batch": dict(sizes=[16] * 8, length=64, vocab=151936),
    "G64": dict(sizes=[64] * 4, length=48, vocab=151936),
    "60%-masked": dict(sizes=[16] * 8, length=64, vocab=151936, mask_rate=2.4),
}


def _shape_batch(name: str):
    spec = dict(SHAPES[name])
    spread = spec.pop("spread", False)
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    responses, mask, rewards, index = make_batch(rng, spec.pop("sizes"), spec.pop("length"), spec.pop("vocab"),
                                                 zipf=True, **spec)
    if spread:  # a fixed random injection of the ids into [0, 2**31)
        table = torch.as_tensor(rng.choice(2**31, size=151936, replace=False), dtype=torch.int64)
        responses = table[responses]
    return responses, mask, rewards, index


@pytest.mark.parametrize("name", SHAPES)
def test_shape_classes_match_reference_at_every_thread_count(name):
    batch = _shape_batch(name)
    expected = token_advantage(*batch, backend="reference")
    results = [token_advantage(*batch, options=ExecutionOptions(threads=n), backend="cpu") for n in (1, 2, 3)]
    torch.testing.assert_close(results[0], expected, rtol=0, atol=1e-6)
    assert all(torch.equal(results[0], r) for r in results[1:]), "the result depends on the thread count"


def test_shape_classes_key_token_scores():
    for name in ("G256", "ids-spread-to-2^31", "60%-masked"):
        batch = _shape_batch(name)
        assert_scores_match(key_token_scores(*batch, backend="reference"), key_token_scores(*batch, backend="cpu"))


def test_a_group_past_the_packed_presence_counts():
    """More than 65535 rollouts in one group: presence counts no longer fit 16 bits (wide entries)."""
    rng = np.random.default_rng(6)
    B = 66_000
    responses = torch.as_tensor(rng.integers(0, 12, size=(B, 2)), dtype=torch.int64)
    mask, index = torch.ones(B, 2, dtype=torch.bool), torch.zeros(B, dtype=torch.int64)
    rewards = torch.as_tensor(rng.random(B) < 0.3, dtype=torch.float32)
    # the reference, not torch: torch lays out the group's whole (n_c + 1)(n_w + 1) grid of tables
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, backend="cpu"),
                               token_advantage(responses, mask, rewards, index, backend="reference"),
                               rtol=0, atol=1e-6)


ADVERSARIAL_IDS = {
    # multiples of 2**20: one bucket under any hash that keeps the low bits (identity mod a power of two)
    "low-bits-collide": [DENSE_IDS + (k << 20) for k in range(1500)],
    # the same low 16 and high bits: collide under a hash of the top or bottom bits alone
    "middle-bits-only": [(1 << 30) | (k << 16) | 0x1234 for k in range(1 << 12)],
    "boundaries": [0, 1, DENSE_IDS - 1, DENSE_IDS, DENSE_IDS + 1, MAX_ID - 1, MAX_ID],
    "dense-and-sparse-interleaved": [k if k % 2 else MAX_ID - k for k in range(3000)],
}


@pytest.mark.parametrize("name", ADVERSARIAL_IDS)
def test_hash_table_adversarial_ids(name):
    """Ids chosen to collide in a naive hash, the dense map's boundary and the largest id: exact counts
    (key_token_scores) and advantages as the reference, at one and two threads."""
    ids = torch.tensor(ADVERSARIAL_IDS[name], dtype=torch.int64)
    rng = np.random.default_rng(len(ids))
    base, mask, rewards, index = make_batch(rng, [6, 5, 7], 300, len(ids), shuffle=True)
    responses = ids[base]
    assert_scores_match(key_token_scores(responses, mask, rewards, index, backend="reference"),
                 key_token_scores(responses, mask, rewards, index, backend="cpu"))
    expected = token_advantage(responses, mask, rewards, index, backend="reference")
    for threads in (1, 2):
        got = token_advantage(responses, mask, rewards, index, options=ExecutionOptions(threads=threads),
                               backend="cpu")
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_many_distinct_sparse_ids_in_one_group():
    """One group's ids all past the dense map, more than the hash table's first size (it grows)."""
    rng = np.random.default_rng(4)
    responses = torch.as_tensor(rng.choice(np.arange(DENSE_IDS, MAX_ID, 977), size=(8, 4000)), dtype=torch.int64)
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards, index = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 0]), torch.zeros(8, dtype=torch.int64)
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, backend="cpu"),
                               token_advantage(responses, mask, rewards, index, backend="reference"), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------- counting paths
# The kernel reads a row in blocks of 8 positions: a block all in the mask whose ids are all below the
# dense map's end takes one loop, one all in the mask with ids up to 2**31 - 1 another (the hash table),
# a block partly in the mask a third, and a row's tail (L % 8 positions) and a block with an id out of
# range go position by position. Each mask kind x id kind below sends rows through a different mix.
MASKS = {
    "prefix": lambda rng, B, L: np.arange(L)[None, :] < rng.integers(0, L + 1, size=(B, 1)),
    "full": lambda rng, B, L: np.ones((B, L), dtype=bool),
    "random-60%-out": lambda rng, B, L: rng.random((B, L)) >= 0.6,
    "blocks": lambda rng, B, L: np.repeat(rng.random((B, L // 8 + 1)) < 0.5, 8, axis=1)[:, :L],
}
IDS = {
    "dense": lambda rng, shape: rng.zipf(1.2, size=shape) % 5000,
    "spread": lambda rng, shape: rng.choice(np.arange(DENSE_IDS, MAX_ID, 7919), size=shape),
    "dense-and-spread": lambda rng, shape: np.where(rng.random(shape) < 0.5, rng.zipf(1.2, size=shape) % 3000,
                                                    MAX_ID - rng.zipf(1.2, size=shape) % 3000),
    "edges": lambda rng, shape: rng.choice([0, 1, DENSE_IDS - 1, DENSE_IDS, DENSE_IDS + 1, MAX_ID - 1, MAX_ID],
                                           size=shape),
}


@pytest.mark.parametrize("length", [64, 61])  # 61: a tail of 5 positions in every row
@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize("mask", MASKS)
def test_counting_paths_match_torch_bitwise(mask, ids, length):
    rng = np.random.default_rng([len(mask), len(ids), length])
    sizes = [16, 16, 5, 70]  # 70: a group past the rollout bits (packed presence)
    B = sum(sizes)
    responses = torch.as_tensor(IDS[ids](rng, (B, length)), dtype=torch.int64)
    masks = torch.as_tensor(MASKS[mask](rng, B, length))
    rewards = torch.as_tensor(rng.random(B) < 0.5, dtype=torch.float32)
    index = torch.as_tensor(rng.permutation(np.repeat(np.arange(len(sizes)), sizes)), dtype=torch.int64)
    config = KTAEConfig(ignore_token_ids=(1, DENSE_IDS + 1, MAX_ID))  # ignored ids in both maps
    expected = token_advantage(responses, masks, rewards, index, config=config, backend="torch")
    for threads in (1, 2):
        got = token_advantage(responses, masks, rewards, index, config=config,
                              options=ExecutionOptions(threads=threads), backend="cpu")
        assert torch.equal(got, expected), f"{threads} threads"
    torch.testing.assert_close(expected, token_advantage(responses, masks, rewards, index, config=config,
                                                         backend="reference"), rtol=0, atol=1e-6)
    assert_scores_match(key_token_scores(responses, masks, rewards, index, config=config, backend="reference"),
                        key_token_scores(responses, masks, rewards, index, config=config, backend="cpu"))


# A group of G <= 32 rollouts whose counts fit beside G presence bits (G * L < 2 ** ((64 - G) // 2))
# counts into 8-byte entries (the compact path) unless a masked id is past the dense map; 32 x 2047 is
# the largest such group of 32 rollouts, 32 x 2048 the smallest that is not.
@pytest.mark.parametrize("G, L", [(32, 2047), (32, 2048), (17, 20), (2, 9)])
def test_compact_entries_at_their_count_limit(G, L):
    """One id at every position of all rollouts but the first: with most rollouts correct (then most
    wrong) its occurrences on one side reach past half of G * L, the most a compact entry holds, and
    its score is not saturated (every count shows). Bitwise as the torch path."""
    responses = torch.full((G, L), 7, dtype=torch.int64)
    responses[0] = 8
    mask = torch.ones(G, L, dtype=torch.bool)
    for n_c in {G - G // 3, max(1, G // 3)}:
        rewards = torch.as_tensor(np.arange(G) < n_c, dtype=torch.float32)
        for config in (KTAEConfig(), KTAEConfig(use_tf=False)):
            expected = token_advantage(responses, mask, rewards, [0] * G, config=config, backend="torch")
            got = token_advantage(responses, mask, rewards, [0] * G, config=config, backend="cpu")
            assert torch.equal(got, expected)
        scores = key_token_scores(responses, mask, rewards, [0] * G, backend="torch")
        assert G == 2 or 0 < abs(float(scores.score[scores.token == 7])) < 0.9


def test_random_batches_match_torch_bitwise_on_both_counting_paths():
    """Seeded random batches: groups of 1-39 rollouts (compact up to 32), ids dense, spread, mostly
    dense with a few past the map (a group falls back part-way) or at the edges, full / random /
    prefix masks with garbage ids out of the mask, ignored ids, negative weights: bitwise the torch
    path at 1 and 2 threads."""
    rng = np.random.default_rng(2026)
    id_kinds = [
        lambda shape: rng.zipf(1.3, size=shape) % 50,
        lambda shape: rng.integers(0, DENSE_IDS, size=shape),
        lambda shape: np.where(rng.random(shape) < 0.02, rng.integers(DENSE_IDS, MAX_ID + 1, size=shape),
                               rng.zipf(1.3, size=shape) % 30),
        lambda shape: rng.choice([0, 1, 5, DENSE_IDS - 1, DENSE_IDS, MAX_ID], size=shape),
    ]
    for case in range(40):
        sizes = rng.integers(1, 40, size=rng.integers(1, 5))
        B, L = int(sizes.sum()), int(rng.integers(1, 70))
        mask = [np.ones((B, L), dtype=bool), rng.random((B, L)) < 0.6,
                np.arange(L)[None, :] < rng.integers(0, L + 1, size=(B, 1))][case % 3]
        ids = np.where(mask, id_kinds[case % 4]((B, L)), rng.choice([-1, 2**40, 7], size=(B, L)))
        batch = (torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(mask),
                 torch.as_tensor(rng.random(B) < 0.5, dtype=torch.float32),
                 torch.as_tensor(rng.permutation(np.repeat(np.arange(len(sizes)), sizes))))
        settings = dict(ignore_token_ids=tuple(int(x) for x in rng.choice([0, 5, DENSE_IDS, MAX_ID], size=case % 3)),
                        weight=[1.0, -0.7, 2.5][case % 3], use_tf=case % 5 != 0)
        expected = token_advantage(*batch, config=KTAEConfig(**settings), backend="torch")
        for threads in (1, 2):
            got = token_advantage(*batch, config=KTAEConfig(**settings),
                                  options=ExecutionOptions(threads=threads), backend="cpu")
            assert torch.equal(got, expected), (case, threads)


@pytest.mark.parametrize("weight", [1.0, -0.5])
def test_ignored_ids_on_the_compact_path(weight):
    """Ignored ids score 0 * weight (-0.0 for a negative weight) wherever they are counted, bitwise as
    the torch path; ignored ids the group lacks, past the dense map or in no group change nothing."""
    rng = np.random.default_rng(5)
    sizes, L = [16, 8, 3], 37
    B = sum(sizes)
    responses = torch.as_tensor(rng.zipf(1.3, size=(B, L)) % 40, dtype=torch.int64)
    mask = torch.as_tensor(MASKS["random-60%-out"](rng, B, L))
    mask[:, 0] = True
    responses[::2, 0] = 3  # an ignored id in half the rollouts of every group
    rewards = torch.as_tensor(np.arange(B) % 3 == 0, dtype=torch.float32)
    index = np.repeat(np.arange(len(sizes)), sizes)
    config = KTAEConfig(ignore_token_ids=(0, 3, 5, 39, 1000, DENSE_IDS, MAX_ID), weight=weight)
    expected = token_advantage(responses, mask, rewards, index, config=config, backend="torch")
    got = token_advantage(responses, mask, rewards, index, config=config, backend="cpu")
    assert torch.equal(got, expected)
    scored = token_advantage(responses, mask, rewards, index, config=KTAEConfig(weight=weight), backend="cpu")
    assert not torch.equal(got[::2, 0], scored[::2, 0])  # id 3 has a score where it is not ignored


@pytest.mark.parametrize("k1, b", [(2.0, 0.5), (1.2, 0.0), (0.5, 1.0)])
def test_term_frequencies_on_both_sides_of_the_cached_range(k1, b):
    """The kernel computes a group's BM25 frequencies of counts below 64 once (Bm25Side) and the others
    per row: ids occurring 0 to 145 times in the correct rollouts (spread over three of four) and 145 to
    0 times in one wrong rollout, bitwise as the torch path."""
    rng = np.random.default_rng(int(k1 * 10 + b * 100))
    G, L, filler = 8, 3072, 1000
    counts = np.arange(0, 150, 5)
    responses = np.full((G, L), filler, dtype=np.int64)
    correct = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    spread = responses[:3].reshape(-1)  # a view: rollouts 0..2 of the correct 0..3
    spread[rng.choice(spread.size, correct.size, replace=False)] = correct
    wrong = rng.permutation(np.repeat(np.arange(len(counts)), counts[::-1]))
    responses[4, : wrong.size] = wrong  # rollout 4 of the wrong 4..7
    responses, mask = torch.as_tensor(responses), torch.ones(G, L, dtype=torch.bool)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4)
    config = KTAEConfig(k1=k1, b=b)
    expected = token_advantage(responses, mask, rewards, [0] * G, config=config, backend="torch")
    assert torch.equal(token_advantage(responses, mask, rewards, [0] * G, config=config, backend="cpu"), expected)
    assert len(torch.unique(expected[:3])) > 20  # the ids' scores differ through their frequencies


@pytest.mark.parametrize("where", ["all-in-block", "mixed-block", "tail", "spread-block"])
@pytest.mark.parametrize("value", [-1, 2**31, -(2**63)])
def test_out_of_range_ids_in_every_counting_path(where, value):
    rng = np.random.default_rng(8)
    B, L = 8, 21  # two blocks and a tail of 5
    responses = torch.as_tensor(rng.integers(0, 100, size=(B, L)), dtype=torch.int64)
    if where == "spread-block":
        responses[:, :8] += MAX_ID - 200
    mask = torch.ones(B, L, dtype=torch.bool)
    if where == "mixed-block":
        mask[:, 8:16] = torch.as_tensor(rng.random((B, 8)) < 0.5)
        mask[5, 9] = True
    rewards, index = torch.tensor([1.0, 0] * 4), torch.zeros(B, dtype=torch.int64)
    at = {"all-in-block": 3, "mixed-block": 9, "tail": 19, "spread-block": 4}[where]
    responses[5, at] = value
    with pytest.raises(ValueError, match="responses"):
        token_advantage(responses, mask, rewards, index, backend="cpu")
    mask[5, at] = False  # out of the mask the id is never counted
    assert torch.equal(token_advantage(responses, mask, rewards, index, backend="cpu"),
                       token_advantage(responses, mask, rewards, index, backend="torch"))


def test_hash_table_is_empty_between_groups_of_any_size():
    """Groups in one call, on one thread, share a workspace: a group with many ids past the dense map
    grows the hash table, the smaller groups after it empty it key by key (not by zeroing), and ids
    that a previous group held must not leak into the next one."""
    rng = np.random.default_rng(12)
    pool = np.arange(DENSE_IDS, MAX_ID, 104729)
    sizes, L = [4, 6, 5, 4, 6], 500
    rows = [rng.choice(pool, size=(G, L)) if g == 0 else rng.choice(pool[:40], size=(G, L))
            for g, G in enumerate(sizes)]
    responses = torch.as_tensor(np.concatenate(rows), dtype=torch.int64)
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards = torch.as_tensor(rng.random(sum(sizes)) < 0.5, dtype=torch.float32)
    index = torch.as_tensor(np.repeat(np.arange(len(sizes)), sizes), dtype=torch.int64)
    expected = token_advantage(responses, mask, rewards, index, backend="torch")
    for _ in range(2):  # the second call reuses the grown table
        assert torch.equal(token_advantage(responses, mask, rewards, index, options=ExecutionOptions(threads=1),
                                           backend="cpu"), expected)
    assert_scores_match(key_token_scores(responses, mask, rewards, index, backend="reference"),
                        key_token_scores(responses, mask, rewards, index, backend="cpu"))


# ---------------------------------------------------------------------------------------------- threads
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_threads_setting_is_validated(value):
    with pytest.raises(ValueError, match="ExecutionOptions.threads"):
        ExecutionOptions(threads=value)


def test_threads_are_an_execution_option_not_a_hyper_parameter():
    """The method's config has no thread count (results never depend on it); the options carry it."""
    assert ExecutionOptions(threads=np.int64(2)).threads == 2
    with pytest.raises(TypeError, match="threads"):
        KTAEConfig(threads=3)


def test_kernel_threads(monkeypatch):
    from ktae_kernels.validation import normalise_batch

    normal = normalise_batch(*make_batch(np.random.default_rng(0), [4] * 8, 10, 50))
    monkeypatch.setattr(cpu, "POSITIONS_PER_THREAD", 1)
    assert cpu.kernel_threads(normal, 3) == 3
    assert cpu.kernel_threads(normal, 64) == 8  # one group per thread at most
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    assert cpu.kernel_threads(normal, None) == 5
    monkeypatch.setattr(cpu, "POSITIONS_PER_THREAD", 1 << 30)
    assert cpu.kernel_threads(normal, 4) == 1  # a small batch: one thread


# ------------------------------------------------------------------------------------------ work sharing
# Groups are claimed one at a time from a shared counter by the calling thread and the workers that
# start in time (csrc/cpu/workers.h): every split of the groups between threads must give the same bits.
SPLITS = {
    "many-tiny-groups": dict(sizes=[1, 2, 3] * 200, length=6, vocab=40),
    "one-giant-group-among-tiny-ones": dict(sizes=[1, 300, 2, 1], length=20, vocab=500),
    "one-group": dict(sizes=[16], length=40, vocab=151936),
    "fewer-groups-than-threads": dict(sizes=[5, 16, 3], length=30, vocab=1000),
}


@pytest.fixture
def together(kernel, monkeypatch):
    """Every call on N threads shares its groups with the N - 1 workers it wakes (they join from any
    core before a group is claimed), however small the batch; normal workers afterwards."""
    monkeypatch.setattr(cpu, "POSITIONS_PER_THREAD", 1)
    kernel.set_worker_mode("together")
    yield kernel
    kernel.set_worker_mode("normal")


@pytest.mark.parametrize("name", SPLITS)
def test_every_split_of_the_groups_between_threads_is_exact(name, together):
    spec = SPLITS[name]
    batch = make_batch(np.random.default_rng(len(name)), spec["sizes"], spec["length"], spec["vocab"], zipf=True,
                       shuffle=True)
    expected = token_advantage(*batch, backend="reference")
    before = together.worker_items()
    results = [token_advantage(*batch, options=ExecutionOptions(threads=n), backend="cpu") for n in (1, 2, 3, 8)]
    torch.testing.assert_close(results[0], expected, rtol=0, atol=1e-6)
    assert all(torch.equal(results[0], r) for r in results[1:]), "the result depends on the thread count"
    if len(spec["sizes"]) > 100:
        assert together.worker_items() > before  # the workers did run groups


def _finishes(fn, seconds: float = 120.0):
    """fn()'s result, run on a daemon thread; AssertionError when it has not returned after ``seconds``."""
    import threading

    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"the call had not returned after {seconds} s"
    return result[0]


def test_a_worker_that_is_never_scheduled_holds_no_call_back(kernel, monkeypatch):
    """Workers held (as threads the operating system does not run, on a busy node): calls on 2 and 4
    threads return, on their own thread, with the exact result; released workers serve the next call."""
    monkeypatch.setattr(cpu, "POSITIONS_PER_THREAD", 1)
    batch = make_batch(np.random.default_rng(4), [16] * 12, 64, 151936, zipf=True)
    expected = token_advantage(*batch, options=ExecutionOptions(threads=1), backend="cpu")
    kernel.set_worker_mode("held")
    try:
        for threads in (2, 4):
            got = _finishes(lambda: token_advantage(*batch, options=ExecutionOptions(threads=threads), backend="cpu"))
            assert torch.equal(got, expected), threads
    finally:
        kernel.set_worker_mode("normal")
    assert torch.equal(token_advantage(*batch, options=ExecutionOptions(threads=4), backend="cpu"), expected)


def _advantage_in_child(batch, connection):
    connection.send(token_advantage(*batch, options=ExecutionOptions(threads=2), backend="cpu").numpy())
    connection.close()


def test_a_forked_child_computes_on_its_own_workers(monkeypatch):
    """A child made by fork (a data loader, a multiprocessing pool) has none of its parent's worker
    threads: its calls start their own and give the exact result."""
    import multiprocessing

    monkeypatch.setattr(cpu, "POSITIONS_PER_THREAD", 1)
    batch = make_batch(np.random.default_rng(6), [16] * 6, 40, 151936, zipf=True)
    expected = token_advantage(*batch, options=ExecutionOptions(threads=2), backend="cpu")  # the parent's workers run
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_advantage_in_child, args=(batch, send))
    child.start()
    try:
        assert receive.poll(120), "the child gave no result"
        assert torch.equal(torch.from_numpy(receive.recv()), expected)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


# ---------------------------------------------------------------------------------------------- binding
def _kernel_arguments():
    """Valid ``_cpu.advantage`` arguments for a 3-group batch (grid-free: native statistics)."""
    B, L = 6, 5
    return dict(
        ids=torch.zeros(B, L, dtype=torch.int64), mask=torch.ones(B, L, dtype=torch.bool),
        order=torch.arange(B), start=torch.tensor([0, 2, 4, 6]), correct=torch.tensor([1, 0] * 3, dtype=torch.bool),
        base=torch.zeros(B, dtype=torch.float64), ignore=torch.zeros(0, dtype=torch.int64),
        out=torch.empty(B, L, dtype=torch.float32),
    )


def _advantage(kernel, args, **kwargs):
    """``_cpu.advantage`` of ``_kernel_arguments()`` (their batch arrays as its ``batch``), on 1 thread."""
    batch = tuple(args[name] for name in ("ids", "mask", "order", "start", "correct"))
    method = kernel.Method(k1=2.0, b=0.5, alpha=1.0, beta=1.0, top=1.0, bound=0.9999999, weight=1.0, use_tf=True)
    return kernel.advantage(batch, args["base"], args["ignore"], args["out"], method, threads=1, **kwargs)


def test_binding_accepts_valid_arrays(kernel):
    args = _kernel_arguments()
    assert _advantage(kernel, args)
    assert torch.isfinite(args["out"]).all()


WRONG = {
    "ids-dtype": ("ids", lambda a: a["ids"].int(), "`ids` must be a int64"),
    "ids-ndim": ("ids", lambda a: a["ids"].reshape(-1), "`ids` must be a int64 CPU array of shape \\[\\*, \\*\\]"),
    "ids-column-stride": ("ids", lambda a: torch.zeros(6, 10, dtype=torch.int64)[:, ::2], "unit column stride"),
    "mask-dtype": ("mask", lambda a: a["mask"].to(torch.uint8), "`mask` must be a bool"),
    "mask-shape": ("mask", lambda a: a["mask"][:, :4], "`mask` must be a bool CPU array of shape \\[6, 5\\]"),
    "order-length": ("order", lambda a: a["order"][:5], "`order` must be a int64 CPU array of shape \\[6\\]"),
    "order-stride": ("order", lambda a: torch.arange(12)[::2], "`order` .* with unit stride"),
    "start-values": ("start", lambda a: torch.tensor([0, 2, 4, 5]), "`start` must rise from 0 to B = 6"),
    "correct-dtype": ("correct", lambda a: a["correct"].long(), "`correct` must be a bool"),
    "base-dtype": ("base", lambda a: a["base"].float(), "`base` must be a float64"),
    "out-dtype": ("out", lambda a: a["out"].double(), "`out` must be a float32"),
    "out-not-contiguous": ("out", lambda a: torch.empty(5, 6, dtype=torch.float32).t(), "`out` .* contiguous"),
    "out-shape": ("out", lambda a: torch.empty(6, 4, dtype=torch.float32), "`out` must be a float32 CPU array of shape \\[6, 5\\]"),
}


@pytest.mark.parametrize("case", WRONG, ids=WRONG.keys())
def test_binding_rejects_wrong_arrays(kernel, case):
    name, make, message = WRONG[case]
    args = _kernel_arguments()
    args[name] = make(args)
    with pytest.raises(ValueError, match=message):
        _advantage(kernel, args)


def test_binding_checks_a_grid_like_the_other_arrays(kernel):
    """A grid's four arrays (offset, stride, strength, h) are checked; a valid one is accepted (every table of
    this batch is uninformative: every advantage is its base, 0)."""
    args = _kernel_arguments()
    grid = [torch.zeros(3, dtype=torch.int64), torch.full((3,), 2), torch.zeros(4, dtype=torch.float64),
            torch.zeros(4, dtype=torch.float64)]
    assert _advantage(kernel, args, grid=tuple(grid)) and torch.equal(args["out"], torch.zeros(6, 5))
    grid[0] = grid[0][:2]
    with pytest.raises(ValueError, match="`offset` must be a int64 CPU array of shape \\[3\\]"):
        _advantage(kernel, args, grid=tuple(grid))


def _listed_grid(entries: list[int], strength: list[float]) -> tuple[torch.Tensor, ...]:
    """A grid of 3 groups of 2 rollouts sharing one block (offset 0, stride 2) whose strength and h hold
    only the listed ``entries`` (h = 1 each)."""
    return (torch.zeros(3, dtype=torch.int64), torch.full((3,), 2), torch.tensor(strength, dtype=torch.float64),
            torch.ones(len(entries), dtype=torch.float64), torch.tensor(entries, dtype=torch.int64))


def test_binding_finds_a_listed_grid_entry_by_search(kernel):
    """With listed ``entries`` the kernel finds a row's table among them, as the full grid finds it at its
    entry; a table missing from the list raises instead of reading past the arrays."""
    args = _kernel_arguments()
    args["mask"][1::2] = False  # the wrong rollouts are empty: table (a, b) = (1, 0), entry 0 + 1 * 2 + 0
    assert _advantage(kernel, args, grid=_listed_grid([0, 2, 3], [0.0, 0.5, 0.0]))
    listed = args["out"].clone()
    full = (torch.zeros(3, dtype=torch.int64), torch.full((3,), 2), torch.tensor([0.0, 0.0, 0.5, 0.0]).double(),
            torch.ones(4, dtype=torch.float64))
    assert _advantage(kernel, args, grid=full) and torch.equal(args["out"], listed)
    assert (listed[::2] > 0).all()
    with pytest.raises(RuntimeError, match="not among the grid's `entries`"):
        _advantage(kernel, args, grid=_listed_grid([0, 1, 3], [0.5, 0.5, 0.5]))
    # the flag does not outlive the call: the same workspace serves the next one
    assert _advantage(kernel, args, grid=_listed_grid([2], [0.5])) and torch.equal(args["out"], listed)


@pytest.mark.parametrize("entries, message", [
    (torch.tensor([0, 2], dtype=torch.int32), "`entries` must be a int64 CPU array of shape \\[2\\]"),
    (torch.tensor([0, 2, 3]), "`entries` must be a int64 CPU array of shape \\[2\\]"),
    (torch.tensor([2, 2]), "`entries` must be strictly increasing"),
    (torch.tensor([3, 2]), "`entries` must be strictly increasing"),
])
def test_binding_checks_listed_entries(kernel, entries, message):
    grid = _listed_grid([0, 2], [0.0, 0.5])[:4] + (entries,)
    with pytest.raises(ValueError, match=message):
        _advantage(kernel, _kernel_arguments(), grid=grid)


def test_binding_rejects_a_partial_grid(kernel):
    with pytest.raises(TypeError):
        _advantage(kernel, _kernel_arguments(), grid=(torch.zeros(3, dtype=torch.int64),))


def test_binding_rejects_a_non_array(kernel):
    args = _kernel_arguments()
    args["ids"] = [[0, 1]]
    with pytest.raises(TypeError):
        _advantage(kernel, args)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _OnCuda:
    """A DLPack producer that says its int64 [rows, cols] array lives on CUDA device 0 (kDLCUDA = 2);
    the kernel must refuse it before reading it."""

    def __init__(self, rows: int, cols: int):
        self._shape = (ctypes.c_int64 * 2)(rows, cols)
        self._strides = (ctypes.c_int64 * 2)(cols, 1)
        self._tensor = _DLManagedTensor(_DLTensor(None, _DLDevice(2, 0), 2, _DLDataType(0, 64, 1), self._shape,
                                                  self._strides, 0), None, None)

    def __dlpack__(self, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._tensor), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, 0)


def test_binding_rejects_a_device_array(kernel):
    args = _kernel_arguments()
    args["ids"] = _OnCuda(6, 5)
    with pytest.raises(ValueError, match="`ids` must be a int64 CPU array.*on device type 2"):
        _advantage(kernel, args)


# ------------------------------------------------------------------------------------------ output pool
def _pooled_batch():
    """A batch whose output (128 x 8192 float32, 4 MB) comes from the output pool."""
    gen = torch.Generator().manual_seed(11)
    responses = torch.randint(0, 151_936, (128, 8192), generator=gen)
    mask = torch.arange(8192)[None, :] < torch.randint(1, 8193, (128, 1), generator=gen)
    rewards = (torch.rand(128, generator=gen) < 0.5).float()
    return responses, mask, rewards, torch.arange(128) // 16


def test_a_micro_batch_output_comes_from_the_pool(kernel):
    """8 x 16 x 3072 float32 is 1.5 MB: pooled, so that holding the previous output costs no page faults."""
    responses, mask = torch.zeros(128, 3072, dtype=torch.int64), torch.ones(128, 3072, dtype=torch.bool)
    rewards, index = (torch.arange(128) % 2).float(), torch.arange(128) // 16
    assert 128 * 3072 * 4 >= cpu.POOL_MIN_BYTES
    cpu.release_output_pool()
    held = token_advantage(responses, mask, rewards, index, backend="cpu")
    assert kernel.output_pool_held()[0] == 0
    nxt = token_advantage(responses, mask, rewards, index, backend="cpu")
    del held
    assert kernel.output_pool_held()[0] == 1
    del nxt
    assert kernel.output_pool_held()[0] == 2
    cpu.release_output_pool()


def test_the_output_pool_reuses_only_outputs_torch_has_freed(kernel):
    """A returned output's memory is reused only once nothing refers to its storage: not while the
    tensor, a view of it, a numpy array over it or a DLPack export of it is alive."""
    batch = _pooled_batch()
    assert 128 * 8192 * 4 >= cpu.POOL_MIN_BYTES
    want = token_advantage(*batch, backend="cpu", out=torch.empty(128, 8192))
    cpu.release_output_pool()

    def call():
        result = token_advantage(*batch, backend="cpu")
        assert torch.equal(result, want)  # a reused block is overwritten everywhere
        return result

    holders = {"tensor": lambda t: t, "view": lambda t: t[3:, 5:], "numpy": lambda t: t.numpy(),
               "dlpack": torch.utils.dlpack.to_dlpack}
    for name, hold in holders.items():
        result = call()
        address = result.data_ptr()
        holder = hold(result)
        del result
        assert call().data_ptr() != address, f"reused while a {name} of the output was alive"
        del holder
        assert call().data_ptr() == address  # freed: the next call takes it (the warmest block)
    assert kernel.output_pool_held()[0] == 2  # at most two freed blocks are kept
    assert cpu.release_output_pool() >= 2 * 128 * 8192 * 4
    assert kernel.output_pool_held() == (0, 0)


def test_concurrent_calls_never_share_an_output(kernel):
    from concurrent.futures import ThreadPoolExecutor

    batch = _pooled_batch()
    want = token_advantage(*batch, backend="cpu", out=torch.empty(128, 8192))
    with ThreadPoolExecutor(3) as threads:
        results = list(threads.map(lambda _: token_advantage(*batch, backend="cpu"), range(6)))
    assert len({r.data_ptr() for r in results}) == 6
    assert all(torch.equal(r, want) for r in results)


def test_the_output_pool_fits_a_block_at_most_twice_the_request(kernel):
    kernel.clear_output_pool()
    big = kernel.new_output(1024, 3072, threads=2)  # 12 MB
    assert big.shape == (1024, 3072) and big.dtype == torch.float32 and big.is_contiguous()
    address = big.data_ptr()
    del big
    small = kernel.new_output(1024, 1000, threads=1)  # 4 MB: a 12 MB block is more than twice that
    assert small.data_ptr() != address
    half = kernel.new_output(1024, 1536, threads=1)  # 6 MB: fits
    assert half.data_ptr() == address and half.shape == (1024, 1536)
    del small, half
    assert kernel.output_pool_held()[0] == 2
    kernel.clear_output_pool()


@pytest.mark.parametrize("rows, cols", [(0, 5), (5, 0), (-1, 3)])
def test_new_output_needs_a_positive_shape(kernel, rows, cols):
    with pytest.raises(ValueError, match="_cpu.new_output: `rows` and `cols` must be positive"):
        kernel.new_output(rows, cols, threads=1)


def test_worker_modes_are_checked(kernel):
    with pytest.raises(ValueError, match="`mode` must be 'normal', 'held' or 'together', got 'hold'"):
        kernel.set_worker_mode("hold")
