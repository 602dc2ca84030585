"""The cuda backend's runtime without a GPU: NVRTC's disk cache (where, when it is read, a corrupt entry
rebuilt, never used), the errors that name their fix (no NVRTC, an unknown arch, a failed compile),
"auto" falling back to triton with one warning, and the argument structs read from the header
(``abi``), checked against the layout the C++ compiler gives them."""
from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ktae_kernels import BackendUnavailableError, KernelVariant, clear_caches
from ktae_kernels.backends.cuda import abi, runtime
from ktae_kernels.registry import resolve

COMPILED = "compiled the cuda kernels"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory ($KTAE_CACHE_DIR), nothing compiled in memory."""
    monkeypatch.setenv("KTAE_CACHE_DIR", str(tmp_path))
    clear_caches()
    yield tmp_path / "cuda"
    clear_caches()


def _entry(cache_dir: Path) -> Path:
    (path,) = cache_dir.glob("*-sm_80.cubin")
    return path


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _installed("cuda.core"), reason='needs cuda-core and NVRTC (pip install -e ".[cuda]")')


def test_cache_dir_follows_ktae_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KTAE_CACHE_DIR", str(tmp_path))
    assert runtime.cache_dir() == tmp_path / "cuda"
    monkeypatch.delenv("KTAE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.cache_dir() == tmp_path / "xdg" / "ktae_kernels" / "cuda"


@needs_nvrtc
def test_a_kernel_variant_is_compiled_only_when_asked_for_into_its_own_entry(cache, caplog):
    """The default variant's compile leaves one cache entry; another variant (its macros) compiles at
    its first use into an entry of its own, kept in memory beside the default's."""
    caplog.set_level(logging.DEBUG, logger="ktae_kernels.cuda")
    default = runtime.cubin(80)
    assert len(list(cache.glob("*.cubin"))) == 1
    variant = KernelVariant(unroll=2, match_any=False)
    other = runtime.cubin(80, variant=variant)
    assert sum(COMPILED in r.message for r in caplog.records) == 2
    assert other.code != default.code and set(other.symbols) == set(default.symbols)
    assert runtime.cubin(80, variant=variant) is other and runtime.cubin(80) is default
    assert {p.name.split("-")[0] for p in cache.glob("*.cubin")} == {runtime.cache_key(80),
                                                                      runtime.cache_key(80, variant)}


@needs_nvrtc
def test_a_variants_compile_holds_up_no_other_kernels(cache, monkeypatch):
    """While one thread compiles a variant, another gets the default's kernels from memory at once."""
    import threading

    import cuda.core

    default = runtime.cubin(80)
    started, release, done = threading.Event(), threading.Event(), []
    real = cuda.core.Program
    monkeypatch.setattr(cuda.core, "Program", lambda *a, **k: (started.set(), release.wait(60), real(*a, **k))[2])
    compiling = threading.Thread(target=runtime.cubin, args=(80, KernelVariant(unroll=2)))
    compiling.start()
    try:
        assert started.wait(60)
        other = threading.Thread(target=lambda: done.append(runtime.cubin(80)))
        other.start()
        other.join(10)
        assert done == [default]  # while the variant is still compiling
    finally:
        release.set()
        compiling.join()


@needs_nvrtc
def test_compiled_once_then_read_from_disk_and_clear_caches_keeps_the_disk(cache, caplog):
    caplog.set_level(logging.DEBUG, logger="ktae_kernels.cuda")
    first = runtime.cubin(80)
    assert sum(COMPILED in r.message for r in caplog.records) == 1  # the first-use compile, logged once
    assert runtime.cubin(80) is first  # from memory
    clear_caches()  # memory only: a later process, in effect
    caplog.clear()
    again = runtime.cubin(80)
    assert again is not first and again == first and not any(COMPILED in r.message for r in caplog.records)
    assert _entry(cache).name.startswith(runtime.cache_key(80))


@needs_nvrtc
@pytest.mark.parametrize("damage", ["flip a cubin byte", "truncate", "garbage", "other arch"])
def test_a_corrupt_cache_entry_is_rebuilt_never_used(cache, caplog, damage):
    good = runtime.cubin(80)
    path = _entry(cache)
    data = bytearray(path.read_bytes())
    if damage == "flip a cubin byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"not a cache entry")
    else:
        data = data.replace(b'"arch": 80', b'"arch": 90', 1)
    path.write_bytes(bytes(data))
    clear_caches()
    caplog.set_level(logging.DEBUG, logger="ktae_kernels.cuda")
    rebuilt = runtime.cubin(80)
    assert rebuilt.code == good.code and any(COMPILED in r.message for r in caplog.records)
    assert path.read_bytes() != bytes(data)  # rewritten


@needs_nvrtc
def test_unknown_arch_names_the_fix(cache):
    with pytest.raises(BackendUnavailableError, match=r"cannot compile for sm_61 .*pip install \"ktae_kernels\[cuda\]\""):
        runtime.cubin(61)


@needs_nvrtc
def test_a_failed_compile_names_the_fix(cache, monkeypatch, tmp_path):
    broken = tmp_path / "ktae_kernels.cu"
    broken.write_text(runtime.SOURCE.read_text().replace("namespace ktae {", "namespace ktae { oops", 1))
    (tmp_path / "ktae_args.h").write_text(abi.HEADER.read_text())
    monkeypatch.setattr(runtime, "SOURCE", broken)
    with pytest.raises(BackendUnavailableError, match=r"NVRTC failed to compile the cuda kernels for sm_80 \(.*"
                                                      r"error: .*\): use backend='triton'"):
        runtime.cubin(80)


def test_without_cuda_core_the_reason_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core", None)  # as if not installed
    with pytest.raises(BackendUnavailableError, match=r'cuda-core is not installed.*pip install "ktae_kernels\[cuda\]"'):
        runtime.cubin(90)


@pytest.fixture
def a_gpu_seen(monkeypatch):
    """torch sees an sm_90 GPU (no kernel is launched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))


@pytest.mark.skipif(not _installed("triton"), reason="needs triton")
def test_auto_falls_back_to_triton_with_one_warning(a_gpu_seen, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core", None)
    clear_caches()
    with pytest.warns(RuntimeWarning, match=r"backend='auto' runs the slower 'triton'.*'cuda' is unavailable: "
                                            r"cuda-core is not installed"):
        assert resolve("auto", "cuda").name == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("auto", "cuda").name == "triton"  # warned once
    clear_caches()


def _fake_driver(monkeypatch, calls: list, load_result=None) -> None:
    """The driver calls ``DriverLauncher`` makes, recorded in ``calls`` (no GPU); ``cuModuleLoadData``
    answers ``load_result`` when given (a refusal)."""
    from cuda.bindings import driver

    ok = driver.CUresult.CUDA_SUCCESS

    def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        pointed = ctypes.c_void_p.from_address(params).value  # the first argument's address
        calls.append(("launch", f, (gx, gy, gz), (bx, by, bz), smem, int(stream), pointed))
        return (ok,)

    def load(image):
        calls.append(("load", bytes(image)))
        return (load_result,) if load_result is not None else (ok, "module")

    fake = dict(cuInit=lambda flags: (ok,), cuDeviceGet=lambda index: (ok, index),
                cuDevicePrimaryCtxRetain=lambda device: (ok, "context"),
                cuCtxSetCurrent=lambda context: (calls.append(("current", context)), (ok,))[1],
                cuModuleLoadData=load, cuModuleGetFunction=lambda module, name: (ok, name.decode()),
                cuDeviceGetAttribute=lambda attribute, device: (ok, 166912),
                cuFuncSetAttribute=lambda f, attribute, value: (calls.append(("limit", f, value)), (ok,))[1],
                cuLaunchKernel=launch, cuGetErrorName=lambda status: (ok, status.name.encode()))
    for name, call in fake.items():
        monkeypatch.setattr(driver, name, call)


def _count_compiles(monkeypatch) -> list:
    """A list that gets an entry per NVRTC program made (each compile, failed or not)."""
    import cuda.core

    made, program = [], cuda.core.Program
    monkeypatch.setattr(cuda.core, "Program", lambda *args, **kwargs: made.append(args) or program(*args, **kwargs))
    return made


@needs_nvrtc
def test_the_check_lists_cuda_where_it_compiles_and_loads(a_gpu_seen, cache, monkeypatch):
    from ktae_kernels.registry import availability

    _fake_driver(monkeypatch, calls := [])
    status = {s.name: s.problem for s in availability("cuda")}
    assert status["cuda"] is None and [c[0] for c in calls].count("load") == 1


@needs_nvrtc
def test_a_driver_that_refuses_the_kernels_makes_cuda_unavailable_once(a_gpu_seen, cache, monkeypatch):
    """A driver older than NVRTC refuses its cubin: "auto" is told why (so it runs triton) after one
    rebuild, and later calls answer at once, with no compile or load, until ``clear_caches()``."""
    from cuda.bindings import driver

    from ktae_kernels.backends import cuda

    _fake_driver(monkeypatch, calls := [], load_result=driver.CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION)
    compiles = _count_compiles(monkeypatch)
    reason = cuda.unavailable_reason()
    assert reason is not None and "the CUDA driver cannot load the kernels NVRTC" in reason
    assert "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" in reason and "backend='triton'" in reason
    assert len(compiles) == 2 and [c[0] for c in calls].count("load") == 2  # the cached cubin, then a rebuild
    assert cuda.unavailable_reason() == reason and len(compiles) == 2 and [c[0] for c in calls].count("load") == 2
    with pytest.raises(BackendUnavailableError, match="the CUDA driver cannot load"):
        cuda.load_launcher(torch.device("cuda", 0))


@needs_nvrtc
def test_a_failed_compile_is_not_paid_again(a_gpu_seen, cache, monkeypatch, tmp_path):
    """A compile that fails (here: a syntax error) raises the same error on later calls (every call loads
    the device's kernels through ``launcher``) without compiling again (a failing ptxas costs seconds a
    call); ``clear_caches()`` forgets it."""
    broken = tmp_path / "ktae_kernels.cu"
    broken.write_text(runtime.SOURCE.read_text().replace("namespace ktae {", "namespace ktae { oops", 1))
    (tmp_path / "ktae_args.h").write_text(abi.HEADER.read_text())
    monkeypatch.setattr(runtime, "SOURCE", broken)
    compiles = _count_compiles(monkeypatch)
    for _ in range(3):
        with pytest.raises(BackendUnavailableError, match="NVRTC failed to compile"):
            runtime.launcher(0)
    assert len(compiles) == 1
    clear_caches()
    with pytest.raises(BackendUnavailableError, match="NVRTC failed to compile"):
        runtime.launcher(0)
    assert len(compiles) == 2


def test_without_a_home_directory_the_cache_is_in_the_temporary_directory(monkeypatch):
    monkeypatch.delenv("KTAE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    import tempfile

    assert runtime.cache_dir() == Path(tempfile.gettempdir()) / "ktae_kernels-cache" / "cuda"


def _batch():
    """A small validated batch (on the CPU: the stand-ins above never touch it)."""
    from ktae_kernels.validation import normalise_batch

    responses = torch.tensor([[5, 7, 2], [5, 8, 2]])
    return normalise_batch(responses, responses != 0, torch.tensor([1.0, 0.0]), [0, 0])


def test_the_kernels_load_with_the_calls_device_current(monkeypatch):
    """Loading a device's kernels makes its context current: it happens inside the call's device guard,
    so a caller on device 0 with tensors on another device keeps device 0 current."""
    import contextlib

    from ktae_kernels import ExecutionOptions, KTAEConfig
    from ktae_kernels.backends import cuda

    inside = []

    @contextlib.contextmanager
    def guard(device):
        inside.append(True)
        yield
        inside.pop()

    class Loaded(Exception):
        pass

    def load(device, variant):
        assert inside, "the kernels were loaded outside the device guard"
        raise Loaded

    monkeypatch.setattr(cuda, "on_device", guard)
    monkeypatch.setattr(cuda, "load_launcher", load)
    batch = _batch()
    for call in (lambda: cuda.token_advantage(batch, KTAEConfig(), None),
                 lambda: cuda.key_token_scores(batch, KTAEConfig(), ExecutionOptions())):
        with pytest.raises(Loaded):
            call()


# ------------------------------------------------------------------------------ the structs (abi)
def _layout_check(header_text: str, structs: dict, tmp_path) -> subprocess.CompletedProcess:
    """Compile static_asserts that each struct's size and each field's offset in ``structs`` (ctypes) are
    what the C++ compiler gives the header's structs."""
    (tmp_path / "ktae_args.h").write_text(header_text)
    lines = ['#include <cstddef>', '#include "ktae_args.h"']
    for name, struct in structs.items():
        lines.append(f"static_assert(sizeof(ktae::{name}) == {ctypes.sizeof(struct)}, \"{name} size\");")
        for field, _ in struct._fields_:
            offset = getattr(struct, field).offset
            lines.append(f"static_assert(offsetof(ktae::{name}, {field}) == {offset}, \"{name}.{field}\");")
    (tmp_path / "check.cpp").write_text("\n".join(lines) + "\n")
    return subprocess.run(["c++", "-std=c++17", "-fsyntax-only", str(tmp_path / "check.cpp")], capture_output=True,
                          text=True, timeout=120)


def test_the_structs_match_the_compilers_layout(tmp_path):
    structs = {"KernelArgs": abi.KernelArgs, "PrepareArgs": abi.PrepareArgs, "StatsArgs": abi.StatsArgs}
    done = _layout_check(abi.HEADER.read_text(), structs, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_field_added_to_the_header_is_in_the_struct(tmp_path):
    """The structs are read from the header, so a new field (here, between two others) moves the later
    offsets in Python as in C++; a struct built from the old text no longer matches."""
    text = abi.HEADER.read_text().replace("  int64_t length;            // L\n",
                                          "  int64_t length;            // L\n  bool late; int32_t a, b;\n", 1)
    assert text != abi.HEADER.read_text()
    parsed = abi.parse(text)
    new = abi.structure("KernelArgs", parsed.structs["KernelArgs"])
    assert [f for f, _ in new._fields_][3:6] == ["late", "a", "b"]
    assert _layout_check(text, {"KernelArgs": new}, tmp_path).returncode == 0
    assert _layout_check(text, {"KernelArgs": abi.KernelArgs}, tmp_path).returncode != 0


def test_the_constants_come_from_the_header():
    assert abi.CONSTANTS["kMaxThreads"] == 1024 and abi.CONSTANTS["kMaxGroupTokens"] == 2**30
    assert abi.CONSTANTS["kEmptyKey"] == 0xFFFFFFFF and abi.CONSTANTS["kBaselineGiven"] == 3
    parsed = abi.parse("namespace x {\nconstexpr int64_t kA = int64_t{1} << 4;  // c\nconstexpr int kB = kA * 2 + 1;\n"
                       "enum E : int { kC = 0, kD = 7 };\nstruct S { const double* p; unsigned long long q, r; };\n}")
    assert parsed.constants == {"kA": 16, "kB": 33, "kC": 0, "kD": 7}
    assert parsed.structs == {"S": [("p", "double*"), ("q", "unsigned long long"), ("r", "unsigned long long")]}
    with pytest.raises(ValueError, match="cannot read the field"):
        abi.parse("struct T { float3 v; };")


# ------------------------------------------------------------------------------ the driver launcher
@needs_nvrtc
def test_the_driver_launcher_enqueues_on_torchs_stream_and_raises_shared_memory_once(cache, monkeypatch):
    """``DriverLauncher`` with the driver's calls recorded (no GPU): the cubin compiled for the device's
    arch is loaded in its primary context, each launch goes to torch's current stream with a pointer to
    each argument, and a kernel's shared memory limit is set only when a launch needs more than before."""
    import types

    _fake_driver(monkeypatch, calls := [])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=4242))
    launcher = runtime.launcher(0)
    assert launcher.max_shared_bytes() == 166912 and runtime.launcher(0) is launcher
    assert ("load", runtime.cubin(80).code) in calls
    variant = KernelVariant(load_ahead=False)
    other = runtime.launcher(0, variant)  # a variant's own kernels, loaded beside the default's
    assert other is not launcher and other.variant == variant and launcher.variant == KernelVariant()
    assert ("load", runtime.cubin(80, variant=variant).code) in calls
    symbol = runtime.cubin(80).symbols["ktae::dynamic_kernel<true>"]
    args = abi.KernelArgs(n_items=3)
    calls.clear()
    for smem in (100_000, 100_000, 90_000, 120_000):
        launcher.launch("ktae::dynamic_kernel<true>", 3, 256, smem, (args,))
    assert [c for c in calls if c[0] == "limit"] == [("limit", symbol, 100_000), ("limit", symbol, 120_000)]
    launches = [c for c in calls if c[0] == "launch"]
    assert launches[0] == ("launch", symbol, (3, 1, 1), (256, 1, 1), 100_000, 4242, ctypes.addressof(args))
    assert [c[4] for c in launches] == [100_000, 100_000, 90_000, 120_000]
