"""Session setup: without a GPU, Triton kernels run in Triton's CPU interpreter.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports ``ktae_kernels.backends.triton``. An explicit TRITON_INTERPRET in the environment wins.

Every test starts with no table size learnt by the GPU backends (``DeviceState.clear``), so that a
test's table sizes and blocks per SM do not depend on the tests before it. Their cached tensors (the
statistics grids: the same values whoever made them) stay, as in a training run.

The tests of the modules in ``CORE`` are marked ``core``: the README's test command,
``python -m pytest -q -m core``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: the README's test command (``-m core``): the library on the CPU against the scipy reference, with the
#: test and bench extras alone (no framework, no GPU kernel): the API and its errors, the method, Fisher,
#: the torch and native backends, properties, the demo, ``--check`` and the README's quick start.
CORE = frozenset({"test_api", "test_config", "test_cpu_backend", "test_demo", "test_docs", "test_errors",
                  "test_fisher", "test_method", "test_metrics", "test_properties", "test_torch_backend"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.stem in CORE:
            item.add_marker(pytest.mark.core)


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
