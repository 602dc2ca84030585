"""The CUDA backend's host-side logic, on the CPU: table sizing, launch geometry, setup.py switches."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ktae_kernels.backends import cuda

ROOT = Path(__file__).resolve().parents[1]
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


def test_shared_capacity_fits_the_largest_group_or_the_device():
    # paper setting: G = 16 (one presence word), 16 x 3072 tokens: 16 bytes a slot -> 8192 slots
    assert cuda.choose_shared_capacity(16 * 3072, 1, H200_SHARED) == 8192
    assert cuda.shared_table_bytes(8192, 1) == 16 + 8192 * 16 <= H200_SHARED
    # a small batch gets a small table (more blocks per SM), never below MIN_CAPACITY
    assert cuda.choose_shared_capacity(100, 1, H200_SHARED) == 256
    assert cuda.choose_shared_capacity(0, 1, H200_SHARED) == cuda.MIN_CAPACITY
    # G = 64: two presence words, 20 bytes a slot
    assert cuda.choose_shared_capacity(64 * 3072, 2, H200_SHARED) == 8192
    # huge groups: not even MIN_CAPACITY slots fit -> every group takes the global-memory table
    assert cuda.choose_shared_capacity(10**6, 2000, H200_SHARED) == 0


def test_packed_slots_and_two_blocks_per_sm():
    # 12 bytes a slot: the paper's 8192-slot table (its groups hold ~2.5-4.7k distinct ids) in 96 KB,
    # so two blocks share an H200 SM (228 KB, 1 KB reserved a block)
    two = cuda.shared_limit(H200_SHARED, 2)
    assert two == 115712 and cuda.shared_limit(H200_SHARED, 1) == H200_SHARED
    assert cuda.shared_table_bytes(8192, 1, packed=True) == 16 + 8192 * 12 <= two
    assert cuda.choose_shared_capacity(16 * 3072, 1, two, packed=True) == 8192
    assert cuda.choose_shared_capacity(16 * 3072, 1, two) == 4096
    assert cuda.choose_shared_capacity(16 * 3072, 1, H200_SHARED, packed=True) == 16384


@pytest.mark.parametrize("length, threads", [(0, 64), (16, 64), (256, 64), (1000, 256), (2048, 512),
                                             (3072, 768), (4096, 1024), (5000, 640), (100_000, 1024)])
def test_block_threads(length, threads):
    assert cuda.block_threads(length) == threads
    assert threads % 32 == 0 and cuda.MIN_THREADS <= threads <= cuda.MAX_THREADS


def test_block_threads_covers_a_rollout_in_as_few_passes_as_possible():
    for length in range(1, 20000, 97):
        threads = cuda.block_threads(length)
        passes = -(-length // (threads * cuda.UNROLL))
        assert passes == max(1, -(-length // (cuda.MAX_THREADS * cuda.UNROLL)))


def _setup_version(**env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KTAE_")} | env
    return subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_setup_skips_the_extension_without_cuda_and_fails_when_forced():
    default = _setup_version()
    assert default.returncode == 0, default.stderr
    assert "not building the CUDA extension: torch" in default.stderr and "CPU-only" in default.stderr
    skipped = _setup_version(KTAE_SKIP_CUDA_BUILD="1")
    assert skipped.returncode == 0 and "KTAE_SKIP_CUDA_BUILD=1" in skipped.stderr
    forced = _setup_version(KTAE_FORCE_CUDA_BUILD="1")
    assert forced.returncode != 0
    assert "KTAE_FORCE_CUDA_BUILD=1 but the CUDA extension cannot be built" in forced.stderr


def test_big_groups_keep_many_fallback_blocks():
    """G = 1024 at the paper's token count (16 groups of ~1.1M masked tokens): the count pass's keys-only
    tables (2M slots, 8 MB) give every group its own block; so do the rows / advantage passes, whose
    tables are sized by the counted distinct ids (30k -> 64k slots of 140 bytes). Before, a 2M-slot
    wide table (294 MB) left one block for all 16 groups."""
    tokens, distinct, words = 1024 * 1075, 30_000, cuda.presence_words(1024)
    assert words == 32
    assert cuda.fallback_blocks(16, cuda.table_capacity(tokens), words, keys_only=True) == 16
    assert cuda.fallback_blocks(16, cuda.table_capacity(distinct), words, keys_only=False) == 16
    assert cuda.fallback_blocks(16, cuda.table_capacity(tokens), words, keys_only=False) == 1  # the old cliff
    assert cuda.fallback_blocks(1000, 1 << 10, 1, keys_only=False) == cuda.FALLBACK_BLOCKS
