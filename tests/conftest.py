"""Session setup: without a GPU, Triton kernels run in Triton's CPU interpreter.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports ``ktae_kernels.backends.triton``. An explicit TRITON_INTERPRET in the environment wins.

Every test starts with no distinct-id count (nor shared-memory need) remembered by the GPU backends'
sync-free paths (``backends.device.remember_keys``), so that a test's table sizes and blocks per SM do
not depend on the tests before it.
"""
import os
from collections import OrderedDict

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def no_remembered_distinct_ids(monkeypatch):
    from ktae_kernels.backends import device

    monkeypatch.setattr(device, "_DISTINCT", OrderedDict())
