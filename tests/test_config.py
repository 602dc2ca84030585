"""KTAEConfig: defaults from the method, frozen, and a ValueError naming each bad field."""
import dataclasses

import pytest

from ktae_kernels import KTAEConfig


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
    ("ignore_token_ids", [1.5]), ("alpha", True),
])
def test_bad_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        KTAEConfig(**{field: value})


def test_alpha_and_beta_not_both_zero():
    with pytest.raises(ValueError, match="alpha"):
        KTAEConfig(alpha=0.0, beta=0.0)
    assert KTAEConfig(alpha=0.0, beta=1.0).alpha == 0.0
