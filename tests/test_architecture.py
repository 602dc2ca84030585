"""The package's house rules, read from the code's own imports (nothing is run):

- a backend (``ktae_kernels.backends.<name>`` and its submodules) imports no other backend, nor
  ``api``, the registry, the data-parallel path, the adapters or viz;
- the whole package has no import cycle (imports inside functions count too);
- the kernels' constants are method's / validation's (read from the C++, CUDA and Triton sources).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ktae_kernels import method, validation

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ktae_kernels"
BACKENDS = ("torch", "cpu", "cuda", "triton")
#: modules a backend must never import: the layers above it.
ABOVE_BACKENDS = ("ktae_kernels.api", "ktae_kernels.plan", "ktae_kernels.registry", "ktae_kernels.distributed",
                  "ktae_kernels.integrations", "ktae_kernels.viz", "ktae_kernels.metrics", "ktae_kernels.__main__")


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


def test_no_backend_imports_another_backend_the_api_or_the_registry():
    bad = []
    for module, targets in import_graph().items():
        own = backend_of(module)
        if own is None:
            continue
        for target in targets:
            other = backend_of(target)
            if (other is not None and other != own) or target.startswith(ABOVE_BACKENDS):
                bad.append(f"{module} -> {target}")
    assert not bad, "backends must depend only on the shared lower modules:\n" + "\n".join(sorted(bad))


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


def test_triton_uses_methods_constants():
    """The Triton kernels take TF_EPS and MAX_TOKEN_ID from method / validation (no copy to drift)."""
    pipeline = (PACKAGE / "backends/triton/pipeline.py").read_text()
    assert "from ...method import TF_EPS" in pipeline and not re.search(r"\b1e-5\b", pipeline)
    assert "_MAX_ID = tl.constexpr(MAX_TOKEN_ID)" in pipeline


def test_the_gpu_backends_share_their_constants_with_the_cuda_sources():
    """One MAX_GROUP_TOKENS, one baseline enum and one flag count for both GPU backends and csrc."""
    from ktae_kernels.backends import cuda, device

    header = (ROOT / "csrc/ktae_kernels.h").read_text()
    assert int(eval(constant(ROOT / "csrc/ktae_kernels.h", "kMaxGroupTokens").replace("int64_t{1}", "1"))) == \
        device.MAX_GROUP_TOKENS
    codes = dict(re.findall(r"kBaseline(\w+) = (\d+)", header))
    assert {name.lower(): int(code) for name, code in codes.items()} == device.BASELINE_CODES
    assert int(constant(ROOT / "csrc/ktae_kernels.h", "kAdvantageFlags")) == cuda.ADVANTAGE_FLAGS
