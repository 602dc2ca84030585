"""The cuda backend on the CPU emulator's kernels, as a backend module a ``BackendSpec`` can load (for
plans in tests): each function is ``ktae_kernels.backends.cuda``'s with ``launcher`` = ``LAUNCHER``,
which the test sets to the emulator (the ``emulator`` fixture)."""
from ktae_kernels.backends import cuda

LAUNCHER = None


def key_token_scores(batch, config, options):
    return cuda.key_token_scores(batch, config, options, launcher=LAUNCHER)


def token_advantage(batch, config, given, out, options):
    return cuda.token_advantage(batch, config, given, out, options, launcher=LAUNCHER)


def capture(batch, config, given, out, options):
    return cuda.capture(batch, config, given, out, options, launcher=LAUNCHER)
