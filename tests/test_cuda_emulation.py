"""The CUDA backend end to end without a GPU: the device source (ktae_kernels/backends/cuda/ktae_kernels.cu)
built against the CPU emulator (csrc/emulation/), launched by the backend's own Python launches
(ktae_kernels/backends/cuda/pipeline.py), checked against the reference.

The emulator runs every CUDA thread of a block as a fiber, switched at barriers, warp exchanges,
atomics and at random, some threads held far behind the others, so this checks the kernels' indexing, hash table, presence bitmasks, overflow fallback,
sort and statistics, the launches' argument checks and the host orchestration. It cannot check
CUDA's memory model, performance or device limits: tests/test_cuda_backend.py does that on a GPU.
The build is cached (tests/emulator.py). Marked slow (``-m "not slow"`` skips it).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ktae_kernels import CudaTuning, ExecutionOptions, KTAEConfig, KernelVariant, method, reference, token_advantage
from ktae_kernels.backends import cuda, device as device_state
from ktae_kernels.backends.cuda import pipeline
from ktae_kernels.validation import normalise_batch
from cases import (adversarial_cases, assert_same_signs, assert_scores_match, distinct_and_repeated_groups, make_batch,
                   random_cases, zero_strength_case)
from cuda_recorder import Recorder

pytestmark = pytest.mark.slow


def wide_groups_case():
    """Groups of 40 and 33 rollouts: two presence words per slot."""
    return ("G40-two-words", *make_batch(np.random.default_rng(7), [40, 33], 24, 40, shuffle=True))


CASES = random_cases(small=True) + adversarial_cases(small=True) + [wide_groups_case()]
#: the kernel variants tested besides the default: with it, each alternative of each switch runs.
VARIANTS = [KernelVariant(unroll=2, match_any=False, load_ahead=False), KernelVariant(unroll=8)]
_expected: dict = {}


def expected(name: str, batch, config: KTAEConfig, given=None):
    """Reference scores and advantages, computed once per (case, config)."""
    key = (name, config, None if given is None else tuple(given.tolist()))
    if key not in _expected:
        _expected[key] = (reference.key_token_scores(batch, config), reference.token_advantage(batch, config, given))
    return _expected[key]


def tuned(**tuning) -> ExecutionOptions:
    return ExecutionOptions(cuda=CudaTuning(**tuning))


def launcher_of(variant: KernelVariant, default):
    """The emulator of ``variant`` (``default``, the ``emulator`` fixture, for the default variant)."""
    from emulator import load

    return default if variant == KernelVariant() else load(variant)


def check(ext, name, batch, config, *, options=ExecutionOptions(), given=None) -> None:
    scores, advantage = expected(name, batch, config, given)
    assert_scores_match(scores, cuda.key_token_scores(batch, config, options, launcher=ext))
    actual = cuda.token_advantage(batch, config, given, None, options, launcher=ext)
    assert actual.dtype == torch.float32 and actual.shape == advantage.shape
    torch.testing.assert_close(actual, advantage, rtol=0.0, atol=1e-6)


def test_emulator_agrees_with_the_host_mirror_of_the_kernel_constants(emulator):
    for words in (1, 2, 3, 33):
        assert emulator.header_bytes(words) == cuda.header_bytes(words)
        for capacity in (2, 32, 1024, 8192):
            assert emulator.shared_table_bytes(capacity, words, False) == cuda.shared_table_bytes(capacity, words)
            assert emulator.shared_table_bytes(capacity, words, True) == cuda.shared_table_bytes(capacity, words, True)
    for words, packed, n_keys in [(1, True, 0), (1, True, 25), (1, False, 4617), (2, False, 100), (481, False, 3)]:
        assert emulator.group_shared_need(words, packed, n_keys) == _shared_need(words, packed, n_keys)
    assert [emulator.max_keys(c) for c in (2, 4, 32, 8192)] == [cuda.max_keys(c) for c in (2, 4, 32, 8192)]


@pytest.mark.parametrize("fisher", ["exact", "upstream"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(emulator, case, fisher):
    name, responses, mask, rewards, index = case
    check(emulator, name, normalise_batch(responses, mask, rewards, index), KTAEConfig(fisher=fisher))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_when_groups_overflow_the_shared_table(emulator, case):
    # two slots: every group with more than two distinct ids fills its shared table and spills
    name, responses, mask, rewards, index = case
    batch = normalise_batch(responses, mask, rewards, index)
    check(emulator, name, batch, KTAEConfig(), options=tuned(table_slots=2))


def test_overflowing_groups_take_the_global_pass_in_every_mode(emulator):
    """Tables of 16 slots (12 ids): the groups with more distinct ids leave the shared pass for the global
    one, in the count and rows passes of key_token_scores as in token_advantage, and every result is
    the reference's."""
    name, responses, mask, rewards, index = next(c for c in CASES if c[0] == "G4-mixed-shuffled")
    batch = normalise_batch(responses, mask, rewards, index)
    distinct = reference.key_token_scores(batch, KTAEConfig()).group.bincount(minlength=batch.n_groups)
    room = cuda.max_keys(16)
    assert (distinct > room).any() and (distinct <= room).any()
    ext = Recorder(emulator)
    check(ext, name, batch, KTAEConfig(), options=tuned(table_slots=16))
    # key_token_scores: count, one read, rows; token_advantage: one call; each a shared pass and a
    # global pass of one block per group, nothing read back between them
    n = batch.n_groups
    assert ext.launches == [("count", True, n), ("rows", True, n), ("advantage", True, n)]


def test_a_fallback_with_fewer_blocks_than_groups_takes_them_in_turn(emulator, monkeypatch):
    # every group overflows a 2-slot table; two fallback blocks take 2-3 groups each, reusing their slice
    monkeypatch.setattr(cuda, "FALLBACK_BLOCKS", 2)
    name, responses, mask, rewards, index = next(c for c in CASES if c[0] == "G4-mixed-shuffled")
    batch = normalise_batch(responses, mask, rewards, index)
    check(emulator, name, batch, KTAEConfig(), options=tuned(table_slots=2))


def test_groups_past_the_grid_compute_their_statistics_per_slot(emulator, monkeypatch):
    """With no grid (its bound patched below 16), every slot computes its table's statistics in the
    kernel (the path of groups past 64 rollouts): one static-bound call, no rows first."""
    monkeypatch.setattr(device_state, "GRID_MAX_GROUP", 8)
    name, responses, mask, rewards, index = next(c for c in CASES if c[0] == "G4-mixed-shuffled")
    batch = normalise_batch(responses, mask, rewards, index)
    ext = Recorder(emulator)
    _, advantage = expected(name, batch, KTAEConfig())
    assert cuda.static_plan(emulator, batch, KTAEConfig()).bound is None
    got = cuda.token_advantage(batch, KTAEConfig(), None, launcher=ext)
    torch.testing.assert_close(got, advantage, rtol=0.0, atol=1e-6)
    assert ext.launches == [("advantage", True, 0)]
    assert ext.tables == [(False, True)]  # no grid: the log-factorials


def test_upstream_scores_the_rows_first(emulator):
    """fisher="upstream": the rows (the passes in count and rows modes, their p-values on the host), then
    the same advantage call as exact mode, the rows' scores given in place of the grid."""
    name, responses, mask, rewards, index = next(c for c in CASES if c[0] == "G4-mixed-shuffled")
    batch = normalise_batch(responses, mask, rewards, index)
    ext = Recorder(emulator)
    config = KTAEConfig(fisher="upstream")
    torch.testing.assert_close(cuda.token_advantage(batch, config, None, launcher=ext),
                               expected(name, batch, config)[1], rtol=0.0, atol=1e-6)
    assert [mode for mode, *_ in ext.launches] == ["count", "rows", "advantage"]
    assert ext.tables == [(False, False)] and ext.given_rows == [len(reference.key_token_scores(batch, config))]


def test_writes_into_out(emulator):
    name, responses, mask, rewards, index = CASES[0]
    batch = normalise_batch(responses, mask, rewards, index)
    out = torch.full(responses.shape, float("nan"), dtype=torch.float32)
    got = cuda.token_advantage(batch, KTAEConfig(), None, out, launcher=emulator)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, expected(name, batch, KTAEConfig())[1], rtol=0.0, atol=1e-6)


CONFIGS = [
    KTAEConfig(ignore_token_ids=(0, 3, 7, 2**31 - 1)),
    KTAEConfig(use_tf=False, alpha=0.0, beta=2.0),
    KTAEConfig(alpha=1.0, beta=0.0, top=2.5, weight=-0.5, baseline="mean"),
    KTAEConfig(baseline="none", correct_threshold=0.5, k1=1.2, b=0.75, eps=1e-3),
    KTAEConfig(fisher="upstream", ignore_token_ids=(1, 2), use_tf=False, weight=2.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("name", ["graded-rewards", "token-ids-near-2^31"])
def test_matches_reference_for_other_configs(emulator, name, config):
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    check(emulator, name, normalise_batch(responses, mask, rewards, index), config)


@pytest.mark.parametrize("fisher", ["exact", "upstream"])
def test_given_rollout_advantage(emulator, fisher):
    name, responses, mask, rewards, index = next(c for c in CASES if c[0] == "G4-mixed-shuffled")
    batch = normalise_batch(responses, mask, rewards, index)
    given = torch.linspace(-2.0, 3.0, responses.shape[0], dtype=torch.float64)
    check(emulator, name, batch, KTAEConfig(fisher=fisher), given=given)


def test_zero_scores_are_positive_zeros_as_in_torch(emulator):
    """A row of strength 0 and negative direction scores +0.0, as the method's squash."""
    responses, mask, rewards, index, given = zero_strength_case()
    batch = normalise_batch(responses, mask, rewards, index)
    expected = token_advantage(responses, mask, rewards, index, rollout_advantage=given, backend="torch")
    assert_same_signs(expected, cuda.token_advantage(batch, KTAEConfig(), given, None, ExecutionOptions(),
                                                     launcher=emulator))


def test_launches_reject_bad_arguments_naming_them(emulator, monkeypatch):
    """``pipeline.advantage`` checks what it is given before anything is launched; the arguments of a real
    call, each changed in turn."""
    name, responses, mask, rewards, index = CASES[0]
    batch = normalise_batch(responses, mask, rewards, index)
    calls, advantage = [], pipeline.advantage
    with monkeypatch.context() as m:
        m.setattr(pipeline, "advantage", lambda *args: (calls.append(args), advantage(*args)))
        cuda.token_advantage(batch, KTAEConfig(), None, launcher=emulator)
    launcher, inputs, scoring, shape = calls[0]

    def launch(**changes):
        """The call, the fields in ``changes`` replaced."""
        structs = [dataclasses.replace(s) for s in (inputs, scoring, shape)]
        for field, value in changes.items():
            setattr(next(s for s in structs if hasattr(s, field)), field, value)
        pipeline.advantage(launcher, *structs)

    with pytest.raises(ValueError, match="`members` must be torch.int64"):
        launch(members=inputs.members.int())
    with pytest.raises(ValueError, match="`mask` must have shape"):
        launch(mask=inputs.mask[:, :-1])
    with pytest.raises(ValueError, match=r"`mode` must be 0 \(advantage\), 1 \(count\) or 2 \(rows\), got 3"):
        launch(mode=3)
    with pytest.raises(ValueError, match="`row_offset` and `row_ints` are required in rows mode"):
        launch(mode=cuda.ROWS)
    with pytest.raises(ValueError, match="`nan_on_error`, `slot_index` and the given rows go with the advantage"):
        launch(mode=cuda.COUNT, nan_on_error=True)
    with pytest.raises(ValueError, match="`threads` must be a multiple of 32"):
        launch(threads=48)
    with pytest.raises(ValueError, match="`workspace` must hold"):
        launch(workspace=inputs.workspace[:-1])
    with pytest.raises(ValueError, match="`out` must be set"):  # a field left unset
        launch(out=None)
    with pytest.raises(TypeError):
        pipeline.AdvantageLaunch(threads=64, blocks=1)  # a misspelt field
    with pytest.raises(RuntimeError, match="invalid launch configuration"):  # what the GPU would refuse
        launch(shared_bytes=emulator.max_shared_bytes() + 8)
    launch()  # and the unchanged call runs


def test_table_slots_is_checked(emulator):
    name, responses, mask, rewards, index = CASES[0]
    batch = normalise_batch(responses, mask, rewards, index)
    for bad in (0, 3, 48, True, 2.0):
        with pytest.raises(ValueError, match="CudaTuning.table_slots must be a power of two"):
            tuned(table_slots=bad)
    with pytest.raises(ValueError, match="`table_slots` = 65536 needs"):
        cuda.key_token_scores(batch, KTAEConfig(), tuned(table_slots=65536), launcher=emulator)


def test_long_rollouts_use_blocks_of_more_than_512_threads(emulator):
    # L = 3072: 768 threads a block (one pass of 4 tokens each), as the paper batch on a GPU
    responses, mask, rewards, index = make_batch(np.random.default_rng(9), [3, 2], 3072, 400)
    batch = normalise_batch(responses, mask, rewards, index)
    assert cuda.block_threads(batch.responses.shape[1]) == 768
    check(emulator, "long-rollouts", batch, KTAEConfig())


@pytest.mark.parametrize("variant", [KernelVariant(), *VARIANTS], ids=str)
@pytest.mark.parametrize("bad, message", [(-5, r"token ids >= 0 where the mask is 1, found -7"),
                                          (2**31, r"token ids must be < 2\*\*31, found 2147483650")])
def test_token_id_range_is_checked_by_the_kernels(emulator, bad, message, variant):
    """The API leaves the id check to the backend (``checks_token_ids``): same errors in every kernel
    variant, padding ignored (at a rollout's end and inside a tile)."""
    from ktae_kernels.registry import backend_spec

    assert backend_spec("cuda").checks_token_ids
    ext, options = launcher_of(variant, emulator), tuned(variant=variant)
    name, responses, mask, rewards, index = CASES[0]
    responses, mask = responses.clone(), mask.clone()
    mask[0, -1] = mask[3, 1] = False
    responses[0, -1], responses[3, 1] = -(2**40), 2**40  # under mask 0: never read
    batch = normalise_batch(responses, mask, rewards, index, check_ids=False)
    torch.testing.assert_close(cuda.token_advantage(batch, KTAEConfig(), None, None, options, launcher=ext),
                               reference.token_advantage(batch, KTAEConfig(), None), rtol=0.0, atol=1e-6)
    mask[1, 0] = mask[2, 1] = True
    responses[1, 0], responses[2, 1] = bad, bad - 2 if bad < 0 else bad + 2
    batch = normalise_batch(responses, mask, rewards, index, check_ids=False)
    for config in (KTAEConfig(), KTAEConfig(fisher="upstream")):
        with pytest.raises(ValueError, match=message):
            cuda.token_advantage(batch, config, None, None, options, launcher=ext)
        with pytest.raises(ValueError, match=message):
            cuda.key_token_scores(batch, config, options, launcher=ext)


@pytest.mark.parametrize("packed, blocks_per_sm", [(False, 1), (True, 2), (False, 2)])
@pytest.mark.parametrize("name", ["G16-zipf", "G4-mixed-shuffled", "huge-counts"])
def test_slot_layouts_and_two_blocks_per_sm(emulator, name, packed, blocks_per_sm):
    # the wide layout where the packed one is the default, and tables sized for two blocks per SM
    tuning = CudaTuning(packed=packed, blocks_per_sm=blocks_per_sm)
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    batch = normalise_batch(responses, mask, rewards, index)
    assert cuda.static_plan(emulator, batch, KTAEConfig(), tuning).packed == packed
    check(emulator, name, batch, KTAEConfig(), options=ExecutionOptions(cuda=tuning))
    check(emulator, name, batch, KTAEConfig(), options=tuned(table_slots=16, packed=packed,
                                                                   blocks_per_sm=blocks_per_sm))


def test_counts_past_16_bits_take_the_wide_slot(emulator):
    """A group of 99,000 masked tokens (one id, 66,000 times in correct rollouts): past
    ``PACKED_MAX_TOKENS`` the kernels keep 32-bit counters, whatever ``CudaTuning.packed`` allows."""
    B, L = 3, 33_000
    batch = normalise_batch(torch.zeros(B, L, dtype=torch.int64), torch.ones(B, L, dtype=torch.bool),
                            torch.tensor([1.0, 1.0, 0.0]), torch.zeros(B, dtype=torch.int64))
    assert B * L > cuda.PACKED_MAX_TOKENS and cuda.static_plan(emulator, batch, KTAEConfig()).packed
    check(emulator, "one-id-99000-times", batch, KTAEConfig())


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, 2.0)])
def test_statistics_kernel_on_every_table_up_to_16_rollouts(emulator, alpha, beta):
    """The CUDA statistics kernel against ``method.table_statistics`` (closeness: statistics_cases.py)."""
    from ktae_kernels.backends.device import grid_tables
    from statistics_cases import assert_matches_method

    grid = grid_tables(16, torch.device("cpu"))
    assert_matches_method(cuda.GridKernel(emulator)(grid, alpha, beta), grid, KTAEConfig(alpha=alpha, beta=beta))


def test_statistics_kernel_on_random_big_tables_and_ties(emulator):
    from statistics_cases import assert_matches_method, big_tables

    grid = big_tables(seed=1, count=2000)
    assert_matches_method(cuda.GridKernel(emulator)(grid, 1.0, 1.0), grid, KTAEConfig())


def test_statistics_kernel_is_checked_against_its_own_tables(emulator):
    """As on a GPU, whose libdevice gives log-factorials and angles a last bit off the CPU's: the kernel
    matches the reference built from the tables it was given (tests/statistics_cases.py)."""
    from ktae_kernels.backends.device import grid_tables
    from statistics_cases import assert_matches_method, with_last_bit_noise

    noisy = with_last_bit_noise(grid_tables(16, torch.device("cpu")))
    assert_matches_method(cuda.GridKernel(emulator)(noisy, 1.0, 1.0), noisy, KTAEConfig())


def test_statistics_launch_rejects_bad_arguments_naming_them(emulator):
    from ktae_kernels.backends.device import grid_tables

    grid = grid_tables(16, torch.device("cpu"))
    args = dict(cells=grid.cells, log_factorial=grid.log_factorial, angle=grid.angle, constants=[0.0] * 6,
                out=torch.empty(5, grid.size, dtype=torch.float64))
    with pytest.raises(ValueError, match="`cells` must be torch.int32"):
        pipeline.table_statistics(emulator, **dict(args, cells=grid.cells.long()))
    with pytest.raises(ValueError, match="`out` must have shape"):
        pipeline.table_statistics(emulator, **dict(args, out=torch.empty(5, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match="`constants` must be"):
        pipeline.table_statistics(emulator, **dict(args, constants=[0.0]))


@pytest.mark.parametrize("bad, message", [(-7, r"token ids >= 0 where the mask is 1, found -7"),
                                          (2**31 + 5, r"token ids must be < 2\*\*31, found 2147483653")])
@pytest.mark.parametrize("slots", [None, 2], ids=["shared", "global"])
@pytest.mark.parametrize("variant", [KernelVariant(), *VARIANTS], ids=str)
def test_bad_ids_leave_out_untouched(emulator, bad, message, slots, variant):
    """The scan pass flags the id before any table pass runs, and the table passes (shared and global)
    write nothing when it is set, in every kernel variant: the ValueError comes from the one read after
    the launches, and a caller's ``out`` is exactly as it was."""
    emulator = launcher_of(variant, emulator)
    name, responses, mask, rewards, index = CASES[0]
    responses, mask = responses.clone(), mask.clone()
    mask[1, 0] = True
    responses[1, 0] = bad
    batch = normalise_batch(responses, mask, rewards, index, check_ids=False)
    tuning = CudaTuning(table_slots=slots, variant=variant)
    plan = cuda.static_plan(emulator, batch, KTAEConfig(), tuning)
    assert plan is not None and (plan.fallback_blocks > 0) == (slots is not None)
    out = torch.full(responses.shape, float("nan"), dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        cuda.token_advantage(batch, KTAEConfig(), None, out, ExecutionOptions(cuda=tuning), launcher=emulator)
    assert torch.isnan(out).all(), "a table pass wrote `out` although an id was out of range"
    # the same `out` afterwards, with the id fixed: every position written
    responses[1, 0] = 5
    batch = normalise_batch(responses, mask, rewards, index)
    cuda.token_advantage(batch, KTAEConfig(), None, out, ExecutionOptions(cuda=tuning), launcher=emulator)
    torch.testing.assert_close(out, reference.token_advantage(batch, KTAEConfig(), None), rtol=0.0, atol=1e-6)


BOOKKEEPING_CASES = ["G4-mixed-shuffled", "graded-rewards", "one-rollout-groups", "all-masked-rollouts", "G40-two-words"]


@pytest.mark.parametrize("baseline", ["grpo", "mean", "none"])
@pytest.mark.parametrize("name", BOOKKEEPING_CASES)
def test_device_bookkeeping_matches_method_bitwise(emulator, name, baseline):
    """The scan and groups passes against method.group_stats and method.rollout_advantage: integer
    columns, flags and offsets equal, and A_i bitwise (sums in index order, products rounded alone)."""
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    batch = normalise_batch(responses, mask, rewards, index)
    config = KTAEConfig(baseline=baseline)
    plan = cuda.static_plan(emulator, batch, config)
    out = torch.empty(responses.shape, dtype=torch.float32)
    views = cuda.workspace_views(cuda.enqueue(plan, batch, config, None, out, None)[1], responses.shape[0],
                                 batch.n_groups)
    stats = method.group_stats(batch, config)
    assert views["flags"][[0, 1, 4, 5]].tolist() == [0, 0, 0, 0]  # no bad input, no group left to the global pass
    assert torch.equal(views["correct"], stats.correct)
    assert torch.equal(views["lengths"], stats.lengths)
    positions = torch.arange(responses.shape[1]) + 1
    assert torch.equal(views["extent"], (batch.mask * positions).amax(1) if responses.shape[1] else views["extent"])
    assert torch.equal(views["starts"], torch.cat([torch.zeros(1, dtype=torch.int64), stats.size.cumsum(0)]))
    assert torch.equal(views["group_counts"], torch.stack([stats.n_c, stats.n_w, stats.T_c, stats.T_w]))
    assert torch.equal(views["base"], method.rollout_advantage(batch.rewards, batch.group, stats.size, config, None))
    assert bool((views["status"] >= 0).all())


def test_given_correct_labels_and_rollout_advantage(emulator):
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == "G4-mixed-shuffled")
    correct = torch.arange(responses.shape[0]) % 3 == 1
    batch = normalise_batch(responses, mask, rewards, index, correct=correct)
    given = torch.linspace(-1.0, 2.0, responses.shape[0], dtype=torch.float64)
    for g in (None, given):
        torch.testing.assert_close(cuda.token_advantage(batch, KTAEConfig(), g, launcher=emulator),
                                   reference.token_advantage(batch, KTAEConfig(), g), rtol=0.0, atol=1e-6)
    plan = cuda.static_plan(emulator, batch, KTAEConfig())
    views = cuda.workspace_views(cuda.enqueue(plan, batch, KTAEConfig(), None, torch.empty(responses.shape), None)[1],
                                 responses.shape[0], batch.n_groups)
    assert torch.equal(views["correct"], correct)
    assert torch.equal(views["group_counts"][0], method.group_stats(batch, KTAEConfig()).n_c)


def _one_diverse_group(seed: int = 3):
    """An adversarial batch for static sizing: one group of 3 rollouts holding ~600 distinct ids (near
    2^31 as well), beside 40 one-rollout groups of one id each, some padding inside the rollouts."""
    rng = np.random.default_rng(seed)
    L = 240
    big = torch.as_tensor(rng.integers(0, 2**31 - 1, size=(3, L)))
    big[:, ::7] = 2**31 - 1
    small = torch.full((40, L), 11, dtype=torch.int64)
    responses = torch.cat([big, small])
    mask = torch.ones_like(responses, dtype=torch.bool)
    mask[0, 200:] = False
    mask[1, 10:20] = False
    mask[3:, 3:] = False
    rewards = torch.as_tensor(rng.random(43) < 0.5, dtype=torch.float64)
    index = torch.cat([torch.zeros(3, dtype=torch.int64), torch.arange(1, 41)])
    return normalise_batch(responses, mask, rewards, index)


@pytest.mark.parametrize("slots, fallback_bytes", [(None, None), (32, None), (32, 8 * 1024), (64, 4096)],
                         ids=["default", "shared-32", "partitions", "many-partitions"])
def test_one_group_holding_every_distinct_id(emulator, monkeypatch, slots, fallback_bytes):
    """Static sizing knows only B, L and the number of groups (largest group <= B - n + 1): the group
    of ~600 distinct ids takes the shared table, or spills to a global slice, or, where even the slice
    is too small (patched STATIC_FALLBACK_BYTES), is counted in 2, 4, ... hash partitions."""
    batch = _one_diverse_group()
    if fallback_bytes is not None:
        monkeypatch.setattr(cuda, "STATIC_FALLBACK_BYTES", fallback_bytes)
    tuning = CudaTuning(table_slots=slots)
    plan = cuda.static_plan(emulator, batch, KTAEConfig(), tuning)
    assert plan.largest == 3 and (plan.fallback_blocks > 0) == (slots is not None)
    distinct = int(torch.unique(batch.responses[:3][batch.mask[:3]]).numel())
    if fallback_bytes is not None:
        slice_slots = plan.fallback_bytes // plan.fallback_blocks // 12
        assert cuda.max_keys(1 << (slice_slots.bit_length() - 1)) < distinct  # more ids than a slice holds
    want = reference.token_advantage(batch, KTAEConfig(), None)
    got = cuda.token_advantage(batch, KTAEConfig(), None, None, ExecutionOptions(cuda=tuning), launcher=emulator)
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("sizes, length", [([128, 100], 6), ([1024], 3)], ids=["G128", "G1024"])
def test_big_groups(emulator, sizes, length):
    """Groups of 128 and 1024 rollouts (4 and 32 presence words a slot; past the device grid's bound, so
    token_advantage computes each slot's table statistics in the kernel and key_token_scores those of
    the rows' tables on the host), shuffled, against the reference; the groups of 128 also with small
    tables."""
    batch = normalise_batch(*make_batch(np.random.default_rng(11), sizes, length, 60, shuffle=True))
    name = f"G{sizes[0]}-big"
    check(emulator, name, batch, KTAEConfig())
    if sizes[0] < 1024:
        check(emulator, name, batch, KTAEConfig(), options=tuned(table_slots=32))


@pytest.mark.parametrize("name", ["G4-mixed-shuffled", "G40-two-words", "all-masked-rollouts"])
def test_global_pass_alone_takes_every_group(emulator, name):
    """No shared-table pass at all (shared_bytes 0): the groups pass marks every group not done, and
    a global pass of two blocks takes them in turn, each in its slice."""
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    batch = normalise_batch(responses, mask, rewards, index)
    plan = cuda.static_plan(emulator, batch, KTAEConfig())
    plan = dataclasses.replace(plan, shared_bytes=0, fallback_blocks=2, fallback_bytes=2 * 64 * 1024)
    out = torch.full(responses.shape, float("nan"), dtype=torch.float32)
    views = cuda.workspace_views(cuda.enqueue(plan, batch, KTAEConfig(), None, out, None)[1], responses.shape[0],
                                 batch.n_groups)
    assert bool((views["status"] >= 0).all())
    torch.testing.assert_close(out, expected(name, batch, KTAEConfig())[1], rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("name", ["G16-zipf", "G40-two-words", "token-ids-near-2^31", "all-masked-rollouts"])
@pytest.mark.parametrize("slot_index", [True, False])
def test_gather_from_the_slot_index_or_the_ids(emulator, name, slot_index):
    """The shared pass's gather reads the slots its build recorded (2 bytes a position) or the ids
    again: the same advantages; the index holds every masked position's slot and nothing else."""
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    batch = normalise_batch(responses, mask, rewards, index)
    tuning = CudaTuning(slot_index=slot_index)
    plan = cuda.static_plan(emulator, batch, KTAEConfig(), tuning)
    assert plan.slot_index == slot_index
    out = torch.empty(responses.shape, dtype=torch.float32)
    workspace = cuda.enqueue(plan, batch, KTAEConfig(), None, out, None)[1]
    torch.testing.assert_close(out, expected(name, batch, KTAEConfig())[1], rtol=0.0, atol=1e-6)
    B, L = responses.shape
    assert workspace.numel() == cuda.advantage_workspace_size(B, batch.n_groups, plan.fallback_bytes,
                                                              B * L if slot_index else 0)
    if slot_index and B * L:
        start = cuda.advantage_workspace_size(B, batch.n_groups, plan.fallback_bytes)
        slots = workspace[start:].view(torch.int16)[: B * L].view(B, L).long() & 0xFFFF
        extent = cuda.workspace_views(workspace, B, batch.n_groups)["extent"]
        written = torch.arange(L)[None, :] < extent[:, None]
        assert torch.equal(slots[written] != 0xFFFF, batch.mask[written])
        # one slot per (rollout's group, id): equal ids of a group share it
        for g in range(batch.n_groups):
            rows = (batch.group == g)[:, None] & batch.mask
            pairs = torch.unique(torch.stack([batch.responses[rows], slots[rows]]), dim=1)
            assert pairs.shape[1] == torch.unique(batch.responses[rows]).numel() == torch.unique(slots[rows]).numel()


def learnt(batch):
    """What the calls of ``batch``'s layout taught the cuda backend (``DeviceState.learnt``)."""
    return device_state.state(batch.device).learnt(("cuda", batch.responses.shape[0], batch.n_groups))


def _shared_need(words: int, packed: bool, n_keys: int) -> int:
    """Shared bytes of a group's table in its layout, sized for ``n_keys`` ids (``group_shared_need``)."""
    return cuda.shared_table_bytes(cuda.table_capacity(n_keys), words, packed)


def _distinct_per_group(batch) -> list[int]:
    """Distinct masked ids of each group (torch.unique on the host)."""
    return [int(torch.unique(batch.responses[(batch.group == g)[:, None] & batch.mask]).numel())
            for g in range(batch.n_groups)]


def test_shared_tables_follow_the_distinct_ids_seen(emulator):
    """Two groups of 4 x 40 tokens, each holding ids 0-2 only: the first call sizes the tables by masked
    tokens (the largest possible group, 7 x 40, 512 slots; no global pass), and its flags carry the most
    distinct ids a group held (3). The next call of this (B, n_groups) caps the shared tables at the
    slots for 3 ids (32, the least) and adds the global pass for groups that hold more; its 400 bytes of
    shared memory (the need read back: 32 packed slots) fit half an SM, so two blocks share one. Then a
    group of 160 distinct ids overflows the 32 slots, the global pass takes it, the result is exact,
    and the count read back (160) sizes the call after (256 slots)."""
    responses, mask, rewards, index = distinct_and_repeated_groups()
    distinct = normalise_batch(responses, mask, rewards, index)
    responses = responses.clone()
    responses[:4] = responses[4:]
    repeated = normalise_batch(responses, mask, rewards, index)
    first = cuda.static_plan(emulator, repeated, KTAEConfig())
    assert (first.max_capacity, first.fallback_blocks, first.key) == (2**30, 0, ("cuda", 8, 2))
    assert first.shared_bytes == cuda.shared_table_bytes(512, 1)
    out = torch.empty(responses.shape, dtype=torch.float32)
    views = cuda.workspace_views(cuda.enqueue(first, repeated, KTAEConfig(), None, out, None)[1], 8, 2)
    assert views["status"].tolist() == _distinct_per_group(repeated) == [3, 3]
    assert views["flags"][2:4].tolist() == [3, _shared_need(1, True, 3)]  # the most distinct ids, shared need
    torch.testing.assert_close(out, reference.token_advantage(repeated, KTAEConfig(), None), rtol=0.0, atol=1e-6)

    cuda.token_advantage(repeated, KTAEConfig(), None, launcher=emulator)  # reads the flags back
    assert learnt(repeated).distinct == 3
    sized = cuda.static_plan(emulator, repeated, KTAEConfig())
    assert (sized.max_capacity, sized.fallback_blocks, sized.blocks_per_sm) == (32, 2, 2)
    assert sized.shared_bytes == cuda.shared_table_bytes(32, 1, packed=True) == 400
    out = torch.empty(responses.shape, dtype=torch.float32)
    views = cuda.workspace_views(cuda.enqueue(sized, distinct, KTAEConfig(), None, out, None)[1], 8, 2)
    assert views["status"].tolist() == _distinct_per_group(distinct) == [160, 3]
    assert views["flags"][2:5].tolist() == [160, _shared_need(1, True, 160), 1]  # (1 group left to the global pass)
    torch.testing.assert_close(out, reference.token_advantage(distinct, KTAEConfig(), None), rtol=0.0, atol=1e-6)

    recorder = Recorder(emulator)
    got = cuda.token_advantage(distinct, KTAEConfig(), None, launcher=recorder)
    assert recorder.launches == [("advantage", True, 2)]
    torch.testing.assert_close(got, reference.token_advantage(distinct, KTAEConfig(), None), rtol=0.0, atol=1e-6)
    assert learnt(distinct).distinct == 160
    after = cuda.static_plan(emulator, distinct, KTAEConfig())
    assert (after.max_capacity, after.fallback_blocks) == (256, 2)


@pytest.mark.parametrize("name", ["G16-zipf", "G40-two-words", "token-ids-near-2^31", "all-masked-rollouts",
                                  "one-rollout-groups"])
def test_second_call_sized_by_the_distinct_ids_of_the_first(emulator, name):
    """A case's second call sizes its shared tables by the first call's largest distinct count: the same
    advantages as the reference; the count read back is the largest group's distinct ids."""
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    batch = normalise_batch(responses, mask, rewards, index)
    want = expected(name, batch, KTAEConfig())[1]
    for _ in range(2):
        got = cuda.token_advantage(batch, KTAEConfig(), None, launcher=emulator)
        torch.testing.assert_close(got, want, rtol=0.0, atol=1e-6)
    most = max(_distinct_per_group(batch), default=0)
    assert (learnt(batch) is None) if most == 0 else (learnt(batch).distinct == most)


def _most_shared_need(batch) -> int:
    """The shared-need flag a call of ``batch`` should read back: the largest group's table in its own
    layout (presence words, packed when one word and < 2^16 masked tokens), sized for its distinct ids."""
    sizes = torch.bincount(batch.group, minlength=batch.n_groups).tolist()
    tokens = torch.zeros(batch.n_groups, dtype=torch.int64).index_add_(0, batch.group, batch.mask.sum(1)).tolist()
    return max(_shared_need(cuda.presence_words(g), cuda.presence_words(g) == 1 and t <= cuda.PACKED_MAX_TOKENS, d)
               for g, t, d in zip(sizes, tokens, _distinct_per_group(batch)))


@pytest.mark.parametrize("name", ["G16-zipf", "G40-two-words", "G4-mixed-shuffled"])
def test_second_call_runs_two_blocks_per_sm_and_matches(emulator, name):
    """The flags of a case's first call carry the most shared memory a group's table needed; the next
    call of the shape reserves that (below half an SM) with at most 512 threads, and still equals the
    reference."""
    _, responses, mask, rewards, index = next(c for c in CASES if c[0] == name)
    batch = normalise_batch(responses, mask, rewards, index)
    want = expected(name, batch, KTAEConfig())[1]
    B, L = responses.shape
    first = cuda.static_plan(emulator, batch, KTAEConfig())
    assert first.blocks_per_sm == 1
    out = torch.empty(B, L, dtype=torch.float32)
    views = cuda.workspace_views(cuda.enqueue(first, batch, KTAEConfig(), None, out, None)[1], B, batch.n_groups)
    need = _most_shared_need(batch)
    assert views["flags"][3] == need and need <= cuda.shared_limit(emulator.max_shared_bytes(), 2)
    torch.testing.assert_close(out, want, rtol=0.0, atol=1e-6)

    cuda.token_advantage(batch, KTAEConfig(), None, launcher=emulator)  # reads the flags back
    assert learnt(batch).shared_need == need
    second = cuda.static_plan(emulator, batch, KTAEConfig())
    assert second.blocks_per_sm == 2 and second.shared_bytes == min(need, first.shared_bytes)
    recorder = Recorder(emulator)
    torch.testing.assert_close(cuda.token_advantage(batch, KTAEConfig(), None, launcher=recorder), want,
                               rtol=0.0, atol=1e-6)
    assert recorder.shapes == [(second.shared_bytes, second.threads)] and second.threads <= 512


def _grown_group_batches(big_vocab: int):
    """Two batches of 64 rollouts x 24 in 4 groups, ids below 20 unless said: groups of 16, then groups
    of 48, 6, 5, 5 whose group of 48 (two presence words, 20-byte slots) draws its ids from
    ``big_vocab`` ids."""
    rng = np.random.default_rng(21)
    mask = torch.as_tensor(rng.random((64, 24)) >= 0.1)
    rewards = torch.as_tensor((rng.random(64) < 0.5).astype(np.float32))
    responses = torch.as_tensor(rng.integers(0, 20, size=(64, 24)))
    even = normalise_batch(responses, mask, rewards, torch.arange(64) // 16)
    grown = responses.clone()
    grown[:48] = torch.as_tensor(rng.permutation(big_vocab)[rng.integers(0, min(big_vocab, 2000), size=(48, 24))])
    index = torch.repeat_interleave(torch.arange(4), torch.tensor([48, 6, 5, 5]))
    return even, normalise_batch(grown, mask, rewards, index)


@pytest.mark.parametrize("big_vocab", [20, 10**5])
def test_a_group_needing_more_than_the_two_block_tables_takes_the_global_pass(emulator, big_vocab):
    """After groups of 16 (at most 20 ids: 32 packed slots, 400 bytes), the same (B, n_groups) with a
    group of 48 rollouts: its 20-byte slots leave 16 slots in the 400 bytes (12 ids), fewer than its
    ids (20, or hundreds drawn from a large vocabulary), so it leaves the shared pass (status -1 without
    the global pass), the global pass redoes it and the result equals the reference; the need read
    back then sizes the next call (still two blocks per SM)."""
    even, grown = _grown_group_batches(big_vocab)
    torch.testing.assert_close(cuda.token_advantage(even, KTAEConfig(), None, launcher=emulator),
                               reference.token_advantage(even, KTAEConfig(), None), rtol=0.0, atol=1e-6)
    assert learnt(even).shared_need == _most_shared_need(even) == 400

    plan = cuda.static_plan(emulator, grown, KTAEConfig())
    assert (plan.blocks_per_sm, plan.shared_bytes, plan.max_capacity) == (2, 400, 32) and plan.fallback_blocks > 0
    out = torch.zeros(64, 24, dtype=torch.float32)
    alone = dataclasses.replace(plan, fallback_blocks=0, fallback_bytes=0)
    status = cuda.workspace_views(cuda.enqueue(alone, grown, KTAEConfig(), None, out, None)[1], 64, 4)["status"]
    assert status.tolist() == [-1] + _distinct_per_group(grown)[1:]
    want = reference.token_advantage(grown, KTAEConfig(), None)
    torch.testing.assert_close(cuda.token_advantage(grown, KTAEConfig(), None, launcher=emulator), want,
                               rtol=0.0, atol=1e-6)
    need = _most_shared_need(grown)
    assert learnt(grown).shared_need == need > 400 and _distinct_per_group(grown)[0] > 12
    after = cuda.static_plan(emulator, grown, KTAEConfig())
    assert (after.blocks_per_sm, after.shared_bytes) == (2, need)
    torch.testing.assert_close(cuda.token_advantage(grown, KTAEConfig(), None, launcher=emulator), want,
                               rtol=0.0, atol=1e-6)


def test_a_group_whose_smallest_table_has_no_room_takes_the_global_pass(emulator):
    """After groups of 25 rollouts holding 40 ids (64 packed slots learnt), the same (B, n_groups) with
    a group of 97 rollouts: its 28-byte slots leave no room for even the 32 slots a group may take
    in the shared pass, so the block leaves the group to the global pass before building anything, and
    the result equals the reference."""
    rng = np.random.default_rng(5)
    B, L = 100, 16
    mask = torch.as_tensor(rng.random((B, L)) >= 0.1)
    rewards = torch.as_tensor((rng.random(B) < 0.5).astype(np.float32))
    responses = torch.as_tensor(rng.integers(0, 40, size=(B, L)))
    even = normalise_batch(responses, mask, rewards, torch.arange(B) // 25)
    wide = normalise_batch(responses, mask, rewards, torch.repeat_interleave(torch.arange(4), torch.tensor([97, 1, 1, 1])))
    few = ExecutionOptions(cuda=CudaTuning(max_threads=64))  # fewer emulated threads: quicker
    torch.testing.assert_close(cuda.token_advantage(even, KTAEConfig(), None, options=few, launcher=emulator),
                               reference.token_advantage(even, KTAEConfig(), None), rtol=0.0, atol=1e-6)
    plan = cuda.static_plan(emulator, wide, KTAEConfig(), few.cuda)
    words = cuda.presence_words(97)
    assert plan.blocks_per_sm == 2 and plan.max_capacity > cuda.MIN_CAPACITY and plan.fallback_blocks > 0
    assert cuda.shared_table_bytes(cuda.MIN_CAPACITY, words) > plan.shared_bytes  # no room for the least table
    out = torch.zeros(B, L, dtype=torch.float32)
    alone = dataclasses.replace(plan, fallback_blocks=0, fallback_bytes=0)
    views = cuda.workspace_views(cuda.enqueue(alone, wide, KTAEConfig(), None, out, None)[1], B, 4)
    assert views["status"][0] == -1 and views["flags"][4] == 1  # left, counted as left
    torch.testing.assert_close(cuda.token_advantage(wide, KTAEConfig(), None, options=few, launcher=emulator),
                               reference.token_advantage(wide, KTAEConfig(), None), rtol=0.0, atol=1e-6)


def test_largest_groups_first_changes_no_bit(emulator):
    """``CudaTuning(largest_first=True)``: the table passes take the groups by masked tokens, most first;
    advantages and rows bitwise those of the default order, with the shared tables and with the global
    pass alone (``table_slots`` too small for the big groups)."""
    batch = normalise_batch(*make_batch(np.random.default_rng(21), [9, 2, 5, 1, 7, 3], 40, 80, shuffle=True))
    ext = Recorder(emulator)
    for extra in ({}, {"table_slots": 32}):
        want = cuda.token_advantage(batch, KTAEConfig(), None, launcher=ext, options=tuned(**extra))
        got = cuda.token_advantage(batch, KTAEConfig(), None, launcher=ext, options=tuned(largest_first=True, **extra))
        assert torch.equal(got, want)
        rows = cuda.key_token_scores(batch, KTAEConfig(), tuned(largest_first=True, **extra), launcher=ext)
        assert_scores_match(cuda.key_token_scores(batch, KTAEConfig(), tuned(**extra), launcher=ext), rows)
    assert any(a[0].group_order for (name, *_), a in zip(ext.kernels, ext.args) if name.startswith("ktae::dynamic"))


def test_the_table_passes_take_the_groups_in_group_order(emulator, monkeypatch):
    """The order the passes read is the one they follow: an order that lists group 0 for every block
    leaves the other groups unwritten."""
    batch = normalise_batch(*make_batch(np.random.default_rng(22), [3, 4, 2], 16, 30))
    counts = torch.tensor([[2, 1, 1], [1, 3, 1], [10, 5, 8], [4, 20, 1]])
    assert pipeline.group_order(counts).tolist() == [1, 0, 2]  # 25, 14, 9 masked tokens
    monkeypatch.setattr(pipeline, "group_order", lambda c: torch.zeros(c.shape[1], dtype=torch.int64))
    out = torch.full(tuple(batch.responses.shape), 7.0)
    cuda.token_advantage(batch, KTAEConfig(), None, out, tuned(largest_first=True), launcher=emulator)
    assert bool((out[3:] == 7.0).all()) and not bool((out[:3] == 7.0).all())



def _same_scores(want, got) -> None:
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else np.array_equal(a, b), field.name


@pytest.mark.parametrize("variant", VARIANTS, ids=["unroll2-lanes-alone-no-load-ahead", "unroll8"])
def test_every_kernel_variant_computes_the_same_bits(emulator, variant):
    """A ``KernelVariant`` changes how many loads a thread has in flight, whether a warp's lanes merge
    their ids and whether the next step's lines are asked of L2, never a bit: advantages and rows
    ``torch.equal`` to the default variant's over the shared cases, with shared tables and with tables
    too small (the global pass, hash partitions), both Fisher modes, and long rollouts in blocks of 64
    threads (many steps a rollout, the load-ahead across steps and rollouts)."""
    from emulator import load

    ext = load(variant)
    runs = [(case, {}) for case in CASES] + [(case, {"table_slots": 32}) for case in CASES]
    rng = np.random.default_rng(31)
    runs.append((("long-rollouts", *make_batch(rng, [5, 3, 40], 1500, 400, zipf=True, shuffle=True)),
                 {"max_threads": 64}))
    for (name, responses, mask, rewards, index), extra in runs:
        batch = normalise_batch(responses, mask, rewards, index)
        for fisher in ("exact", "upstream") if not extra else ("exact",):
            config = KTAEConfig(fisher=fisher)
            want = cuda.token_advantage(batch, config, None, None, tuned(**extra), launcher=emulator)
            got = cuda.token_advantage(batch, config, None, None, tuned(variant=variant, **extra), launcher=ext)
            assert torch.equal(got, want), (name, extra, fisher)
        _same_scores(cuda.key_token_scores(batch, KTAEConfig(), tuned(**extra), launcher=emulator),
                     cuda.key_token_scores(batch, KTAEConfig(), tuned(variant=variant, **extra), launcher=ext))


def test_a_launcher_runs_only_the_variant_it_was_compiled_for(emulator):
    batch = normalise_batch(*make_batch(np.random.default_rng(5), [3, 2], 8, 10))
    with pytest.raises(ValueError, match=r"`launcher` runs the kernels of KernelVariant\(unroll=4.*"
                                         r"`options.cuda.variant` asks for KernelVariant\(unroll=2"):
        cuda.token_advantage(batch, KTAEConfig(), None, None, tuned(variant=KernelVariant(unroll=2)),
                             launcher=emulator)
