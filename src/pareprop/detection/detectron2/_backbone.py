"""What detectron2's ViT and MViT backbones share beyond their layers: absolute positions made
at the pretraining grid, detectron2's weight initialisation, and a configuration built from
keyword overrides."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Type, TypeVar

import torch
import torch.nn as nn

__all__ = ["cfg_with", "init_weights", "pos_embed_table"]

C = TypeVar("C")


def pos_embed_table(use_abs_pos: bool, grid: int, has_cls_token: bool, dim: int,
                    device=None, dtype=None) -> Optional[nn.Parameter]:
    """The ``(1, grid [+ 1], dim)`` table of absolute positions (a slot for the class token
    when the pretrained model had one), or None without absolute positions."""
    if not use_abs_pos:
        return None
    n = grid + (1 if has_cls_token else 0)
    return nn.Parameter(torch.zeros(1, n, dim, device=device, dtype=dtype))


def init_weights(modules: Iterable[nn.Module], pos_embed: Optional[nn.Parameter]) -> None:
    """detectron2's initialisation: truncated normal (std 0.02) for positions and linear
    weights, zero biases, unit LayerNorms; everything else (pooling convolutions, relative
    position tables) keeps what its constructor made."""
    if pos_embed is not None:
        nn.init.trunc_normal_(pos_embed, std=0.02)
    for m in modules:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def cfg_with(cls: Type[C], label: str, overrides: Any) -> C:
    """A ``cls`` (a config dataclass) with ``overrides``; unknown names refused in one line
    that calls them ``label``'s arguments."""
    names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown {label} argument(s) {unknown}; expected some of {sorted(names)}")
    return cls(**overrides)
