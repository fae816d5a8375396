"""Stochastic depth (drop-path) whose rate is a tensor, so blocks of different rates share one
compiled graph.

# NOTE [ Drop-path rates as buffers ]
# Stochastic depth gives every block its own rate (a linear ramp over depth). timm's DropPath
# keeps the rate as a Python float, and torch.compile guards on such an attribute as a
# constant: under regional compilation (pareprop.compile_blocks, one compiled F and G shared by
# all blocks of a class) every block then recompiles, compile time grows with depth, and past
# Dynamo's recompile limit the remaining blocks silently run eagerly. Here the keep
# probability is a non-persistent buffer: with nn.Modules inlined, buffers are graph inputs,
# so one graph serves every rate. It stays float32 whatever the model is cast to (a bf16 copy
# of 0.9 would be 0.8984), and is not in the state dict. The draw is the same as timm's
# (one Bernoulli per sample, scaled by 1 / keep), made with the tensor-probability kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from pareprop.chunking import Chunk, whole_shape

__all__ = ["DropPath", "drop_path"]


class DropPath(nn.Module):
    """Drop the whole residual branch per sample with probability ``drop_prob`` in training,
    scaling kept samples by ``1 / (1 - drop_prob)``; identity in eval mode.

    Args:
        drop_prob: probability of dropping a sample's branch, in [0, 1).
    """

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= float(drop_prob) < 1.0:
            raise ValueError(f"expected a drop-path rate in [0, 1), got {drop_prob!r}")
        self._drop_prob = float(drop_prob)
        self.register_buffer(
            "keep_prob", torch.tensor(1.0 - self._drop_prob, dtype=torch.float32),
            persistent=False,
        )

    @property
    def drop_prob(self) -> float:
        return self._drop_prob

    @drop_prob.setter
    def drop_prob(self, value: float) -> None:
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"expected a drop-path rate in [0, 1), got {value!r}")
        self._drop_prob = float(value)
        with torch.no_grad():
            self.keep_prob.fill_(1.0 - self._drop_prob)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        # Rebuilt from the exact rate, float32, where the cast put it (a device move or a
        # dtype cast; see NOTE [ Drop-path rates as buffers ]).
        self.keep_prob = torch.full((), 1.0 - self._drop_prob, dtype=torch.float32,
                                    device=self.keep_prob.device)
        return self

    def forward(
        self, x: torch.Tensor, chunk: Optional[Chunk] = None, dim: int = 1
    ) -> torch.Tensor:
        """``chunk``: ``x`` is that chunk's slice along ``dim`` of the whole branch's tensor;
        a chunk of samples (``dim=0``) takes its slice of the whole batch's draw (NOTE
        [ Exact randomness in chunks ] in pareprop/chunking.py)."""
        if not self.training:
            return x
        keep = self.keep_prob
        whole = chunk is not None and chunk.count > 1 and dim == 0
        samples, rows = whole_shape(x, chunk, 0) if whole else ([x.shape[0]], 1)
        mask = x.new_empty((samples[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        if whole:
            mask = chunk.take(mask, 0, rows)
        return x * mask.div_(keep.to(x.dtype))

    def extra_repr(self) -> str:
        return f"drop_prob={self._drop_prob:.3f}"


def drop_path(
    module: nn.Module, x: torch.Tensor, chunk: Optional[Chunk] = None, dim: int = 1
) -> torch.Tensor:
    """``module(x)`` for a block's drop-path slot (a :class:`DropPath`, or ``nn.Identity``
    when the rate is 0), passing a chunk on to a :class:`DropPath`."""
    return module(x, chunk, dim) if isinstance(module, DropPath) else module(x)
