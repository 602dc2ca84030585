"""The Triton backend's sync-free ``token_advantage`` (``backends/triton/nosync.py``): on CUDA, or on
CPU in Triton's interpreter (small shapes). Each test checks which path ran (``nosync._SYNC_SHAPES``,
``Run.flags``) as well as the result, against the reference backend.
"""
import numpy as np
import pytest
import torch

from cases import adversarial_cases, distinct_and_repeated_groups, make_batch, random_cases, triton_devices
from ktae_kernels import KTAEConfig, token_advantage

pytest.importorskip("triton")
DEVICES = triton_devices()
if not DEVICES:
    pytest.skip("the Triton backend needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from ktae_kernels.backends import device as device_helpers  # noqa: E402
from ktae_kernels.backends.triton import nosync, tables  # noqa: E402
from ktae_kernels.validation import normalise_batch  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def fresh_shapes(monkeypatch):
    """Every test starts with no remembered shape (which path a shape takes is what they check)."""
    monkeypatch.setattr(nosync, "_SYNC_SHAPES", set())
    monkeypatch.setattr(nosync, "_BOUNDS", {})


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def run(responses, mask, rewards, index, device, config=KTAEConfig(), given=None):
    """The sync-free run on the device, its flags and result (None where it flagged a retry), its first
    tables sized as the API's call would (the remembered bound and distinct ids)."""
    batch = normalise_batch(*on(device, responses, mask, rewards, index), check_ids=False)
    B, L = responses.shape
    keys = device_helpers.expected_keys(device_helpers.distinct_key("triton", batch.device, B, batch.n_groups))
    plan = nosync.sizes(B, L, batch.n_groups, nosync._BOUNDS.get((B, L, batch.n_groups, batch.device), 16), keys)
    done = nosync.run(batch, config, given, None, plan)
    return done, done.flags.tolist()


def reference(responses, mask, rewards, index, config=KTAEConfig(), given=None):
    return token_advantage(responses, mask, rewards, index, config=config, backend="reference",
                           rollout_advantage=given)


def assert_nosync_matches(responses, mask, rewards, index, device, config=KTAEConfig(), given=None):
    """The API call takes the sync-free path (no shape remembered) and matches the reference."""
    got = token_advantage(*on(device, responses, mask, rewards, index), config=config, backend="triton",
                          rollout_advantage=None if given is None else given.to(device))
    assert not nosync._SYNC_SHAPES and not nosync._BOUNDS, "the call fell back to the synchronising path"
    torch.testing.assert_close(got.cpu(), reference(responses, mask, rewards, index, config, given),
                               rtol=0, atol=1e-6)


CASES = random_cases(seed=20, small=True)[:2] + [c for c in adversarial_cases(small=True)
                                                 if c[0] in ("fisher-ties", "token-ids-near-2^31", "huge-counts",
                                                             "everything-masked", "one-rollout-groups")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_small_batches_take_the_sync_free_path(case, device):
    _, responses, mask, rewards, index = case
    assert_nosync_matches(responses, mask, rewards, index, device)


@pytest.mark.parametrize("baseline", ["grpo", "mean", "none", "given", "correct-labels"])
def test_baselines_and_labels_on_the_device(baseline, device):
    """GRPO mean / std, mean, none, a given A_i, and caller ``correct`` labels, all on the device."""
    _, responses, mask, rewards, index = random_cases(seed=21, small=True)[1]
    given = torch.linspace(-1.0, 2.0, responses.shape[0], dtype=torch.float64) if baseline == "given" else None
    config = KTAEConfig(baseline=baseline if baseline in ("grpo", "mean", "none") else "grpo", weight=2.0,
                        correct_threshold=0.3, eps=1e-3, ignore_token_ids=(3, 2**40))
    if baseline == "correct-labels":
        correct = torch.arange(responses.shape[0]) % 2 == 0
        got = token_advantage(*on(device, responses, mask, rewards, index, ), correct=correct.to(device),
                              config=config, backend="triton")
        want = token_advantage(responses, mask, rewards, index, correct=correct, config=config, backend="reference")
        assert not nosync._SYNC_SHAPES
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6)
        return
    assert_nosync_matches(responses, mask, rewards, index, device, config, given)


def test_one_group_holding_every_distinct_id_is_rebuilt_on_the_device(device):
    """One group of all-distinct ids (far past its first table) beside a group of three ids: the
    device rebuild takes it (no fallback), and only that group is marked."""
    responses, mask, rewards, index = distinct_and_repeated_groups()
    done, flags = run(responses, mask, rewards, index, device)
    over = done.grp[nosync._OVER.value * 2: nosync._OVER.value * 2 + 2].tolist()
    assert over == [1, 0] and flags[nosync._RETRY.value] == 0
    assert flags[nosync._SLOTS_FROM.value] > 0  # the rebuilt slice comes after the first ones
    assert_nosync_matches(responses, mask, rewards, index, device)


def test_hash_collisions(device):
    """Ids with the same Fibonacci home slot (the top 8 bits of id * 2654435761 mod 2**32 are zero: slot 0
    of every table of up to 256 slots) probe past each other; then a forced probe limit of 1 and a tiny
    first guess, so that every group is rebuilt on the device."""
    same_home = [t for t in range(1, 10**4) if ((t * 2654435761) & 0xFFFFFFFF) >> 24 == 0][:14]
    assert len(same_home) == 14
    ids = torch.tensor(same_home + [7, 7, 9])
    responses = ids[torch.as_tensor(np.random.default_rng(3).integers(0, len(ids), size=(8, 24)))]
    mask = torch.ones_like(responses, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0] * 4)
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert_nosync_matches(responses, mask, rewards, index, device)
    nosync._SYNC_SHAPES.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables, "_FIRST_GUESS", 0.01)
        mp.setattr(tables, "_FIRST_PROBE_LIMIT", 1)
        done, flags = run(responses, mask, rewards, index, device)
        assert flags[nosync._RETRY.value] == 0 and flags[nosync._SLOTS_FROM.value] > 0
        assert_nosync_matches(responses, mask, rewards, index, device)


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
    assert not nosync._SYNC_SHAPES and bool(torch.isnan(out).all())
    done, flags = run(responses, mask, rewards, index, device)
    assert (flags[nosync._BAD_LOW.value] < 0) == (bad < 0) and (flags[nosync._BAD_HIGH.value] > 0) == (bad > 0)


def test_a_group_past_the_assumed_bound_falls_back_then_the_shape_assumes_more(device, monkeypatch):
    """Groups of 20 rollouts: the first call flags them (bound 16) and returns the synchronising path's
    result; the shape then assumes 32 and the next call is sync-free. (The device grid stops at 16
    here: the interpreter takes about a minute for the 32-rollout grid, so the rows' statistics are
    computed in the score kernel.)"""
    from ktae_kernels.backends import device as device_helpers

    monkeypatch.setattr(device_helpers, "GRID_MAX_GROUP", 16)
    responses, mask, rewards, index = make_batch(np.random.default_rng(9), [20, 12], 8, 40, shuffle=True)
    want = reference(responses, mask, rewards, index)
    args = on(device, responses, mask, rewards, index)
    first = token_advantage(*args, backend="triton")
    key = next(iter(nosync._BOUNDS))
    assert nosync._BOUNDS[key] == 32 and not nosync._SYNC_SHAPES
    torch.testing.assert_close(first.cpu(), want, rtol=0, atol=1e-6)
    done, flags = run(responses, mask, rewards, index, device)
    assert flags[nosync._RETRY.value] == 0 and done.grp.shape[0] > 0
    second = token_advantage(*args, backend="triton")
    assert nosync._BOUNDS[key] == 32 and not nosync._SYNC_SHAPES
    torch.testing.assert_close(second.cpu(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sizes, length", [([128, 100], 6), ([1024], 3)], ids=["G128", "G1024"])
def test_big_groups_computed_on_the_device(sizes, length, device, monkeypatch):
    """Past 64 rollouts: the first call flags the group and falls back; the shape then assumes its
    largest group (read with the flags) and the next call is sync-free, the score kernel computing
    each row's table statistics; past ``INLINE_MAX_GROUP`` the shape takes the synchronising path."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(11), sizes, length, 60, shuffle=True)
    want = reference(responses, mask, rewards, index)
    args = on(device, responses, mask, rewards, index)
    key = (*responses.shape, len(sizes), torch.device(device))
    torch.testing.assert_close(token_advantage(*args, backend="triton").cpu(), want, rtol=0, atol=1e-6)
    assert nosync._BOUNDS == {key: sizes[0]} and not nosync._SYNC_SHAPES
    assert nosync.inline(sizes[0])
    torch.testing.assert_close(token_advantage(*args, backend="triton").cpu(), want, rtol=0, atol=1e-6)
    assert nosync._BOUNDS == {key: sizes[0]} and not nosync._SYNC_SHAPES
    monkeypatch.setattr(nosync, "_BOUNDS", {})
    monkeypatch.setattr(nosync, "INLINE_MAX_GROUP", 64)
    torch.testing.assert_close(token_advantage(*args, backend="triton").cpu(), want, rtol=0, atol=1e-6)
    assert nosync._SYNC_SHAPES == {key}


def test_sizes_are_static_bounds_of_the_shape():
    """Allocations depend on (B, L, n) only, cover the first tables and their rebuild, stay in budget."""
    plan = nosync.sizes(16384, 3072, 1024)
    per_slot = 16 + 4 * (plan.words // plan.slots)
    assert plan.bound == 16 and plan.slots * per_slot <= nosync.TABLE_BUDGET_BYTES
    assert plan.slots >= 1024 * 2**14  # the paper batch's first tables: 2**14 slots a group
    small = nosync.sizes(24, 10, 3)
    assert small.slots >= 3 * 16 + 3 * 16  # first slices of at least 16 and their rebuilds
    assert nosync.sizes(100, 10, 1, bound=128).bound == 128
    assert nosync.sizes(10**4, 10, 1, bound=8192) is None  # past INLINE_MAX_GROUP


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
    exactly; the count read back (160) would size a slice of 2**8, more than the token share (2**7)."""
    repeated, distinct = _repeated_and_distinct()
    key = device_helpers.distinct_key("triton", torch.device(device), 8, 2)
    assert nosync.sizes(8, 40, 2).max_log_cap == tables._MAX_FIRST_LOG_CAP
    done, flags = run(*repeated, device)
    assert (flags[nosync._SLOTS.value], flags[nosync._DISTINCT.value], flags[nosync._RETRY.value]) == (2 * 2**7, 3, 0)
    assert_nosync_matches(*repeated, device)
    assert device_helpers.expected_keys(key) == 3 and nosync.first_table_log_cap(3) == 4
    done, flags = run(*repeated, device)
    # (nothing rebuilt: the slots in use start where the rebuilt ones would)
    assert (flags[nosync._SLOTS.value], flags[nosync._SLOTS_FROM.value], flags[nosync._DISTINCT.value]) == (32, 32, 3)
    assert_nosync_matches(*repeated, device)
    done, flags = run(*distinct, device)
    over = done.grp[nosync._OVER.value * 2: nosync._OVER.value * 2 + 2].tolist()
    assert over == [1, 0] and flags[nosync._RETRY.value] == 0
    assert (flags[nosync._SLOTS_FROM.value], flags[nosync._SLOTS.value]) == (2 * 2**4, 2 * 2**4 + 2**9)
    assert flags[nosync._DISTINCT.value] == 160
    assert_nosync_matches(*distinct, device)
    assert device_helpers.expected_keys(key) == 160 and nosync.first_table_log_cap(160) == 8
    assert nosync.sizes(8, 40, 2, keys=160).max_log_cap == 8


def test_a_remembered_count_far_too_small_is_forgotten(device, monkeypatch):
    """When the groups that overflow a remembered size need more rebuilt slices than the budget holds, the
    call is redone by the synchronising path (exact), the shape stays sync-free and the count is
    forgotten: the next call sizes by masked tokens again."""
    _, distinct = _repeated_and_distinct()
    key = device_helpers.distinct_key("triton", torch.device(device), 8, 2)
    device_helpers.remember_keys(key, 3)
    monkeypatch.setattr(nosync, "TABLE_BUDGET_BYTES", 100 * 20)  # 100 slots: the 2 x 16 first ones, no rebuild
    done, flags = run(*distinct, device)
    assert flags[nosync._RETRY.value] == nosync.RETRY_REBUILD
    got = token_advantage(*on(device, *distinct), backend="triton")
    torch.testing.assert_close(got.cpu(), reference(*distinct), rtol=0, atol=1e-6)
    assert not nosync._SYNC_SHAPES and device_helpers.expected_keys(key) is None


@pytest.mark.parametrize("case", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_second_call_sized_by_the_distinct_ids_of_the_first(case, device):
    """A case's second call sizes its first tables by the first call's largest distinct count: still the
    reference's advantages, on the sync-free path."""
    _, responses, mask, rewards, index = case
    for _ in range(2):
        assert_nosync_matches(responses, mask, rewards, index, device)
    batch = normalise_batch(responses, mask, rewards, index)
    most = max(int(torch.unique(batch.responses[(batch.group == g)[:, None] & batch.mask]).numel())
               for g in range(batch.n_groups))
    key = device_helpers.distinct_key("triton", torch.device(device), responses.shape[0], batch.n_groups)
    assert device_helpers.expected_keys(key) == most
