"""pytest-benchmark timings of the core ops on a medium batch (G=16, 16 prompts, L=1024).

Not part of the default test run (``testpaths = ["tests"]``); run them in one process (pytest-benchmark
times nothing on pytest-xdist workers) with::

    python -m pytest bench/ -n 0 --benchmark-only
    python -m pytest bench/ -n 0 --benchmark-only --benchmark-json bench-results/ops.json

On a CUDA machine every op runs on "cpu" and "cuda". Each test also checks its result: the library
backends must reproduce the reference's advantages.
"""
from __future__ import annotations

import pytest
import torch

import ktae_kernels
from bench.contenders import ALL_NAMES, BENCH_CONFIG, UPSTREAM, make_contender, unavailable_reason
from bench.data import Shape, make_batch
from bench.timing import synchronize
from ktae_kernels.validation import normalise_batch
from ktae_kernels.backends import torch as torch_backend

MEDIUM = Shape(16, 16, 1024)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def medium(request):
    return make_batch(MEDIUM, seed=0, device=request.param)


@pytest.fixture(scope="module")
def expected(medium):
    """The reference's advantages on the medium batch (CPU, float32 [B, L])."""
    return ktae_kernels.token_advantage(*medium.args(), config=BENCH_CONFIG, backend="reference").cpu()


def synced(fn, device):
    def run():
        out = fn()
        synchronize(device)
        return out
    return run


def test_build_tables(benchmark, medium):
    device = medium.responses.device
    batch = normalise_batch(*medium.args())
    stats = torch_backend.group_stats(batch, BENCH_CONFIG)
    tables = benchmark(synced(lambda: torch_backend.build_tables(batch, stats), device))
    assert int((tables.f_c + tables.f_w).sum()) == medium.tokens
    assert bool(((tables.a + tables.b) >= 1).all())
    assert bool((tables.a + tables.b <= MEDIUM.G).all())


def test_fisher_pvalues(benchmark, medium):
    device = medium.responses.device
    rows = ktae_kernels.key_token_scores(*medium.args(), config=BENCH_CONFIG, backend="torch")
    cells = (rows.a, rows.b, rows.c, rows.d)
    p = benchmark(synced(lambda: ktae_kernels.fisher_exact_pvalue(*cells), device))
    assert p.shape == rows.a.shape and p.dtype == torch.float64
    assert bool(((p > 0) & (p <= 1)).all())
    torch.testing.assert_close(p, rows.p_value, rtol=0, atol=0)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_token_advantage(benchmark, medium, expected, name):
    device = medium.responses.device
    reason = unavailable_reason(name, device)
    if reason is not None:
        pytest.skip(reason)
    contender = make_contender(name)
    contender.prepare(medium)
    run = synced(lambda: contender.run(medium), device)
    if contender.per_group:  # seconds per call: a few rounds are enough
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    else:
        out = benchmark(run)
    out = out.cpu()
    assert out.shape == (MEDIUM.B, MEDIUM.L) and out.dtype == torch.float32
    assert bool((out[~medium.mask.cpu()] == 0).all())
    if name == UPSTREAM:  # float32 Fisher: scores differ from the exact test by design
        assert bool(torch.isfinite(out).all())
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
