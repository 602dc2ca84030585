"""KTAEConfig: defaults from the method, frozen, a ValueError naming each bad field, and a TypeError naming
an unknown one (with the closest field, or where a former field went)."""
import dataclasses
import inspect
import re

import numpy as np
import pytest
import torch

from ktae_kernels import CudaTuning, ExecutionOptions, KernelVariant, KTAEConfig, key_token_scores, token_advantage


def test_defaults_follow_the_method():
    c = KTAEConfig()
    assert (c.alpha, c.beta, c.use_tf, c.top, c.k1, c.b) == (1.0, 1.0, True, 1.0, 2.0, 0.5)
    assert (c.correct_threshold, c.weight, c.baseline, c.eps, c.fisher) == (0.0, 1.0, "grpo", 1e-6, "exact")
    assert c.ignore_token_ids == ()


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KTAEConfig().alpha = 2.0  # type: ignore[misc]


def test_ignore_ids_normalised():
    assert KTAEConfig(ignore_token_ids=[151643, 5, 5]).ignore_token_ids == (5, 151643)


@pytest.mark.parametrize("field, value", [
    ("alpha", -1.0), ("beta", float("nan")), ("top", 0.0), ("k1", -2.0), ("b", 1.5), ("b", -0.1),
    ("eps", -1e-6), ("weight", float("inf")), ("correct_threshold", "0"), ("baseline", "rloo"),
    ("fisher", "float32"), ("use_tf", 1), ("ignore_token_ids", [-1]), ("ignore_token_ids", "151643"),
    ("ignore_token_ids", [1.5]), ("alpha", True), ("eps", 0.0), ("eps", float("inf")),
    ("ignore_token_ids", [2**31]), ("top", np.bool_(True)),
])
def test_bad_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        KTAEConfig(**{field: value})


def test_eps_must_be_positive_for_groups_of_equal_rewards():
    """eps = 0 would divide a group of equal rewards (std 0) by 0: NaN advantages on every backend."""
    with pytest.raises(ValueError, match=r"^KTAEConfig.eps must be > 0, got 0.0$"):
        KTAEConfig(eps=0.0)
    responses = torch.tensor([[5, 7, 2], [5, 8, 2]])
    adv = token_advantage(responses, responses != 0, [1.0, 1.0], [0, 0], config=KTAEConfig(eps=1e-12),
                          backend="torch")
    assert adv.tolist() == [[0.0] * 3] * 2


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.int64(2), np.int8(1)])
def test_numpy_real_scalars_are_taken_as_python_floats(value):
    config = KTAEConfig(alpha=value, beta=value, top=value, correct_threshold=value, weight=value)
    assert (config.alpha, config.top, config.weight) == (float(value),) * 3
    assert type(config.alpha) is float and type(config.correct_threshold) is float


def test_real_fields_are_floats_so_every_backend_takes_them():
    """A Python int past int64 in a real field is stored as a float (the kernels take float64 scalars); one
    past float64's range is refused naming the field, as is alpha + beta past it (the key divides by it)."""
    config = KTAEConfig(top=2**70, correct_threshold=2**80, alpha=1, weight=3)
    assert (type(config.top), type(config.correct_threshold), type(config.alpha)) == (float, float, float)
    responses = torch.tensor([[5, 7], [5, 8], [6, 7], [6, 9]])
    batch = (responses, torch.ones_like(responses, dtype=torch.bool), [1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0])
    for backend in ("torch", "cpu", "reference"):
        scores = key_token_scores(*batch, config=KTAEConfig(top=2**70), backend=backend)
        assert torch.equal(scores.score, key_token_scores(*batch, config=KTAEConfig(top=float(2**70)),
                                                          backend=backend).score), backend
    with pytest.raises(ValueError, match=r"^KTAEConfig.alpha must be a finite number"):
        KTAEConfig(alpha=2**1100)
    with pytest.raises(ValueError, match=r"^KTAEConfig.alpha \+ KTAEConfig.beta must be > 0 and finite"):
        KTAEConfig(alpha=1e308, beta=1e308)


@pytest.mark.parametrize("value", [np.array(5), torch.tensor(5), 5, b"ab"])
def test_ignore_ids_that_are_not_a_collection_are_named(value):
    with pytest.raises(ValueError, match=r"^KTAEConfig.ignore_token_ids must be an iterable of ints"):
        KTAEConfig(ignore_token_ids=value)
    assert KTAEConfig(ignore_token_ids=(i for i in (7, 3))).ignore_token_ids == (3, 7)


def test_ignore_ids_must_fit_the_token_id_range():
    """Token ids lie in [0, 2**31) (``responses``' range): a larger ignored id can never match a token."""
    assert KTAEConfig(ignore_token_ids=(2**31 - 1, np.int64(3))).ignore_token_ids == (3, 2**31 - 1)
    with pytest.raises(ValueError, match=r"^KTAEConfig.ignore_token_ids must be < 2\*\*31 \(token ids' range\), "
                                         r"got 2147483648$"):
        KTAEConfig(ignore_token_ids=(5, 2**31))


@pytest.mark.parametrize("value", [0, 32, 100, 2000, 1.5, "a", True, None])
def test_max_threads_has_one_message(value):
    with pytest.raises(ValueError, match=rf"^CudaTuning.max_threads must be a multiple of 32 in \[64, 1024\], "
                                         rf"got {re.escape(repr(value))}$"):
        CudaTuning(max_threads=value)
    assert CudaTuning(max_threads=64).max_threads == 64


def test_alpha_and_beta_not_both_zero():
    with pytest.raises(ValueError, match="alpha"):
        KTAEConfig(alpha=0.0, beta=0.0)
    assert KTAEConfig(alpha=0.0, beta=1.0).alpha == 0.0


FIELDS = "alpha, beta, use_tf, top, k1, b, correct_threshold, ignore_token_ids, weight, baseline, eps, fisher"


def test_threads_says_it_moved_to_execution_options():
    with pytest.raises(TypeError) as raised:
        KTAEConfig(threads=4)
    assert str(raised.value) == ("KTAEConfig has no field 'threads': the native kernel's thread count moved to "
                                 "ExecutionOptions: pass `options=ExecutionOptions(threads=4)` to the call; its "
                                 f"fields are {FIELDS}")


def test_a_misspelt_field_names_the_closest_one_and_every_field():
    with pytest.raises(TypeError) as raised:
        KTAEConfig(ignore_tokens=(151643,))
    assert str(raised.value) == (f"KTAEConfig has no field 'ignore_tokens' (did you mean 'ignore_token_ids'?); "
                                 f"its fields are {FIELDS}")
    with pytest.raises(TypeError) as raised:
        ExecutionOptions(thread=2)
    assert str(raised.value) == ("ExecutionOptions has no field 'thread' (did you mean 'threads'?); its fields are "
                                 "threads, cuda, triton")
    with pytest.raises(TypeError, match=r"^CudaTuning has no field 'slots' \(did you mean 'table_slots'\?\)"):
        CudaTuning(slots=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(unroll=3), r"KernelVariant.unroll must be 2, 4 or 8, got 3"),
    (dict(unroll=True), r"KernelVariant.unroll must be 2, 4 or 8, got True"),
    (dict(unroll=4.0), r"KernelVariant.unroll must be 2, 4 or 8, got 4.0"),
    (dict(match_any=1), r"KernelVariant.match_any must be a bool, got 1"),
    (dict(load_ahead="no"), r"KernelVariant.load_ahead must be a bool, got 'no'"),
])
def test_kernel_variant_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        KernelVariant(**kwargs)


def test_a_kernel_variant_goes_in_cuda_tuning():
    assert CudaTuning().variant == KernelVariant() and KernelVariant(unroll=8).macros()[0] == ("KTAE_UNROLL", "8")
    with pytest.raises(ValueError, match=r"^CudaTuning.variant must be a KernelVariant, got \{'unroll': 2\}$"):
        CudaTuning(variant={"unroll": 2})
    with pytest.raises(TypeError, match=r"^KernelVariant has no field 'unrol' \(did you mean 'unroll'\?\)"):
        KernelVariant(unrol=2)


def test_the_field_check_keeps_the_dataclass_behaviour():
    """Positional arguments, ``dataclasses.replace`` and the signature are the dataclass's own; a negative
    weight's warning still points at the caller's line."""
    config = KTAEConfig(2.0, 3.0)
    assert (config.alpha, config.beta) == (2.0, 3.0)
    assert dataclasses.replace(config, weight=0.5).weight == 0.5
    assert list(inspect.signature(KTAEConfig).parameters)[:2] == ["alpha", "beta"]
    with pytest.warns(UserWarning) as caught:
        KTAEConfig(weight=-1.0)
    assert caught[0].filename == __file__
