"""The Triton backend against the scipy reference: on CUDA, or on CPU in Triton's interpreter.

Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported, and these run the
same kernels on CPU tensors (small shapes only: the interpreter is slow).
"""
import numpy as np
import pytest
import torch

from cases import adversarial_cases, assert_scores_match, distinct_and_repeated_groups, make_batch, random_cases
from ktae_kernels import ExecutionOptions, KTAEConfig, TritonTuning, key_token_scores, token_advantage

pytest.importorskip("triton")

CASES = random_cases(seed=0, small=True) + adversarial_cases(small=True)
CONFIGS = {
    "default": KTAEConfig(),
    "upstream": KTAEConfig(fisher="upstream"),
    "no-tf-ignore": KTAEConfig(use_tf=False, ignore_token_ids=(3, 5, 151643, 2**31 - 1)),
    "weights": KTAEConfig(alpha=0.5, beta=2.0, top=0.3, k1=1.2, b=0.75, weight=0.5, baseline="mean",
                          correct_threshold=0.5),
}


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def check_against_reference(responses, mask, rewards, index, config, device, given=None, options=None):
    expected = key_token_scores(responses, mask, rewards, index, config=config, backend="reference")
    adv_ref = token_advantage(responses, mask, rewards, index, config=config, backend="reference",
                              rollout_advantage=given)
    r, m, w, i = on(device, responses, mask, rewards, index)
    actual = key_token_scores(r, m, w, i, config=config, backend="triton", options=options)
    assert actual.score.device.type == device.type
    assert_scores_match(expected, actual)
    adv = token_advantage(r, m, w, i, config=config, backend="triton", options=options,
                          rollout_advantage=None if given is None else given.to(device))
    assert adv.dtype == torch.float32 and adv.device.type == device.type
    torch.testing.assert_close(adv.cpu(), adv_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_reference(case, config, device):
    _, responses, mask, rewards, index = case
    check_against_reference(responses, mask, rewards, index, config, device)


@pytest.mark.parametrize("baseline", ["grpo", "mean", "none", "given"])
def test_rollout_baselines(baseline, device):
    _, responses, mask, rewards, index = random_cases(seed=1, small=True)[1]
    given = torch.linspace(-1.0, 2.0, responses.shape[0], dtype=torch.float64) if baseline == "given" else None
    config = KTAEConfig(baseline="grpo" if baseline == "given" else baseline, weight=2.0)
    check_against_reference(responses, mask, rewards, index, config, device, given)


def test_groups_wider_than_one_presence_word(device):
    """Groups of 70 and 33 rollouts need three and two 32-bit presence words."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(5), [70, 33, 5], 10, 24, shuffle=True)
    check_against_reference(responses, mask, rewards, index, KTAEConfig(), device)


#: first tables far too small, a probe budget of one: every group is rebuilt on the device
TINY_TABLES = ExecutionOptions(triton=TritonTuning(first_guess=0.02, probe_limit=1, max_first_slots=16))


@pytest.mark.parametrize("name", ["G4-mixed-shuffled", "G16-zipf"])
@pytest.mark.parametrize("config", [KTAEConfig(), KTAEConfig(fisher="upstream")], ids=["exact", "upstream"])
def test_undersized_tables_are_rebuilt(name, config, device):
    """First tables far too small (``TritonTuning``) rebuild on the device: the same results."""
    _, responses, mask, rewards, index = next(c for c in random_cases(seed=2, small=True) if c[0] == name)
    check_against_reference(responses, mask, rewards, index, config, device, options=TINY_TABLES)


def test_a_group_of_distinct_ids_beside_a_repeated_one(device):
    """Group 0 holds only distinct ids (more than its first slice takes), group 1 three ids."""
    check_against_reference(*distinct_and_repeated_groups(), KTAEConfig(), device)
    check_against_reference(*distinct_and_repeated_groups(), KTAEConfig(), device, options=TINY_TABLES)


@pytest.mark.parametrize("B, L", [(0, 5), (3, 0)])
def test_empty_batches(B, L, device):
    r, m = torch.zeros(B, L, dtype=torch.int64, device=device), torch.zeros(B, L, dtype=torch.bool, device=device)
    w, i = torch.ones(B, device=device), torch.zeros(B, dtype=torch.int64, device=device)
    assert token_advantage(r, m, w, i, backend="triton").shape == (B, L)
    scores = key_token_scores(r, m, w, i, backend="triton")
    assert len(scores) == 0 and scores.n_c.shape == (min(B, 1),)


def test_writes_into_out(device):
    _, responses, mask, rewards, index = random_cases(seed=5, small=True)[0]
    r, m, w, i = on(device, responses, mask, rewards, index)
    out = torch.full(responses.shape, float("nan"), dtype=torch.float32, device=device)
    got = token_advantage(r, m, w, i, backend="triton", out=out)
    assert got.data_ptr() == out.data_ptr()
    want = token_advantage(responses, mask, rewards, index, backend="reference")
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad, message", [(-5, r"token ids >= 0 where the mask is 1, found -7"),
                                          (2**31, r"token ids must be < 2\*\*31, found 2147483650")])
def test_token_id_range_is_checked_by_the_table_build(bad, message, device):
    """The API leaves the id check to the backend (``checks_token_ids``): same errors, padding ignored."""
    from ktae_kernels.registry import resolve

    assert resolve("triton", device).checks_token_ids
    _, responses, mask, rewards, index = random_cases(seed=6, small=True)[0]
    responses, mask = responses.clone(), mask.clone()
    mask[0, -1] = False
    responses[0, -1] = -(2**40)  # under mask 0: never read
    ok = token_advantage(*on(device, responses, mask, rewards, index), backend="triton")
    torch.testing.assert_close(ok.cpu(), token_advantage(responses, mask, rewards, index, backend="reference"),
                               rtol=0, atol=1e-6)
    mask[1, 0] = mask[2, 1] = True
    responses[1, 0], responses[2, 1] = bad, bad - 2 if bad < 0 else bad + 2
    for api in (token_advantage, key_token_scores):
        with pytest.raises(ValueError, match=message):
            api(*on(device, responses, mask, rewards, index), backend="triton")


@pytest.mark.parametrize("sizes, length", [([128, 100], 6), ([1024], 3)], ids=["G128", "G1024"])
def test_big_groups(sizes, length, device):
    """Groups of 128 and 1024 rollouts: 4 and 32 presence words a slot, the statistics of the rows'
    tables (past the device grid's bound), shuffled rollouts."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(11), sizes, length, 60, shuffle=True)
    check_against_reference(responses, mask, rewards, index, KTAEConfig(), device)


def test_groups_past_a_capped_first_table_are_rebuilt(device):
    """With first tables of at most 16 slots, every group of 128 rollouts (more than 12 distinct ids) is
    rebuilt on the device."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(12), [128, 100], 6, 60, shuffle=True)
    options = ExecutionOptions(triton=TritonTuning(max_first_slots=16))
    check_against_reference(responses, mask, rewards, index, KTAEConfig(), device, options=options)
