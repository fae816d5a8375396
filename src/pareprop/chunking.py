"""Chunked branches: how a reversible block's F and G split, so that the reversible engines can
rebuild and differentiate a branch a piece at a time.

# NOTE [ Chunked branches ]
# Under the reversible engines a step keeps two streams per stack, and the peak of a step is
# set by the backward of one block: its rebuilt graph (qkv, the attention output, the MLP's
# hidden maps before and after the activation) and its gradients, all at once. That graph
# splits into independent pieces (Reformer, Kitaev et al. 2020): a branch that acts on every
# index along one axis alone computes, for a slice of its input along that axis, exactly the
# same slice of its output. Two such axes serve every family here:
#
# * tokens (``Split.tokens``, the token axis): LayerNorm + MLP, the G of every family, acts on
#   each token alone (Swin's on each row of its (B, H, W, C) map);
# * samples (``Split.samples``, the batch axis): LayerNorm + attention, the F of every family,
#   acts on each sample alone (Swin's windows and MViTv2's pooling stay inside a sample).
#
# Attention is not split over heads (qkv rows and projection columns per head, the outputs
# summed), which saves less: every head chunk still makes the whole LayerNorm output, its
# gradient and a whole-width projection output, about three stream-sized maps per chunk that
# no head count removes; a chunk of samples shrinks all of F's graph with the chunk, at no
# extra compute.
#
# A block declares the split (``f_split`` / ``g_split``) and computes one chunk (``f_chunk`` /
# ``g_chunk``: the branch on the chunk's slice of its input, its random draws told which slice
# of the whole draw is theirs); the engine alone decides how many chunks, rebuilds each chunk's
# graph, reconstructs the stream from it, backpropagates and frees the graph before the next
# chunk is built, adding the chunks' parameter gradients (NOTE [ Chunked backward ] in
# engine/chunked.py). The chunks' outputs are slices of the whole branch's output, so gradients
# equal the whole branch's up to the order of the parameter gradients' sums (float64 tests agree
# with plain autograd to 1e-10).
#
# NOTE [ Exact randomness in chunks ]
# A chunked branch must draw exactly what the whole branch drew in forward. The engine restores
# the branch's generator state before every chunk, so each chunk starts where forward started.
# Then every random draw inside the chunk must consume the generator exactly as the whole
# branch did, and use the part of the draw that belongs to the chunk. :func:`dropout` and
# :class:`pareprop.layers.DropPath` do that: they draw the mask of the whole tensor (dropout:
# ``F.dropout`` of ones of the whole shape, which consumes the generator as forward's call did
# and yields the same mask) and apply the chunk's slice of it. The one case that needs no
# whole draw is drop-path's one value per sample under a token split: it is the same for the
# whole branch and for every chunk. The price is a transient of one whole mask per dropout
# call while a chunk runs (the size of that tensor for the whole batch); dropout inside the
# branches is off in the image models' default configurations, which use drop-path.
#
# Along the batch axis a chunk's tensors may hold several rows per sample (Swin's windows,
# ``(B * nW, N, C)``, sample-major): a chunk of ``n`` samples then has ``r * n`` rows for the
# ``r * size`` of the whole, and its slice starts at row ``r * start``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["Split", "Chunk", "chunks", "dropout", "whole_shape"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Split:
    """A branch that acts on each of the ``size`` indices along ``dim`` of its input alone,
    so it runs on slices of its input along ``dim``, in at most ``size`` chunks."""

    size: int
    dim: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"expected a split of at least 1 unit, got {self.size}")

    @staticmethod
    def tokens(size: int, dim: int = 1) -> "Split":
        """Over the ``size`` tokens along ``dim`` (a token-wise branch: LayerNorm + MLP)."""
        return Split(size, dim)

    @staticmethod
    def samples(size: int) -> "Split":
        """Over the ``size`` samples of the batch (any branch that mixes nothing across
        samples: attention, windows, pooling)."""
        return Split(size, 0)


@dataclass(frozen=True)
class Chunk:
    """Units [start, stop) of ``size`` (tokens or samples), chunk ``index`` of ``count``."""

    index: int
    count: int
    start: int
    stop: int
    size: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def take(self, x: Tensor, dim: int, rows: int = 1) -> Tensor:
        """This chunk's slice of ``x`` along ``dim`` (a view), ``rows`` rows per unit."""
        return x.narrow(dim, self.start * rows, self.length * rows)


def chunks(size: int, count: int) -> List[Chunk]:
    """``count`` chunks covering ``size`` units (at most ``size`` chunks), the first
    ``size % count`` one unit longer, as :func:`torch.tensor_split` cuts."""
    count = max(1, min(int(count), size))
    base, extra = divmod(size, count)
    out, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        out.append(Chunk(i, count, start, stop, size))
        start = stop
    return out


def whole_shape(x: Tensor, chunk: Chunk, dim: int) -> Tuple[List[int], int]:
    """The shape of the tensor of the whole branch whose chunk ``x`` is, and the rows per unit
    along ``dim`` (NOTE [ Exact randomness in chunks ])."""
    rows, rest = divmod(x.shape[dim], chunk.length)
    if rest:
        raise ValueError(
            f"a chunk of {chunk.length} units along dim {dim} cannot hold {x.shape[dim]} rows"
        )
    shape = list(x.shape)
    shape[dim] = chunk.size * rows
    return shape, rows


def dropout(
    x: Tensor, p: float, training: bool, chunk: Optional[Chunk] = None, dim: int = 1
) -> Tensor:
    """``F.dropout(x, p)``, where ``x`` is ``chunk``'s slice along ``dim`` of the tensor the
    whole branch drops out: draws that whole tensor's mask and applies its slice (NOTE
    [ Exact randomness in chunks ]). Without a chunk (or with one chunk), plain dropout."""
    if not training or p == 0.0:
        return x
    if chunk is None or chunk.count == 1:
        return F.dropout(x, p, training=True)
    shape, rows = whole_shape(x, chunk, dim)
    mask = F.dropout(x.new_ones(shape), p, training=True)  # 0 or 1 / (1 - p), as forward drew
    return x * chunk.take(mask, dim, rows)
