"""The devices a run may name: ``cpu``, ``cuda`` and ``cuda:N`` (``auto`` where a run picks one).

Checked when a command line or a configuration is read, before a model is built: torch itself
accepts more names (``mps``, ``xpu``, ...) and fails only later, on the first tensor moved
there, with a traceback about how it was built.
"""

from __future__ import annotations

import torch

__all__ = ["check_device_name", "device_here"]


def _expected(flag: str, auto: bool) -> str:
    forms = "auto, cpu, cuda or cuda:N" if auto else "cpu, cuda or cuda:N"
    return f"expected {flag + ' ' if flag else ''}{forms}"


def check_device_name(name: str, flag: str = "--device", auto: bool = False) -> None:
    """Raise ``ValueError`` unless ``name`` is a device pareprop runs on, on any machine.

    Args:
        name: ``cpu``, ``cuda`` or ``cuda:N``; with ``auto``, also ``auto``.
        flag: the option named in the message (``""``: none).
        auto: accept ``auto``.
    """
    if auto and name == "auto":
        return
    try:
        kind = torch.device(name).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{_expected(flag, auto)}, got {name!r}")


def device_here(name: str, flag: str = "--device") -> torch.device:
    """``name`` (``cpu``, ``cuda`` or ``cuda:N``) as a device this machine has, or ``ValueError``
    saying what it has instead."""
    check_device_name(name, flag)
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag + ' ' if flag else ''}{name}: this machine has no CUDA "
                             "device; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag + ' ' if flag else ''}{name}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device
