"""Chunked branches: how a reversible block's F and G split, so that the reversible engines can
rebuild and differentiate a branch a piece at a time.

# NOTE [ Chunked branches ]
# Under the reversible engines a step keeps two streams per stack, and the peak of a step is
# set by the backward of one block: its rebuilt graph (qkv, the attention output, the MLP's
# hidden maps before and after the activation) and its gradients, all at once. Most of that
# graph splits into independent pieces (Reformer, Kitaev et al. 2020):
#
# * ``Split.tokens``: the branch acts on every token alone (LayerNorm + MLP, the G of every
#   family here). Output rows [a, b) along ``dim`` depend only on input rows [a, b), so a chunk
#   is the branch applied to a slice of its input.
# * ``Split.heads``: the branch is a sum over attention heads (LayerNorm + attention, the F of
#   every family): the qkv projection's rows and the output projection's columns split by head,
#   and the output is the sum of the heads' contributions (the projection's bias joins the
#   first chunk). Each chunk takes the whole input and returns a whole-shaped contribution.
#
# A block declares the split (``f_split`` / ``g_split``) and computes one chunk (``f_chunk`` /
# ``g_chunk``); the engine alone decides how many chunks, rebuilds each chunk's graph,
# reconstructs the stream from it, backpropagates and frees the graph before the next chunk is
# built, adding the chunks' input and parameter gradients (NOTE [ Chunked backward ] in
# engine.py). The mathematics is unchanged: the chunks' outputs are slices or summands of the
# whole branch's output, so gradients equal the whole branch's up to the order of floating-point
# sums (float64 tests agree with plain autograd to 1e-10).
#
# NOTE [ Exact randomness in chunks ]
# A chunked branch must draw exactly what the whole branch drew in forward. The engine restores
# the branch's generator state before every chunk, so each chunk starts where forward started.
# Then every random draw inside the chunk must consume the generator exactly as the whole
# branch did, and use the part of the draw that belongs to the chunk:
#
# * drop-path draws one value per sample, ``(B, 1, ...)``: the same draw for the whole branch
#   and for every chunk (chunks never split the batch), so it needs nothing.
# * dropout draws one value per element. :func:`dropout` draws the mask of the whole tensor
#   (``F.dropout`` of ones of the whole shape, which consumes the generator as forward's call
#   did and yields the same mask) and multiplies the chunk by its slice of it. The price is a
#   transient of one whole mask per call, while the chunk runs; dropout inside a branch is off
#   in the image models' default configurations (drop-path is what they use).
# * dropout on a tensor the chunk does not split (after a heads chunk's output projection, whose
#   output has the whole shape) is an ordinary dropout: the same mask in every chunk, and as
#   multiplying by a mask is linear, the chunks' contributions still sum to the whole output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["Split", "Chunk", "Chunking", "chunks", "dropout"]

Tensor = torch.Tensor

_KINDS = ("tokens", "heads")


@dataclass(frozen=True)
class Split:
    """How a branch splits: ``kind`` "tokens" (rows along ``dim`` of the input) or "heads"
    (a sum over ``size`` attention heads), into at most ``size`` chunks."""

    kind: str
    size: int
    dim: int = 1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"expected a split kind in {_KINDS}, got {self.kind!r}")
        if self.size < 1:
            raise ValueError(f"expected a split of at least 1 unit, got {self.size}")

    @staticmethod
    def tokens(size: int, dim: int = 1) -> "Split":
        """The branch acts on each of the ``size`` positions along ``dim`` alone."""
        return Split("tokens", size, dim)

    @staticmethod
    def heads(size: int) -> "Split":
        """The branch is a sum over ``size`` attention heads."""
        return Split("heads", size)


@dataclass(frozen=True)
class Chunk:
    """Units [start, stop) of ``size`` (tokens or heads), chunk ``index`` of ``count``."""

    index: int
    count: int
    start: int
    stop: int
    size: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def first(self) -> bool:
        """The chunk that carries a heads split's bias (once per branch)."""
        return self.index == 0

    def take(self, x: Tensor, dim: int) -> Tensor:
        """This chunk's slice of ``x`` along ``dim`` (a view)."""
        return x.narrow(dim, self.start, self.length)


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


@dataclass(frozen=True)
class Chunking:
    """A stack's chunking: a fixed chunk ``count`` per branch, or ``max_bytes``, the most a
    chunk's saved activations may take (the engine picks the fewest chunks under it)."""

    count: Optional[int] = None
    max_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.count is None) == (self.max_bytes is None):
            raise ValueError("expected exactly one of chunks= (a count) or max_bytes=")
        if self.count is not None and (isinstance(self.count, bool) or self.count < 1):
            raise ValueError(f"expected a chunk count >= 1, got {self.count!r}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"expected max_bytes > 0, got {self.max_bytes!r}")

    def count_for(self, size: int, fixed: float = 0.0, per_unit: float = 0.0) -> int:
        """Chunks for a branch of ``size`` units whose chunk of ``u`` units saves
        ``fixed + per_unit * u`` bytes: the fewest within ``max_bytes`` (all ``size`` when
        even one unit is over it)."""
        if self.count is not None:
            return max(1, min(self.count, size))
        room = self.max_bytes - fixed
        if per_unit <= 0:
            return 1
        if room < per_unit:
            return size
        units = max(1, int(room // per_unit))
        return max(1, min(size, math.ceil(size / units)))


def parse_chunking(
    chunks: Optional[int] = None, max_bytes: Union[int, str, None] = None
) -> Optional[Chunking]:
    """A :class:`Chunking` from ``chunks=`` or ``max_bytes=`` (bytes, or "64MiB"); None when
    both are None (whole branches)."""
    if chunks is None and max_bytes is None:
        return None
    if isinstance(max_bytes, str):
        max_bytes = _parse_bytes(max_bytes)
    return Chunking(count=chunks, max_bytes=max_bytes)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def _parse_bytes(text: str) -> int:
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    if not number or unit not in _UNITS:
        raise ValueError(f"expected a size like 268435456, '256MiB' or '1GB', got {text!r}")
    return int(float(number) * _UNITS[unit])


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
    shape = list(x.shape)
    shape[dim] = chunk.size
    mask = F.dropout(x.new_ones(shape), p, training=True)  # 0 or 1 / (1 - p), as forward drew
    return x * chunk.take(mask, dim)
