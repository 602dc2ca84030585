"""The package's house rules, read from the code's own imports (nothing is run):

- every module imports only what its layer allows (``ALLOWED``, the whitelist docs/architecture.md
  draws); a new module must be given a layer here;
- a backend imports no other backend (its own submodules aside);
- the whole package has no import cycle (imports inside functions count too);
- bench/ uses no private name of the package;
- every constant the C++, CUDA, Triton and Python code share is one value (read from the sources).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ktae_kernels import fisher, method, validation

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ktae_kernels"
BACKENDS = ("torch", "cpu", "cuda", "triton")

#: the shared lower modules: formulas, inputs, options, the backend contract
LOWER = {"types", "config", "options", "primitives", "fisher", "method", "validation"}
#: what a backend may import besides its own submodules
BACKEND_IMPORTS = LOWER | {"backends.base", "backends.device"}
#: the public API's modules, which adapters, viz and the demo call
PUBLIC = {"ktae_kernels", "api", "plan", "registry", "metrics"}
#: module (without "ktae_kernels.") -> the package modules it may import; prefixes ending in "." give a
#: rule to every module under them.
ALLOWED: dict[str, set[str]] = {
    "types": set(), "config": {"options"}, "options": set(), "primitives": set(),
    "fisher": {"types"},
    "method": {"config", "fisher", "primitives", "types"},
    "validation": {"config", "options", "types"},
    "reference": LOWER,
    "backends": set(),
    "backends.base": {"config", "options", "types"},
    "backends.device": {"backends.base", "config", "fisher", "method"},
    "backends.torch": BACKEND_IMPORTS, "backends.cpu": BACKEND_IMPORTS, "backends.cuda": BACKEND_IMPORTS,
    "backends.triton": BACKEND_IMPORTS | {"backends.triton.pipeline"},
    "backends.triton.": BACKEND_IMPORTS | {"backends.triton.hashing", "backends.triton.statistics"},
    "registry": {"backends.base", "backends.cpu", "backends.cuda"},  # availability probes
    "distributed": LOWER | {"backends.torch"},  # the torch stages over a process group
    "api": LOWER | {"backends.base", "registry", "distributed"},
    "plan": LOWER | {"backends.base", "backends.device", "registry"},
    "metrics": LOWER,
    "ktae_kernels": LOWER | PUBLIC | {"backends.base"},
    "__main__": {"ktae_kernels", "registry", "viz"},
    "viz": {"viz.decode", "viz.html", "viz.png"},
    "viz.": LOWER | PUBLIC | {"viz.common", "viz.decode", "viz.html", "viz.png"},
    "integrations": set(),
    "integrations.": LOWER | PUBLIC | {"integrations.shared", "integrations.import_hooks", "integrations.gathered"},
    "integrations.verl": {"integrations.verl.estimator", "integrations.verl.loading", "integrations.verl.settings"},
    "integrations.verl.": LOWER | PUBLIC | {"integrations.shared", "integrations.import_hooks"}
                          | {f"integrations.verl.{m}" for m in ("check", "estimator", "framework", "loading",
                                                                "settings", "trainers")},
}


def allowed(module: str) -> set[str] | None:
    """The whitelist of ``module`` (None: no rule, a new module to place)."""
    name = module.removeprefix("ktae_kernels.") if module != "ktae_kernels" else module
    if name in ALLOWED:
        return ALLOWED[name]
    prefixes = [p for p in ALLOWED if p.endswith(".") and name.startswith(p)]
    return ALLOWED[max(prefixes, key=len)] if prefixes else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def existing(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """The package modules ``path`` imports, at any depth in the file (relative imports resolved;
    ``from X import y`` counts ``X.y`` when that is a module, else ``X``)."""
    name = module_name(path)
    package = name if is_package(path) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if existing(child) else base)
    return {m for m in found if m.startswith("ktae_kernels") and m != name}


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def backend_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "backends" and parts[2] in BACKENDS:
        return parts[2]
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "ktae_kernels.method" in graph["ktae_kernels.backends.torch"]
    assert "ktae_kernels.backends.base" in graph["ktae_kernels.registry"]
    assert {"ktae_kernels.backends.triton.hashing", "ktae_kernels.backends.device"} <= graph[
        "ktae_kernels.backends.triton.pipeline"]


def test_every_module_imports_only_what_its_layer_allows():
    bad, unplaced = [], []
    for module, targets in import_graph().items():
        rule = allowed(module)
        if rule is None:
            unplaced.append(module)
            continue
        full = {f"ktae_kernels.{m}" if m != "ktae_kernels" else m for m in rule}
        bad += [f"{module} -> {t}" for t in sorted(targets - full)]
    assert not unplaced, f"modules without a layer in ALLOWED: {unplaced}"
    assert not bad, "imports outside the module's layer:\n" + "\n".join(bad)


def test_no_backend_imports_another_backend():
    bad = [f"{module} -> {target}" for module, targets in import_graph().items() if backend_of(module)
           for target in targets if backend_of(target) not in (None, backend_of(module))]
    assert not bad, bad


def test_bench_uses_no_private_name_of_the_package():
    """bench/ reaches the package through public names only (no ``_name`` imported or used as an attribute
    of a package module), so a backend's internals can change without breaking it."""
    bad = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ktae_kernels"):
                bad += [f"{path.name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
                modules.update(a.asname or a.name for a in node.names)
                if any(part.startswith("_") for part in node.module.split(".")):
                    bad.append(f"{path.name}: {node.module}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("ktae_kernels"):
                        modules.add(a.asname or a.name.split(".")[0])
                        bad += [f"{path.name}: import {a.name}"] if any(p.startswith("_") for p in a.name.split(".")) else []
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in modules:
                    bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def constant(source: Path, name: str) -> str:
    """The value text of ``constexpr <type> name = <value>;`` in a C++ / CUDA source."""
    found = re.findall(rf"constexpr\s+[\w:]+\s+{name}\s*=\s*([^;]+);", source.read_text())
    assert len(found) == 1, f"{source.name}: expected one definition of {name}, found {found}"
    return found[0].strip()


@pytest.mark.parametrize("source", ["csrc/cpu/ktae_cpu.cpp", "csrc/ktae_kernels.cu"])
def test_kernel_constants_are_methods(source):
    path = ROOT / source
    assert float(constant(path, "kTfEps")) == method.TF_EPS
    assert int(constant(path, "kMaxTokenId")) == validation.MAX_TOKEN_ID


def test_the_cpu_kernels_statistics_constants_are_fishers():
    header = ROOT / "csrc/cpu/statistics.h"
    assert float(constant(header, "kScipyRtol")) == fisher.SCIPY_RTOL
    assert eval(constant(header, "kPOne")) == fisher.P_ONE
    assert eval(constant(header, "kLogErr")) == fisher._LOG_ERR
    assert float(constant(header, "kLog2")) == __import__("math").log(2.0)


def test_triton_uses_methods_constants():
    """The Triton kernels take TF_EPS and MAX_TOKEN_ID from method / validation (no copy to drift)."""
    pipeline = (PACKAGE / "backends/triton/pipeline.py").read_text()
    assert "from ...method import TF_EPS" in pipeline and not re.search(r"\b1e-5\b", pipeline)
    assert "_MAX_ID = tl.constexpr(MAX_TOKEN_ID)" in pipeline


def test_the_gpu_backends_share_their_constants_with_the_cuda_sources():
    """One MAX_GROUP_TOKENS, one baseline enum, one flag count and the launch constants the host mirrors."""
    from ktae_kernels.backends import cuda, device

    path = ROOT / "csrc/ktae_kernels.h"
    header = path.read_text()
    assert int(eval(constant(path, "kMaxGroupTokens").replace("int64_t{1}", "1"))) == device.MAX_GROUP_TOKENS
    codes = dict(re.findall(r"kBaseline(\w+) = (\d+)", header))
    assert {name.lower(): int(code) for name, code in codes.items()} == device.BASELINE_CODES
    assert int(constant(path, "kAdvantageFlags")) == cuda.ADVANTAGE_FLAGS
    for name, value in (("kMaxThreads", cuda.MAX_THREADS), ("kUnroll", cuda.UNROLL),
                        ("kMinCapacity", cuda.MIN_CAPACITY), ("kPackedMaxTokens", cuda.PACKED_MAX_TOKENS)):
        assert int(constant(path, name)) == value, name
    modes = dict(re.findall(r"k(Count|Rows) = (\d+)", header))
    assert (int(modes["Count"]), int(modes["Rows"])) == (cuda.COUNT, cuda.ROWS)
