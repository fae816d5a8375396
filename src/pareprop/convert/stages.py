"""A source's sequence of multi-scale blocks as runs of reversible stacks and the blocks kept.

NOTE [ Runs of blocks that keep their shape ]
A multi-scale source (MViTv2: timm's ``MultiScaleVit``, torchvision's ``MViT``) calls its
blocks one after the other as ``x, size = block(x, size)``, where ``size`` is the token map's
(H, W) or (T, H, W). A block whose shape does not change (queries not pooled, so neither is its
shortcut, and the width stays: no projected residual) is two residual sub-layers ``z + H(z)``
and becomes a :class:`~pareprop.convert.block.CoupledBlock`; each maximal run of such blocks is
one :class:`~pareprop.ReversibleStack`, which starts from ``(x, x)`` and hands on ``Y2`` of its
last block (docs/convert.md, "The coupling": ``z_0 = z_1 = x``, the next layer reads
``z_{2L+1}``). Every other block (one that pools the shortcut or changes the width: the stage
transitions of Rev-MViT) is the source's own block, run by its own ``forward``, and under
``set_grad_checkpointing()`` checkpointed as timm checkpoints it (it keeps its input, which is
the stack's ``Y2`` the engines keep anyway, NOTE [ Checkpointing what is not reversible ] in
pareprop/engine/recompute.py). With the stacks' branches chunked (``set_chunking``) it is
checkpointed in chunks of samples as Rev-MViT's transitions are (NOTE [ Checkpointed blocks in
chunks ]): each of its layers acts on a sample alone, and while a chunk runs,
:func:`~pareprop.convert.block.sample_draws` makes its random layers draw the chunk's slice of
the whole batch's draw.
The map's size is a constant keyword of the stacks, as ``hw`` of Rev-MViT's.

:class:`CoupledRuns` holds the parts in the source's order under ``parts`` (``parts.4`` a stack
whose ``blocks.0`` is the source's ``blocks.4``); :meth:`CoupledRuns.source_names` gives the
renames that keep the source's state-dict names (NOTE [ The source's names in the state dict ]
in pareprop/convert/source.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import CoupledBlock, sample_draws
from pareprop.engine import ReversibleStack
from pareprop.engine.recompute import maybe_checkpoint

__all__ = ["CoupledRuns", "KeptBlock", "pools_nothing"]


def pools_nothing(pool: Any) -> bool:
    """Whether a pooling layer (or None) keeps the map's size: every stride 1."""
    if pool is None:
        return True
    stride = getattr(pool, "stride", 1)
    return all(s == 1 for s in (stride if isinstance(stride, (tuple, list)) else (stride,)))


class CoupledRuns(nn.Module):
    """``x, size = runs(x, size)``: the source's blocks, each maximal run of those that keep
    their shape a reversible stack of coupled blocks, the others kept (NOTE [ Runs of blocks
    that keep their shape ]).

    Args:
        blocks: the source's blocks, in order (shared, not copied).
        keeps_shape: whether a block becomes a coupled block.
        coupled: the coupled block of a block that keeps its shape.
        engine: the stacks' backward engine.
        size_keyword: the keyword the coupled blocks' ``f`` and ``g`` take the map size by.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        keeps_shape: Callable[[nn.Module], bool],
        coupled: Callable[[nn.Module], CoupledBlock],
        engine: str,
        size_keyword: str,
    ):
        super().__init__()
        self.size_keyword = size_keyword
        runs: List[Any] = []  # a list: a run of coupled blocks; a module: a kept block
        self.source_indices: List[List[int]] = []  # the source's block index of every block
        for i, block in enumerate(blocks):
            if keeps_shape(block):
                if not runs or not isinstance(runs[-1], list):
                    runs.append([])
                    self.source_indices.append([])
                runs[-1].append(coupled(block))
            else:
                runs.append(block)
                self.source_indices.append([])
            self.source_indices[-1].append(i)
        self.parts = nn.ModuleList(
            ReversibleStack(run, engine=engine) if isinstance(run, list) else run for run in runs)
        # The kept blocks as maybe_checkpoint takes them (not modules: no new state-dict names).
        self._kept = {p: KeptBlock(part) for p, part in enumerate(self.parts)
                      if not isinstance(part, ReversibleStack)}
        self.grad_checkpointing = False  # set by the model's set_grad_checkpointing

    def stacks(self) -> List[ReversibleStack]:
        return [p for p in self.parts if isinstance(p, ReversibleStack)]

    def source_names(self, ours: str, theirs: str) -> List[Tuple[str, str]]:
        """(our name, the source's) of every block, for :func:`keep_source_names`: ``ours``
        is this module's prefix (``"stages.1."``), ``theirs`` the source's prefix of its blocks
        (``"stages.1.blocks."``)."""
        pairs = []
        for p, (part, indices) in enumerate(zip(self.parts, self.source_indices)):
            if isinstance(part, ReversibleStack):
                pairs += [(f"{ours}parts.{p}.blocks.{j}.", f"{theirs}{i}.")
                          for j, i in enumerate(indices)]
            else:
                pairs.append((f"{ours}parts.{p}.", f"{theirs}{indices[0]}."))
        return pairs

    def forward(self, x: torch.Tensor, size: Sequence[int]) -> Tuple[torch.Tensor, Any]:
        stacks = self.stacks()
        chunking = stacks[0].chunking if stacks else None  # set_chunking sets every stack
        for p, part in enumerate(self.parts):
            if isinstance(part, ReversibleStack):
                # z_0 = z_1 = x; the next part reads z_{2L+1} (Y2); the size does not change.
                _, x = part(x, x, **{self.size_keyword: tuple(size)})
            elif self.grad_checkpointing:
                kept = self._kept[p]
                kept.size = size
                x = maybe_checkpoint(kept, x, True, chunking)  # type: ignore[arg-type]
                size = kept.out_size
            else:
                x, size = part(x, size)
        return x, size


class KeptBlock:
    """A block kept from the source as :func:`~pareprop.engine.recompute.maybe_checkpoint`
    takes it: one tensor in and out (the map's size is set before the call, the output's
    recorded), and the ``split`` and ``forward_chunk`` of NOTE [ Checkpointed blocks in chunks ]
    (every layer of an MViT block acts on each sample alone)."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.size: Any = None  # the input map's (H, W) or (T, H, W)
        self.out_size: Any = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, self.out_size = self.block(x, self.size)
        return x

    def parameters(self) -> Iterator[nn.Parameter]:  # left out of a chunk's measured graph
        return self.block.parameters()

    def split(self, x: torch.Tensor) -> Split:
        return Split.samples(x.shape[0])

    def forward_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        with sample_draws(self.block, chunk):
            x, self.out_size = self.block(x, self.size)
        return x
