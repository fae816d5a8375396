"""The autograd Function of a stack: forward without a graph, backward by reconstruction.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from pareprop.engine.backward import _backward_in_order, _backward_pareprop
from pareprop.engine.block import _skip, skip_scale
from pareprop.engine.chunked import _couple_chunked
from pareprop.engine.forward import _couple
from pareprop.engine.plan import _block_params, _BlockRecord, _Plan
from pareprop.engine.rebuild import _store
from pareprop.engine.replay import _RngState

Tensor = torch.Tensor


def _take_outputs(plan: _Plan) -> List[Optional[Tensor]]:
    """A chunked stack's outputs, handed to backward once (NOTE [ Chunked backward ] in
    chunked.py)."""
    if plan.outputs is None:
        raise RuntimeError(
            "backward through a chunked ReversibleStack a second time: its backward releases "
            "the stack's outputs as it goes, so retain_graph=True cannot keep them; turn "
            "chunking off (pareprop.set_chunking(model)) to backpropagate twice"
        )
    outputs, plan.outputs = plan.outputs, None
    for t, version in zip(outputs, plan.output_versions):
        if t._version != version:
            raise RuntimeError(
                "an output of a ReversibleStack was modified in place between forward and "
                "backward; the reversible engines rebuild every block's inputs from it (use "
                "an out-of-place operation on the output)"
            )
    return outputs


class _ReversibleFunction(torch.autograd.Function):
    """Forward without a graph, keeping only the outputs; backward by reconstruction.

    Parameters are inputs of the Function, so their gradients come back from ``backward`` as
    ordinary outputs: ``torch.autograd.grad`` works on them and DistributedDataParallel's hooks
    fire once per parameter, as with plain autograd.
    """

    @staticmethod
    def forward(ctx, plan: _Plan, x1: Tensor, x2: Tensor, *params: Tensor):
        keep = plan.debug_tolerance is not None
        stored = plan.stored
        for index, block in enumerate(plan.blocks):
            sharded = plan.sharding is not None
            if sharded:
                plan.sharding.unshard_for_forward(index)
                plan.block_params[index], plan.block_locations[index] = _block_params(block)
            if stored[index]:
                keep_x1 = index > 0 and not stored[index - 1]
                probe = plan.probe(index, x1) if plan.probe else contextlib.nullcontext()
                with probe:
                    rebuilt = _store(block, x1, x2, plan.kwargs, keep_x1, plan.graph_rng, index)
                plan.graphs.append(rebuilt)
                plan.records.append(_BlockRecord(None, None))
                x1 = rebuilt.y1.detach()
                x2 = _skip(skip_scale(block), x2) + rebuilt.g_out.detach()
            elif plan.chunking is not None:  # NOTE [ Chunked forward ] in chunked.py
                plan.graphs.append(None)
                x1, x2 = _couple_chunked(plan, index, x1, x2, keep)
            else:
                plan.graphs.append(None)
                x1, x2 = _couple(block, x1, x2, plan.kwargs, plan.records, keep_inputs=keep,
                                 rng=plan.graph_rng)
            if sharded:
                plan.sharding.reshard_after_forward(index)
        plan.reconstruction_errors[:] = [(float("nan"), float("nan"))] * len(plan.blocks)
        ctx.plan = plan
        # The top block's outputs are what the reversible engines rebuild from; a stored top
        # block keeps what its backward needs in its own graph. A chunked stack holds them
        # itself, to release them in backward (NOTE [ Chunked backward ] in chunked.py).
        if plan.chunking is not None and not stored[-1]:
            plan.outputs = [x1.detach(), x2.detach()]
            plan.output_versions = (x1._version, x2._version)
        else:
            ctx.save_for_backward(*((x1, x2) if not stored[-1] else ()))
        return x1, x2

    @staticmethod
    def backward(ctx, dy1: Tensor, dy2: Tensor):
        if torch.is_grad_enabled():  # backward(create_graph=True) runs with grad mode on
            raise RuntimeError(
                "the reversible engines do not support double backward (create_graph=True): "
                "they rebuild activations without a graph of the gradients; use "
                "engine='autograd' for higher-order gradients"
            )
        # Saved tensors are freed after the first backward (unless retain_graph=True), so a
        # second backward raises autograd's own "backward through the graph a second time".
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        streams = _take_outputs(plan) if plan.output_versions else list(saved or (None, None))
        param_grads: List[Optional[Tensor]] = [None] * plan.num_params
        # A captured step leaves the generators alone: its branches draw from their own streams.
        entry = _RngState.capture(plan.device) if plan.graph_rng is None else None
        schedule, trial = "reversible", None
        # A chunked stack runs Reprop's schedule (NOTE [ Chunking runs Reprop ] in chunked.py).
        if plan.engine == "pareprop" and plan.chunking is None:
            schedule, trial = (("pareprop", None) if plan.fallback is None
                               else plan.fallback.begin(plan.device))
        try:
            if schedule == "pareprop":
                dx1, dx2 = _backward_pareprop(plan, streams, dy1, dy2, param_grads)
            else:
                dx1, dx2 = _backward_in_order(plan, streams, dy1, dy2, param_grads)
        finally:
            if entry is not None:
                entry.restore(plan.device)
            if trial is not None:
                plan.fallback.end(trial)
        return (None, dx1, dx2, *param_grads)
