"""The Triton pipeline (``backends/triton/pipeline.py``): its flags, sizes and retries, on CUDA or on the
CPU in Triton's interpreter (small shapes). Each test checks how a call ran (the flags, the tries, the
sizes learnt) as well as its result, against the reference backend.
"""
import numpy as np
import pytest
import torch

from cases import adversarial_cases, distinct_and_repeated_groups, make_batch, random_cases
from ktae_kernels import KTAEConfig, TritonTuning, key_token_scores, token_advantage

pytest.importorskip("triton")

from ktae_kernels.backends import device as device_state  # noqa: E402
from ktae_kernels.backends.triton import pipeline  # noqa: E402
from ktae_kernels.validation import normalise_batch  # noqa: E402

TUNING = TritonTuning()


@pytest.fixture
def tries(monkeypatch):
    """The sizes of every table build, in order (one per try)."""
    built = []
    build = pipeline.build

    def recording(batch, config, sizes, tuning, grpo=False):
        built.append(sizes)
        return build(batch, config, sizes, tuning, grpo)

    monkeypatch.setattr(pipeline, "build", recording)
    return built


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def first_try(responses, mask, rewards, index, device, config=KTAEConfig(), tuning=TUNING):
    """The flags of a first try sized as the API's call would (what this layout learnt), and its run."""
    batch = normalise_batch(*on(device, responses, mask, rewards, index), check_ids=False)
    run = pipeline.build(batch, config, pipeline.first_sizes(batch, tuning, True), tuning)
    pipeline.score(run, config, device)
    return run, run.read()[0]


def reference(responses, mask, rewards, index, config=KTAEConfig(), given=None):
    return token_advantage(responses, mask, rewards, index, config=config, backend="reference",
                           rollout_advantage=given)


def assert_matches(responses, mask, rewards, index, device, config=KTAEConfig(), given=None, tuning=TUNING):
    got = token_advantage(*on(device, responses, mask, rewards, index), config=config, backend="triton",
                          rollout_advantage=None if given is None else given.to(device),
                          options=pipeline_options(tuning))
    torch.testing.assert_close(got.cpu(), reference(responses, mask, rewards, index, config, given),
                               rtol=0, atol=1e-6)


def pipeline_options(tuning):
    from ktae_kernels import ExecutionOptions

    return ExecutionOptions(triton=tuning)


def learnt(device, B, n_groups):
    return device_state.state(device).learnt(("triton", B, n_groups))


CASES = random_cases(seed=20, small=True)[:2] + [c for c in adversarial_cases(small=True)
                                                 if c[0] in ("fisher-ties", "token-ids-near-2^31", "huge-counts",
                                                             "everything-masked", "one-rollout-groups")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_small_batches_complete_in_one_try(case, device, tries):
    _, responses, mask, rewards, index = case
    assert_matches(responses, mask, rewards, index, device)
    assert len(tries) == 1 and not tries[0].safe


@pytest.mark.parametrize("baseline", ["grpo", "mean", "none", "given", "correct-labels"])
def test_baselines_and_labels_on_the_device(baseline, device, tries):
    """GRPO mean / std, mean, none, a given A_i, and caller ``correct`` labels, all on the device."""
    _, responses, mask, rewards, index = random_cases(seed=21, small=True)[1]
    given = torch.linspace(-1.0, 2.0, responses.shape[0], dtype=torch.float64) if baseline == "given" else None
    config = KTAEConfig(baseline=baseline if baseline in ("grpo", "mean", "none") else "grpo", weight=2.0,
                        correct_threshold=0.3, eps=1e-3, ignore_token_ids=(3, 2**31 - 1))
    if baseline == "correct-labels":
        correct = torch.arange(responses.shape[0]) % 2 == 0
        got = token_advantage(*on(device, responses, mask, rewards, index), correct=correct.to(device),
                              config=config, backend="triton")
        want = token_advantage(responses, mask, rewards, index, correct=correct, config=config, backend="reference")
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6)
    else:
        assert_matches(responses, mask, rewards, index, device, config, given)
    assert len(tries) == 1


def test_one_group_holding_every_distinct_id_is_rebuilt_on_the_device(device, tries):
    """One group of all-distinct ids (far past its first table) beside a group of three ids: the
    device rebuild takes it, in the first try, and only that group is marked."""
    responses, mask, rewards, index = distinct_and_repeated_groups()
    run, flags = first_try(responses, mask, rewards, index, device)
    assert run.overflowed().tolist() == [1, 0] and flags.retry == 0
    assert flags.slots_from > 0  # the rebuilt slice comes after the first ones
    tries.clear()
    assert_matches(responses, mask, rewards, index, device)
    assert len(tries) == 1


def test_hash_collisions(device, tries):
    """Ids with the same Fibonacci home slot (the top 8 bits of id * 2654435761 mod 2**32 are zero: slot 0
    of every table of up to 256 slots) probe past each other; then a probe limit of 1 and a tiny first
    guess (``TritonTuning``), so that every group is rebuilt on the device."""
    same_home = [t for t in range(1, 10**4) if ((t * 2654435761) & 0xFFFFFFFF) >> 24 == 0][:14]
    assert len(same_home) == 14
    ids = torch.tensor(same_home + [7, 7, 9])
    responses = ids[torch.as_tensor(np.random.default_rng(3).integers(0, len(ids), size=(8, 24)))]
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0] * 4)
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert_matches(responses, mask, rewards, index, device)
    tiny = TritonTuning(first_guess=0.02, probe_limit=1)
    run, flags = first_try(responses, mask, rewards, index, device, tuning=tiny)
    assert flags.retry == 0 and flags.slots_from > 0
    assert_matches(responses, mask, rewards, index, device, tuning=tiny)


@pytest.mark.parametrize("bad, message", [(-5, r"token ids >= 0 where the mask is 1, found -7"),
                                          (2**31, r"token ids must be < 2\*\*31, found 2147483650")])
def test_bad_ids_leave_out_untouched(bad, message, device):
    """The device flag stops the advantage kernel: ``out`` keeps its NaNs, and the error is the API's."""
    _, responses, mask, rewards, index = random_cases(seed=22, small=True)[0]
    responses, mask = responses.clone(), mask.clone()
    mask[1, 0] = mask[2, 1] = True
    responses[1, 0], responses[2, 1] = bad, bad - 2 if bad < 0 else bad + 2
    out = torch.full(responses.shape, float("nan"), dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=message):
        token_advantage(*on(device, responses, mask, rewards, index), backend="triton", out=out)
    assert bool(torch.isnan(out).all())
    _, flags = first_try(responses, mask, rewards, index, device)
    assert (flags.low < 0) == (bad < 0) and (flags.high > 0) == (bad > 0)


def test_a_group_past_the_assumed_bound_is_redone_then_learnt_for_every_length(device, monkeypatch, tries):
    """Groups of 20 rollouts: the first try flags them (bound 16) and the call is redone at once with
    exact sizes; the layout (B, n_groups) then assumes 20 rollouts, for any L: the next calls, at
    another response length too, take one try. (The device grid stops at 16 here: the interpreter
    takes about a minute for the 32-rollout grid, so the rows' statistics come from the score kernel.)"""
    monkeypatch.setattr(device_state, "GRID_MAX_GROUP", 16)
    responses, mask, rewards, index = make_batch(np.random.default_rng(9), [20, 12], 8, 40, shuffle=True)
    assert_matches(responses, mask, rewards, index, device)
    assert [s.safe for s in tries] == [False, True] and tries[0].bound == 16 and tries[1].bound == 32
    assert learnt(device, 32, 2).largest == 20
    for length in (8, 6, 11):
        tries.clear()
        longer, mask2, _, _ = make_batch(np.random.default_rng(length), [20, 12], length, 40, shuffle=False)
        assert_matches(longer, mask2, rewards, index, device)
        assert len(tries) == 1 and tries[0].bound == 32


@pytest.mark.parametrize("sizes, length", [([128, 100], 6), ([1024], 3)], ids=["G128", "G1024"])
def test_big_groups_computed_on_the_device(sizes, length, device, tries):
    """Past 64 rollouts: the first try flags the group and the call is redone; the layout then assumes
    its largest group and the next call takes one try, the score kernel computing each row's table
    statistics."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(11), sizes, length, 60, shuffle=True)
    assert_matches(responses, mask, rewards, index, device)
    assert len(tries) == 2 and pipeline.inline(tries[1].bound)
    tries.clear()
    assert_matches(responses, mask, rewards, index, device)
    assert len(tries) == 1 and pipeline.inline(tries[0].bound)


def test_groups_past_the_inline_bound_are_refused(device, monkeypatch):
    monkeypatch.setattr(pipeline, "INLINE_MAX_GROUP", 64)
    responses, mask, rewards, index = make_batch(np.random.default_rng(11), [128, 100], 6, 60, shuffle=True)
    with pytest.raises(ValueError, match=r"`index`: a group holds 128 rollouts; the triton backend takes at most 64"):
        token_advantage(*on(device, responses, mask, rewards, index), backend="triton")


def test_upstream_statistics_grow_with_the_rows_not_the_tables_a_group_could_have(device, monkeypatch):
    """fisher="upstream": one group of 600 rollouts could have about 90,000 tables; the score pass gets
    only the host's statistics of its rows (float64 ``[2, rows]``), and the reference's advantages."""
    score, by_rows = pipeline.score, []

    def recording(run, config, device, by_row=None):
        by_rows.append(by_row)
        return score(run, config, device, by_row)

    monkeypatch.setattr(pipeline, "score", recording)
    responses, mask, rewards, index = make_batch(np.random.default_rng(12), [600], 4, 30)
    config = KTAEConfig(fisher="upstream")
    assert_matches(responses, mask, rewards, index, device, config)
    rows = len(key_token_scores(responses, mask, rewards, index, config=config, backend="torch"))
    assert len(by_rows) == 1 and by_rows[0].dtype == torch.float64
    assert by_rows[0].shape == (2, rows) and 0 < rows <= 30


def test_sizes_are_static_bounds_of_the_shape():
    """Allocations depend on (B, L, n) only, cover the first tables and their rebuild, stay in budget."""
    sizes = pipeline.sizes(16384, 3072, 1024, TUNING)
    per_slot = 16 + 4 * (sizes.words // sizes.slots)
    assert sizes.bound == 16 and sizes.slots * per_slot <= TUNING.budget_bytes
    assert sizes.slots >= 1024 * 2**14  # the paper batch's first tables: 2**14 slots a group
    small = pipeline.sizes(24, 10, 3, TUNING)
    assert small.slots >= 3 * 16 + 3 * 16  # first slices of at least 16 and their rebuilds
    assert pipeline.sizes(100, 10, 1, TUNING, bound=128).bound == 128
    assert pipeline.sizes(100, 10, 1, TUNING, score=False).bound == 0


def test_first_tables_of_big_groups_are_capped():
    """A first table holds at most ``max_first_slots`` (2**16) slots, and at least 16."""
    assert pipeline.first_table_log_cap(None, TUNING) == 16
    assert pipeline.first_table_log_cap(3, TUNING) == 4
    assert pipeline.first_table_log_cap(160, TUNING) == 8
    assert pipeline.first_table_log_cap(10**6, TUNING) == 16
    assert pipeline.first_table_log_cap(None, TritonTuning(max_first_slots=16)) == 4


def _repeated_and_distinct():
    """Two batches of one shape (2 groups of 4 rollouts x 40): both groups holding ids 0-2 only, and
    ``distinct_and_repeated_groups`` (group 0: 160 distinct ids)."""
    responses, mask, rewards, index = distinct_and_repeated_groups()
    repeated = responses.clone()
    repeated[:4] = responses[4:]
    return (repeated, mask, rewards, index), (responses, mask, rewards, index)


def test_first_tables_follow_the_distinct_ids_seen(device):
    """160 masked tokens a group: the first call's slices hold 2**7 slots each (a share of the tokens),
    and its flags carry the most distinct ids a group held (3). The next call of this (B, n_groups)
    sizes them for 3 ids (2**4, the least): 32 slots cleared, not 256. Then a group of 160 distinct
    ids overflows its 16 slots and is rebuilt on the device (a slice of 2**9 after the first ones),
    exactly; the count learnt (160) would size a slice of 2**8, more than the token share (2**7)."""
    repeated, distinct = _repeated_and_distinct()
    _, flags = first_try(*repeated, device)
    assert (flags.slots, flags.distinct, flags.retry) == (2 * 2**7, 3, 0)
    assert_matches(*repeated, device)
    assert learnt(device, 8, 2).distinct == 3
    _, flags = first_try(*repeated, device)
    # (nothing rebuilt: the slots in use start where the rebuilt ones would)
    assert (flags.slots, flags.slots_from, flags.distinct) == (32, 32, 3)
    assert_matches(*repeated, device)
    run, flags = first_try(*distinct, device)
    assert run.overflowed().tolist() == [1, 0] and flags.retry == 0
    assert (flags.slots_from, flags.slots) == (2 * 2**4, 2 * 2**4 + 2**9)
    assert flags.distinct == 160
    assert_matches(*distinct, device)
    assert learnt(device, 8, 2).distinct == 160
    assert pipeline.sizes(8, 40, 2, TUNING, keys=160).max_log_cap == 8


def test_a_learnt_count_far_too_small_is_redone_with_exact_sizes(device, tries):
    """When the groups that overflow a learnt size need more rebuilt slices than the budget holds, the
    call is redone with exact sizes (exact result) and learns the larger count."""
    repeated, distinct = _repeated_and_distinct()
    assert_matches(*repeated, device)
    tight = TritonTuning(budget_bytes=100 * 20)  # 100 slots: the 2 x 16 first ones, no rebuild
    tries.clear()
    assert_matches(*distinct, device, tuning=tight)
    assert [s.safe for s in tries] == [False, True]
    assert learnt(device, 8, 2).distinct == 160


@pytest.mark.parametrize("case", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_second_call_sized_by_the_distinct_ids_of_the_first(case, device, tries):
    """A case's second call sizes its first tables by the first call's largest distinct count: still the
    reference's advantages, in one try."""
    _, responses, mask, rewards, index = case
    for _ in range(2):
        assert_matches(responses, mask, rewards, index, device)
    assert len(tries) == 2
    batch = normalise_batch(responses, mask, rewards, index)
    most = max(int(torch.unique(batch.responses[(batch.group == g)[:, None] & batch.mask]).numel())
               for g in range(batch.n_groups))
    assert learnt(device, responses.shape[0], batch.n_groups).distinct == most
