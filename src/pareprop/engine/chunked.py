"""Chunked branches: a block's forward, rebuild and gradients a chunk at a time.

With chunking on (:func:`pareprop.engine.set_chunking`; NOTE [ Chunked branches ] in
pareprop/chunking.py) each branch that declares a split runs chunk by chunk, in forward and in
backward, so one chunk's graph is alive at a time instead of a block's two whole graphs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Set, Tuple

import torch

from pareprop.chunking import Chunk, Split, chunks
from pareprop.engine.block import _skip, skip_scale
from pareprop.engine.chunk_cost import (
    distinct_chunks,
    graph_bytes,
    linear_cost,
    plain,
    planned_cost,
)
from pareprop.engine.forward import _call_checked
from pareprop.engine.plan import _BlockRecord, _Plan, _plan_beta
from pareprop.engine.rebuild import (
    _add_param_grads,
    _check_reconstruction,
    _forward_parameters,
    _profiled,
    _vjp,
)
from pareprop.engine.replay import _ModeState, _RngState

Tensor = torch.Tensor


# NOTE [ Chunked forward ]
# The forward of a chunked stack runs each branch chunk by chunk too, without a graph: its
# whole-branch temporaries (a ViT-B MLP's two 4C-wide hidden maps, qkv and the attention
# output) would otherwise set the step's peak once backward no longer does. Each chunk's
# output is added into its slice of the block's output (Y1 = beta X1 + F(X2), then Y2 = beta
# X2 + G(Y1)), a tensor the stack made. Randomness is drawn as in backward: the branch's
# generator state is restored before every chunk, and each chunk takes its slice of the whole
# draw (NOTE [ Exact randomness in chunks ]), so the generator ends where the whole branch
# leaves it, and backward rebuilds exactly what forward computed, chunk for chunk.


def _couple_chunked(
    plan: "_Plan", index: int, x1: Tensor, x2: Tensor, keep_inputs: bool
) -> Tuple[Tensor, Tensor]:
    """``_couple`` of block ``index`` of a chunked stack, each branch in chunks."""
    block = plan.blocks[index]
    f_rng = _RngState.capture(x2.device)
    y1 = _add_branch(plan, index, "f", x2, x1, f_rng)
    g_rng = _RngState.capture(x2.device)
    y2 = _add_branch(plan, index, "g", y1, x2, g_rng)
    inputs = (x1.clone(), x2.clone()) if keep_inputs else None
    plan.records.append(_BlockRecord(f_rng, g_rng, inputs, _ModeState.capture(block, index)))
    return y1, y2


def _add_branch(plan: "_Plan", index: int, name: str, x: Tensor, skip: Tensor,
                rng: _RngState) -> Tensor:
    """``beta * skip + branch(x)`` in forward, in chunks where the branch has more than one."""
    block = plan.blocks[index]
    beta = skip_scale(block)
    branch = _branch(plan, index, name, x, rng)
    if branch.whole:  # as _couple does it
        rng.restore(plan.device)  # measuring the chunk cost (chunking by bytes) has drawn
        return _skip(beta, skip) + _call_checked(block, name, x, plan.kwargs)
    out = skip.clone() if beta is None else beta * skip
    _run_chunks(plan, branch, _ChunkTargets(add_into=out))
    return out


# NOTE [ Chunked backward ]
# With chunking on (set_chunking; NOTE [ Chunked branches ] in pareprop/chunking.py) a
# recomputed block's backward runs branch by branch and, inside a branch, chunk by chunk:
#   G: per chunk, restore G's generator state, rebuild the chunk's graph from a leaf (the
#      chunk's slice of Y1: tokens for G, samples for F), subtract its output from its slice
#      of Y2, where X2 = (Y2 - G(Y1)) / beta is being rebuilt, backpropagate the matching part
#      of dY2, add the input gradient into dY1 and the parameter gradients into their sums;
#      the chunk's graph is freed before the next chunk is built.
#   F: the same over X2 (complete by now) with the total dY1 flowing in, subtracting where
#      X1 = (Y1 - F(X2)) / beta is rebuilt, adding the input gradients into dX2 = beta dY2 +
#      dF (beta: NOTE [ Skip scale of the coupling ] in block.py, 1 for most blocks).
# So one chunk's graph is alive at a time instead of the block's two whole graphs.
#
# What is kept when, under "reversible". A block's backward holds its output streams Y1, Y2,
# their gradients dY1, dY2, and one chunk's graph with its gradients. The rebuilt streams and
# the new gradients take the storage of the old ones, in place:
#   * X2 goes into Y2: G reads Y1 only, and nothing reads Y2 after G's chunks are subtracted;
#   * X1 goes into Y1 once G is done: F reads X2 only;
#   * dY1 + dG goes into dY1, and dY2 + dF into dY2: G's backward has read dY2 by then.
# The floor of a block's backward is therefore one pair of streams and one pair of
# gradients, plus what autograd holds. Not for the top block: its streams are the stack's
# outputs, which the caller may still hold, and its gradients come from autograd, which may
# hand out views of one tensor (after torch.cat) or a tensor a hook kept. So the top block
# writes into copies, and every block below works in place in what the block above returned.
# The copies cost nothing lasting: a chunked stack does not save its outputs in the autograd
# Function but holds detached aliases itself (their versions checked in backward), and the
# top block drops them as soon as they are copied, so they are freed unless the caller holds
# them. The price is that backward can run once: with retain_graph=True a second backward
# raises. What stays is the top block's incoming gradients, which autograd holds until
# backward returns: a block's backward holds two streams, their two gradients, those two, and
# one chunk's graph with its gradients.
#
# Under "pareprop" a chunked stack runs this same schedule, Reprop's (NOTE [ Chunking runs
# Reprop ]).
# Stored blocks keep their whole graphs from forward.


# NOTE [ Chunking runs Reprop ]
# Chunking is for memory, PaReprop for idle device time, and they do not combine. PaReprop
# rebuilds block l-1 beside block l's gradients, so it cannot rebuild in the storage that
# block l still reads: a chunked block would be rebuilt once without a graph into new maps,
# and then once more, chunk by chunk, with a graph to differentiate (a depth-3 Rev-ViT with 2
# chunks ran its branches' chunks 22 times in backward against Reprop's 12), holding more
# stream maps than Reprop to do so and running slower than chunked Reprop (BENCHMARKS.md),
# and the largest batches where chunking matters fill the device with one block anyway. So a
# chunked stack under "pareprop" runs Reprop's schedule, in place, and :func:`schedule_reasons`
# says so.


@dataclass
class _Branch:
    """Branch ``name`` (``"f"`` or ``"g"``) of block ``index`` on input ``x``, as it runs in
    chunks: its split (None: whole), its chunk count, and the generator state every chunk
    starts from."""

    index: int
    name: str
    x: Tensor
    split: Optional[Split]
    count: int
    rng: _RngState

    @property
    def whole(self) -> bool:
        return self.split is None or self.count == 1


@dataclass
class _ChunkTargets:
    """Where each chunk's results go: its output is subtracted from ``subtract_from`` or added
    into ``add_into``; with ``grad_out`` each chunk is backpropagated at once, its input
    gradient added into ``grad_into`` and its parameter gradients into ``param_grads`` (the
    indices summed so far in ``sums``)."""

    subtract_from: Optional[Tensor] = None
    add_into: Optional[Tensor] = None
    grad_out: Optional[Tensor] = None
    grad_into: Optional[Tensor] = None
    param_grads: Optional[List[Optional[Tensor]]] = None
    sums: Optional[Set[int]] = None


def _branch(plan: _Plan, index: int, name: str, x: Tensor, rng: _RngState) -> _Branch:
    """Branch ``name`` of block ``index`` on ``x``, with its split and chunk count."""
    split, count = _branch_chunking(plan, index, name, x, rng)
    return _Branch(index, name, x, split, count, rng)


def _branch_chunking(
    plan: _Plan, index: int, name: str, x: Tensor, rng: _RngState
) -> Tuple[Optional[Split], int]:
    """Block ``index``'s split of branch ``name`` for input ``x`` and its chunk count."""
    block = plan.blocks[index]
    split = getattr(block, f"{name}_split")(x, **plan.kwargs)
    if split is None:
        return None, 1
    if not isinstance(split, Split):
        raise TypeError(
            f"{type(block).__name__}.{name}_split must return a pareprop.chunking.Split or None, "
            f"got {type(split).__name__}"
        )
    chunking = plan.chunking
    if chunking.count is not None:
        return split, chunking.count_for(split.size)
    return split, chunking.count_for(split.size, *_chunk_cost(plan, index, name, x, split, rng))


def _chunk_cost(
    plan: _Plan, index: int, name: str, x: Tensor, split: Split, rng: _RngState
) -> Tuple[float, float]:
    """(fixed, per unit) bytes saved by the graph of one chunk of a branch, measured once per
    block, branch, input shape and autocast state on chunks of one and two units (NOTE
    [ Measuring a chunk's graph ] in chunk_cost.py)."""
    key = (index, name, tuple(x.shape), x.dtype, plan.autocast)
    if key in plan.chunk_costs:
        return plan.chunk_costs[key]
    block = plan.blocks[index]

    def measure() -> Tuple[float, float]:
        measured = []
        for units in (1, 2) if split.size >= 2 else (1,):
            chunk = Chunk(0, 2, 0, units, split.size)

            def build(chunk: Chunk = chunk) -> Tuple[Tensor, List[Tensor]]:
                rng.restore(plan.device)
                # A copy of one or two units, not a view: tools that hook module inputs in
                # forward (torch's ModTracker) keep a leaf they saw, and a view would keep the
                # whole stream with it.
                leaf = _chunk_input(x, split, chunk).detach().clone().requires_grad_(True)
                return _call_checked(block, name, leaf, plan.kwargs, chunk), [leaf]

            measured.append(graph_bytes(build, free=block.parameters()))
        return linear_cost(measured, f"block {index} ({type(block).__name__}) branch {name}")

    # While planning, blocks alike share one measurement (NOTE [ Chunk costs while planning ]).
    plan.chunk_costs[key] = cost = planned_cost(block, (
        "branch", name, plain(x), plan.autocast, split, plain(plan.kwargs)), measure)
    return cost


def _chunk_input(x: Tensor, split: Optional[Split], chunk: Optional[Chunk]) -> Tensor:
    if chunk is None or split is None:
        return x
    return chunk.take(x, split.dim)


def _run_chunks(plan: _Plan, branch: _Branch, to: _ChunkTargets) -> None:
    """``branch`` chunk by chunk, each chunk's results into ``to``; with a gradient to
    propagate, each chunk's graph is freed before the next chunk is built."""
    block, split = plan.blocks[branch.index], branch.split
    owned = plan.block_params[branch.index]
    params = [p for _, p in owned]
    # All chunks, or while planning those that can set a new peak (NOTE [ Planning a chunked
    # branch from its distinct chunks ] in chunk_cost.py).
    pieces = [None] if branch.whole else distinct_chunks(chunks(split.size, branch.count))
    backward = to.grad_out is not None
    accumulate = backward and len(pieces) > 1
    with (_accumulating(plan, branch.index, params) if accumulate
          else contextlib.nullcontext()) as leaves:
        for chunk in pieces:
            branch.rng.restore(plan.device)
            with torch.set_grad_enabled(backward):
                leaf = _chunk_input(branch.x, split, chunk).detach()
                if backward:
                    leaf.requires_grad_(True)
                out = _call_checked(block, branch.name, leaf, plan.kwargs, chunk)
            if to.subtract_from is not None:
                with torch.no_grad():
                    _chunk_input(to.subtract_from, split, chunk).sub_(out)
            if to.add_into is not None:
                with torch.no_grad():
                    _chunk_input(to.add_into, split, chunk).add_(out)
            if not backward:
                continue
            part = _chunk_input(to.grad_out, split, chunk)
            if accumulate:  # parameter gradients accumulate in the leaves' .grad
                if out.requires_grad:
                    torch.autograd.backward(out, part.to(out.dtype), inputs=[leaf, *leaves])
                grad_in, grads = leaf.grad, ()
            else:
                grad_in, *grads = _vjp(out, [leaf, *params], part)
            del out, leaf  # the chunk's graph is gone; its gradients remain
            into = _chunk_input(to.grad_into, split, chunk)
            if grad_in is not None:
                into.add_(grad_in)
            _add_param_grads(owned, grads, to.param_grads, to.sums)
        if accumulate:
            _add_param_grads(owned, [t.grad for t in leaves], to.param_grads, to.sums)


# NOTE [ Parameter gradients of chunks ]
# torch.autograd.grad hands back every parameter's gradient of a chunk at once, all alive together
# beside the running sums: one block's parameter gradients more than whole branches need, which is
# what sets the peak of a small-batch step. So over several chunks the block's parameters are
# swapped (as NOTE [ Recomputing with the forward's parameters ] in rebuild.py swaps them) for
# leaves that alias them, and backward accumulates into the leaves' .grad: each parameter's chunk
# gradient is added in place and freed as soon as it is computed.


@contextlib.contextmanager
def _accumulating(plan: _Plan, index: int, params: List[Tensor]) -> Iterator[List[Tensor]]:
    leaves = {id(p): p.detach().requires_grad_(True) for p in params}
    swapped = []
    try:
        for loc in plan.block_locations[index]:
            current = loc.module._parameters[loc.name]
            if id(current) in leaves:
                swapped.append((loc.module, loc.name, current))
                loc.module._parameters[loc.name] = leaves[id(current)]
        yield [leaves[id(p)] for p in params]
    finally:
        for module, name, current in reversed(swapped):
            module._parameters[name] = current


@_profiled("pareprop::chunked")
def _block_chunked(
    plan: _Plan,
    index: int,
    streams: List[Optional[Tensor]],
    dy1: Tensor,
    dy2: Tensor,
    param_grads: List[Optional[Tensor]],
    in_place: bool,
) -> Tuple[Tensor, Tensor]:
    """Recover and backpropagate block ``index`` chunk by chunk ("reversible"). ``streams``
    holds Y1, Y2 and is left holding X1, X2; returns dX1, dX2. With ``in_place`` everything is
    rebuilt in the storage of Y1, Y2, dY1, dY2; without, into copies, and Y1, Y2 are released
    as soon as they are copied."""
    if plan.sharding is not None:
        plan.sharding.gather(index)
        param_grads = [None] * len(plan.block_params[index])
    record, sums = plan.records[index], set()
    plan.keywords.check(index, plan.blocks[index])
    beta = _plan_beta(plan, index)  # NOTE [ Skip scale of the coupling ] in block.py
    x2 = streams[1] if in_place else streams[1].clone()
    streams[1] = None
    dy1_total = dy1 if in_place else dy1.clone()
    with plan.autocast.replay(), plan.backends.replay(), record.modes.replay(), \
            _forward_parameters(plan, index):
        # Y2 = beta X2 + G(Y1): X2 is rebuilt into Y2, dY2 flows into G, whose input gradient
        # joins dY1.
        _run_chunks(plan, _branch(plan, index, "g", streams[0], record.g_rng),
                    _ChunkTargets(subtract_from=x2, grad_out=dy2, grad_into=dy1_total,
                                  param_grads=param_grads, sums=sums))
        _unskip_(beta, x2)
        x1 = streams[0] if in_place else streams[0].clone()
        streams[0] = None
        dx2 = _skip_(beta, dy2 if in_place else dy2.clone())
        # Y1 = beta X1 + F(X2): X1 is rebuilt into Y1, the total dY1 flows into F, whose input
        # gradient joins beta dY2.
        _run_chunks(plan, _branch(plan, index, "f", x2, record.f_rng),
                    _ChunkTargets(subtract_from=x1, grad_out=dy1_total, grad_into=dx2,
                                  param_grads=param_grads, sums=sums))
        _unskip_(beta, x1)
        _skip_(beta, dy1_total)  # dX1 = beta dY1', once F has read dY1'
    if record.inputs is not None:
        _check_reconstruction(plan, index, (x1, x2), record.inputs)
    if plan.sharding is not None:
        plan.sharding.reduce(index, [p for _, p in plan.block_params[index]], param_grads)
    streams[:] = [x1, x2]
    return dy1_total, dx2


def _skip_(beta: Optional[Tensor], x: Tensor) -> Tensor:
    """``_skip`` in place, on a tensor of ours."""
    return x if beta is None else x.mul_(beta)


def _unskip_(beta: Optional[Tensor], x: Tensor) -> Tensor:
    """``_unskip`` in place, on a tensor of ours."""
    return x if beta is None else x.div_(beta)
