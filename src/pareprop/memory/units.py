"""Memory sizes as people write them (``"80GiB"``, ``"512MB"``, ``"8e10"``) turned into bytes."""

from __future__ import annotations

from typing import Any

from pareprop.engine.chunk_cost import parse_bytes

__all__ = ["parse_memory"]


def parse_memory(text: Any) -> int:
    """``"80GiB"``, ``"80GB"``, ``"8e10"`` (bytes), ``"512MiB"`` -> bytes: the same forms as
    every size option (:func:`pareprop.engine.chunk_cost.parse_bytes`).

    Raises:
        ValueError: naming the accepted forms, for anything else.
    """
    return parse_bytes(text)
