"""Native CPU backend: the C++17 / OpenMP kernel of ``csrc/cpu/`` (module ``ktae_kernels._cpu``)."""
from __future__ import annotations

import importlib
from types import ModuleType

BUILD_HINT = ("`pip install .` builds it on a machine with a C++17 compiler (g++ or clang++); "
              "reinstall with one on PATH")


def load_extension() -> ModuleType:
    """The compiled kernel module; ImportError when it was not built."""
    return importlib.import_module("ktae_kernels._cpu")


def unavailable_reason() -> str | None:
    """None when the native kernel is built, else why not and how to build it."""
    try:
        load_extension()
    except ImportError as err:
        return f"the native CPU kernel ktae_kernels._cpu is not built ({err}); {BUILD_HINT}"
    return None
