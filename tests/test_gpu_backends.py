"""The GPU backends on a real GPU beyond the per-backend tests: a non-default stream, a device other
than the current one, a batch whose groups overflow every table; and, anywhere, that bench/gpu.sh
parses and bench/gpu_check.py runs (its --dry-run: tiny shapes, Triton interpreter, on the CPU).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ktae_kernels import token_advantage
from ktae_kernels.registry import available_backends

ROOT = Path(__file__).resolve().parents[1]
GPU_BACKENDS = [b for b in ("triton", "cuda") if torch.cuda.is_available() and b in available_backends("cuda")]
needs_gpu = pytest.mark.skipif(not GPU_BACKENDS, reason="needs a CUDA GPU (and triton or the built extension)")


def _batch(device, groups=6, G=16, L=1024, vocab=20_000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B = groups * G
    responses = torch.randint(0, vocab, (B, L), generator=gen)
    mask = torch.arange(L)[None, :] < torch.randint(1, L + 1, (B, 1), generator=gen)
    rewards = (torch.rand(B, generator=gen) < 0.5).float()
    index = torch.arange(B) // G
    return [t.to(device) for t in (responses, mask, rewards, index)]


def test_gpu_sh_parses():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    done = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_gpu_check_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--skip-timings", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "checks passed" in done.stdout and "FAIL" not in done.stdout
    assert list(tmp_path.glob("*-gpu-check-dry-run.json"))


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


@pytest.mark.skipif("cuda" not in GPU_BACKENDS, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("threads, blocks_per_sm, packed", [(256, 1, True), (512, 1, True), (1024, 1, True),
                                                            (1024, 1, False), (512, 2, True), (512, 2, False)])
def test_cuda_launch_variants_match_torch(threads, blocks_per_sm, packed):
    """Every launch shape bench/gpu_check.py times (cuda.Tuning) against torch."""
    from ktae_kernels import KTAEConfig
    from ktae_kernels.backends import cuda
    from ktae_kernels.validation import normalise_batch

    args = _batch("cuda", groups=8, G=16, L=3072, vocab=151_936, seed=2)
    want = token_advantage(*args, backend="torch")
    tuning = cuda.Tuning(packed=packed, blocks_per_sm=blocks_per_sm, max_threads=threads)
    got = cuda.token_advantage(normalise_batch(*args), KTAEConfig(), None, tuning=tuning)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@needs_gpu
def test_device_statistics_grid_matches_the_cpu_on_the_gpu():
    """The Triton and CUDA statistics kernels on the GPU against method.table_statistics (as the
    interpreter and emulator tests, statistics_cases.py)."""
    from ktae_kernels import KTAEConfig
    from ktae_kernels.backends.device import grid_tables
    from statistics_cases import assert_matches_method

    grid = grid_tables(32, torch.device("cuda"))
    if "triton" in GPU_BACKENDS:
        from ktae_kernels.backends.triton.statistics import grid_statistics_kernel

        assert_matches_method(grid_statistics_kernel(grid, 1.0, 1.0), grid, KTAEConfig())
    if "cuda" in GPU_BACKENDS:
        from ktae_kernels.backends import cuda

        assert_matches_method(cuda._GridKernel(cuda.load_extension())(grid, 1.0, 1.0), grid, KTAEConfig())


@pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="needs a CUDA GPU and triton")
def test_triton_call_with_out_is_captured_and_replayed_in_a_cuda_graph():
    """The sync-free path (backends/triton/nosync.py) under ``torch.cuda.graph``: nothing is read back
    while capturing; each replay recomputes from the captured input buffers (new ids, mask and
    rewards copied in), and a replay whose batch holds an out-of-range id leaves ``out`` untouched.
    Called at the backend (the API's validation reads values on the host, which capture forbids)."""
    from cases import cuda_graph_of
    from ktae_kernels import KTAEConfig
    from ktae_kernels.backends import triton as backend
    from ktae_kernels.backends.triton import nosync
    from ktae_kernels.validation import normalise_batch

    config = KTAEConfig()
    args = _batch("cuda", groups=8, G=16, L=512, seed=3)
    batch = normalise_batch(*args)
    out = torch.empty(batch.responses.shape, dtype=torch.float32, device="cuda")
    graph = cuda_graph_of(lambda: backend.token_advantage(batch, config, None, out))
    key = (*batch.responses.shape, batch.n_groups, batch.device)
    assert key not in nosync._SYNC_SHAPES and key not in nosync._BOUNDS  # the warm-up ran sync-free
    for seed in (3, 4):
        new = _batch("cuda", groups=8, G=16, L=512, seed=seed)
        batch.responses.copy_(new[0])
        batch.mask.copy_(new[1])
        batch.rewards.copy_(new[2].double())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, token_advantage(*new, backend="torch"), rtol=0, atol=1e-6)
    batch.responses[0, 0], batch.mask[0, 0] = -3, True
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())
