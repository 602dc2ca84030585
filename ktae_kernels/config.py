"""KTAEConfig: the method's hyper-parameters, frozen and validated on construction."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

from .checks import finite_real, plain_int
from .options import named_fields

Baseline = Literal["grpo", "mean", "none"]
FisherMode = Literal["exact", "upstream"]

BASELINES: tuple[str, ...] = ("grpo", "mean", "none")
FISHER_MODES: tuple[str, ...] = ("exact", "upstream")
#: token ids must fit a signed 32-bit int (every vocabulary does; the GPU and CPU kernels rely on it).
MAX_TOKEN_ID = 2**31 - 1
#: the real-valued fields, stored as Python floats (the kernels take float64 scalars).
REAL_FIELDS: tuple[str, ...] = ("alpha", "beta", "top", "k1", "b", "correct_threshold", "weight", "eps")


def _check_real(name: str, value: object, *, minimum: float | None = None, positive: bool = False) -> None:
    """ValueError naming ``KTAEConfig.name`` unless ``value`` is a finite real number (a Python or numpy
    int or float, not a bool) in range."""
    if not finite_real(value):
        raise ValueError(f"KTAEConfig.{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"KTAEConfig.{name} must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"KTAEConfig.{name} must be >= {minimum}, got {value!r}")


@named_fields(moved={"threads": "the native kernel's thread count moved to ExecutionOptions: pass "
                             "`options=ExecutionOptions(threads={value!r})` to the call"})
@dataclass(frozen=True)
class KTAEConfig:
    """Hyper-parameters of Key-token Advantage Estimation (see README, "The method").

    alpha, beta: weights of the Fisher term F and the information gain IG (>= 0, not both 0).
    use_tf: add the BM25 term-frequency ratio to the Cohen-h direction.
    top: scores lie in (-top, top).
    k1, b: BM25 saturation and length normalisation.
    correct_threshold: a rollout is correct when its reward is > this.
    ignore_token_ids: token ids whose score is forced to 0 (e.g. Qwen's 151643), in ``[0, 2**31)`` as
        token ids are.
    weight: advantage = A_rollout + weight * score; 0 leaves the rollout advantage alone. A negative
        weight reverses the key-token term (the tokens typical of correct rollouts are pushed down),
        which is only an ablation: it is allowed, with a warning, so that such a run can be made.
    baseline: rollout advantage A: "grpo" (group z-score), "mean" (group mean-centred, Dr. GRPO),
        "none" (the reward itself).
    eps: added to the group std in the "grpo" baseline (> 0: a group of equal rewards has std 0).
    fisher: "exact" (scipy's two-sided test in float64) or "upstream" (the published float32 code).

    Raises:
        ValueError: a field is out of range or of the wrong type (the message names the field). Real
            fields take Python or numpy numbers (stored as Python floats), never bools.
        TypeError: an unknown keyword (the message lists the fields; ``threads`` is in ``ExecutionOptions``).

    Example:
        >>> from ktae_kernels import KTAEConfig
        >>> KTAEConfig(ignore_token_ids=[151643, 151643], baseline="mean").ignore_token_ids
        (151643,)
    """

    alpha: float = 1.0
    beta: float = 1.0
    use_tf: bool = True
    top: float = 1.0
    k1: float = 2.0
    b: float = 0.5
    correct_threshold: float = 0.0
    ignore_token_ids: tuple[int, ...] = field(default=())
    weight: float = 1.0
    baseline: Baseline = "grpo"
    eps: float = 1e-6
    fisher: FisherMode = "exact"

    def __post_init__(self) -> None:
        _check_real("alpha", self.alpha, minimum=0.0)
        _check_real("beta", self.beta, minimum=0.0)
        if not 0 < float(self.alpha) + float(self.beta) < math.inf:
            raise ValueError(f"KTAEConfig.alpha + KTAEConfig.beta must be > 0 and finite (they weight F and IG and "
                             f"divide the key), got {self.alpha!r} + {self.beta!r}")
        if not isinstance(self.use_tf, bool):
            raise ValueError(f"KTAEConfig.use_tf must be a bool, got {self.use_tf!r}")
        _check_real("top", self.top, positive=True)
        _check_real("k1", self.k1, positive=True)
        _check_real("b", self.b, minimum=0.0)
        if self.b > 1:
            raise ValueError(f"KTAEConfig.b must be in [0, 1], got {self.b!r}")
        _check_real("correct_threshold", self.correct_threshold)
        _check_real("weight", self.weight)
        if self.weight < 0:
            warnings.warn(f"KTAEConfig.weight={self.weight!r} is negative: the key-token term is reversed (tokens "
                          f"of correct rollouts are pushed down, those of wrong ones up); use weight >= 0 "
                          f"unless this is an ablation", UserWarning, stacklevel=4)
        _check_real("eps", self.eps, positive=True)
        if self.baseline not in BASELINES:
            raise ValueError(f"KTAEConfig.baseline must be one of {BASELINES}, got {self.baseline!r}")
        if self.fisher not in FISHER_MODES:
            raise ValueError(f"KTAEConfig.fisher must be one of {FISHER_MODES}, got {self.fisher!r}")
        object.__setattr__(self, "ignore_token_ids", _normalise_ids(self.ignore_token_ids))
        for name in REAL_FIELDS:  # ints and numpy scalars as Python floats: the kernels take float64
            object.__setattr__(self, name, float(getattr(self, name)))


def _normalise_ids(ids: object) -> tuple[int, ...]:
    """Sorted, de-duplicated tuple of Python ints in ``[0, MAX_TOKEN_ID]``."""
    try:
        if isinstance(ids, (str, bytes)):
            raise TypeError(ids)
        values = list(ids)  # type: ignore[call-overload]
    except TypeError:  # not iterable, or a 0-d array or tensor
        raise ValueError(f"KTAEConfig.ignore_token_ids must be an iterable of ints, got {ids!r}") from None
    out = set()
    for v in values:
        if not plain_int(v):
            raise ValueError(f"KTAEConfig.ignore_token_ids must hold ints, got {v!r}")
        v = int(v)
        if v < 0:
            raise ValueError(f"KTAEConfig.ignore_token_ids must be >= 0, got {v}")
        if v > MAX_TOKEN_ID:
            raise ValueError(f"KTAEConfig.ignore_token_ids must be < 2**31 (token ids' range), got {v}")
        out.add(v)
    return tuple(sorted(out))
