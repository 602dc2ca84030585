"""Session setup: without a GPU, Triton kernels run in Triton's CPU interpreter.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports ``ktae_kernels.backends.triton``. An explicit TRITON_INTERPRET in the environment wins.

Every test starts with no table size learnt by the GPU backends (``DeviceState.clear``), so that a
test's table sizes and blocks per SM do not depend on the tests before it. Their cached tensors (the
statistics grids: the same values whoever made them) stay, as in a training run.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_device_state():
    from ktae_kernels.backends import device

    for state in device.states():
        state.clear(cached=False)


@pytest.fixture(params=["cuda"] if torch.cuda.is_available() else
                ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
def device(request):
    """The device the Triton kernels run on here: CUDA, else the CPU under the interpreter (tests that
    take it are skipped where neither is)."""
    return torch.device(request.param)


@pytest.fixture(scope="session")
def emulator():
    """The cuda backend's kernels built for the CPU emulator (tests/emulator.py)."""
    from emulator import load

    return load()
