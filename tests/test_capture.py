"""CUDA-graph capture of a plan's call, without a GPU: the capture flag stubbed, the Triton kernels in
Triton's interpreter and the CUDA kernels in the emulator (tests/emulator.py).

A stubbed capture runs the kernels at once, with the sizes a real capture would record, so a call made
while the flag is set stands for a replay of the captured call on that call's data. What these check:
a replay on data that needs more than the captured tables either writes the right advantages or is
reported by ``plan.check()`` (``out`` then holds NaN, never stale values); what a captured call reads
from the backends' caches outlives any number of other configs; nothing is read back, waited for or
uploaded while capturing; a capture before any warm-up is refused, saying how to warm up. The real
capture and replay are tests/test_plan.py's GPU test.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import emulated_cuda
from cases import distinct_and_repeated_groups
from ktae_kernels import (ExecutionOptions, GraphCaptureError, KTAEConfig, TritonTuning, plan as plan_module,
                          token_advantage)
from ktae_kernels.backends import device as device_state
from ktae_kernels.backends.base import BackendSpec
from ktae_kernels.plan import TokenAdvantagePlan

pytest.importorskip("triton")

BACKENDS = ["triton", "cuda"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The backend's module path: the Triton backend (in the interpreter), or the cuda backend over the
    emulator build."""
    if request.param == "cuda":
        emulated_cuda.EXTENSION = request.getfixturevalue("emulator")
        return "emulated_cuda"
    return "ktae_kernels.backends.triton"


def make_plan(module: str, index, shape, config=KTAEConfig(), options=ExecutionOptions()) -> TokenAdvantagePlan:
    spec = BackendSpec(module, module, ("cpu",), lambda _: None, checks_token_ids=True, capturable=True)
    labels, group = np.unique(np.asarray(index), return_inverse=True)
    return TokenAdvantagePlan(shape=shape, device=torch.device("cpu"), config=config, spec=spec,
                              group=torch.as_tensor(group, dtype=torch.int64), group_labels=labels, options=options)


@contextlib.contextmanager
def capturing(monkeypatch):
    """The CUDA-graph capture flag set, for the plan and for the backends' state."""
    with monkeypatch.context() as m:
        m.setattr(plan_module, "capturing", lambda device: True)
        m.setattr(device_state, "capturing", lambda device: True)
        yield


def batches():
    """Two batches of one layout (2 groups of 4 rollouts x 40): both groups holding ids 0-2 only, and
    ``distinct_and_repeated_groups`` (group 0: 160 distinct ids); float64 rewards, so that a plan's call
    converts nothing (every tensor the kernels read is the caller's or the backend's)."""
    responses, mask, rewards, index = distinct_and_repeated_groups()
    repeated = responses.clone()
    repeated[:4] = responses[4:]
    rewards = rewards.double()
    return (repeated, mask, rewards), (responses, mask, rewards), index


def reference(responses, mask, rewards, index, config=KTAEConfig()):
    return token_advantage(responses, mask, rewards, index, config=config, backend="reference")


@pytest.mark.parametrize("tuning", [TritonTuning(), TritonTuning(budget_bytes=100 * 20)], ids=["rebuilt", "too-small"])
def test_a_replay_on_more_distinct_ids_writes_the_right_out_or_check_raises(backend, tuning, monkeypatch):
    """Warmed up on groups of three ids, captured, then replayed on a group of 160 distinct ids: the
    cuda backend's global pass and the Triton rebuild write the reference's advantages; Triton tables
    too small for the rebuild (``budget_bytes``) leave NaN in ``out`` and ``check`` says so."""
    repeated, distinct, index = batches()
    plan = make_plan(backend, index, (8, 40), options=ExecutionOptions(triton=tuning))
    torch.testing.assert_close(plan(*repeated), reference(*repeated, index), rtol=0, atol=1e-6)
    out = torch.zeros(8, 40)
    with capturing(monkeypatch):
        assert plan(*distinct, out=out) is out
    if backend == "emulated_cuda" or tuning == TritonTuning():
        plan.check()
        torch.testing.assert_close(out, reference(*distinct, index), rtol=0, atol=1e-6)
    else:
        with pytest.raises(GraphCaptureError, match="the last replay could not complete .* NaN in `out`.*Warm the plan"):
            plan.check()
        assert bool(out.isnan().all())


def test_a_replay_with_a_bad_id_leaves_out_untouched_and_check_raises(backend, monkeypatch):
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    plan(*repeated)
    bad = repeated[0].clone()
    bad[3, 5] = -4
    out = torch.full((8, 40), 7.0)
    with capturing(monkeypatch):
        plan(bad, *repeated[1:], out=out)
    with pytest.raises(ValueError, match="token ids >= 0 where the mask is 1, found -4"):
        plan.check()
    assert bool((out == 7.0).all())


def test_a_captured_call_keeps_what_it_reads_for_100_other_configs(backend, monkeypatch):
    """Every tensor the captured call's kernels read that existed before it (the backend's cached grid,
    constants, log-factorials) is still alive after 100 calls with other configs have cycled the
    backend's bounded caches: the plan holds them for the graph's life."""
    repeated, _, index = batches()
    config = KTAEConfig(ignore_token_ids=[2])
    plan = make_plan(backend, index, (8, 40), config)
    plan(*repeated)
    before = {id(t.untyped_storage()): weakref.ref(t.untyped_storage()) for t in _live_tensors()}
    with capturing(monkeypatch), _launched(backend, monkeypatch) as read:
        plan(*repeated)
    held = {key: before[key] for key in {id(t.untyped_storage()) for t in read} if key in before}
    shapes = {id(t.untyped_storage()): (tuple(t.shape), t.dtype) for t in read}
    assert len(held) > 3  # the caller's tensors and the backend's cached ones
    for i in range(100):
        token_advantage(*repeated, index, backend=_name(backend), config=KTAEConfig(weight=1 + i / 100,
                                                                                    ignore_token_ids=[i]))
    gc.collect()
    freed = [shapes[key] for key, ref in held.items() if ref() is None]
    assert not freed, f"tensors the graph reads were freed: {freed}"


def test_nothing_is_read_back_or_waited_for_while_capturing(backend, monkeypatch):
    repeated, distinct, index = batches()
    plan = make_plan(backend, index, (8, 40))
    plan(*repeated)
    out = torch.empty(8, 40)
    with capturing(monkeypatch), _no_host_sync(monkeypatch):
        plan(*distinct, out=out)
    plan.check()


def test_a_capture_before_any_warm_up_is_refused(backend, monkeypatch):
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    device_state.state(plan.device).clear()  # nothing cached, nothing learnt
    with capturing(monkeypatch), pytest.raises(GraphCaptureError, match="make one call of the plan .* before capturing"):
        plan(*repeated)


def test_the_backends_hold_no_cuda_events():
    """Nothing a capture could wait on: the GPU backends make no CUDA event (a cache entry is complete
    once made: ``DeviceState`` synchronises its stream once)."""
    root = Path(__file__).resolve().parents[1] / "ktae_kernels" / "backends"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "Event(" not in text and ".query(" not in text and "wait_event" not in text, path


# ----------------------------------------------------------------------------------------- helpers
def _name(module: str) -> str:
    return "triton" if module.endswith("triton") else "torch"


def _live_tensors() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel()]


@contextlib.contextmanager
def _launched(module: str, monkeypatch):
    """Every tensor handed to a kernel launch inside the block: Triton's interpreted launches, or the
    emulator's ``advantage`` call."""
    read: list[torch.Tensor] = []
    with monkeypatch.context() as m:
        if module == "emulated_cuda":
            advantage = emulated_cuda.EXTENSION.advantage

            def recording(*structs):
                fields = (getattr(s, name) for s in structs for name in dir(s) if not name.startswith("_"))
                read.extend(v for v in fields if isinstance(v, torch.Tensor))
                return advantage(*structs)

            m.setattr(emulated_cuda.EXTENSION, "advantage", recording)
        else:
            from triton.runtime.interpreter import InterpretedFunction

            run = InterpretedFunction.run

            def recording(self, *args, **kwargs):
                read.extend(a for a in args if isinstance(a, torch.Tensor))
                return run(self, *args, **kwargs)

            m.setattr(InterpretedFunction, "run", recording)
        yield read


@contextlib.contextmanager
def _no_host_sync(monkeypatch):
    """Reading a tensor's values on the host, synchronising a stream or waiting on an event fails the test."""
    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} while capturing")
        return call
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        m.setattr(torch.cuda, "synchronize", refuse("torch.cuda.synchronize"))
        for name in ("synchronize", "wait_event", "wait_stream", "query"):
            m.setattr(torch.cuda.Stream, name, refuse(f"Stream.{name}"))
        for name in ("synchronize", "wait", "query"):
            m.setattr(torch.cuda.Event, name, refuse(f"Event.{name}"))
        yield
