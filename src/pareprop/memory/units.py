"""Memory sizes as people write them (``"80GiB"``, ``"512MB"``, ``"8e10"``) turned into bytes."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["parse_memory"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: Any) -> int:
    """``"80GiB"``, ``"80GB"``, ``"8e10"`` (bytes), ``"512MiB"`` -> bytes.

    Raises:
        ValueError: naming the accepted forms, for anything else.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"expected a memory size such as 80GiB, 80GB, 512MiB or 8e10 (bytes), got {text!r}"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"expected a positive memory size, got {text!r}")
    return size
