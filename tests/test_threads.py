"""The GPU backends' shared state under threads (two trainer threads on one GPU share it: a colocated
reference model, an async rollout worker): 4 threads x 2,000 mixed calls on one ``DeviceState`` (cached
tensors cycled past its bound, table sizes learnt and read back) and plan calls of the triton backend
(in Triton's interpreter) and of the cuda backend (on the CPU emulator) between them, with no error and
every result exact.

Python switches threads every microsecond here (``sys.setswitchinterval``), so that a lookup-then-touch
or read-then-write gap in the state's code is hit within the run. Triton's interpreter itself is not
thread-safe (a global program index and patches of ``triton.language`` while a kernel runs; launches on a
GPU are), so the interpreted launches take turns; everything around them runs concurrently.
"""
from __future__ import annotations

import math
import random
import sys
import threading

import numpy as np
import pytest
import torch

import emulated_cuda
from cases import ragged_batch
from ktae_kernels import KTAEConfig, token_advantage
from ktae_kernels.backends import cuda, device as device_state
from ktae_kernels.backends.base import BackendSpec
from ktae_kernels.plan import TokenAdvantagePlan

triton = pytest.importorskip("triton")
from ktae_kernels.backends.triton.statistics import grid_statistics_kernel  # noqa: E402

THREADS = 4
CALLS = 2000
#: in one round of KERNEL_EVERY, each thread makes a plan call in place of a state call (a kernel run costs
#: ~0.1-0.3 s of CPU here; a state call microseconds)
KERNEL_EVERY = 200
#: distinct constant vectors the threads ask for: more than the state keeps, so entries are evicted
#: while other threads look them up
CONSTANTS = device_state.DeviceState.CACHED + 16


def plan_of(module: str, index, shape) -> TokenAdvantagePlan:
    spec = BackendSpec(module, module, ("cpu",), lambda _: None, checks_token_ids=True, capturable=True)
    labels, group = np.unique(np.asarray(index), return_inverse=True)
    return TokenAdvantagePlan(shape=shape, device=torch.device("cpu"), config=KTAEConfig(), spec=spec,
                              group=torch.as_tensor(group, dtype=torch.int64), group_labels=labels)


@pytest.fixture
def fast_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def interpreter_in_turns(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    run, turn = InterpretedFunction.run, threading.Lock()

    def in_turn(self, *args, **kwargs):
        with turn:
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", in_turn)


def test_four_threads_of_mixed_calls_share_one_device_state(emulator, fast_switching, interpreter_in_turns):
    """The threads run the calls in rounds (a barrier between rounds, so that every round's calls
    overlap): each learns a size under the round's key (the state must keep the round's largest) and asks
    for a cached tensor (evicting others'), or, once every ``KERNEL_EVERY`` rounds, makes a plan call."""
    emulated_cuda.LAUNCHER = emulator
    state = device_state.state(torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    index = torch.arange(8) // 4
    batches = [ragged_batch(gen, 8, 16, 40) for _ in range(3)]
    plans = {"triton": plan_of("ktae_kernels.backends.triton", index, (8, 16)),
             "cuda": plan_of("emulated_cuda", index, (8, 16))}
    exact = {name: [plan(*b) for b in batches] for name, plan in plans.items()}  # one thread: the truth
    for results in exact.values():
        for got, b in zip(results, batches):
            torch.testing.assert_close(got, token_advantage(*b, index, backend="reference"), rtol=0, atol=1e-6)
    grids = (grid_statistics_kernel, cuda.GridKernel(emulator))
    learnt = [[0] * THREADS for _ in range(CALLS)]
    lost: list[str] = []

    def check_round() -> None:  # run by the last thread to reach the barrier
        call = check_round.call
        seen = state.learnt(("threads", call))
        if max(learnt[call]) and (seen is None or seen.distinct != max(learnt[call])):
            lost.append(f"round {call}: learnt {learnt[call]}, kept {seen}")
        check_round.call += 1

    check_round.call = 0
    barrier = threading.Barrier(THREADS, action=check_round)
    errors: list[BaseException] = []

    def one_call(me: int, call: int, rng: random.Random) -> None:
        if call % KERNEL_EVERY == me:
            name = ("triton", "cuda")[(call // KERNEL_EVERY + me) % 2]
            which = rng.randrange(len(batches))
            assert torch.equal(plans[name](*batches[which]), exact[name][which]), f"{name} batch {which} differs"
            return
        distinct = rng.randrange(1, 10**6)
        learnt[call][me] = distinct
        state.learn(("threads", call), largest=distinct % 97, distinct=distinct)
        op = rng.randrange(3)
        if op == 0:  # a constant vector, evicted and made again as the threads cycle them
            value = rng.randrange(CONSTANTS)
            assert state.constant((value, -value), torch.int64).tolist() == [value, -value]
        elif op == 1:
            n = rng.randrange(1, 300)
            assert state.log_factorials(n)[n].item() == pytest.approx(math.lgamma(n + 1), rel=1e-12)
        else:  # the kernels' grids stay in use (made again if evicted)
            assert state.grid(rng.choice(grids), 1.0, 1.0, 16).shape == (5, 4845)

    def work(me: int) -> None:
        rng = random.Random(me)
        try:
            for call in range(CALLS):
                one_call(me, call, rng)
                barrier.wait()
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
            barrier.abort()

    workers = [threading.Thread(target=work, args=(me,)) for me in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, f"{len(errors)} threads failed, the first: {errors[0]!r}"
    assert not lost, f"{len(lost)} of {CALLS} rounds lost a learnt size, e.g. {lost[:3]}"
    assert check_round.call == CALLS
