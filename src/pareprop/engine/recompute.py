"""Activation checkpointing of the blocks that are not reversible (timm's
``set_grad_checkpointing``), whole or in chunks.

# NOTE [ Checkpointing what is not reversible ]
# A reversible stack keeps nothing of its blocks; what the hierarchical models keep after
# forward is what their other blocks keep: Rev-MViTv2's stage transitions (pooling attention
# and an MLP at the previous stage's resolution) and Rev-Swin's patch merging and stream
# fusion (LayerNorm and MLP on 2C channels of the 56x56 stage-1 map). Those blocks are few and
# do not grow with depth, but at high resolution they are most of the step's activations.
# Under ``set_grad_checkpointing()`` they run in torch.utils.checkpoint (non-reentrant): they
# keep their input, which is a stage end the engines keep anyway, and run again in backward,
# with the same RNG state (drop-path) and autocast state as in forward.
#
# NOTE [ Checkpointed blocks in chunks ]
# With the branches chunked (set_chunking), the recomputation of one checkpointed block is
# what sets the peak of Rev-MViTv2-B's step: a stage transition rebuilds pooling attention at
# the previous stage's resolution (qkv, three attention maps per head) for the whole batch.
# Such a block acts on each sample alone (LayerNorm, attention, pooling and the MLP stay inside
# a sample), and Rev-Swin's stream fusion on each token alone, so it can be recomputed and
# differentiated a slice at a time with exactly the whole block's result. A block that can
# declares ``split(x)`` (a :class:`pareprop.chunking.Split`) and ``forward_chunk(x, chunk)``
# (the block on the chunk's slice of its input, giving that slice of its output along the same
# dim, its random draws told which slice of the whole draw is theirs); the stage hands over its
# stack's chunking. Forward then runs each chunk under its own non-reentrant checkpoint from
# one slice of ``x.split`` and joins the outputs: in backward the autograd engine runs the
# chunks one after the other (a later chunk's nodes come first in its order, and a chunk's
# nodes all precede the next one's), each recomputed when its first saved tensor is needed
# and freed as its backward proceeds, so one chunk's graph is alive at a time. The split's
# backward joins the chunks' input gradients once, at the end.
# Randomness is exact as in the reversible blocks (NOTE [ Exact randomness in chunks ]): the
# generator state is put back before every chunk, so each chunk draws the whole block's masks
# and takes its slice, torch's checkpoint replays that same state in backward, and after the
# last chunk the generator stands where the whole block leaves it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union
from weakref import WeakKeyDictionary

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pareprop.chunking import Chunk, Split, chunks
from pareprop.engine.chunk_cost import (
    Chunking,
    graph_bytes,
    linear_cost,
    plain,
    planned_cost,
    tracing_distinct,
)

__all__ = ["maybe_checkpoint", "checkpoint_chunk_count"]

# Measured chunk costs of chunking by bytes, per module and input (not state).
_COSTS: "WeakKeyDictionary[nn.Module, Dict[Any, Tuple[float, float]]]" = WeakKeyDictionary()


def maybe_checkpoint(
    module: Optional[nn.Module],
    x: Union[torch.Tensor, Sequence[torch.Tensor]],
    enabled: bool,
    chunking: Optional[Chunking] = None,
    join: Optional[Callable[..., torch.Tensor]] = None,
) -> torch.Tensor:
    """``module(x)``, under ``torch.utils.checkpoint`` when ``enabled`` and autograd records
    (in eval or under ``no_grad`` there is nothing to save); ``x`` when ``module`` is None.
    With ``chunking`` (the stage's stack's) a module that declares ``split`` and
    ``forward_chunk`` is checkpointed in chunks (NOTE [ Checkpointed blocks in chunks ]).
    With ``join``, ``x`` is a sequence of tensors and the module's input is ``join(*x)``,
    made inside the checkpoint: the checkpoint keeps the parts (a stack's two output streams,
    which the stack keeps anyway), not a joined copy of them."""
    parts = tuple(x) if join is not None else (x,)
    join = join if join is not None else _first
    if module is None:
        return join(*parts)
    if enabled and torch.is_grad_enabled() and not torch.jit.is_scripting():
        count, split = checkpoint_chunk_count(module, parts, chunking, join)
        if count > 1:
            return _checkpoint_chunks(module, parts, join, split, count)
        return checkpoint(_Joined(module, join), *parts, use_reentrant=False)
    return module(join(*parts))


def _first(x: torch.Tensor) -> torch.Tensor:
    return x


class _Joined:
    """``module(join(*parts))``, or ``module.forward_chunk(join(*parts), chunk)``."""

    def __init__(self, module: nn.Module, join: Callable[..., torch.Tensor],
                 chunk: Optional[Chunk] = None):
        self.module, self.join, self.chunk = module, join, chunk

    def __call__(self, *parts: torch.Tensor) -> torch.Tensor:
        if self.chunk is None:
            return self.module(self.join(*parts))
        return self.module.forward_chunk(self.join(*parts), self.chunk)


def checkpoint_chunk_count(
    module: nn.Module,
    parts: Sequence[torch.Tensor],
    chunking: Optional[Chunking],
    join: Callable[..., torch.Tensor] = _first,
) -> Tuple[int, Optional[Split]]:
    """How many chunks ``module`` is checkpointed in for input ``join(*parts)`` under
    ``chunking``: 1 when chunking is off or the module declares no split; else the chunking's
    count, or the fewest chunks whose graph saves at most its ``max_bytes`` (measured once per
    input). The module's ``split`` sees the first part, which splits along the same axis as
    the joined input (samples, or rows of a map)."""
    split = getattr(module, "split", None)
    if chunking is None or split is None:
        return 1, None
    split = split(parts[0])
    if not isinstance(split, Split):
        raise TypeError(f"{type(module).__name__}.split must return a pareprop.chunking.Split, "
                        f"got {type(split).__name__}")
    if chunking.count is not None:
        return chunking.count_for(split.size), split
    return chunking.count_for(split.size, *_chunk_cost(module, parts, join, split)), split


def _rng_state(device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Tuple[torch.Tensor, Optional[torch.Tensor]],
                   device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _split(x: torch.Tensor, split: Split, pieces: List[Chunk]) -> Tuple[torch.Tensor, ...]:
    rows = x.shape[split.dim] // split.size
    return x.split([c.length * rows for c in pieces], dim=split.dim)


def _checkpoint_chunks(module: nn.Module, parts: Sequence[torch.Tensor],
                       join: Callable[..., torch.Tensor], split: Split,
                       count: int) -> torch.Tensor:
    pieces = chunks(split.size, count)
    traced = _traced(pieces) if tracing_distinct() else range(len(pieces))
    device = parts[0].device
    state = _rng_state(device)
    outs: List[torch.Tensor] = []
    like: Dict[int, Tuple[torch.Size, torch.dtype]] = {}  # length -> a traced chunk's output
    for i, (chunk, *sliced) in enumerate(zip(pieces, *(_split(p, split, pieces) for p in parts))):
        if i not in traced:  # planning: NOTE [ Planning checkpointed chunks ]
            outs.append(_Standin.apply(*like[chunk.length], *sliced))
            continue
        _set_rng_state(state, device)  # every chunk draws what the whole block drew
        outs.append(checkpoint(_Joined(module, join, chunk), *sliced, use_reentrant=False))
        like[chunk.length] = (outs[-1].shape, outs[-1].dtype)
    return torch.cat(outs, dim=split.dim)


# NOTE [ Planning checkpointed chunks ]
# A plan traces a chunked branch of the engine from its distinct chunks (NOTE [ Planning a
# chunked branch from its distinct chunks ] in chunk_cost.py); a checkpointed block in chunks
# differs: forward keeps each chunk's output until they are joined, so chunk k runs beside the
# outputs of chunks 0..k-1, and backward (last chunk first) keeps each chunk's input gradient
# until the split's backward joins them, so chunk k runs beside those of chunks k+1..n-1 (and
# the last chunk, the first done, creates the parameters' gradients). ``chunks`` gives the
# longer chunks first, so the chunks whose step can set a peak are the first and the last
# chunk of each length: forward's highest for a length is its last chunk, backward's its
# first. While planning only those run; every other chunk is a stand-in that allocates what
# the chunk would keep, an output of the traced chunk's shape in forward and an input
# gradient of each part's slice in backward, at the same moments. The plan's peak is the
# trace of every chunk's (tests/test_memory.py).
def _traced(pieces: List[Chunk]) -> Set[int]:
    first = {}
    for i, chunk in enumerate(pieces):
        first.setdefault(chunk.length, i)
    last = {chunk.length: i for i, chunk in enumerate(pieces)}
    return set(first.values()) | set(last.values())


class _Standin(torch.autograd.Function):
    """Planning only: a skipped chunk's output (``shape``, ``dtype``) and input gradients,
    allocated where the chunk would allocate them, computing nothing."""

    @staticmethod
    def forward(ctx, shape: torch.Size, dtype: torch.dtype,
                *sliced: torch.Tensor) -> torch.Tensor:
        ctx.parts = [(s.shape, s.dtype, s.device) for s in sliced]
        return sliced[0].new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grads = [torch.empty(shape, dtype=dtype, device=device) if needed else None
                 for (shape, dtype, device), needed in zip(ctx.parts, ctx.needs_input_grad[2:])]
        return (None, None, *grads)


def _autocast_key(device_type: str) -> Tuple[Any, ...]:
    try:  # torch >= 2.4
        return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                     for t in sorted({"cpu", device_type}))
    except (TypeError, RuntimeError):  # a device type without autocast (meta)
        return (torch.is_autocast_enabled(),)


def _chunk_cost(module: nn.Module, parts: Sequence[torch.Tensor],
                join: Callable[..., torch.Tensor], split: Split) -> Tuple[float, float]:
    """(fixed, per unit) bytes saved by the graph of one chunk, measured on chunks of one and
    two units, as the engine measures a branch's chunks (NOTE [ Measuring a chunk's graph ] in
    engine/chunk_cost.py)."""
    x = parts[0]
    key = (tuple(tuple(p.shape) for p in parts), x.dtype, _autocast_key(x.device.type))
    costs = _COSTS.setdefault(module, {})
    if key in costs:
        return costs[key]
    def measure() -> Tuple[float, float]:
        state = _rng_state(x.device)
        measured = []
        for units in (1, 2) if split.size >= 2 else (1,):
            chunk = Chunk(0, 2, 0, units, split.size)

            def build(chunk: Chunk = chunk) -> Tuple[torch.Tensor, List[torch.Tensor]]:
                # Copies, not views of the parts: a memory tracker's hooks (torch's
                # MemTracker) can keep the measured graph alive in a reference cycle, and it
                # must not hold the parts' storage then. A chunk's parts are slices of the
                # parts kept anyway: no cost.
                leaves = [chunk.take(p, split.dim, p.shape[split.dim] // split.size)
                          .detach().clone().requires_grad_(True) for p in parts]
                return _Joined(module, join, chunk)(*leaves), leaves

            measured.append(graph_bytes(build, free=module.parameters()))
        _set_rng_state(state, x.device)  # the measurement drew nothing, as far as forward knows
        return linear_cost(measured, type(module).__name__)

    # While planning, modules alike share one measurement (NOTE [ Chunk costs while planning ]
    # in chunk_cost.py).
    costs[key] = planned_cost(module, (
        "checkpointed", key, plain(list(parts)), plain(join), split), measure)
    return costs[key]
