"""timm's MLP, able to run on a chunk of tokens with dropout masks drawn as for all of them."""

from __future__ import annotations

from typing import Optional

import torch
from timm.layers import Mlp as _TimmMlp

from pareprop.chunking import Chunk, dropout

__all__ = ["Mlp"]


class Mlp(_TimmMlp):
    """:class:`timm.layers.Mlp` (same submodules, same state dict) whose forward also takes a
    token chunk: ``x`` is then the chunk's slice along ``dim`` of the whole input, and its
    dropout masks are the chunk's slices of the whole input's masks (NOTE [ Exact randomness
    in chunks ] in pareprop/chunking.py)."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, chunk: Optional[Chunk] = None, dim: int = 1
    ) -> torch.Tensor:
        if chunk is None:
            return super().forward(x)
        x = self.act(self.fc1(x))
        x = dropout(x, self.drop1.p, self.training, chunk, dim)
        x = self.fc2(self.norm(x))
        return dropout(x, self.drop2.p, self.training, chunk, dim)
