"""The package's house rules, read from the code's own imports (nothing is run):

- every module imports only what its layer allows (``ALLOWED``, the whitelist docs/architecture.md
  draws); a new module must be given a layer here;
- a backend imports no other backend (its own submodules aside);
- the whole package has no import cycle (imports inside functions count too);
- tests/ and bench/ use no private name of the package;
- every constant the C++, CUDA, Triton and Python code share is one value (read from the sources).
"""
from __future__ import annotations

import dataclasses

import ast
import re
from pathlib import Path

import pytest

from ktae_kernels import KernelVariant, fisher, method, validation

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ktae_kernels"
BACKENDS = ("torch", "cpu", "cuda", "triton")

#: the shared lower modules: formulas, inputs, options, the backend contract
LOWER = {"caches", "checks", "types", "config", "options", "primitives", "fisher", "method", "validation"}
#: what a backend may import besides its own submodules
BACKEND_IMPORTS = LOWER | {"backends.base", "backends.device"}
#: the public API's modules, which adapters, viz and the demo call
PUBLIC = {"ktae_kernels", "api", "plan", "registry", "metrics"}
#: module (without "ktae_kernels.") -> the package modules it may import; prefixes ending in "." give a
#: rule to every module under them.
ALLOWED: dict[str, set[str]] = {
    "caches": set(), "checks": set(), "types": {"checks"}, "config": {"checks", "options"}, "options": set(),
    "primitives": set(), "fisher": {"checks", "types"},
    "method": {"caches", "config", "fisher", "primitives", "types"},
    "validation": {"checks", "config", "options", "types"},
    "reference": LOWER,
    "backends": set(),
    "backends.base": {"caches", "config", "options", "types"},
    "backends.device": {"backends.base", "caches", "config", "fisher", "method", "types"},
    "backends.torch": BACKEND_IMPORTS, "backends.cpu": BACKEND_IMPORTS,
    "backends.cuda": BACKEND_IMPORTS | {"backends.cuda.abi", "backends.cuda.pipeline", "backends.cuda.runtime"},
    "backends.cuda.": BACKEND_IMPORTS | {"backends.cuda.abi"},
    "backends.triton": BACKEND_IMPORTS | {"backends.triton.pipeline"},
    "backends.triton.": BACKEND_IMPORTS | {"backends.triton.hashing", "backends.triton.statistics"},
    "registry": {"backends.base", "backends.cpu", "backends.cuda", "caches"},  # availability probes
    "distributed": LOWER | {"backends.torch", "registry"},  # the torch stages over a process group
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


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_uses(path: Path) -> list[str]:
    """Every private name of the package ``path`` uses: imported (``from ktae_kernels.x import _y``, a
    module ``ktae_kernels._x``), read as an attribute of a package module or of a name imported from the
    package (``cuda._enqueue``), set, got or deleted by name (``monkeypatch.setattr(registry, "_WARNED",
    ...)``), or spelt out as a dotted path (``"ktae_kernels._C"``). As ``line: use``."""
    tree = ast.parse(path.read_text())
    found, package_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ktae_kernels"):
            if any(_private(p) for p in node.module.split(".")):
                found.append((node.lineno, node.module))
            for alias in node.names:
                package_names.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ktae_kernels"):
                    package_names.add(alias.asname or alias.name.split(".")[0])
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append((node.lineno, alias.name))

    def from_package(node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in package_names

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and from_package(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("setattr", "getattr", "delattr", "hasattr")
              and from_package(node.args[0])):
            found.append((node.lineno, f"{getattr(node.func, 'attr', getattr(node.func, 'id', ''))}"
                                       f"({ast.unparse(node.args[0])}, {node.args[1].value!r})"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ktae_kernels.")
              and re.fullmatch(r"[\w.]+", node.value) and any(_private(p) for p in node.value.split("."))):
            found.append((node.lineno, repr(node.value)))
    return [f"{line}: {use}" for line, use in sorted(set(found))]


def test_tests_and_bench_use_no_private_name_of_the_package():
    """tests/ and bench/ reach the package through public names only, so that its internals can change
    without breaking them; what a test needs is a public seam, documented as one (docs/api.md)."""
    bad = [f"{path.relative_to(ROOT)}:{use}"
           for path in sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py")])
           for use in private_uses(path)]
    assert not bad, "private names of the package used:\n" + "\n".join(bad)


def test_the_private_name_rule_sees_each_kind_of_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import sys\nimport ktae_kernels._C\nfrom ktae_kernels.backends import cuda, _hidden\n"
                      "from ktae_kernels.registry import backend_spec as spec\n"
                      "cuda._enqueue(1)\nspec._x\nmonkeypatch.setattr(cuda, '_y', 1)\nsys.modules['ktae_kernels._cpu']\n"
                      "cuda.enqueue(1)\nsys._getframe\n")
    assert private_uses(sample) == ["2: ktae_kernels._C", "3: ktae_kernels.backends._hidden", "5: cuda._enqueue",
                                    "6: spec._x", "7: setattr(cuda, '_y')", "8: 'ktae_kernels._cpu'"]


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


@pytest.mark.parametrize("source", ["csrc/cpu/ktae_cpu.cpp", "ktae_kernels/backends/cuda/ktae_kernels.cu"])
def test_kernel_constants_are_methods(source):
    path = ROOT / source
    assert float(constant(path, "kTfEps")) == method.TF_EPS
    assert int(constant(path, "kMaxTokenId")) == validation.MAX_TOKEN_ID


def test_the_cpu_kernels_statistics_constants_are_fishers():
    header = ROOT / "csrc/cpu/statistics.h"
    assert float(constant(header, "kScipyRtol")) == fisher.SCIPY_RTOL
    assert eval(constant(header, "kPOne")) == fisher.P_ONE
    assert eval(constant(header, "kLogErr")) == fisher.LOG_ERR
    assert float(constant(header, "kLog2")) == __import__("math").log(2.0)


def test_triton_uses_methods_constants():
    """The Triton kernels take TF_EPS and MAX_TOKEN_ID from method / validation (no copy to drift)."""
    pipeline = (PACKAGE / "backends/triton/pipeline.py").read_text()
    assert "from ...method import TF_EPS" in pipeline and not re.search(r"\b1e-5\b", pipeline)
    assert "_MAX_ID = tl.constexpr(MAX_TOKEN_ID)" in pipeline


def test_the_gpu_backends_share_their_constants_with_the_cuda_sources():
    """One MAX_GROUP_TOKENS and one baseline enum for both GPU backends; the cuda backend reads the rest of
    its constants from the header (``abi``), which the header's own text confirms here."""
    from ktae_kernels.backends import cuda, device
    from ktae_kernels.backends.cuda import abi

    path = ROOT / "ktae_kernels/backends/cuda/ktae_args.h"
    assert int(eval(constant(path, "kMaxGroupTokens").replace("int64_t{1}", "1"))) == device.MAX_GROUP_TOKENS
    codes = dict(re.findall(r"kBaseline(\w+) = (\d+)", path.read_text()))
    assert {name.lower(): int(code) for name, code in codes.items()} == device.BASELINE_CODES
    for name, value in (("kMaxThreads", cuda.MAX_THREADS), ("kMinCapacity", cuda.MIN_CAPACITY),
                        ("kPackedMaxTokens", cuda.PACKED_MAX_TOKENS)):
        assert int(constant(path, name)) == value == abi.CONSTANTS[name], name
    # the header's variant macros default to KernelVariant(): the kernels a compile without -D builds
    macros = dict(re.findall(r"#define (KTAE_\w+) (\d+)", path.read_text()))
    assert {name: int(v) for name, v in KernelVariant().macros()} == {n: int(v) for n, v in macros.items()}
    flags = dict(re.findall(r"(kFlag\w+|kAdvantageFlags) = (\d+)", path.read_text()))
    assert {name: int(at) for name, at in flags.items()} == {name: abi.CONSTANTS[name] for name in flags}
    assert cuda.ADVANTAGE_FLAGS == len(dataclasses.fields(cuda.Flags)) == int(flags["kAdvantageFlags"])
