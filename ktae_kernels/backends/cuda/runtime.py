"""The CUDA kernels compiled at first use and launched on torch's stream.

``cubin(arch, variant)`` compiles the device source (``ktae_kernels.cu`` and ``ktae_args.h``, package data)
with NVRTC (through ``cuda-core``) for one arch and one ``KernelVariant`` (its macros), every kernel the
backend launches (``KERNELS``: the name expressions of each template instantiation), and keeps the cubin
in memory and on disk (``cache_dir()``: ``$KTAE_CACHE_DIR/cuda``, default ``~/.cache/ktae_kernels/cuda``).
A disk entry is keyed by a hash of the sources, the arch, the variant, NVRTC's version and the options; it
is written atomically and checked when read (an entry that fails its checksum, or that the driver refuses,
is rebuilt). No device is needed to compile, so the tests compile every kernel for sm_80 and sm_90 on any
machine.

``DriverLauncher`` loads a variant's cubin on a device and launches a kernel through the driver's
``cuLaunchKernel`` on torch's current stream, so that a CUDA graph capture records it like any torch op.
Its kernels' dynamic shared memory limits are raised once, under its lock.

Errors (no NVRTC, an arch NVRTC does not know, a compile failure) raise ``BackendUnavailableError``
naming the fix.
"""
from __future__ import annotations

import ctypes
import hashlib
import io
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import caches
from ...options import KernelVariant
from ..base import BackendUnavailableError
from . import abi

LOG = logging.getLogger("ktae_kernels.cuda")
#: the device source (package data); it includes ``abi.HEADER``.
SOURCE = Path(__file__).with_name("ktae_kernels.cu")
#: how to get what the cuda backend needs.
INSTALL = 'pip install "ktae_kernels[cuda]"'
#: every kernel the backend launches, as NVRTC name expressions (the emulator takes the same names).
KERNELS = ("ktae::scan_kernel", "ktae::groups_kernel", "ktae::group_sums_kernel", "ktae::dynamic_kernel<true>",
           "ktae::dynamic_kernel<false>", "ktae::nan_on_error_kernel", "ktae::table_statistics_kernel")
#: NVRTC options (besides the arch): the header's host-callable helpers compile as device code; a fixed
#: seed names the anonymous namespace, so that a compile is reproducible (the report reads the same code).
OPTIONS = dict(std="c++17", device_as_default_execution_space=True, frandom_seed="ktae")


@dataclass(frozen=True)
class Cubin:
    """The kernels compiled for one arch: ``code`` (cubin bytes) and ``symbols`` (each name of
    ``KERNELS`` -> its mangled symbol)."""

    arch: int
    code: bytes
    symbols: dict


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$KTAE_CACHE_DIR/cuda``, else ``$XDG_CACHE_HOME/ktae_kernels/cuda``,
    else ``~/.cache/ktae_kernels/cuda``; without a home directory (no ``$HOME``, a uid with no passwd
    entry, as in some containers), ``ktae_kernels-cache/cuda`` in the temporary directory."""
    if os.environ.get("KTAE_CACHE_DIR"):
        return Path(os.environ["KTAE_CACHE_DIR"]) / "cuda"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "ktae_kernels" / "cuda"
    try:
        return Path.home() / ".cache" / "ktae_kernels" / "cuda"
    except RuntimeError:  # Path.home(): "Could not determine home directory."
        return Path(tempfile.gettempdir()) / "ktae_kernels-cache" / "cuda"


def _nvrtc():
    """``cuda.bindings.nvrtc``; BackendUnavailableError naming the fix when it or NVRTC is missing."""
    try:
        import cuda.core  # noqa: F401  (the compiler front end)
        from cuda.bindings import nvrtc
    except ImportError as err:
        raise BackendUnavailableError(f"cuda-core is not installed ({err}): `{INSTALL}`") from None
    try:
        result, *_ = nvrtc.nvrtcVersion()
    except Exception as err:  # the bindings load libnvrtc on first use
        raise BackendUnavailableError(f"the NVRTC runtime cannot be loaded ({err}): `{INSTALL}`") from None
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BackendUnavailableError(f"the NVRTC runtime does not answer ({result}): `{INSTALL}`")
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    _, major, minor = _nvrtc().nvrtcVersion()
    return major, minor


def supported_archs() -> tuple[int, ...]:
    """The archs this NVRTC compiles for (75, 80, 86, 90, ...)."""
    _, archs = _nvrtc().nvrtcGetSupportedArchs()
    return tuple(archs)


def cache_key(arch: int, variant: KernelVariant = KernelVariant()) -> str:
    """A hash of everything a compile depends on: the sources, the kernels, the arch, the variant's macros,
    NVRTC, the options."""
    digest = hashlib.sha256(json.dumps([arch, variant.macros(), nvrtc_version(), KERNELS,
                                        sorted(OPTIONS.items())]).encode())
    for path in (SOURCE, abi.HEADER):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


_MEMORY: dict[tuple[int, KernelVariant], Cubin] = {}
#: guards _MEMORY, _COMPILING, _LAUNCHERS and _LOAD_FAILED (held for lookups only, never through a compile)
_LOCK = threading.Lock()
#: one lock per (arch, variant), held while its cubin is read or compiled
_COMPILING: dict[tuple[int, KernelVariant], threading.Lock] = {}


def cubin(arch: int, variant: KernelVariant = KernelVariant(), *, rebuild: bool = False) -> Cubin:
    """The kernels for ``arch`` (e.g. 90) in ``variant``: from memory, else from the disk cache, else
    compiled (and cached). ``rebuild``: compile again, replacing the cached entry (one the driver refused).
    A compile holds only its own (arch, variant): other threads' calls go on meanwhile. (``launcher``
    keeps a failure, so that calls do not compile again.)"""
    _nvrtc()  # BackendUnavailableError naming the fix, even for kernels compiled before
    key = (arch, variant)
    with _LOCK:
        if not rebuild and key in _MEMORY:
            return _MEMORY[key]
        compiling = _COMPILING.setdefault(key, threading.Lock())
    with compiling:
        with _LOCK:
            if not rebuild and key in _MEMORY:  # another thread made it meanwhile
                return _MEMORY[key]
        path = cache_dir() / f"{cache_key(arch, variant)}-sm_{arch}.cubin"
        found = None if rebuild else _read_entry(path, arch)
        if found is None:
            found = _compile(arch, variant)
            _write_entry(path, found)
        with _LOCK:
            _MEMORY[key] = found
        return found


def _compile(arch: int, variant: KernelVariant, ptxas_log: list | None = None) -> Cubin:
    """NVRTC's cubin of every kernel for ``arch`` in ``variant``; BackendUnavailableError for an unknown
    arch or a failed compile. ``ptxas_log``: a list that gets the compile log with ptxas's resource report."""
    if arch not in supported_archs():
        major, minor = nvrtc_version()
        raise BackendUnavailableError(
            f"NVRTC {major}.{minor} cannot compile for sm_{arch} (it knows sm_{', sm_'.join(map(str, supported_archs()))}):"
            f" install the NVRTC of a CUDA release that supports this GPU (`{INSTALL}`, or `pip install "
            f"\"ktae_kernels[cuda12]\"` for CUDA 12)")
    from cuda.core import Program, ProgramOptions

    start = time.perf_counter()
    extra = {} if ptxas_log is None else dict(ptxas_options="-v")
    options = ProgramOptions(arch=f"sm_{arch}", include_path=[str(SOURCE.parent)], name=SOURCE.name, **OPTIONS,
                             define_macro=list(variant.macros()), **extra)
    log = io.StringIO()
    try:
        program = Program(SOURCE.read_text(), "c++", options=options)
        code = program.compile("cubin", name_expressions=KERNELS, logs=log)
    except Exception as err:
        errors = [line.strip() for line in str(err).splitlines() if ": error" in line][:3] or [str(err)[:500]]
        raise BackendUnavailableError(f"NVRTC failed to compile the cuda kernels for sm_{arch} ({'; '.join(errors)}): "
                                      f"use backend='triton', and report this with the output of "
                                      f"`python -m ktae_kernels --check`") from None
    if ptxas_log is not None:
        ptxas_log.append(log.getvalue())
    symbols = {name: _text(code.symbol_mapping[name]) for name in KERNELS}
    LOG.debug("compiled the cuda kernels for sm_%d (%s) with NVRTC in %.1f s (cached in %s)", arch, variant,
              time.perf_counter() - start, cache_dir())
    return Cubin(arch, bytes(code.code), symbols)


def compile_report(arch: int, variant: KernelVariant = KernelVariant()) -> tuple[Cubin, str]:
    """The kernels for ``arch`` in ``variant`` compiled as ``cubin`` compiles them, with ptxas's resource
    report (registers, spills, stack and shared memory per kernel: the log of ``ptxas -v``); not cached."""
    _nvrtc()
    log: list[str] = []
    return _compile(arch, variant, log), log[0]


def _text(symbol: bytes | str) -> str:
    return symbol.decode() if isinstance(symbol, bytes) else symbol


def _read_entry(path: Path, arch: int) -> Cubin | None:
    """The cached cubin at ``path``, or None when absent, unreadable or failing its checksum."""
    try:
        head, _, code = path.read_bytes().partition(b"\n")
        meta = json.loads(head)
        if meta["sha256"] != hashlib.sha256(code).hexdigest() or meta["arch"] != arch:
            return None
        return Cubin(arch, code, dict(meta["symbols"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_entry(path: Path, found: Cubin) -> None:
    """Cache ``found`` at ``path``: a JSON line (checksum, arch, symbols), then the cubin; written to a
    temporary file and renamed, so a reader sees a whole entry or none. A cache that cannot be written
    is skipped (the next process compiles again)."""
    meta = json.dumps(dict(sha256=hashlib.sha256(found.code).hexdigest(), arch=found.arch, symbols=found.symbols))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(meta.encode() + b"\n" + found.code)
        os.replace(tmp, path)
    except OSError as err:
        LOG.debug("cannot write the cuda kernel cache %s: %s", path, err)


def device_arch(index: int) -> int:
    """The compute capability of CUDA device ``index`` as NVRTC names it (9.0 -> 90)."""
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


# ----------------------------------------------------------------------------- launching on a device
def _check(result: tuple, what: str) -> tuple:
    """``result`` of a driver call past its status; RuntimeError naming the call when it failed."""
    from cuda.bindings import driver

    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise RuntimeError(f"ktae_kernels.cuda: {what} failed: {name.decode() if name else status}")
    return tuple(values)


class DriverLauncher:
    """The kernels of ``variant`` loaded on CUDA device ``index``, launched through ``cuLaunchKernel`` on
    torch's current stream. Thread-safe: loading and each kernel's shared memory limit happen under the
    lock (a limit only grows, so two threads never lower each other's)."""

    def __init__(self, index: int, variant: KernelVariant = KernelVariant()) -> None:
        arch = device_arch(index)
        found = cubin(arch, variant)  # first: BackendUnavailableError naming the fix without cuda-core or NVRTC
        from cuda.bindings import driver

        self.index, self.variant = index, variant
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}
        _check(driver.cuInit(0), "cuInit")
        (self._device,) = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        (self._context,) = _check(driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        try:
            self._kernels = self._load(found)
        except RuntimeError:  # a cached cubin the driver refuses: compile it again
            try:
                self._kernels = self._load(cubin(arch, variant, rebuild=True))
            except BackendUnavailableError:
                raise
            except RuntimeError as err:
                major, minor = nvrtc_version()
                raise BackendUnavailableError(
                    f"the CUDA driver cannot load the kernels NVRTC {major}.{minor} compiled for sm_{arch} ({err}): "
                    f"a driver older than NVRTC refuses its code; install the NVRTC of the driver's CUDA release "
                    f"(`pip install \"ktae_kernels[cuda12]\"` for CUDA 12) or use backend='triton'") from None
        (self.max_shared,) = _check(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._device),
            "cuDeviceGetAttribute")

    def _load(self, found: Cubin) -> dict:
        """Each kernel of ``found`` loaded in the device's primary context (torch's)."""
        from cuda.bindings import driver

        _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        (self._module,) = _check(driver.cuModuleLoadData(found.code), "cuModuleLoadData")
        return {name: _check(driver.cuModuleGetFunction(self._module, symbol.encode()), f"loading {name}")[0]
                for name, symbol in found.symbols.items()}

    def max_shared_bytes(self) -> int:
        """Opt-in dynamic shared memory per block of the device."""
        return self.max_shared

    def _allow(self, name: str, kernel, smem: int) -> None:
        """Raise ``name``'s dynamic shared memory limit to ``smem`` once per size increase (so that a call
        inside a graph capture, after a warm-up, sets nothing)."""
        from cuda.bindings import driver

        if smem <= 48 * 1024 or self._limits.get(name, 0) >= smem:
            return
        with self._lock:
            if self._limits.get(name, 0) >= smem:
                return
            _check(driver.cuFuncSetAttribute(
                kernel, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                f"setting {name}'s shared memory")
            self._limits[name] = smem

    def launch(self, name: str, grid: int, block: int, smem: int, args: tuple) -> None:
        """Enqueue kernel ``name`` over ``grid`` blocks of ``block`` threads with ``smem`` bytes of dynamic
        shared memory on torch's current stream; ``args``: its arguments as ctypes objects, in order."""
        from cuda.bindings import driver

        kernel = self._kernels[name]
        self._allow(name, kernel, smem)
        _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        stream = driver.CUstream(torch.cuda.current_stream(self.index).cuda_stream)
        _check(driver.cuLaunchKernel(kernel, grid, 1, 1, block, 1, 1, smem, stream, ctypes.addressof(params), 0),
               f"launching {name}")


_LAUNCHERS: dict[tuple[int, KernelVariant], DriverLauncher] = {}
#: devices' kernels that could not be compiled or loaded, by (index, variant): every call runs through
#: ``launcher``, so a failure is raised again here, not paid again (a compile costs seconds), until clear_caches()
_LOAD_FAILED: dict[tuple[int, KernelVariant], BackendUnavailableError] = {}


def launcher(index: int, variant: KernelVariant = KernelVariant()) -> DriverLauncher:
    """The kernels of ``variant`` loaded on CUDA device ``index`` (loaded on first use; compiled then if
    not cached); BackendUnavailableError, kept and raised again, when they cannot be compiled or loaded."""
    key = (index, variant)
    with _LOCK:
        found = _LAUNCHERS.get(key)
        if found is None and key in _LOAD_FAILED:
            raise _LOAD_FAILED[key]
    if found is None:
        try:
            made = DriverLauncher(index, variant)
        except BackendUnavailableError as err:
            with _LOCK:
                _LOAD_FAILED[key] = err
            raise
        with _LOCK:
            found = _LAUNCHERS.setdefault(key, made)
    return found


@caches.on_clear
def _forget() -> None:
    """The compiled kernels kept in memory and the devices' loaded kernels (the disk cache stays)."""
    with _LOCK:
        _MEMORY.clear()
        _LAUNCHERS.clear()
        _LOAD_FAILED.clear()
