"""A cache of slow test builds (the CUDA emulator, nvcc compiles), kept across runs and clones of the
same sources: ``$KTAE_CACHE_DIR``, else ``$XDG_CACHE_HOME/ktae_kernels``, else ``~/.cache/ktae_kernels``."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path


def cache_root() -> Path:
    """The cache folder (created on first write)."""
    if os.environ.get("KTAE_CACHE_DIR"):
        return Path(os.environ["KTAE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ktae_kernels"


def cached_run(kind: str, cmd: list[str], inputs: list[Path], key_extra: str = "", **run) -> dict:
    """``subprocess.run(cmd, **run)``'s return code, stdout and stderr, from the cache when the command
    and the contents of ``inputs`` (everything the command reads) are unchanged. Failed runs are not kept."""
    digest = hashlib.sha256(json.dumps([cmd, key_extra]).encode())
    for path in inputs:
        digest.update(path.read_bytes())
    entry = cache_root() / kind / f"{digest.hexdigest()[:20]}.json"
    if entry.exists():
        return json.loads(entry.read_text())
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **run)
    result = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    if done.returncode == 0:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, entry)
    return result
