"""What a user who installs the package relies on: one version, the license, type hints, a complete sdist.

The wheel itself (built from the sdist, installed in a fresh venv without a compiler, running the demo)
is checked by ``.ci/package``, which CI runs.
"""
from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import ktae_kernels

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_has_one_source_and_the_changelog_names_it():
    project = pyproject()
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ktae_kernels.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", ktae_kernels.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(r"^## (\S+)", changelog, re.M).group(1) == ktae_kernels.__version__


def test_license_file_matches_the_metadata():
    assert pyproject()["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_package_is_typed():
    assert (ROOT / "ktae_kernels" / "py.typed").is_file()
    assert "py.typed" in pyproject()["tool"]["setuptools"]["package-data"]["ktae_kernels"]


def test_the_cuda_source_is_package_data_and_nvrtc_an_extra():
    """The wheel carries the CUDA kernels' source, which NVRTC compiles at first use; cuda-core and NVRTC come
    with the cuda extras only (a CPU install, and the README's core tests, pull none of it)."""
    data = pyproject()["tool"]["setuptools"]["package-data"]["ktae_kernels"]
    for name in ("ktae_kernels.cu", "ktae_args.h"):
        assert (ROOT / "ktae_kernels" / "backends" / "cuda" / name).is_file()
        assert any(fnmatch.fnmatch(f"backends/cuda/{name}", pattern) for pattern in data), name
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    cuda_packages = ("cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc")
    for extra in ("cuda", "cuda12"):
        assert sorted(d.split(">")[0].split(";")[0].split("-cu12")[0] for d in extras[extra]) == sorted(cuda_packages)
    assert not [d for d in project["dependencies"] + extras["test"] if d.startswith(cuda_packages)]


@pytest.mark.slow
def test_the_wheel_lists_the_cuda_source(tmp_path):
    pytest.importorskip("build")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path),
                           str(ROOT)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = tmp_path.glob("ktae_kernels-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ktae_kernels/backends/cuda/ktae_kernels.cu", "ktae_kernels/backends/cuda/ktae_args.h"} <= names
    assert not [n for n in names if n.startswith("ktae_kernels/_C")]


def test_triton_is_an_extra_that_the_whole_suite_brings():
    """Triton (hundreds of MB) serves only ``backend="triton"``: a CUDA torch brings it, a CPU install does
    not need it, nor do the README's core tests (the test extra). The whole suite runs its interpreter,
    so the README's whole-suite command (which CI runs) installs the triton extra."""
    project = pyproject()["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    extras = project["optional-dependencies"]
    assert [d for d in extras["triton"] if d.startswith("triton")]
    assert not [d for d in extras["test"] if d.startswith("triton")]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[test,triton,' in readme


@pytest.mark.slow
def test_sdist_holds_every_source_a_build_needs(tmp_path):
    pytest.importorskip("build")
    # in an isolated environment with pyproject's build requirements, as pip and `python -m build` do
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = tmp_path.glob("ktae_kernels-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {"setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "README.md", "ktae_kernels/py.typed"}
    needed |= {str(path.relative_to(ROOT)) for path in (ROOT / "csrc").rglob("*") if path.is_file()}
    needed |= {"ktae_kernels/backends/cuda/ktae_kernels.cu", "ktae_kernels/backends/cuda/ktae_args.h"}
    assert needed <= names, sorted(needed - names)
    assert not [name for name in names if name.endswith((".so", ".o"))]


def test_setup_declares_no_source_outside_the_project(tmp_path):
    """The routes without build isolation (``pip install -e . --no-build-isolation``, ``pip wheel
    --no-build-isolation``) build against the environment's nanobind, wherever it is installed; setuptools
    stops such a build when a source setup() declares, which egg_info lists in SOURCES.txt after the
    build, is an absolute path. nanobind's runtime joins the sources only while the kernel is built: here
    ``build_ext`` (with ``true`` as the compiler and linker, so nothing is compiled) then ``egg_info`` in one
    run, as pip's editable build runs them. .ci/build-routes builds both routes for real."""
    pytest.importorskip("nanobind")
    noop = {name: "true" for name in ("CC", "CXX", "LDSHARED", "LDCXXSHARED")}
    temp = tmp_path / "temp"
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(temp), "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **noop})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [path for path in temp.rglob("*") if path.name == "nanobind"], "the build did not compile nanobind's runtime"
    sources = (tmp_path / "ktae_kernels.egg-info" / "SOURCES.txt").read_text().splitlines()
    assert "csrc/cpu/ktae_cpu.cpp" in sources
    assert not [s for s in sources if s.endswith((".c", ".cc", ".cpp", ".cu")) and os.path.isabs(s)]


def test_a_build_that_skips_the_native_kernel_says_so_in_a_banner(tmp_path):
    """Without nanobind (a --no-build-isolation build) the package still builds, without ``_cpu``: the
    build says so in a banner that names the reason and the check to run after installing."""
    run = ("import runpy, sys; sys.modules['nanobind'] = None; sys.argv = ['setup.py', '-q', 'build_ext', "
           f"'--build-lib', {str(tmp_path / 'lib')!r}, '--build-temp', {str(tmp_path / 'temp')!r}]; "
           "runpy.run_path('setup.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "!" * 79 + "\nWARNING: ktae_kernels: NOT building the native CPU kernel (ktae_kernels._cpu): nanobind is " \
           "not importable in the build environment" in done.stderr
    assert "Check an install with: python -m ktae_kernels --check" in done.stderr
    assert not list(tmp_path.rglob("_cpu*.so"))
