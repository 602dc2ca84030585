"""The GPU backends on a real GPU beyond the per-backend tests: a non-default stream, a device other
than the current one, a batch whose groups overflow every table, launch variants, the statistics
kernels against the GPU's own tables. (bench/gpu.sh's dry run: tests/test_gpu_script.py.)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cases import make_batch
from ktae_kernels import token_advantage
from ktae_kernels.registry import available_backends

GPU_BACKENDS = [b for b in ("triton", "cuda") if torch.cuda.is_available() and b in available_backends("cuda")]
needs_gpu = pytest.mark.skipif(not GPU_BACKENDS, reason="needs a CUDA GPU (and triton or the cuda extra)")


def _batch(device, groups=6, G=16, L=1024, vocab=20_000, seed=0):
    return [t.to(device) for t in make_batch(np.random.default_rng(seed), [G] * groups, L, vocab)]


@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_non_default_stream_and_out(backend):
    args = _batch("cuda")
    want = token_advantage(*args, backend="torch")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        busy = torch.randn(2048, 2048, device="cuda")
        for _ in range(4):
            busy = busy @ busy
        responses = args[0].clone()  # written on this stream, right before the call
        out = torch.empty(responses.shape, dtype=torch.float32, device="cuda")
        got = token_advantage(responses, *args[1:], backend=backend, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_runs_on_the_batch_device_not_the_current_one(backend):
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    args = _batch(last, groups=2)
    want = token_advantage(*args, backend="torch")
    with torch.cuda.device(0):
        got = token_advantage(*args, backend=backend)
    assert got.device == last
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_groups_with_many_distinct_ids_raced_by_many_programs(backend):
    # 64 x 2048 uniform ids over 50k per group: ~45k distinct ids, far past any first table guess
    args = _batch("cuda", groups=4, G=64, L=2048, vocab=50_000, seed=1)
    want = token_advantage(*args, backend="torch")
    torch.testing.assert_close(token_advantage(*args, backend=backend), want, rtol=0, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("G, groups, L", [(128, 8, 1024), (1024, 2, 256)], ids=["G128", "G1024"])
def test_big_groups_match_torch_and_repeat_bit_for_bit(backend, G, groups, L):
    """Groups of 128 and 1024 rollouts (many presence words, tables past shared memory, statistics of
    the rows' tables), three runs identical (a race would show as a difference)."""
    args = _batch("cuda", groups=groups, G=G, L=L, vocab=30_000, seed=G)
    want = token_advantage(*args, backend="torch")
    runs = [token_advantage(*args, backend=backend) for _ in range(3)]
    torch.testing.assert_close(runs[0], want, rtol=0, atol=1e-6)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.skipif("cuda" not in GPU_BACKENDS, reason="needs a CUDA GPU and the cuda extra (NVRTC)")
@pytest.mark.parametrize("threads, blocks_per_sm, packed", [(256, 1, True), (512, 1, True), (1024, 1, True),
                                                            (1024, 1, False), (512, 2, True), (512, 2, False)])
def test_cuda_launch_variants_match_torch(threads, blocks_per_sm, packed):
    """Every launch shape bench/gpu_check.py times (``CudaTuning``) against torch."""
    from ktae_kernels import CudaTuning, ExecutionOptions

    args = _batch("cuda", groups=8, G=16, L=3072, vocab=151_936, seed=2)
    want = token_advantage(*args, backend="torch")
    options = ExecutionOptions(cuda=CudaTuning(packed=packed, blocks_per_sm=blocks_per_sm, max_threads=threads))
    torch.testing.assert_close(token_advantage(*args, backend="cuda", options=options), want, rtol=0, atol=1e-6)


@needs_gpu
def test_device_statistics_grid_matches_the_cpu_on_the_gpu():
    """The Triton and CUDA statistics kernels on the GPU against the reference built from the GPU's own
    log-factorial and angle tables (statistics_cases.py: integer columns and the p = 1 / F = 0 rule
    exact, h and IG within stated ulps)."""
    from ktae_kernels import KTAEConfig
    from ktae_kernels.backends.device import grid_tables
    from statistics_cases import assert_matches_method

    grid = grid_tables(32, torch.device("cuda"))
    if "triton" in GPU_BACKENDS:
        from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

        assert_matches_method(grid_statistics_kernel(grid, 1.0, 1.0), grid, KTAEConfig())
    if "cuda" in GPU_BACKENDS:
        from ktae_kernels.backends import cuda

        assert_matches_method(cuda.GridKernel(cuda.load_launcher(grid.cells.device))(grid, 1.0, 1.0), grid, KTAEConfig())
