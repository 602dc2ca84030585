"""backend="cuda" against the reference on a GPU (skipped without CUDA, cuda-core and NVRTC), and the
error it raises when NVRTC is missing (runs anywhere).

Without a GPU the same code paths run under the CPU emulator: tests/test_cuda_emulation.py.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch

from ktae_kernels import (BackendUnavailableError, CudaTuning, ExecutionOptions, KTAEConfig, key_token_scores,
                          token_advantage)
from bench.gpu_variants import KERNEL_VARIANTS
from ktae_kernels.backends import cuda
from ktae_kernels.validation import normalise_batch
from ktae_kernels.registry import get_backend
from cuda_recorder import Recorder
from cases import (adversarial_cases, assert_replays_match_torch, assert_scores_match, cuda_graph_of, ragged_batch,
                   random_cases)


needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and cuda.unavailable_reason() is None),
                               reason="needs a CUDA GPU, cuda-core and NVRTC (pip install -e \".[cuda]\")")

CASES = random_cases() + adversarial_cases()
_expected: dict = {}


def expected(case, config: KTAEConfig):
    """The reference's scores and advantages of a case, computed once per (case, config)."""
    key = (case[0], config)
    if key not in _expected:
        args = case[1:]
        _expected[key] = (key_token_scores(*args, config=config, backend="reference"),
                          token_advantage(*args, config=config, backend="reference"))
    return _expected[key]


def _on_gpu(*tensors):
    return [t.cuda() for t in tensors]


@needs_gpu
@pytest.mark.parametrize("fisher", ["exact", "upstream"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, fisher):
    config = KTAEConfig(fisher=fisher)
    scores, want = expected(case, config)
    actual = key_token_scores(*_on_gpu(*case[1:]), config=config, backend="cuda")
    assert actual.score.device.type == "cuda"
    assert_scores_match(scores, actual)
    got = token_advantage(*_on_gpu(*case[1:]), config=config, backend="cuda")
    assert got.dtype == torch.float32 and got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, rtol=0.0, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("fisher", ["exact", "upstream"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_overflow_fallback_matches_reference(case, fisher):
    # 32 slots take 24 ids: most groups spill to the global-memory table, the smallest stay shared
    config = KTAEConfig(fisher=fisher)
    scores, want = expected(case, config)
    batch = normalise_batch(*_on_gpu(*case[1:]))
    options = ExecutionOptions(cuda=CudaTuning(table_slots=32))
    assert_scores_match(scores, cuda.key_token_scores(batch, config, options))
    got = cuda.token_advantage(batch, config, None, None, options)
    torch.testing.assert_close(got.cpu(), want, rtol=0.0, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("name", sorted(KERNEL_VARIANTS))
def test_every_kernel_variant_computes_the_default_bits(name):
    """On a GPU (its memory model, which the emulator lacks): each variant bench/gpu_variants.py measures
    writes advantages ``torch.equal`` to the default's, with shared tables and with overflowing ones."""
    for case in CASES:
        batch = normalise_batch(*_on_gpu(*case[1:]))
        for slots in (None, 32):
            default = CudaTuning(table_slots=slots)
            want = cuda.token_advantage(batch, KTAEConfig(), None, None, ExecutionOptions(cuda=default))
            tuning = dataclasses.replace(default, variant=KERNEL_VARIANTS[name])
            got = cuda.token_advantage(batch, KTAEConfig(), None, None, ExecutionOptions(cuda=tuning))
            assert torch.equal(got, want), (case[0], slots)


@needs_gpu
def test_groups_too_diverse_for_shared_memory_spill_by_themselves():
    # 16 x 4096 uniform ids out of 10^6: ~65k distinct ids, more than any shared table holds
    rng = np.random.default_rng(5)
    responses = torch.as_tensor(rng.integers(0, 10**6, size=(32, 4096)))
    responses[16:] %= 50  # the second group fits
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards = torch.as_tensor(rng.random(32) < 0.5, dtype=torch.float32)
    index = torch.arange(32) // 16
    batch = normalise_batch(*_on_gpu(responses, mask, rewards, index))
    ext = Recorder(cuda.load_launcher(batch.device))
    got = cuda.token_advantage(batch, KTAEConfig(), None, launcher=ext)
    assert ext.launches == [("advantage", True, 2)]  # a shared pass, then a global pass of a block a group
    want = token_advantage(responses, mask, rewards, index, backend="torch")
    torch.testing.assert_close(got.cpu(), want, rtol=0.0, atol=1e-6)
    expected = key_token_scores(responses, mask, rewards, index, backend="torch")
    assert_scores_match(expected, cuda.key_token_scores(batch, KTAEConfig()))


@needs_gpu
def test_tables_follow_the_distinct_ids_seen_and_overflow_exactly():
    """8 groups of 16 x 1024 tokens holding 100 ids each: the first call sizes by masked tokens, the next
    by the 100 ids read back (256 slots); then groups of ~4k distinct ids overflow those tables, the
    global pass takes them, and the advantages still equal torch's; the count grows to theirs."""
    from ktae_kernels.backends import device

    rng = np.random.default_rng(6)
    B, L = 128, 1024
    index = torch.arange(B) // 16
    repeated = torch.as_tensor(rng.integers(0, 100, size=(B, L))) + 1000 * index[:, None]
    diverse = torch.as_tensor(rng.integers(0, 5000, size=(B, L)))
    mask = torch.ones(B, L, dtype=torch.bool)
    rewards = torch.as_tensor(rng.random(B) < 0.5, dtype=torch.float32)
    ext = cuda.load_launcher(torch.device("cuda", torch.cuda.current_device()))
    state = device.state(torch.device("cuda", torch.cuda.current_device()))
    for responses in (repeated, repeated, diverse, diverse):
        batch = normalise_batch(*_on_gpu(responses, mask, rewards, index))
        got = cuda.token_advantage(batch, KTAEConfig(), None, launcher=ext)
        want = token_advantage(responses, mask, rewards, index, backend="torch")
        torch.testing.assert_close(got.cpu(), want, rtol=0.0, atol=1e-6)
        if responses is repeated:
            assert state.learnt(("cuda", B, 8)).distinct == 100
            assert cuda.static_plan(ext, batch, KTAEConfig()).max_capacity == 256
    most = max(int(torch.unique(diverse[index == g]).numel()) for g in range(8))
    assert state.learnt(("cuda", B, 8)).distinct == most > 4000


@needs_gpu
@pytest.mark.slow
def test_positions_beyond_2_to_the_31():
    # B * L = 2^31 + 2^17: only the last group (its rows end past flat index 2^31) holds tokens
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 40 GiB of GPU memory")
    B, L = 32770, 2**16
    responses = torch.randint(0, 50, (B, L), device="cuda")
    mask = torch.zeros(B, L, dtype=torch.bool, device="cuda")
    mask[-2:, :300] = True
    mask[-2:, -300:] = True
    rewards = torch.zeros(B, device="cuda")
    rewards[-1] = 1.0
    index = torch.arange(B, device="cuda") // 2
    got = token_advantage(responses, mask, rewards, index, backend="cuda")
    small = [t[-2:].cpu() for t in (responses, mask, rewards)] + [torch.zeros(2, dtype=torch.int64)]
    want = token_advantage(*small, backend="reference")
    torch.testing.assert_close(got[-2:].cpu(), want, rtol=0.0, atol=1e-6)
    assert not bool(got[:-2].any())
    del got
    rows = key_token_scores(responses, mask, rewards, index, backend="cuda")
    last = rows.group == B // 2 - 1
    expected = key_token_scores(*small, backend="reference")
    assert torch.equal(rows.token[last].cpu(), expected.token)
    torch.testing.assert_close(rows.score[last].cpu(), expected.score, rtol=1e-9, atol=1e-9)


def test_cuda_backend_without_nvrtc_says_how_to_install_it(monkeypatch):
    """cuda-core missing (as in a CPU-only install): the backend is unavailable and the reason names the
    extra that brings it."""
    monkeypatch.setitem(sys.modules, "cuda.core", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    with pytest.raises(BackendUnavailableError, match=r'cuda-core is not installed.*pip install "ktae_kernels\[cuda\]"'):
        get_backend("cuda", "cuda")


@needs_gpu
def test_a_call_with_out_is_captured_in_a_cuda_graph_and_replayed():
    """``cuda.capture`` reads nothing back, so a call with ``out=`` is capturable; replays on new inputs
    copied into the captured tensors match torch, and a replay with a bad id writes NaN over ``out``
    (never the last replay's values), its flag read by the captured call's ``check``."""
    gen = torch.Generator().manual_seed(4)
    B, L = 64, 512
    batch = lambda: ragged_batch(gen, B, L, 5000)  # noqa: E731
    index = torch.arange(B) // 16
    responses, mask, rewards = (t.cuda() for t in batch())
    data = normalise_batch(responses, mask, rewards, index.cuda())
    out = torch.empty(B, L, dtype=torch.float32, device="cuda")
    captured = []
    graph = cuda_graph_of(lambda: captured.append(cuda.token_advantage(data, KTAEConfig(), None, out)
                                                  if not torch.cuda.is_current_stream_capturing()
                                                  else cuda.capture(data, KTAEConfig(), None, out)[1]))
    assert_replays_match_torch(graph, (data.responses, data.mask, data.rewards), out, batch, index)
    captured[-1].check()
    out.fill_(7.0)
    data.responses[3, 0] = -1
    data.mask[3, 0] = True
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="found -1"):
        captured[-1].check()
