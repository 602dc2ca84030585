"""ExecutionOptions: how a call runs, apart from the method's hyper-parameters (``KTAEConfig``).

No option changes a result: every setting gives the same advantages, bit for bit. They tune speed,
and the table-size knobs let tests and benchmarks force the backends' overflow paths.
"""
from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, TypeVar

_Class = TypeVar("_Class", bound=type)


def named_fields(moved: Mapping[str, str] | None = None) -> Callable[[_Class], _Class]:
    """Class decorator of a dataclass: a keyword that is not a field raises a TypeError naming it, the
    field it is closest to, or where it went (``moved``: former field -> a sentence, formatted with the
    given ``value``), and every field. Python's own message names only the keyword."""

    def decorate(cls: _Class) -> _Class:
        init = cls.__init__
        names = [f.name for f in fields(cls) if f.init]

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except TypeError:
                unknown = [name for name in kwargs if name not in names]
                if not unknown:
                    raise
                name = unknown[0]
                close = difflib.get_close_matches(name, names, n=1)
                hint = (f": {moved[name].format(value=kwargs[name])}" if moved and name in moved
                        else f" (did you mean {close[0]!r}?)" if close else "")
                raise TypeError(f"{cls.__name__} has no field {name!r}{hint}; its fields are "
                                f"{', '.join(names)}") from None

        cls.__init__ = __init__
        return cls

    return decorate


def _power_of_two(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value!r}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _bools(options: object, names: tuple[str, ...]) -> None:
    """ValueError naming the first of ``options``' fields ``names`` that is not a bool."""
    for name in names:
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{type(options).__name__}.{name} must be a bool, got {getattr(options, name)!r}")


@named_fields()
@dataclass(frozen=True)
class KernelVariant:
    """How the ``cuda`` backend's kernels are compiled. A variant other than the default is compiled
    (by NVRTC, and cached) the first time a call asks for it; every variant computes the same bits.

    unroll: positions each thread loads per step of the scan, the table build and the gather (2, 4 or
        8): the loads in flight before the first is used.
    match_any: lanes of a warp holding the same id are merged (``__match_any_sync``), so a frequent id
        costs one atomic per warp; False: each lane updates its own id's slot.
    load_ahead: while a step's ids are inserted, ask L2 for the lines of the next step's mask and ids.
    """

    unroll: int = 4
    match_any: bool = True
    load_ahead: bool = True

    def __post_init__(self) -> None:
        if type(self.unroll) is not int or self.unroll not in (2, 4, 8):
            raise ValueError(f"KernelVariant.unroll must be 2, 4 or 8, got {self.unroll!r}")
        _bools(self, ("match_any", "load_ahead"))

    def macros(self) -> tuple[tuple[str, str], ...]:
        """The variant as the device source's compile-time macros (ktae_args.h), name and value."""
        return (("KTAE_UNROLL", str(self.unroll)), ("KTAE_MATCH_ANY", str(int(self.match_any))),
                ("KTAE_LOAD_AHEAD", str(int(self.load_ahead))))


@named_fields()
@dataclass(frozen=True)
class CudaTuning:
    """Launch choices of the ``cuda`` backend.

    table_slots: force each group's shared-memory table to this many slots (a power of two >= 2;
        None: sized by the group's masked tokens and the distinct ids earlier calls saw); a group
        with more distinct ids takes the global-memory pass.
    packed: the 12-byte slot (16-bit counters beside one presence word) for groups of at most 32
        rollouts and 65,535 masked tokens.
    blocks_per_sm: size shared tables so that this many blocks share an SM (1 or 2; None: 2 once
        the tables of this batch layout are known to fit half an SM).
    max_threads: most threads per block (a multiple of 32 in [64, 1024]).
    slot_index: the shared pass records each position's slot while building, and the gather reads
        2 bytes a position instead of the mask and the int64 id.
    largest_first: the table passes take the groups with the most masked tokens first (one device sort
        of the groups a call), so that a large group does not run alone in the last wave.
    variant: how the kernels are compiled (``KernelVariant``).
    """

    table_slots: int | None = None
    packed: bool = True
    blocks_per_sm: int | None = None
    max_threads: int = 1024
    slot_index: bool = True
    largest_first: bool = False
    variant: KernelVariant = KernelVariant()

    def __post_init__(self) -> None:
        if not isinstance(self.variant, KernelVariant):
            raise ValueError(f"CudaTuning.variant must be a KernelVariant, got {self.variant!r}")
        if self.table_slots is not None:
            _power_of_two("CudaTuning.table_slots", self.table_slots, 2)
        if self.blocks_per_sm not in (None, 1, 2):
            raise ValueError(f"CudaTuning.blocks_per_sm must be None, 1 or 2, got {self.blocks_per_sm!r}")
        threads = self.max_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads % 32 or not 64 <= threads <= 1024:
            raise ValueError(f"CudaTuning.max_threads must be a multiple of 32 in [64, 1024], got {threads!r}")
        _bools(self, ("packed", "slot_index", "largest_first"))


@named_fields()
@dataclass(frozen=True)
class TritonTuning:
    """Table sizes of the ``triton`` backend's first try (a group that overflows them is rebuilt on the
    device; a batch whose rebuilds pass the budget is redone with exact sizes, or, in a replay of a
    captured call, reported by ``TokenAdvantagePlan.check``).

    first_guess: slots of a group's first table per masked token (0 < x <= 4; rounded up to a power of
        two).
    probe_limit: linear probes a lane makes in a first table before its group is rebuilt.
    max_first_slots: most slots of a first table (a power of two >= 16).
    budget_bytes: most bytes the first try's tables and rebuilds may take.
    """

    first_guess: float = 0.5
    probe_limit: int = 256
    max_first_slots: int = 2**16
    budget_bytes: int = 512 * 2**20

    def __post_init__(self) -> None:
        guess = self.first_guess
        if isinstance(guess, bool) or not isinstance(guess, (int, float)) or not math.isfinite(guess) \
                or not 0 < guess <= 4:
            raise ValueError(f"TritonTuning.first_guess must be in (0, 4], got {guess!r}")
        _positive_int("TritonTuning.probe_limit", self.probe_limit)
        _power_of_two("TritonTuning.max_first_slots", self.max_first_slots, 16)
        _positive_int("TritonTuning.budget_bytes", self.budget_bytes)


@named_fields()
@dataclass(frozen=True)
class ExecutionOptions:
    """How ``token_advantage`` / ``key_token_scores`` / a plan run: per-backend knobs that never change
    the result. ``ExecutionOptions()`` is every backend's default.

    threads: threads of the native CPU kernel (``backend="cpu"``), at most; None:
        ``torch.get_num_threads()``. Small batches use fewer (one per group at most).
    cuda: ``CudaTuning``. triton: ``TritonTuning``.

    Example:
        >>> from ktae_kernels import ExecutionOptions, TritonTuning
        >>> ExecutionOptions(threads=4, triton=TritonTuning(first_guess=0.01)).triton.probe_limit
        256
    """

    threads: int | None = None
    cuda: CudaTuning = field(default_factory=CudaTuning)
    triton: TritonTuning = field(default_factory=TritonTuning)

    def __post_init__(self) -> None:
        if self.threads is not None:
            threads = self.threads
            if isinstance(threads, bool) or not hasattr(threads, "__index__") or int(threads) < 1:
                raise ValueError(f"ExecutionOptions.threads must be None or an int >= 1, got {threads!r}")
            object.__setattr__(self, "threads", int(threads))
        if not isinstance(self.cuda, CudaTuning):
            raise ValueError(f"ExecutionOptions.cuda must be a CudaTuning, got {self.cuda!r}")
        if not isinstance(self.triton, TritonTuning):
            raise ValueError(f"ExecutionOptions.triton must be a TritonTuning, got {self.triton!r}")


DEFAULT_OPTIONS = ExecutionOptions()
