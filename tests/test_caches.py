"""``ktae_kernels.clear_caches``: the one reset of everything the package and its compiled extensions keep
between calls. Each cache is seen through what it does (a value made again, a warning given again, a
module loaded again), never through its private name; a source scan checks that every memo of the
package is registered with the reset."""
from __future__ import annotations

import ast
import dataclasses
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import ktae_kernels
from cases import make_batch
from ktae_kernels import KTAEConfig, clear_caches, method, token_advantage
from ktae_kernels.backends import cpu, cuda, device as device_state
from ktae_kernels.backends.base import BackendSpec
from ktae_kernels.registry import backend_spec, register_backend, resolve

PACKAGE = Path(ktae_kernels.__file__).parent


def test_clear_caches_forgets_the_device_state():
    state = device_state.state(torch.device("cpu"))
    made = []
    make = lambda: made.append(1) or torch.ones(2)  # noqa: E731
    state.cached(("caches-test",), make)
    state.cached(("caches-test",), make)
    state.learn(("caches-test",), largest=3, distinct=7)
    assert len(made) == 1 and state.learnt(("caches-test",)).distinct == 7
    clear_caches()
    assert state.learnt(("caches-test",)) is None
    state.cached(("caches-test",), make)
    assert len(made) == 2


def test_clear_caches_forgets_the_methods_memos():
    n_c, n_w = torch.tensor([3, 2]), torch.tensor([1, 2])
    first = method.full_grid_statistics(n_c, n_w, KTAEConfig())
    assert method.full_grid_statistics(n_c, n_w, KTAEConfig()).stats is first.stats  # memoised
    clear_caches()
    again = method.full_grid_statistics(n_c, n_w, KTAEConfig())
    assert again.stats is not first.stats and np.array_equal(again.strength, first.strength)


def test_clear_caches_forgets_which_fallbacks_were_warned_about():
    stub = backend_spec("cpu")
    register_backend(dataclasses.replace(stub, unavailable=lambda kind: "not built (stub)"))
    try:
        clear_caches()
        with pytest.warns(RuntimeWarning, match="backend 'cpu' is unavailable: not built"):
            resolve("auto", "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            resolve("auto", "cpu")  # warned once
        clear_caches()
        with pytest.warns(RuntimeWarning, match="backend 'cpu' is unavailable: not built"):
            resolve("auto", "cpu")
    finally:
        register_backend(stub)


def test_clear_caches_loads_and_checks_backends_again(monkeypatch):
    spec = BackendSpec("caches-test", "caches_test_backend", ("cpu",), lambda _: None)
    first, second = (types.SimpleNamespace(key_token_scores=print, token_advantage=print) for _ in range(2))
    monkeypatch.setitem(sys.modules, spec.module, first)
    assert spec.load() is first
    monkeypatch.setitem(sys.modules, spec.module, second)
    assert spec.load() is first  # loaded once
    clear_caches()
    assert spec.load() is second


@pytest.mark.skipif(cpu.unavailable_reason() is not None, reason="the native CPU kernel is not built")
def test_clear_caches_empties_the_cpu_kernels_statistics_cache():
    batch = make_batch(np.random.default_rng(11), [300, 200], 40, 400, zipf=True, p_correct=0.4)
    before = token_advantage(*batch, backend="cpu")  # big groups: statistics memoised in the kernel
    assert cpu.load_extension().statistics_cache_size() > 0
    clear_caches()
    assert cpu.load_extension().statistics_cache_size() == 0
    assert torch.equal(token_advantage(*batch, backend="cpu"), before)


def test_clear_caches_forgets_the_compiled_cuda_kernels_in_memory_not_on_disk(tmp_path, monkeypatch):
    """The cuda backend's cubins (and the devices' loaded kernels) are kept in memory; clear_caches forgets
    them, and the next use reads the disk cache instead of compiling (tests/test_cuda_runtime.py)."""
    pytest.importorskip("cuda.core")
    monkeypatch.setenv("KTAE_CACHE_DIR", str(tmp_path))
    first = cuda.runtime.cubin(80)
    assert cuda.runtime.cubin(80) is first
    clear_caches()
    entries = sorted(tmp_path.glob("cuda/*.cubin"))
    assert entries and cuda.runtime.cubin(80) is not first and cuda.runtime.cubin(80) == first
    assert sorted(tmp_path.glob("cuda/*.cubin")) == entries


def test_every_memo_of_the_package_is_cleared_by_clear_caches():
    """A function memoised with ``functools.lru_cache`` / ``cache`` has its ``cache_clear`` registered with
    ``caches.on_clear`` in its own module (directly, or in a reset registered there)."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and any(
                    "lru_cache" in ast.unparse(d) or ast.unparse(d).endswith("cache") for d in node.decorator_list):
                if f"{node.name}.cache_clear" not in text or "on_clear" not in text:
                    missing.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert not missing, f"memos clear_caches does not reach: {missing}"
