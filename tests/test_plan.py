"""``plan_token_advantage``: a plan's call equals ``token_advantage`` for its layout, checks what it is
given against the plan, and, while a CUDA graph captures, reads nothing back (a contract test on the
CPU with the capture flag stubbed; the real capture and replay run on a GPU only)."""
from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from cases import assert_replays_match_torch, cuda_graph_of, ragged_batch, random_cases
from ktae_kernels import GraphCaptureError, KTAEConfig, TokenAdvantagePlan, plan_token_advantage, token_advantage
from ktae_kernels import plan as plan_module
from ktae_kernels.backends.base import BackendSpec, BackendUnavailableError, CapturedCall
from ktae_kernels.registry import available_backends

CPU_BACKENDS = [b for b in ("cpu", "torch", "reference", "triton") if b in available_backends("cpu")]  # triton: interpreted
GPU_BACKENDS = [b for b in ("triton", "cuda") if torch.cuda.is_available() and b in available_backends("cuda")]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", random_cases(small=True), ids=lambda c: c[0])
def test_a_plan_equals_token_advantage(backend, case):
    _, responses, mask, rewards, index = case
    config = KTAEConfig(baseline="mean", ignore_token_ids=(3,))
    plan = plan_token_advantage(index, tuple(responses.shape), config=config, backend=backend)
    want = token_advantage(responses, mask, rewards, index, config=config, backend=backend)
    assert torch.equal(plan(responses, mask, rewards), want)
    out = torch.full(responses.shape, float("nan"))
    assert plan(responses, mask, rewards, out=out) is out and torch.equal(out, want)


def test_a_plan_serves_new_data_of_its_layout_with_every_option():
    labels = np.array(["q7", "q2", "q7", "q2", "q2", "q9"], dtype=object)
    plan = plan_token_advantage(labels, (6, 5))
    assert plan.group.tolist() == [1, 0, 1, 0, 0, 2] and list(plan.group_labels) == ["q2", "q7", "q9"]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        responses = torch.randint(0, 9, (6, 5), generator=gen)
        mask = torch.rand(6, 5, generator=gen) < 0.8
        rewards = torch.rand(6, 5, generator=gen, dtype=torch.float64)  # token-level, summed over L
        given = torch.randn(6, generator=gen, dtype=torch.float64)
        correct = torch.tensor([1, 0, 1, 1, 0, 1])
        want = token_advantage(responses, mask, rewards, labels, rollout_advantage=given, correct=correct)
        assert torch.equal(plan(responses, mask, rewards, rollout_advantage=given, correct=correct), want)


def test_plans_compare_and_hash_by_identity():
    """A plan holds tensors, captures and replay counts of its own: two plans of one layout are two
    plans, and either may key a dict."""
    first, second = (plan_token_advantage([0, 0, 1], (3, 4)) for _ in range(2))
    assert first == first and first != second
    assert len({first: 1, second: 2}) == 2


@pytest.mark.parametrize("shape", [(4,), (4, -1), "ab", (4, 2.0), None])
def test_a_plan_needs_a_shape(shape):
    with pytest.raises(ValueError, match="`shape` must be \\(B, L\\)"):
        plan_token_advantage([0, 0, 1, 1], shape)


def test_plan_checks_index_and_backend_as_token_advantage_does():
    with pytest.raises(ValueError, match="`index` must be 1-D of length B = 3"):
        plan_token_advantage([0, 1], (3, 4))
    with pytest.raises(ValueError, match="`backend` must be 'auto' or one of"):
        plan_token_advantage([0, 1], (2, 4), backend="fast")
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' runs on 'cuda' tensors"):
        plan_token_advantage([0, 1], (2, 4), backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a usable CUDA GPU")
@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_a_plan_for_cuda_without_a_gpu_says_why(backend):
    """As ``token_advantage`` on a device this machine lacks: BackendUnavailableError, never torch's error."""
    with pytest.raises(BackendUnavailableError, match=r"CPU-only build|no usable CUDA GPU"):
        plan_token_advantage([0, 1], (2, 4), device="cuda", backend=backend)


@pytest.mark.parametrize("device", ["tpu", None, 5])
def test_a_plan_names_a_bad_device(device):
    with pytest.raises(ValueError, match=rf"^`device` must be a torch.device or a device string such as 'cpu' or "
                                         rf"'cuda:0', got {device!r}$"):
        plan_token_advantage([0, 1], (2, 4), device=device)


def test_a_plan_rejects_batches_of_another_shape():
    plan = plan_token_advantage([0, 0, 1, 1], (4, 3))
    responses = torch.ones(4, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="`responses` must have the planned shape \\(4, 3\\), got \\(4, 5\\)"):
        plan(responses, responses > 0, torch.ones(4))
    responses = torch.ones(3, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="`responses` must have B = 4 rows"):
        plan(responses, responses > 0, torch.ones(3))


def test_a_plan_reports_bad_values_as_token_advantage_does():
    plan = plan_token_advantage([0, 0], (2, 2))
    responses = torch.tensor([[1, 2], [3, -5]])
    with pytest.raises(ValueError, match="found -5"):
        plan(responses, torch.ones(2, 2, dtype=torch.bool), torch.ones(2))
    with pytest.raises(ValueError, match="`rewards` must be finite"):
        plan(responses.abs(), torch.ones(2, 2, dtype=torch.bool), torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="`response_mask` must be bool or hold only 0 and 1"):
        plan(responses.abs(), torch.full((2, 2), 2), torch.ones(2))


# ------------------------------------------------------------------------- capture contract (CPU stub)
class _Recorder:
    """A backend module that keeps what it was handed (registered as capturable for the test)."""

    def __init__(self):
        self.calls = []

    def token_advantage(self, batch, config, given, out, options):
        raise AssertionError("not called while capturing")

    def capture(self, batch, config, given, out, options):
        self.calls.append((batch, config, given, out))
        return out, CapturedCall(keep=(), check=lambda: None)

    def key_token_scores(self, batch, config, options):
        raise AssertionError("not called")


_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def _no_host_reads(monkeypatch):
    """Any read of a tensor's values back to the host fails the test inside the block."""
    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a value back while capturing")
        return read
    with monkeypatch.context() as m:
        for name in _READS:
            m.setattr(torch.Tensor, name, refuse(name))
        yield


def _capturing_plan(monkeypatch, capturable=True, config=None):
    recorder = _Recorder()
    module = f"recorder_{id(recorder)}"  # imported once, as any backend module: by name, from sys.modules
    spec = BackendSpec("recorder", module, ("cpu",), lambda _: None, checks_token_ids=True, capturable=capturable)
    monkeypatch.setitem(sys.modules, module, recorder)
    plan = TokenAdvantagePlan(shape=(4, 3), device=torch.device("cpu"), config=config or KTAEConfig(), spec=spec,
                              group=torch.tensor([1, 1, 0, 0]), group_labels=np.array([3, 8]))
    monkeypatch.setattr(plan_module, "capturing", lambda device: True)
    return plan, recorder


def test_while_capturing_a_plan_reads_nothing_back(monkeypatch):
    """Contract test: the plan's own checks and conversions touch no value on the host (the capture
    flag and the backend are stubbed; a real capture of cuda / triton is the GPU test below)."""
    plan, recorder = _capturing_plan(monkeypatch)
    responses = torch.tensor([[5, 7, 2], [5, 8, 2], [1, 2, 3], [3, 3, 0]], dtype=torch.int32)
    mask = responses != 0
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float32)
    given = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float32)
    correct = torch.tensor([True, False, True, False])
    out = torch.empty(4, 3)
    with _no_host_reads(monkeypatch):
        assert plan(responses, mask, rewards, rollout_advantage=given, correct=correct, out=out) is out
    (batch, config, base_given, passed_out), = recorder.calls
    assert batch.responses.dtype == torch.int64 and torch.equal(batch.responses, responses.long())
    assert torch.equal(batch.mask, mask) and batch.rewards.dtype == torch.float64
    assert torch.equal(batch.rewards, rewards.double()) and torch.equal(base_given, given.double())
    assert torch.equal(batch.group, plan.group) and batch.n_groups == 2 and torch.equal(batch.correct, correct)
    assert config is plan.config and passed_out is out


def test_while_capturing_unreadable_inputs_are_refused(monkeypatch):
    plan, _ = _capturing_plan(monkeypatch)
    responses = torch.ones(4, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="`response_mask` must be bool while a CUDA graph captures"):
        plan(responses, torch.ones(4, 3), torch.ones(4))
    with pytest.raises(ValueError, match="`rewards` must be a tensor on cpu while a CUDA graph captures"):
        plan(responses, responses > 0, [1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="`rollout_advantage` must be a tensor on cpu while a CUDA graph"):
        plan(responses, responses > 0, torch.ones(4), rollout_advantage=np.zeros(4))


def test_while_capturing_an_out_overlapping_an_input_is_refused_with_no_read(monkeypatch):
    """The overlap check is pointer arithmetic: a capture refuses an ``out`` sharing an input's memory
    before the backend is handed anything, reading no value back."""
    plan, recorder = _capturing_plan(monkeypatch)
    out = torch.zeros(4, 3)
    responses, mask = torch.ones(4, 3, dtype=torch.int64), torch.ones(4, 3, dtype=torch.bool)
    with _no_host_reads(monkeypatch), pytest.raises(ValueError, match=r"^`out` must not overlap `rewards` in memory"):
        plan(responses, mask, out[:, 0], out=out)
    with _no_host_reads(monkeypatch), pytest.raises(ValueError, match=r"^`out` must not overlap `correct` in memory"):
        plan(responses, mask, torch.ones(4), correct=out.view(torch.bool)[3, :4], out=out)
    assert recorder.calls == []


def test_capturing_needs_a_capturable_backend_and_exact_fisher(monkeypatch):
    responses = torch.ones(4, 3, dtype=torch.int64)
    plan, _ = _capturing_plan(monkeypatch, capturable=False)
    with pytest.raises(BackendUnavailableError, match="cannot be captured in a CUDA graph; plan with backend='cuda'"):
        plan(responses, responses > 0, torch.ones(4))
    plan, _ = _capturing_plan(monkeypatch, config=KTAEConfig(fisher="upstream"))
    with pytest.raises(ValueError, match="`config.fisher` must be 'exact' to capture"):
        plan(responses, responses > 0, torch.ones(4))


def test_a_plan_keeps_one_captured_call_per_graph_up_to_its_limit(monkeypatch):
    """Each capture adds its own ``CapturedCall`` (a plan may live in several graphs); past
    ``MAX_CAPTURES`` a capture is refused, saying to make a new plan."""
    plan, recorder = _capturing_plan(monkeypatch)
    responses = torch.ones(4, 3, dtype=torch.int64)
    for _ in range(plan_module.MAX_CAPTURES):
        plan(responses, responses > 0, torch.ones(4))
    assert len(plan.captured) == len(recorder.calls) == plan_module.MAX_CAPTURES
    assert len({id(call) for call in plan.captured}) == plan_module.MAX_CAPTURES
    with pytest.raises(GraphCaptureError, match="captured in 64 CUDA graphs already.*make a new plan"):
        plan(responses, responses > 0, torch.ones(4))


# ----------------------------------------------------------------------------------------- GPU only
@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a CUDA GPU (and triton or the cuda extra)")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_a_plan_call_is_captured_in_a_cuda_graph_and_replayed(backend):
    """The public path (a plan's call, with ``out=``) under ``torch.cuda.graph``; each replay on new data
    copied into the captured tensors equals the torch backend and ``check`` passes; a replay with a
    bad id writes NaN over ``out`` and ``check`` raises the API's error."""
    gen = torch.Generator().manual_seed(7)
    B, L = 64, 384
    batch = lambda: ragged_batch(gen, B, L, 151_936)  # noqa: E731
    index = [f"q{i // 16}" for i in range(B)]
    plan = plan_token_advantage(index, (B, L), device="cuda", backend=backend)
    static = [t.cuda() for t in batch()]
    out = torch.empty(B, L, device="cuda")
    graph = cuda_graph_of(lambda: plan(*static, out=out))
    assert_replays_match_torch(graph, static, out, batch, index)
    plan.check()
    out.fill_(7.0)
    static[0][5, 0] = -1
    static[1][5, 0] = True
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="token ids >= 0 where the mask is 1, found -1"):
        plan.check()


@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a CUDA GPU (and triton or the cuda extra)")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_check_reads_the_graph_of_a_plan_replayed_since_the_last_check(backend):
    """A plan captured in two graphs: ``check`` refuses before any replay, then reads the flags of
    the graph replayed since the previous ``check()``, and ``check(call)`` those of ``call``; a failed
    replay leaves NaN."""
    gen = torch.Generator().manual_seed(8)
    B, L = 32, 128
    index = torch.arange(B) // 8
    plan = plan_token_advantage(index, (B, L), device="cuda", backend=backend)
    good = [t.cuda() for t in ragged_batch(gen, B, L, 1000)]
    bad = [t.clone() for t in good]
    outs = [torch.empty(B, L, device="cuda") for _ in range(2)]
    graphs = [cuda_graph_of(lambda: plan(*good, out=outs[0])), cuda_graph_of(lambda: plan(*bad, out=outs[1]))]
    with pytest.raises(GraphCaptureError, match="no CUDA graph of this plan has replayed yet"):
        plan.check()
    bad[0][5, 0], bad[1][5, 0] = -1, True
    graphs[1].replay()
    torch.cuda.synchronize()
    with pytest.raises(GraphCaptureError, match="captured call 0 of this plan has not replayed yet"):
        plan.check(plan.captured[0])
    with pytest.raises(ValueError, match="found -1"):
        plan.check()
    graphs[0].replay()
    torch.cuda.synchronize()
    plan.check()
    with pytest.raises(ValueError, match="found -1"):
        plan.check(plan.captured[1])
    assert torch.isnan(outs[1]).all() and not torch.isnan(outs[0]).any()
