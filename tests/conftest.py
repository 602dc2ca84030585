"""Session setup: without a GPU, Triton kernels run in Triton's CPU interpreter.

``triton.jit`` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
module imports ``ktae_kernels.triton``. An explicit TRITON_INTERPRET in the environment wins.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
