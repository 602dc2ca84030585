"""CUDA-graph capture of a plan's call, without a GPU: the capture flag stubbed, the Triton kernels in
Triton's interpreter and the CUDA kernels in the emulator (tests/emulator.py).

A stubbed capture runs the kernels at once, with the sizes a real capture would record, so a call made
while the flag is set stands for a replay of the captured call on that call's data. What these check:
a replay never leaves a finite wrong value in ``out`` (the right advantages, or NaN and ``plan.check()``
says why); a capture is refused until the plan's own layout ran outside a graph; ``check()`` reads every
call replayed since the previous ``check()`` (or the one it is given) and refuses before any replay; what a captured call
reads from the backends' caches outlives any number of other configs; nothing is read back, waited for
or uploaded while capturing. The real capture and replay are tests/test_plan.py's GPU test.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
from ktae_kernels.backends.base import BackendSpec, CapturedCall
from ktae_kernels.backends.cuda import pipeline as cuda_pipeline
from ktae_kernels.plan import TokenAdvantagePlan

pytest.importorskip("triton")

BACKENDS = ["triton", "cuda"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The backend's module path: the Triton backend (in the interpreter), or the cuda backend launching
    on the emulator."""
    if request.param == "cuda":
        emulated_cuda.LAUNCHER = request.getfixturevalue("emulator")
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


def with_bad_id(args, value=-4):
    bad = args[0].clone()
    bad[3, 5] = value
    return (bad, *args[1:])


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


def test_a_replay_with_a_bad_id_leaves_no_stale_value_and_check_raises(backend, monkeypatch):
    """A replay on a good batch, then one whose batch holds an id out of range, ``check`` not called in
    between: ``out`` holds NaN, not the first replay's advantages; ``check`` raises the API's error. The
    eager call raises at once and leaves ``out`` untouched."""
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    plan(*repeated)
    out = torch.full((8, 40), 7.0)
    with capturing(monkeypatch):
        plan(*repeated, out=out)
        torch.testing.assert_close(out, reference(*repeated, index), rtol=0, atol=1e-6)
        plan(*with_bad_id(repeated), out=out)
    assert bool(out.isnan().all()), "a failed replay left finite values in `out`"
    with pytest.raises(ValueError, match="token ids >= 0 where the mask is 1, found -4"):
        plan.check()
    eager = torch.full((8, 40), 7.0)
    with pytest.raises(ValueError, match="found -4"):
        plan(*with_bad_id(repeated), out=eager)
    assert bool((eager == 7.0).all())


def test_a_plan_is_captured_only_after_its_own_layout_ran(backend, monkeypatch):
    """The lessons of one layout do not license another of the same ``(B, n_groups)``: after a warm-up of
    six groups of 4, a plan of groups [16, 4, 1, 1, 1, 1] is refused (saying how to warm up); once it ran
    itself, its replays are the reference's advantages (never NaN). (At most 16 rollouts a group: the
    device's table grid for 16 is a tenth of the one for 32, which the Triton interpreter fills slowly.)"""
    gen = torch.Generator().manual_seed(5)
    responses = torch.randint(0, 30, (24, 8), generator=gen)
    mask = torch.rand(24, 8, generator=gen) < 0.9
    rewards = (torch.rand(24, generator=gen, dtype=torch.float64) < 0.5).double()
    fours = make_plan(backend, torch.arange(24) // 4, (24, 8))
    fours(responses, mask, rewards)
    skewed_index = torch.tensor([0] * 16 + [1] * 4 + [2, 3, 4, 5])
    skewed = make_plan(backend, skewed_index, (24, 8))
    out = torch.full((24, 8), 7.0)
    with capturing(monkeypatch), pytest.raises(GraphCaptureError, match="make one call of the plan .* before capturing"):
        skewed(responses, mask, rewards, out=out)
    skewed(responses, mask, rewards)  # the warm-up
    with capturing(monkeypatch):
        skewed(responses, mask, rewards, out=out)
    skewed.check()
    torch.testing.assert_close(out, reference(responses, mask, rewards, skewed_index), rtol=0, atol=1e-6)


def test_check_reads_the_calls_replayed_since_the_last_check_or_the_one_it_is_given(backend, monkeypatch):
    """A plan captured in two graphs (A on a good batch, B on one with a bad id) keeps a ``CapturedCall``
    each; ``check()`` reads the flags of every call replayed since the previous ``check()`` (again the
    same ones when none replayed since), ``check(call)`` those of ``call``. The stub cannot replay A
    again: it does the bookkeeping A's replay adds to its kernels (``replays``), on A's unchanged flags."""
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    plan(*repeated)
    with capturing(monkeypatch):
        plan(*repeated, out=torch.empty(8, 40))
        plan(*with_bad_id(repeated), out=torch.empty(8, 40))
    good, bad = plan.captured
    for _ in range(2):
        with pytest.raises(ValueError, match="found -4"):
            plan.check()
    plan.check(good)
    with pytest.raises(ValueError, match="found -4"):
        plan.check(bad)
    plan.replays[0] += 1  # A replays
    plan.replays[1] = plan.replays[0]
    plan.check()
    plan.check()
    for replayed in (2, 1):  # B, then A, replay before the next check(): B's bad id is not lost
        plan.replays[0] += 1
        plan.replays[replayed] = plan.replays[0]
    with pytest.raises(ValueError, match="found -4"):
        plan.check()
    with pytest.raises(ValueError, match="one of this plan's `captured` calls"):
        plan.check(CapturedCall(keep=(), check=lambda: None))


def test_check_reads_every_call_of_a_graph_that_holds_several(backend, monkeypatch):
    """One graph holding two calls of the plan (two micro-batches), the first with a bad id: its replay
    leaves NaN in the first ``out`` and the right advantages in the second, and ``check()`` raises the
    first call's error, not only the last call's flags."""
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    plan(*repeated)
    outs = torch.zeros(2, 8, 40)
    with capturing(monkeypatch):
        plan(*with_bad_id(repeated), out=outs[0])
        plan(*repeated, out=outs[1])
    assert torch.isnan(outs[0]).all()
    torch.testing.assert_close(outs[1], reference(*repeated, index), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="found -4"):
        plan.check()
    plan.check(plan.captured[1])


def test_check_before_any_replay_raises(backend, monkeypatch):
    """Before its graph replayed, a captured call's flags hold nothing (a real capture runs no kernel;
    the stub's run is undone in ``replays``): ``check`` says so instead of reading them."""
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    with pytest.raises(GraphCaptureError, match="no call of this plan was captured"):
        plan.check()
    plan(*repeated)
    with capturing(monkeypatch):
        plan(*with_bad_id(repeated), out=torch.empty(8, 40))
    plan.replays.zero_()  # what the device holds after a real capture, before any replay
    with pytest.raises(GraphCaptureError, match="no CUDA graph of this plan has replayed yet"):
        plan.check()
    with pytest.raises(GraphCaptureError, match="captured call 0 of this plan has not replayed yet"):
        plan.check(plan.captured[0])


def test_a_captured_call_keeps_what_it_reads_through_other_configs(backend, monkeypatch):
    """Every cached tensor the captured call's kernels read (the backend's grid, constants,
    log-factorials) is still alive after calls of the same backend with ``DeviceState.CACHED + 8`` other
    configs have cycled its bounded cache: the plan holds them for the graph's life. The test holds no
    reference to them (only weak ones)."""
    repeated, _, index = batches()
    config = KTAEConfig(alpha=2.0, ignore_token_ids=[2])  # a grid and constants of its own
    plan = make_plan(backend, index, (8, 40), config)
    plan(*repeated)
    before = {id(s): weakref.ref(s) for s in _live_storages()}
    with capturing(monkeypatch), _launched(backend, monkeypatch) as read:
        plan(*repeated)
    held = {key: ref for key, ref in read.items() if key in before and before[key]() is ref() is not None}
    callers = {id(t.untyped_storage()) for t in (*repeated, plan.group)}
    assert len(set(held) - callers) >= 2, "the capture read no cached tensor"  # a grid and constants at least
    tiny = (repeated[0][::4, :4].contiguous(), repeated[1][::4, :4].contiguous(), repeated[2][::4].contiguous())
    for i in range(device_state.DeviceState.CACHED + 8):
        make_plan(backend, [0, 1], (2, 4), KTAEConfig(weight=1 + i / 100, ignore_token_ids=[100 + i]))(*tiny)
    gc.collect()
    freed = [key for key, ref in held.items() if ref() is None]
    assert not freed, f"{len(freed)} tensors the graph reads were freed"


def test_nothing_is_read_back_or_waited_for_while_capturing(backend, monkeypatch):
    """While capturing, no value is read back and no stream is synchronised or waited on, cache hits
    included: the state's streams (``DeviceState.stream``, the test seam) are a stream that refuses
    every wait while the flag is set (the warm-up's cache misses synchronise it once, as on a GPU)."""
    repeated, distinct, index = batches()
    plan = make_plan(backend, index, (8, 40))
    stream = _RefusingStream()
    state = device_state.state(plan.device)
    monkeypatch.setattr(device_state.DeviceState, "stream", lambda self: stream)
    state.clear()  # every cached tensor made again, on this stream
    try:
        plan(*repeated)
        out = torch.empty(8, 40)
        with capturing(monkeypatch), _no_host_sync(monkeypatch):
            stream.capturing = True
            plan(*distinct, out=out)
        stream.capturing = False
        plan.check()
        assert stream.synchronized > 0  # the warm-up's misses
    finally:
        state.clear()  # no entry made on the stand-in outlives the test


def test_a_capture_before_any_warm_up_is_refused(backend, monkeypatch):
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    device_state.state(plan.device).clear()  # nothing cached, nothing learnt
    with capturing(monkeypatch), pytest.raises(GraphCaptureError, match="make one call of the plan .* before capturing"):
        plan(*repeated)


def test_a_warm_up_that_counted_no_token_does_not_allow_a_capture(backend, monkeypatch):
    """A warm-up on a batch with every mask value 0 completes (zeros) but sizes no table: the capture is
    refused, and the error says why that warm-up did not count."""
    repeated, _, index = batches()
    plan = make_plan(backend, index, (8, 40))
    device_state.state(plan.device).clear()
    masked_out = (repeated[0], torch.zeros_like(repeated[1]), repeated[2])
    assert torch.equal(plan(*masked_out), torch.zeros(8, 40))
    with capturing(monkeypatch), pytest.raises(GraphCaptureError, match="every mask value 0 .* does not count"):
        plan(*repeated)


def test_the_backends_hold_no_cuda_events():
    """Nothing a capture could wait on: the GPU backends make no CUDA event (a cache entry is complete
    once made: ``DeviceState`` synchronises its stream once)."""
    root = Path(__file__).resolve().parents[1] / "ktae_kernels" / "backends"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "Event(" not in text and ".query(" not in text and "wait_event" not in text, path


# ----------------------------------------------------------------------------------------- helpers
def _live_storages() -> list:
    return [o.untyped_storage() for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel()]


@contextlib.contextmanager
def _launched(module: str, monkeypatch):
    """The storages of every tensor handed to a kernel launch inside the block (Triton's interpreted
    launches, or the tensors of the cuda backend's ``pipeline.advantage`` call), by id, as weak references only."""
    read: dict[int, weakref.ref] = {}

    def record(values):
        read.update((id(s), weakref.ref(s)) for s in (v.untyped_storage() for v in values
                                                       if isinstance(v, torch.Tensor)))

    with monkeypatch.context() as m:
        if module == "emulated_cuda":
            advantage = cuda_pipeline.advantage

            def recording(launcher, *structs):
                record(getattr(s, f.name) for s in structs for f in dataclasses.fields(s))
                return advantage(launcher, *structs)

            m.setattr(cuda_pipeline, "advantage", recording)
        else:
            from triton.runtime.interpreter import InterpretedFunction

            run = InterpretedFunction.run

            def recording(self, *args, **kwargs):
                record(args)
                return run(self, *args, **kwargs)

            m.setattr(InterpretedFunction, "run", recording)
        yield read


class _RefusingStream:
    """A stand-in for a CUDA stream: counts ``synchronize`` and refuses any wait or query while
    ``capturing``."""

    def __init__(self) -> None:
        self.capturing = False
        self.synchronized = 0

    def synchronize(self) -> None:
        if self.capturing:
            raise AssertionError("Stream.synchronize while capturing")
        self.synchronized += 1

    def __getattr__(self, name: str):
        raise AssertionError(f"Stream.{name} used by a backend")


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
