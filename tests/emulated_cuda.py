"""The cuda backend on the CPU emulator's kernels, as a backend module a ``BackendSpec`` can load (for
plans in tests): each function is ``ktae_kernels.backends.cuda``'s with ``extension`` = ``EXTENSION``,
which the test sets to the emulator build (the ``emulator`` fixture)."""
from types import ModuleType

from ktae_kernels.backends import cuda

EXTENSION: ModuleType | None = None


def key_token_scores(batch, config, options):
    return cuda.key_token_scores(batch, config, options, extension=EXTENSION)


def token_advantage(batch, config, given, out, options):
    return cuda.token_advantage(batch, config, given, out, options, extension=EXTENSION)


def capture(batch, config, given, out, options):
    return cuda.capture(batch, config, given, out, options, extension=EXTENSION)
