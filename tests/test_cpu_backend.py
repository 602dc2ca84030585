"""The native CPU backend (csrc/cpu) against the scipy reference, the torch backend and itself across
thread counts, on random, adversarial and property-generated batches; its build-less error path."""
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import ktae_kernels.backends.cpu as cpu
from cases import adversarial_cases, assert_same_signs, assert_scores_match, make_batch, random_cases, zero_strength_case
from ktae_kernels import BackendUnavailableError, KTAEConfig, available_backends, key_token_scores, method, token_advantage
from ktae_kernels.registry import get_backend
from test_properties import batches, configs
from test_torch_backend import big_group_peak_growth_mb

pytestmark = pytest.mark.skipif(cpu.unavailable_reason() is not None and not os.environ.get("CI"),
                                reason="the native CPU kernel is not built (CI requires it)")

CASES = random_cases(seed=0) + adversarial_cases()
CONFIGS = {
    "default": KTAEConfig(),
    "upstream": KTAEConfig(fisher="upstream"),
    "no-tf-ignore": KTAEConfig(use_tf=False, ignore_token_ids=(3, 5, 151643, 2**31 - 1)),
    "weights": KTAEConfig(alpha=0.5, beta=2.0, top=0.3, k1=1.2, b=0.75, weight=0.5, baseline="mean",
                          correct_threshold=0.5),
}


@pytest.fixture
def threads(monkeypatch):
    """Set the torch thread count (restored afterwards); the kernel then uses exactly that many
    threads whenever there are that many groups, however small the batch, its workers joining every
    call (``set_worker_mode("together")``: on a busy machine they would often not)."""
    monkeypatch.setattr(cpu, "POSITIONS_PER_THREAD", 1)
    before = torch.get_num_threads()
    kernel = cpu.load_extension()
    kernel.set_worker_mode("together")
    yield torch.set_num_threads
    kernel.set_worker_mode("normal")
    torch.set_num_threads(before)


def _advantages_at(threads, counts, *args, **kwargs) -> list[torch.Tensor]:
    out = []
    for n in counts:
        threads(n)
        out.append(token_advantage(*args, backend="cpu", **kwargs))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_reference_at_one_and_two_threads(case, config, threads):
    _, responses, mask, rewards, index = case
    expected = key_token_scores(responses, mask, rewards, index, config=config, backend="reference")
    assert_scores_match(expected, key_token_scores(responses, mask, rewards, index, config=config, backend="cpu"))
    adv_ref = token_advantage(responses, mask, rewards, index, config=config, backend="reference")
    one, two = _advantages_at(threads, (1, 2), responses, mask, rewards, index, config=config)
    torch.testing.assert_close(one, adv_ref, rtol=0, atol=1e-6)
    assert torch.equal(one, two), "the result depends on the thread count"
    # same float64 operations as the torch backend: bitwise equal
    assert torch.equal(one, token_advantage(responses, mask, rewards, index, config=config, backend="torch"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rows_first_path_matches_reference(case, monkeypatch):
    """Past ``method.FULL_GRID_WORK`` the rows are listed first and only their tables computed."""
    monkeypatch.setattr(method, "FULL_GRID_WORK", 0)
    _, responses, mask, rewards, index = case
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, backend="cpu"),
                               token_advantage(responses, mask, rewards, index, backend="reference"), rtol=0, atol=1e-6)


def test_upstream_groups_past_the_full_grid_equal_torch_and_reference(threads):
    """fisher="upstream" finds each row's table among the listed distinct tables: groups of several shapes in
    one batch, two of them too big for a full grid in any mode, give the torch backend's bits at one and two
    threads and the reference's scores."""
    rng = np.random.default_rng(11)
    batch = make_batch(rng, [16, 300, 9, 520, 16], 12, 400, zipf=True, p_correct=0.35, shuffle=True)
    _, _, rewards, index = batch
    n_c = torch.zeros(5, dtype=torch.int64).index_add_(0, index, (rewards > 0).long())
    n_w = torch.bincount(index, minlength=5) - n_c
    for big in (1, 3):
        assert method.full_grid_statistics(n_c[big:big + 1], n_w[big:big + 1], KTAEConfig()) is None
    config = KTAEConfig(fisher="upstream")
    one, two = _advantages_at(threads, (1, 2), *batch, config=config)
    assert torch.equal(one, two) and torch.equal(one, token_advantage(*batch, config=config, backend="torch"))
    torch.testing.assert_close(one, token_advantage(*batch, config=config, backend="reference"), rtol=0, atol=1e-6)


def test_upstream_memory_does_not_grow_with_the_tables_a_group_could_have():
    """One group of 8,000 rollouts could have 16 million tables (40 bytes each as a grid); in upstream mode the
    kernel gets only the tables its rows use, so a call's peak memory stays with its rows, in a fresh process."""
    grown_mb = big_group_peak_growth_mb("cpu", fisher="upstream")
    assert grown_mb < 100, grown_mb


@settings(max_examples=40, deadline=None)
@given(batches(), configs)
def test_equals_torch_backend_on_generated_batches(batch, config):
    assert torch.equal(token_advantage(*batch, config=config, backend="cpu"),
                       token_advantage(*batch, config=config, backend="torch"))
    assert_scores_match(key_token_scores(*batch, config=config, backend="torch"),
                        key_token_scores(*batch, config=config, backend="cpu"), p_rtol=0, atol=0)


def test_zero_scores_are_positive_zeros_as_in_torch():
    """A row of strength 0 and negative direction scores +0.0, as the method's squash (no -0.0 sum with a
    -0.0 rollout advantage)."""
    responses, mask, rewards, index, given = zero_strength_case()
    expected = token_advantage(responses, mask, rewards, index, rollout_advantage=given, backend="torch")
    assert_same_signs(expected, token_advantage(responses, mask, rewards, index, rollout_advantage=given, backend="cpu"))


def test_one_group_of_1024_rollouts(threads):
    """Presence by last-seen stamps (G > 64) and a table grid too large to fill up front."""
    rng = np.random.default_rng(7)
    responses, mask, rewards, index = make_batch(rng, [1024], 48, 300, zipf=True, p_correct=0.4)
    config = KTAEConfig()
    expected = key_token_scores(responses, mask, rewards, index, config=config, backend="reference")
    assert_scores_match(expected, key_token_scores(responses, mask, rewards, index, config=config, backend="cpu"))
    one, two = _advantages_at(threads, (1, 2), responses, mask, rewards, index, config=config)
    torch.testing.assert_close(one, token_advantage(responses, mask, rewards, index, backend="reference"),
                               rtol=0, atol=1e-6)
    assert torch.equal(one, two)


def test_ids_beyond_the_dense_map_and_at_the_limit():
    rng = np.random.default_rng(3)
    responses, mask, rewards, index = make_batch(rng, [6, 6, 5], 40, 50, shuffle=True)
    responses = torch.where(responses % 3 == 0, responses + (2**31 - 60), responses + (1 << 18) - 20)
    expected = token_advantage(responses, mask, rewards, index, backend="reference")
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, backend="cpu"), expected,
                               rtol=0, atol=1e-6)
    assert_scores_match(key_token_scores(responses, mask, rewards, index, backend="reference"),
                        key_token_scores(responses, mask, rewards, index, backend="cpu"))


def test_non_contiguous_inputs():
    rng = np.random.default_rng(5)
    responses, mask, rewards, index = make_batch(rng, [4, 4, 4], 30, 40, shuffle=True)
    wide_r = torch.zeros(12, 60, dtype=torch.int64)
    wide_r[:, ::2] = responses
    wide_m = torch.zeros(12, 60, dtype=torch.bool)
    wide_m[:, ::2] = mask
    views = {
        "column-strided": (wide_r[:, ::2], wide_m[:, ::2]),
        "transposed": (responses.t().contiguous().t(), mask.t().contiguous().t()),
        "row-strided": (torch.stack([responses, -responses], 1).reshape(24, 30)[::2],
                        torch.stack([mask, ~mask], 1).reshape(24, 30)[::2]),
    }
    expected = token_advantage(responses, mask, rewards, index, backend="torch")
    for name, (r, m) in views.items():
        assert not r.is_contiguous(), name
        assert torch.equal(token_advantage(r, m, rewards, index, backend="cpu"), expected), name


@pytest.mark.parametrize("value, message", [(-1, ">= 0"), (2**31, "< 2\\*\\*31")])
@pytest.mark.parametrize("entry", [key_token_scores, token_advantage])
def test_out_of_range_ids_under_the_mask_raise(value, message, entry):
    responses, mask, rewards, index = random_cases(seed=1, small=True)[0][1:]
    responses = responses.clone()
    responses[3, 2] = value
    mask = mask.clone()
    mask[3, 2] = True
    with pytest.raises(ValueError, match=message):
        entry(responses, mask, rewards, index, backend="cpu")
    mask[3, 2] = False  # under mask 0 the id is never read
    entry(responses, mask, rewards, index, backend="cpu")


def test_empty_batches():
    for B, L in ((0, 5), (4, 0)):
        out = token_advantage(torch.zeros(B, L, dtype=torch.int64), torch.ones(B, L, dtype=torch.bool),
                              torch.zeros(B), torch.zeros(B, dtype=torch.int64), backend="cpu")
        assert out.shape == (B, L) and out.dtype == torch.float32


def test_empty_batches_score_no_rows():
    for B, L in ((0, 5), (4, 0)):
        scores = key_token_scores(torch.zeros(B, L, dtype=torch.int64), torch.ones(B, L, dtype=torch.bool),
                                  torch.zeros(B), torch.zeros(B, dtype=torch.int64), backend="cpu")
        assert scores.score.shape == (0,) and scores.n_c.shape == (min(B, 1),)


@pytest.mark.parametrize("config", [KTAEConfig(), KTAEConfig(alpha=0.5, beta=2.0, use_tf=False)])
def test_small_groups_score_from_the_cached_grid(config, monkeypatch):
    """Small groups' key-token scores look their tables up in the cached full grid (no per-call table
    statistics), with the same bits as the rows' distinct tables; groups of several sizes in one batch."""
    batch = make_batch(np.random.default_rng(5), [16, 12, 9, 16, 1, 2], 60, 300, zipf=True)
    monkeypatch.setattr(method, "distinct_tables", _must_not_run)
    cached = key_token_scores(*batch, config=config, backend="cpu")
    monkeypatch.undo()
    monkeypatch.setattr(method, "full_grid_statistics", lambda *args: None)
    distinct = key_token_scores(*batch, config=config, backend="cpu")
    for name in ("group", "token", "a", "b", "p_value", "F", "IG", "x", "score"):
        assert torch.equal(getattr(cached, name), getattr(distinct, name)), name


def _must_not_run(*args, **kwargs):
    raise AssertionError("small groups must take their tables' statistics from the cached full grid")


def test_not_built_is_reported_with_how_to_build(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_kernel(name, *args, **kwargs):
        if name == cpu.EXTENSION:
            raise ImportError(f"No module named {cpu.EXTENSION!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_kernel)
    assert "cpu" not in available_backends("cpu")
    assert get_backend("auto", "cpu").__name__ == "ktae_kernels.backends.torch"
    with pytest.raises(BackendUnavailableError, match="not built.*pip install"):
        get_backend("cpu", "cpu")


def test_ci_builds_the_native_kernel():
    """CI installs from a clean clone on a machine with g++: the kernel must be there."""
    if not os.environ.get("CI"):
        pytest.skip("only checked in CI")
    assert cpu.unavailable_reason() is None
