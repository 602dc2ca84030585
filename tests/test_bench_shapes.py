"""The benchmark's shapes preset (its batch variants) and its memory-floor pass (bench/floor.c)."""
import pytest
import torch

from bench.data import PAD_ID, Shape, batch_tokens, make_batch
from bench.floor import floor_library, memory_floor_s
from bench.grid import PRESETS


def test_shapes_preset_has_the_issue_rows_and_variants():
    shapes = PRESETS["shapes"]
    assert len(shapes) == 8 and len(set(shapes)) == 8
    assert any(s.spread_ids for s in shapes) and any(s.masked == 0.6 for s in shapes)
    assert {s.G for s in shapes} >= {16, 64, 256, 1024}


@pytest.mark.parametrize("shape", [Shape(8, 3, 40, spread_ids=True), Shape(8, 3, 40, masked=0.6), Shape(8, 3, 40)],
                         ids=str)
def test_batch_variants(shape):
    batch = make_batch(shape, seed=3)
    assert batch.tokens == batch_tokens(shape, seed=3)
    assert batch.first_groups(2).shape == Shape(shape.G, 2, shape.L, shape.spread_ids, shape.masked)
    real = batch.responses[batch.mask]
    if shape.spread_ids:
        assert int(real.max()) >= 1 << 18  # ids past the kernel's dense map, below 2**31
        assert int(real.max()) < 2**31
    if shape.masked:
        assert abs(float(batch.mask.double().mean()) - (1 - shape.masked)) < 0.1
        assert bool((batch.responses[~batch.mask] == PAD_ID).all())


def test_floor_pass_reads_ids_and_mask_and_writes_float32():
    lib = floor_library()
    if isinstance(lib, str):
        pytest.skip(lib)
    batch = make_batch(Shape(4, 2, 30), seed=1)
    ids, mask = batch.responses, batch.mask
    out = torch.empty(ids.shape, dtype=torch.float32)
    lib.ktae_floor(ids.data_ptr(), ids.stride(0), mask.data_ptr(), mask.stride(0), ids.shape[0], ids.shape[1],
                   out.data_ptr(), 2)
    assert torch.equal(out, torch.where(mask, ids.float(), 0.0))
    assert memory_floor_s(batch, torch.device("cpu"), repeats=1) > 0


def test_a_floor_built_without_openmp_is_no_floor_for_several_threads(monkeypatch):
    """The build falls back to no -fopenmp where the compiler lacks it (Apple clang): that pass runs on one
    thread, and timing it as the floor of backends on two would understate every ``x floor``."""
    from bench import floor

    calls = []

    class OneThreadBuild:
        def ktae_floor_openmp(self):
            return 0

        def ktae_floor(self, *args):
            calls.append(args[-1])

    monkeypatch.setattr(floor, "floor_library", lambda: OneThreadBuild())
    batch, before = make_batch(Shape(4, 2, 30), seed=1), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert floor.memory_floor_s(batch, torch.device("cpu"), repeats=1) is None and calls == []
        torch.set_num_threads(1)
        assert floor.memory_floor_s(batch, torch.device("cpu"), repeats=1) > 0 and calls == [1, 1]
    finally:
        torch.set_num_threads(before)


def test_each_floor_sample_is_the_faster_of_the_backends_threads_and_one(monkeypatch):
    """Beside a busy process an OpenMP team waits at its barrier for a descheduled thread, many times a
    one-thread pass: a floor timed on the team alone would hide the backends' cost. Fake passes on a fake
    clock: the team's pass is the slow one here."""
    from types import SimpleNamespace

    from bench import floor

    clock = [0.0]
    seconds = {2: 10e-3, 1: 0.5e-3}

    class Build:
        def ktae_floor_openmp(self):
            return 1

        def ktae_floor(self, *args):
            clock[0] += seconds[args[-1]]

    monkeypatch.setattr(floor, "floor_library", lambda: Build())
    monkeypatch.setattr(floor, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    batch, before = make_batch(Shape(4, 2, 30), seed=1), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert floor.memory_floor_s(batch, torch.device("cpu"), repeats=3) == pytest.approx(0.5e-3)
        seconds[2] = 0.3e-3  # a quiet machine: the team is faster
        assert floor.memory_floor_s(batch, torch.device("cpu"), repeats=3) == pytest.approx(0.3e-3)
    finally:
        torch.set_num_threads(before)
