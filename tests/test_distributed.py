"""Data-parallel KTAE: 2 CPU ranks over gloo give, for each rank's rows, exactly the one-process result
on the concatenated batch (groups split unevenly across ranks, string uids, different lengths, int ids
of different dtypes per rank), also in TRL's gathered layout (``ktae_kernels.integrations.gathered``).
Ranks that disagree on the call (entry point, config, ``rollout_advantage`` / ``correct`` given) are
refused on every rank and stay in step."""
from __future__ import annotations

import dataclasses
import datetime
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cases import adversarial_cases, random_cases
from ktae_kernels import KTAEConfig, key_token_scores, token_advantage
from ktae_kernels.integrations.gathered import grpo_token_advantages
from ktae_kernels.types import KeyTokenScores

WORLD = 2
CONFIGS = {
    "default": KTAEConfig(),
    "upstream-ignore": KTAEConfig(fisher="upstream", ignore_token_ids=(3, 5)),
    "mean-no-tf": KTAEConfig(baseline="mean", use_tf=False, weight=0.5, correct_threshold=0.5),
    "none": KTAEConfig(baseline="none"),
}


def _uids(index: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
    """verl-style object array of random uid strings, one per group id."""
    names = {int(g): f"{rng.integers(1 << 30):08x}-{int(g)}" for g in index.unique()}
    return np.array([names[int(g)] for g in index], dtype=object)


def _shards():
    """Named (rows of rank 0, rows of rank 1) splits: uneven cuts through groups, interleaved groups,
    one rank without rows, and different padded lengths per rank."""
    rng = np.random.default_rng(7)
    named = {name: rest for name, *rest in random_cases(seed=3, small=True) + adversarial_cases(small=True)}
    out = []
    for name in ("G4-mixed-shuffled", "G16-zipf", "G2-small-vocab", "one-rollout-groups",
                 "all-correct-and-all-wrong-groups", "graded-rewards", "token-ids-near-2^31", "fisher-ties"):
        r, m, w, i = named[name]
        uid = _uids(i, rng)
        cut = int(rng.integers(1, r.shape[0]))
        a, b = slice(0, cut), slice(cut, None)
        out.append((f"{name}-cut{cut}", (r[a], m[a], w[a], uid[a]), (r[b], m[b], w[b], uid[b])))
    r, m, w, i = named["G4-mixed-shuffled"]
    uid = _uids(i, rng)
    out.append(("rank1-empty", (r, m, w, uid), (r[:0], m[:0], w[:0], uid[:0])))
    short = 10  # rank 0 pads its rows to 10 tokens, rank 1 to the full length
    r, m, w, i = named["G16-zipf"]
    uid = _uids(i, rng)
    out.append(("different-lengths", (r[:20, :short], m[:20, :short], w[:20], uid[:20]), (r[20:], m[20:], w[20:], uid[20:])))
    return out


SHARDS = _shards()


def _concat(shard0, shard1):
    """The one-process batch: rank 0's rows then rank 1's, padded to the longer length."""
    L = max(shard0[0].shape[1], shard1[0].shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, L - t.shape[1]))  # noqa: E731
    return (torch.cat([pad(shard0[0]), pad(shard1[0])]), torch.cat([pad(shard0[1]), pad(shard1[1])]),
            torch.cat([shard0[2], shard1[2]]), np.concatenate([shard0[3], shard1[3]]))


def _given(rewards: torch.Tensor) -> torch.Tensor:
    return rewards.double() * 0.25 - 0.1


TRL_G, TRL_ROWS = 4, 9  # 2 processes x 9 rows: groups of 4 straddle the processes


def _trl_layout(seed: int = 5):
    """A gathered TRL batch: ids, loss mask, rewards per function (NaN: not scored; row 7 unscorable),
    reward weights, TRL's per-rollout advantages."""
    rng = np.random.default_rng(seed)
    n, T = WORLD * TRL_ROWS, 12
    ids = torch.as_tensor(rng.integers(3, 20, size=(n, T)))
    mask = (torch.arange(T)[None, :] < torch.as_tensor(rng.integers(1, T + 1, size=n))[:, None]).long()
    per_func = torch.as_tensor(rng.integers(0, 2, size=(n, 2)), dtype=torch.float32)
    per_func[:, 1] = torch.where(torch.as_tensor(rng.random(n) < 0.5), torch.nan, per_func[:, 1])
    per_func[7] = torch.nan
    return ids, mask, per_func, torch.tensor([1.0, 0.5]), torch.as_tensor(rng.normal(size=n), dtype=torch.float32)


def _trl_advantages(rank: int | None, process_group=None) -> dict:
    """Both rollout-advantage modes for one process's rows (all rows when ``rank`` is None)."""
    ids, mask, per_func, weights, trl_adv = _trl_layout()
    own = slice(None) if rank is None else slice(rank * TRL_ROWS, (rank + 1) * TRL_ROWS)
    return {name: grpo_token_advantages(ids[own], mask[own], per_func, weights, given, process_index=rank or 0,
                                        num_generations=TRL_G, config=KTAEConfig(), process_group=process_group)
            for name, given in (("trl", trl_adv[own]), ("ktae", None))}


def _worker(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for name, *shards in SHARDS:
        r, m, w, uid = shards[rank]
        for cname, config in CONFIGS.items():
            adv = token_advantage(r, m, w, uid, config=config, process_group=dist.group.WORLD)
            kts = key_token_scores(r, m, w, uid, config=config, process_group=dist.group.WORLD)
            results[name, cname] = (adv, dataclasses.asdict(kts))
        given = token_advantage(r, m, w, uid, rollout_advantage=_given(w), process_group=dist.group.WORLD)
        results[name, "given"] = (given, None)
    results["trl-layout"] = _trl_advantages(rank, dist.group.WORLD)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawned(worker, out) -> list:
    """Each rank's saved results of ``worker(rank, store, out_dir)`` run on ``WORLD`` processes in ``out``."""
    mp.spawn(worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{k}.pt", weights_only=False) for k in range(WORLD)]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return _spawned(_worker, tmp_path_factory.mktemp("dist"))


def _restrict(full: KeyTokenScores, groups: torch.Tensor) -> dict:
    keep = torch.isin(full.group, groups)
    row = {f.name: getattr(full, f.name)[keep] for f in dataclasses.fields(full)
           if isinstance(getattr(full, f.name), torch.Tensor) and getattr(full, f.name).shape == full.group.shape}
    return row


@pytest.mark.parametrize("shard", SHARDS, ids=[s[0] for s in SHARDS])
def test_two_ranks_equal_one_process(rank_results, shard):
    name, shard0, shard1 = shard
    r, m, w, uid = _concat(shard0, shard1)
    rows = [range(0, shard0[0].shape[0]), range(shard0[0].shape[0], r.shape[0])]
    for cname, config in CONFIGS.items():
        adv = token_advantage(r, m, w, uid, config=config)
        full = key_token_scores(r, m, w, uid, config=config)
        for rank, own in enumerate(rows):
            got, kts = rank_results[rank][name, cname]
            L = got.shape[1]
            assert torch.equal(got, adv[own.start:own.stop, :L]), (cname, rank)
            assert list(kts["group_labels"]) == list(full.group_labels)
            for key in ("n_c", "n_w", "T_c", "T_w"):
                assert torch.equal(kts[key], getattr(full, key)), (cname, rank, key)
            own_groups = torch.unique(torch.as_tensor(np.searchsorted(full.group_labels, uid[own.start:own.stop]), dtype=torch.int64))
            for key, value in _restrict(full, own_groups).items():
                assert torch.equal(kts[key], value), (cname, rank, key)
    given = token_advantage(r, m, w, uid, rollout_advantage=_given(w))
    for rank, own in enumerate(rows):
        got, _ = rank_results[rank][name, "given"]
        assert torch.equal(got, given[own.start:own.stop, :got.shape[1]])


def test_trl_layout_groups_split_across_processes(rank_results):
    one = _trl_advantages(None)
    for name, expected in one.items():
        got = torch.cat([rank_results[k]["trl-layout"][name] for k in range(WORLD)])
        assert torch.equal(got, expected), name
        assert torch.all(expected[7] == 0)  # the unscorable rollout
    assert not torch.equal(one["trl"], one["ktae"])


#: calls whose ranks disagree on what the collectives depend on: (name, call of rank k, expected message).
#: Each is refused on every rank after the first collective: otherwise the ranks would run different
#: collectives (a hang until the timeout) or silently mix two configs.
MISMATCHES = {
    "rollout-advantage-on-rank-0": (
        lambda k, r, m, w, i: token_advantage(r, m, w, i, rollout_advantage=_given(w) if k == 0 else None,
                                              process_group=dist.group.WORLD),
        r"`rollout_advantage` must be given on every rank of `process_group` or on none, got it on ranks \[0\] of 2"),
    "correct-on-rank-1": (
        lambda k, r, m, w, i: token_advantage(r, m, w, i, correct=w > 0 if k == 1 else None, process_group=dist.group.WORLD),
        r"`correct` must be given on every rank of `process_group` or on none, got it on ranks \[1\] of 2"),
    "baseline-differs": (
        lambda k, r, m, w, i: token_advantage(r, m, w, i, config=KTAEConfig(baseline=("grpo", "none")[k]),
                                              process_group=dist.group.WORLD),
        r"`config` must be the same on every rank of `process_group`, got KTAEConfig\(.*baseline='grpo'.*\) on rank 0, "
        r"KTAEConfig\(.*baseline='none'.*\) on rank 1"),
    "weight-differs": (
        lambda k, r, m, w, i: key_token_scores(r, m, w, i, config=KTAEConfig(weight=1.0 + k), process_group=dist.group.WORLD),
        r"`config` must be the same on every rank of `process_group`, got .*weight=1.0.* on rank 0, .*weight=2.0.* on rank 1"),
    "different-functions": (
        lambda k, r, m, w, i: (key_token_scores, token_advantage)[k](r, m, w, i, process_group=dist.group.WORLD),
        r"every rank of `process_group` must call the same function, got 'key_token_scores' on rank 0, "
        r"'token_advantage' on rank 1"),
}


#: int group ids of a different dtype on each rank: (name, rank k's index for ``_group_ids`` g, message of the
#: refusal or None). Before, uint64 beside int64 ids met as float64 (ids past 2**53 merged into one group)
#: and an object array of ints beside an int array was refused as "not of one kind".
BIG = 2**60
INDEX_KINDS = {
    "uint64-beside-int64": (lambda k, g: (BIG + g).astype((np.int64, np.uint64)[k]), None),
    "object-ints-beside-int64": (lambda k, g: np.array(g.tolist(), dtype=object) if k == 0 else torch.as_tensor(g), None),
    # as one process's np.asarray of every rank's ids holds them: uint64
    "uint64-past-2**63-beside-int64": (lambda k, g: g if k == 0 else g.astype(np.uint64) + np.uint64(2**63), None),
    "uint64-past-2**63-beside-negative-int64": (
        lambda k, g: g - 100 if k == 0 else g.astype(np.uint64) + np.uint64(2**63),
        r"`index` group ids must fit one integer dtype over every rank, got ids up to \d+ \(past int64\) and "
        r"down to -\d+ \(below 0\)"),
    "bytes-beside-str": (  # np.unique would merge b"3" and "3"
        lambda k, g: np.array([str(v).encode() if k == 0 else str(v) for v in g.tolist()], dtype=object),
        r"`index` group ids must be of one kind on every rank \(all ints, all strings or all bytes\), got "
        r"bytes \(object\), str \(object\)"),
}


#: a bad argument on rank 1 only: (name, call of rank k, message on rank 1). Rank 0 must raise too, naming
#: it, not wait for rank 1 in the first collective until the timeout.
REFUSED_ON_RANK_1 = {
    "float-ids": (lambda k, r, m, w, i: token_advantage(r.double() if k else r, m, w, i, process_group=dist.group.WORLD),
                  re.escape("`responses` must hold integer token ids, got dtype torch.float64; convert with `responses.long()`")),
    "backend": (lambda k, r, m, w, i: key_token_scores(r, m, w, i, backend=("auto", "cuda")[k], process_group=dist.group.WORLD),
                r"`backend` must be one of \('auto', 'torch'\) with a `process_group` .*got 'cuda'"),
}


def _group_ids(uid: np.ndarray) -> np.ndarray:
    """int64 ``[B]``: the group number in each of ``_uids``' uid strings."""
    return np.array([int(u.rsplit("-", 1)[1]) for u in uid], dtype=np.int64)


def _mismatch_worker(rank: int, store: str, out_dir: str) -> None:
    """Every ``MISMATCHES`` call on the rows of ``SHARDS[0]`` (its message, or None when it returned), then
    an agreed call: the ranks must still be in step. A short timeout makes a hang an error. Then
    ``token_advantage`` and the group labels with each ``INDEX_KINDS`` index (or the message)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    r, m, w, uid = SHARDS[0][1 + rank]
    results = {}
    calls = {name: call for name, (call, _) in {**MISMATCHES, **REFUSED_ON_RANK_1}.items()}
    calls["not-a-group"] = lambda k, r, m, w, i: token_advantage(r, m, w, i, process_group="WORLD")
    for name, call in calls.items():  # the mismatches, the refusals, then a group that is none
        try:
            call(rank, r, m, w, uid)
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
    results["after"] = token_advantage(r, m, w, uid, process_group=dist.group.WORLD)
    for name, (index, _) in INDEX_KINDS.items():
        ids = index(rank, _group_ids(uid))
        try:
            results[name] = (token_advantage(r, m, w, ids, process_group=dist.group.WORLD),
                             key_token_scores(r, m, w, ids, process_group=dist.group.WORLD).group_labels.tolist())
        except ValueError as err:
            results[name] = str(err)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mismatch_results(tmp_path_factory):
    return _spawned(_mismatch_worker, tmp_path_factory.mktemp("mismatch"))


@pytest.mark.parametrize("name", MISMATCHES)
def test_ranks_that_disagree_are_refused_on_every_rank(mismatch_results, name):
    for rank in range(WORLD):
        assert mismatch_results[rank][name] is not None, (name, rank)
        assert re.fullmatch(MISMATCHES[name][1], mismatch_results[rank][name]), (rank, mismatch_results[rank][name])


@pytest.mark.parametrize("name", REFUSED_ON_RANK_1)
def test_an_argument_refused_on_one_rank_is_raised_on_every_rank(mismatch_results, name):
    message = REFUSED_ON_RANK_1[name][1]
    assert re.fullmatch(message, mismatch_results[1][name]), mismatch_results[1][name]
    assert re.fullmatch("another rank of `process_group` refused its arguments, so every rank stops: rank 1: ValueError: "
                        + message, mismatch_results[0][name]), mismatch_results[0][name]


def test_ranks_stay_in_step_after_a_refused_call(mismatch_results):
    _, shard0, shard1 = SHARDS[0]
    expected = token_advantage(*_concat(shard0, shard1))
    got = torch.cat([mismatch_results[k]["after"] for k in range(WORLD)])
    assert torch.equal(got, expected[:, :got.shape[1]])


@pytest.mark.parametrize("name", INDEX_KINDS)
def test_ids_of_different_dtypes_or_kinds_per_rank(mismatch_results, name):
    _, shard0, shard1 = SHARDS[0]
    r, m, w, uid = _concat(shard0, shard1)
    index, refused = INDEX_KINDS[name]
    if refused:
        for rank in range(WORLD):
            assert re.fullmatch(refused, mismatch_results[rank][name]), (rank, mismatch_results[rank][name])
        return
    one = np.concatenate([np.asarray(index(k, _group_ids(s[3])), dtype=object) for k, s in enumerate((shard0, shard1))])
    labels = sorted(set(one.tolist()))
    expected = token_advantage(r, m, w, torch.as_tensor(np.unique(one, return_inverse=True)[1]))  # ids past int64 too
    got = torch.cat([mismatch_results[k][name][0] for k in range(WORLD)])
    assert torch.equal(got, expected[:, :got.shape[1]])
    for rank in range(WORLD):
        assert mismatch_results[rank][name][1] == labels


def test_process_group_that_is_no_group_is_named(mismatch_results):
    for rank in range(WORLD):
        assert mismatch_results[rank].get("not-a-group") == ("`process_group` must be a torch.distributed group "
                                                             "(dist.group.WORLD or one made by dist.new_group), got 'WORLD'")


def test_process_group_refuses_other_backends():
    r, m, w, i = random_cases(small=True)[0][1:]
    with pytest.raises(ValueError, match="backend"):
        token_advantage(r, m, w, i, backend="reference", process_group=object())


def test_process_group_needs_initialised_distributed():
    r, m, w, i = random_cases(small=True)[0][1:]
    with pytest.raises(ValueError, match="init_process_group"):
        key_token_scores(r, m, w, i, process_group=object())
