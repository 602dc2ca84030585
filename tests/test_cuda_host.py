"""The CUDA backend's host-side logic, on the CPU: table sizing, launch geometry."""
from __future__ import annotations

import pytest
import torch

from ktae_kernels import CudaTuning
from ktae_kernels.backends import cuda, device

H200_SHARED = 232448  # opt-in shared memory per block of an H100 / H200


@pytest.mark.parametrize("n_keys", [0, 1, 24, 25, 48, 49, 1000, 6144, 6145, 49152, 2**30])
def test_table_capacity_is_the_smallest_power_of_two_that_holds_the_keys(n_keys):
    capacity = cuda.table_capacity(n_keys)
    assert capacity >= cuda.MIN_CAPACITY and capacity & (capacity - 1) == 0
    assert cuda.max_keys(capacity) >= n_keys
    assert capacity == cuda.MIN_CAPACITY or cuda.max_keys(capacity // 2) < n_keys


def test_max_keys_is_three_quarters():
    assert [cuda.max_keys(c) for c in (2, 4, 32, 8192)] == [2, 3, 24, 6144]


@pytest.mark.parametrize("words, expected", [(1, 16), (2, 16), (3, 24), (32, 136)])
def test_header_bytes_hold_two_counters_and_the_correct_mask_aligned_to_8(words, expected):
    assert cuda.header_bytes(words) == expected


def test_packed_slots_and_two_blocks_per_sm():
    # 12 bytes a slot: the paper's 8192-slot table (its groups hold ~2.5-4.7k distinct ids) in 96 KB,
    # so two blocks share an H200 SM (228 KB, 1 KB reserved a block)
    two = cuda.shared_limit(H200_SHARED, 2)
    assert two == 115712 and cuda.shared_limit(H200_SHARED, 1) == H200_SHARED
    assert cuda.shared_table_bytes(8192, 1, packed=True) == 16 + 8192 * 12 <= two
    assert cuda.shared_table_bytes(8192, 1) == 16 + 8192 * 16 > two  # the wide slot: one block an SM


@pytest.mark.parametrize("length, threads", [(0, 64), (16, 64), (256, 64), (1000, 256), (2048, 512),
                                             (3072, 768), (4096, 1024), (5000, 640), (100_000, 1024)])
def test_block_threads(length, threads):
    assert cuda.block_threads(length) == threads
    assert threads % 32 == 0 and cuda.MIN_THREADS <= threads <= cuda.MAX_THREADS


@pytest.mark.parametrize("unroll", [2, 4, 8])
def test_block_threads_covers_a_rollout_in_as_few_passes_as_possible(unroll):
    for length in range(1, 20000, 97):
        threads = cuda.block_threads(length, unroll=unroll)
        passes = -(-length // (threads * unroll))
        assert passes == max(1, -(-length // (cuda.MAX_THREADS * unroll)))


class _SharedOnly:
    """Stands in for the launcher: static_plan reads only the opt-in shared memory."""

    def max_shared_bytes(self) -> int:
        return H200_SHARED


def _shape_only_batch(B: int, n_groups: int, L: int):
    """A batch of the given shape (zero-sized storage: static_plan reads shapes only)."""
    import numpy as np
    from ktae_kernels.types import Batch

    responses = torch.empty(B, L, dtype=torch.int64)
    return Batch(responses=responses, mask=torch.empty(B, L, dtype=torch.bool), rewards=torch.empty(B, dtype=torch.float64),
                 group=torch.empty(B, dtype=torch.int64), group_labels=np.arange(n_groups))


def test_static_plan_of_the_paper_batch_reads_nothing_from_the_device():
    """B = 16384, 1024 groups, L = 3072: every group has at most 15361 rollouts as far as the host knows
    (no sync), so the grid of groups of up to 64 plus per-slot statistics beyond, the whole opt-in
    shared memory, and a bounded global pass (64 blocks, STATIC_FALLBACK_BYTES) for any group that
    overflows; the kernels size each group's own table on the device."""
    from ktae_kernels import KTAEConfig

    plan = cuda.static_plan(_SharedOnly(), _shape_only_batch(16384, 1024, 3072), KTAEConfig())
    assert plan.largest == 16384 - 1024 + 1 and plan.bound == 64
    assert plan.shared_bytes == H200_SHARED and plan.max_capacity == 2**30 and plan.threads == 768
    assert plan.fallback_blocks == cuda.FALLBACK_BLOCKS
    assert plan.fallback_bytes <= cuda.STATIC_FALLBACK_BYTES and plan.fallback_bytes % (8 * plan.fallback_blocks) == 0
    two = cuda.static_plan(_SharedOnly(), _shape_only_batch(16384, 1024, 3072), KTAEConfig(),
                           CudaTuning(blocks_per_sm=2))
    assert two.shared_bytes == cuda.shared_limit(H200_SHARED, 2) and two.threads == 384  # two passes of 384 x 4


def test_static_plan_of_small_and_huge_batches():
    from ktae_kernels import KTAEConfig

    ext = _SharedOnly()
    small = cuda.static_plan(ext, _shape_only_batch(8, 4, 16), KTAEConfig())
    # groups of at most 5 rollouts x 16 tokens: an 128-slot table always fits, no global pass
    assert small.bound == 16 and small.fallback_blocks == 0 and small.fallback_bytes == 0
    assert small.shared_bytes == cuda.shared_table_bytes(cuda.table_capacity(5 * 16), 1)
    forced = cuda.static_plan(_SharedOnly(), _shape_only_batch(8, 4, 16), KTAEConfig(), CudaTuning(table_slots=2))
    assert forced.max_capacity == 2 and forced.fallback_blocks == 4
    # upstream p-values and a possible group of more than 2**30 masked tokens take the same plan
    assert cuda.static_plan(ext, _shape_only_batch(8, 4, 16), KTAEConfig(fisher="upstream")) == small
    huge = cuda.static_plan(_SharedOnly(), _shape_only_batch(32770, 16385, 2**16), KTAEConfig())
    assert huge.largest * 2**16 > cuda.MAX_GROUP_TOKENS and huge.fallback_bytes <= cuda.STATIC_FALLBACK_BYTES


def test_workspace_size_mirrors_the_layout():
    B, n, fallback = 10, 3, 800
    assert cuda.advantage_workspace_size(B, n, fallback) == 7 + n + (n + 1) + 4 * n + 3 * B + 2 + 100
    views = cuda.workspace_views(torch.arange(cuda.advantage_workspace_size(B, n, fallback)), B, n)
    assert views["flags"].tolist() == [0, 1, 2, 3, 4, 5, 6] and views["status"].tolist() == [7, 8, 9]
    assert views["starts"].tolist() == [10, 11, 12, 13] and views["group_counts"][0].tolist() == [14, 15, 16]
    assert views["group_counts"].shape == (4, n) and views["base"].dtype == torch.float64 and views["correct"].shape == (B,)


def test_static_plan_sizes_the_paper_tables_by_the_distinct_ids_seen():
    """After a call of the paper batch whose largest group held 4,617 distinct ids (bench/data.py), the
    next caps every shared table at 8,192 slots (6,144 ids at 3/4 load) instead of the 16,384 its
    ~20k masked tokens give; the counts kept are the largest seen (0: nothing learnt), per (B, n_groups)."""
    from ktae_kernels import KTAEConfig

    batch = _shape_only_batch(16384, 1024, 3072)
    state, key = device.state(batch.device), ("cuda", 16384, 1024)
    assert cuda.static_plan(_SharedOnly(), batch, KTAEConfig()).key == key and state.learnt(key) is None
    for seen in (4617, 3000, 0):
        state.learn(key, distinct=seen)
    assert state.learnt(key).distinct == 4617
    assert state.learnt(("cuda", 16384, 512)) is None
    plan = cuda.static_plan(_SharedOnly(), batch, KTAEConfig())
    assert plan.max_capacity == 8192 == cuda.table_capacity(4617) and cuda.max_keys(8192) == 6144
    assert plan.shared_bytes == H200_SHARED and plan.fallback_blocks == cuda.FALLBACK_BLOCKS
    forced = cuda.static_plan(_SharedOnly(), batch, KTAEConfig(), CudaTuning(table_slots=1024))
    assert forced.max_capacity == 1024  # CudaTuning.table_slots wins
    small = cuda.static_plan(_SharedOnly(), _shape_only_batch(8, 4, 16), KTAEConfig())
    state.learn(("cuda", 8, 4), distinct=5)
    sized = cuda.static_plan(_SharedOnly(), _shape_only_batch(8, 4, 16), KTAEConfig())
    assert (small.max_capacity, small.fallback_blocks) == (2**30, 0)
    assert (sized.max_capacity, sized.fallback_blocks) == (32, 4)
    assert sized.shared_bytes == cuda.shared_table_bytes(32, 1) < small.shared_bytes
    state.clear()
    assert state.learnt(key) is None


def test_two_blocks_per_sm_once_the_paper_tables_are_known_to_fit_half_an_sm():
    """The paper batch (B = 16384, 1024 groups of 16, L = 3072) on an H200: its first call reserves the
    whole opt-in shared memory (one block per SM, 768 threads), as the largest possible group's table
    needs it. Once a call has reported its groups' need (4,617 distinct ids: 8,192 packed 12-byte slots
    and a 16-byte header, 98,320 bytes), that fits half an SM (115,712 bytes), so the shared pass
    reserves just that with at most 512 threads (two passes of 384 x 4), two blocks per SM; the
    global pass stays for a group that needs more. A need past half an SM (G = 64: two presence words,
    20-byte slots, 163,856 bytes) keeps one block; an explicit ``CudaTuning.blocks_per_sm`` is unchanged."""
    from ktae_kernels import KTAEConfig

    batch = _shape_only_batch(16384, 1024, 3072)
    state, key = device.state(batch.device), ("cuda", 16384, 1024)
    half = cuda.shared_limit(H200_SHARED, 2)
    plan = lambda tuning=CudaTuning(): cuda.static_plan(_SharedOnly(), batch, KTAEConfig(), tuning)
    first = plan()
    assert (first.blocks_per_sm, first.shared_bytes, first.threads) == (1, H200_SHARED, 768)

    need = cuda.shared_table_bytes(cuda.table_capacity(4617), 1, packed=True)
    assert need == 98320 <= half == 115712 and cuda.occupancy(None, need, H200_SHARED) == 2
    state.learn(key, distinct=4617, shared_need=need)
    assert state.learnt(key).shared_need == need
    two = plan()
    assert (two.blocks_per_sm, two.shared_bytes, two.threads, two.max_capacity) == (2, need, 384, 8192)
    assert two.shared_bytes <= half and two.threads <= 512
    assert (two.fallback_blocks, two.fallback_bytes) == (first.fallback_blocks, first.fallback_bytes) != (0, 0)
    explicit = [plan(CudaTuning(blocks_per_sm=b)) for b in (1, 2)]
    assert [(p.blocks_per_sm, p.shared_bytes, p.threads) for p in explicit] == [(1, H200_SHARED, 768), (2, half, 384)]

    wide = cuda.shared_table_bytes(cuda.table_capacity(4617), 2)
    state.learn(key, distinct=4617, shared_need=wide)  # a later call held a group of 64 rollouts: the most is kept
    assert wide == 163856 > half and cuda.occupancy(None, wide, H200_SHARED) == 1
    one = plan()
    assert (one.blocks_per_sm, one.shared_bytes, one.threads) == (1, H200_SHARED, 768)
    assert [cuda.occupancy(b, wide, H200_SHARED) for b in (1, 2)] == [1, 2]
    # forced tables keep one block unless told
    state.clear()
    state.learn(key, distinct=4617, shared_need=need)
    assert plan(CudaTuning(table_slots=8192)).blocks_per_sm == 1


@pytest.mark.parametrize("arch", [80, 90])
def test_shared_memory_stays_within_the_opt_in_limit(arch):
    """Every shared pass the host sizes fits the device's opt-in limit per block (sm_80: 163 KB, sm_90:
    227 KB), for one or two blocks per SM, whatever the layout learnt; the kernels declare no static
    shared memory (tests/test_cuda_compile.py)."""
    from compile_report import OPT_IN_SHARED
    from ktae_kernels import KTAEConfig

    limit = OPT_IN_SHARED[arch]

    class Device:
        def max_shared_bytes(self) -> int:
            return limit

    shapes = [(8, 4, 16), (256, 16, 3072), (16384, 1024, 3072), (2048, 2, 8192), (64, 1, 200_000)]
    for B, n, L in shapes:
        batch = _shape_only_batch(B, n, L)
        state, key = device.state(batch.device), ("cuda", B, n)
        for learnt in (None, (10, 400), (4617, 98_320), (60_000, 10**6)):
            state.clear()
            if learnt:
                state.learn(key, distinct=learnt[0], shared_need=learnt[1])
            for tuning in (CudaTuning(), CudaTuning(blocks_per_sm=2), CudaTuning(blocks_per_sm=1)):
                plan = cuda.static_plan(Device(), batch, KTAEConfig(), tuning)
                assert 0 <= plan.shared_bytes <= cuda.shared_limit(limit, plan.blocks_per_sm) <= limit, (B, n, L, learnt)
                assert plan.threads <= cuda.most_threads(1024, plan.blocks_per_sm)
