"""One reset for everything the package keeps between calls (``clear_caches``).

A module that keeps something between calls (a memo, the GPU backends' ``DeviceState``, a compiled
extension's records, a warn-once set) registers how to forget it with ``on_clear`` when it is imported;
a module never imported holds nothing. ``clear_caches`` runs every registered reset.
"""
from __future__ import annotations

import threading
from typing import Callable

_RESETS: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def on_clear(reset: Callable[[], None]) -> Callable[[], None]:
    """Register ``reset`` (no arguments) to run on every ``clear_caches``; returns it (a decorator)."""
    with _LOCK:
        _RESETS.append(reset)
    return reset


def clear_caches() -> None:
    """Forget everything the package keeps between calls, in this process: the method's memos, the GPU
    backends' per-device state (cached grids and constants, and the table sizes learnt per batch layout:
    a plan must be called once again before it is captured in a CUDA graph), the compiled extensions'
    caches, the backends loaded and checked, and which "auto" fallbacks were warned about. Results do
    not change; the next calls make what they need again. Graphs already captured keep what they read
    (their plan holds it). Safe to call while other threads make calls."""
    with _LOCK:
        resets = list(_RESETS)
    for reset in resets:
        reset()
