"""What the benchmark ran on: CPU, cores, library versions, GPU, date; and a short machine slug."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
from importlib import import_module
import os
import platform
import re
import subprocess

import torch


#: environment variables that change the timings (allocator, threads, preloads), recorded in the JSON.
ENV_PREFIXES = ("MALLOC_", "OMP_", "MKL_", "LD_PRELOAD", "PYTORCH_", "TORCH_", "TRITON_", "CUDA_VISIBLE", "KTAE_")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def machine_info(device: torch.device) -> dict:
    """JSON-ready description of this machine and the software the benchmark ran with."""
    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "scipy": _version("scipy"),
        "ktae_kernels": _version("ktae_kernels") or getattr(import_module("ktae_kernels"), "__version__", None),
        "device": str(device),
        "load_average_1min": load_average(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "cuda_runtime": torch.version.cuda,
            "driver": _nvidia_driver(),
        }
    return info


def load_average() -> float | None:
    """The 1-minute load average (other processes competing for the cores), None where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_slug(device: torch.device) -> str:
    """``cpu-2core`` on a CPU, the GPU's name (``nvidia-h200``) on CUDA: the prefix of result files."""
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{os.cpu_count()}core"


def today() -> str:
    """The local date as ``YYYY-MM-DD``."""
    return _dt.date.today().isoformat()
