"""The three packages OpenRLHF imports that do not install without CUDA (flash_attn, deepspeed, vllm),
handed out as empty modules by an import finder, so that OpenRLHF's own trainer code imports and runs on
a CPU (``import_openrlhf``). Everything else, OpenRLHF included, is the real package.

This module imports nothing of OpenRLHF: Ray workers that must not import it import this one.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from contextlib import contextmanager
from typing import Iterator

#: the packages replaced by empty modules (and their submodules).
STUBBED = ("flash_attn", "deepspeed", "vllm")
#: the OpenRLHF modules the tests drive, and those ``openrlhf.cli.train_ppo_ray`` imports (the CLI itself
#: runs as ``__main__``).
MODULES = ("openrlhf.trainer.ppo_trainer", "openrlhf.trainer.ppo_utils.samples_generator",
           "openrlhf.trainer.ppo_utils.experience_maker", "openrlhf.models.utils", "openrlhf.trainer.ray",
           "openrlhf.trainer.ray.launcher", "openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ray.ppo_critic",
           "openrlhf.utils")


class _Placeholder:
    """Whatever OpenRLHF imports by name from a stubbed package; using it says why it cannot work."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a test stub (the package needs CUDA)")


class _StubModule(types.ModuleType):
    """An empty package: any attribute is a placeholder class of that name."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``STUBBED`` packages and their submodules as ``_StubModule`` s."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _is_stub(name: str) -> bool:
    return name.split(".")[0] in STUBBED and isinstance(sys.modules.get(name), _StubModule)


@contextmanager
def stubbed() -> Iterator[None]:
    """Within the block the ``STUBBED`` packages import as empty modules. After it they leave
    ``sys.modules`` again (what was imported meanwhile keeps its references), so that the rest of the
    test session, TRL's and transformers' availability checks included, still finds them absent."""
    finder = StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _is_stub(n)]:
            del sys.modules[name]


def import_openrlhf() -> types.ModuleType:
    """Import the OpenRLHF modules the tests drive (``MODULES``) with the CUDA-only packages stubbed;
    returns ``openrlhf``. ImportError when OpenRLHF is not installed."""
    import ray  # noqa: F401 - the real packages OpenRLHF needs are imported first, without stubs
    import transformers  # noqa: F401

    with stubbed():
        for name in MODULES:
            importlib.import_module(name)
    return sys.modules["openrlhf"]


# ------------------------------------------------------------------- what runs inside Ray workers
def worker_state() -> dict:
    """What a Ray worker that builds no trainer (a vLLM engine, say) holds after the setup hook ran."""
    return {"hooked": any(getattr(f, "owner", None) == "ktae_kernels.integrations.openrlhf" for f in sys.meta_path),
            "openrlhf_imported": any(n == "openrlhf" or n.startswith("openrlhf.") for n in sys.modules),
            "env": {k: os.environ.get(k) for k in ("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "NCCL_DEBUG",
                                                   "TOKENIZERS_PARALLELISM")}}
