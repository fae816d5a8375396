"""Stopping a sweep on a signal (``timeout``'s SIGTERM, a time share's SIGALRM) at a safe point.

NOTE [ Stopping on a signal ]
    A handler that raises runs at whatever Python bytecode the main thread executes next, and
    that can be a callback torch's C++ makes while it frees a tensor (the weak-reference
    finalizers of the planner's MemTracker, saved-tensor hooks). The exception then crosses a
    C++ destructor and the process aborts ("terminate called after throwing an instance of
    'python_error'", seen once in CI's ``gpu.sh --dry-run``), losing the records of that
    engine. So handlers only ask to stop, and the sweep raises KeyboardInterrupt itself at the
    next safe point, between configurations and between the steps of one; ``run_bench`` then
    returns what it measured. A hard stop stays with ``timeout -k``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["request_stop", "clear", "stop_requested", "check"]

_requested = False


def request_stop(signum: Any = None, frame: Any = None) -> None:
    """Ask the running sweep to stop at its next safe point (usable as a signal handler)."""
    global _requested
    _requested = True


def clear() -> None:
    """Forget an earlier request (a new sweep starts)."""
    global _requested
    _requested = False


def stop_requested() -> bool:
    return _requested


def check() -> None:
    """Raise KeyboardInterrupt here if a stop was requested."""
    if _requested:
        raise KeyboardInterrupt
