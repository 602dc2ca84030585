"""Patch a framework's module when (and only in the process where) it is imported: a meta-path finder
that runs a patch right after the module executes, or at once when it is already imported. Used by
the verl adapter (trainer modules) and the OpenRLHF one (the trainer module, in the trainer actor only)."""
from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable, Mapping

Patch = Callable[[Any], None]


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the patch on the executed module."""

    def __init__(self, loader: Any, patch: Patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds modules through the other finders and patches those in ``patches`` once loaded."""

    def __init__(self, owner: str, patches: Mapping[str, Patch]):
        self.owner, self.patches = owner, dict(patches)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, AfterImport) or type(finder).__name__ == "AfterImport" or \
                    not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def patch_on_import(owner: str, patches: Mapping[str, Patch]) -> None:
    """Apply ``patches`` (module name -> patch) to the modules already imported, and to the others when
    they are. ``owner`` names the caller: installing again for it replaces its finder (idempotent, also
    across a reload of the caller)."""
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "owner", None) != owner]
    sys.meta_path.insert(0, AfterImport(owner, patches))
