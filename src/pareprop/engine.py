"""PLACEHOLDER: the real engine is being written; only the API is final."""
from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.nn as nn

ENGINES = ("autograd", "reversible", "pareprop")


class ReversibleBlock(nn.Module):
    def f(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def g(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x1, x2, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + self.f(x2, **kwargs)
        y2 = x2 + self.g(y1, **kwargs)
        return y1, y2


class ReversibleStack(nn.Module):
    def __init__(self, blocks: Iterable[ReversibleBlock], engine: str = "reversible"):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.engine = engine

    def set_engine(self, name: str) -> None:
        self.engine = name

    def forward(self, x1, x2, **kwargs):
        for block in self.blocks:
            x1, x2 = block(x1, x2, **kwargs)
        return x1, x2


def set_engine(module: nn.Module, name: str) -> nn.Module:
    for m in module.modules():
        if isinstance(m, ReversibleStack):
            m.set_engine(name)
    return module
