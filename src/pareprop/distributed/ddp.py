"""DistributedDataParallel for the reversible engines: wrapping a whole model, refusing a wrapper
inside a stack, and skipping a backward's reduction.

NOTE [ Reversible engines under DDP ]
    DistributedDataParallel reduces a parameter's gradient when autograd's AccumulateGrad hook
    for that parameter fires. The reversible engines run the stack as one autograd Function
    whose backward recomputes each block and returns the parameters' gradients as ordinary
    outputs (the parameters are inputs of the Function), so every parameter's hook fires exactly
    once per backward, after its gradient is complete, in the usual last-block-first order.
    Hence:

    * ``find_unused_parameters=False``: every parameter is reached from the loss (through the
      Function), so the extra graph walk is waste; it is also the setting under which DDP
      overlaps reduction with the backward of earlier blocks.
    * ``static_graph``: valid (the same parameters take part in every step) but it buys nothing
      the defaults do not, so it stays off unless asked for (``wrap_ddp(..., static_graph=True)``
      works and is tested).
    * ``cuda_graphs=True``: the same, a graphed stack being one autograd Function too; its
      capture differentiates with respect to aliases of the parameters, never at the
      AccumulateGrad nodes the reducer holds (NOTE [ Parameter aliases in a capture ] in
      pareprop/engine/graphs.py).
    * Wrap the WHOLE model, once. A DDP (or FSDP) wrapper around a block or a stack's inner
      module cannot work: the engine calls a block's ``f`` and ``g`` directly in recomputation,
      bypassing the wrapper's ``forward`` (FSDP would not gather the sharded weights; DDP would
      see gradients it was never told to expect and fail with "Expected to have finished
      reduction"). :func:`wrap_ddp` and :func:`check_wrapping` refuse such models with a message.
      The exception is :func:`shard` (FSDP2 per block): it tells each stack's engine to gather
      its blocks itself; see NOTE [ FSDP2 and reversible blocks ] in pareprop/distributed/fsdp.py. A
      ``fully_shard`` applied to a block by hand is still refused: the engine would not know.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional

import torch
import torch.distributed as tdist
import torch.nn as nn

from pareprop.distributed.fsdp import is_sharded, is_wrapper
from pareprop.engine import stacks_of

__all__ = ["no_sync", "wrap_ddp", "check_wrapping"]


def no_sync(model: nn.Module) -> ContextManager:
    """Skip the gradient reduction of this backward: DDP's ``no_sync``, or for a model sharded
    with FSDP2 ``set_requires_gradient_sync(False)`` (gradients accumulate unreduced) until the
    block ends; a no-op otherwise."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(model)
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def check_wrapping(model: nn.Module) -> None:
    """Raise ``ValueError`` if a data-parallel wrapper sits inside a reversible stack.

    See NOTE [ Reversible engines under DDP ] for why such a model cannot train.
    """
    for name, stack in stacks_of(model):
        # Blocks sharded by pareprop.distributed.fsdp.shard are gathered by the engine itself (NOTE
        # [ FSDP2 and reversible blocks ] in distributed/fsdp.py); any other wrapper is bypassed.
        sharded = {id(b) for b in stack.blocks} if stack.sharding is not None else set()
        for sub_name, sub in stack.named_modules():
            if sub is stack or id(sub) in sharded or not is_wrapper(sub):
                continue
            where = f"{name}.{sub_name}" if name else sub_name
            raise ValueError(
                f"{type(sub).__name__} wraps {where!r}, inside the ReversibleStack {name!r}: the "
                f"reversible engines call each block's f and g directly when they recompute, "
                f"bypassing the wrapper. Wrap the whole model once instead "
                f"(pareprop.distributed.wrap_ddp(model)), or use engine='autograd'"
            )


def wrap_ddp(
    model: nn.Module,
    device: Optional[torch.device] = None,
    static_graph: bool = False,
    **ddp_kwargs: Any,
) -> nn.parallel.DistributedDataParallel:
    """Wrap a whole pareprop model in DDP with settings valid for every engine.

    Args:
        model: the bare model (already on ``device``).
        device: its device; CUDA gives ``device_ids=[index]``.
        static_graph: passed to DDP (valid with every engine; off by default).
        **ddp_kwargs: other DDP arguments. ``find_unused_parameters=True`` is refused for the
            reversible engines: it is never needed (see the module note) and only costs a graph
            walk per step.

    Raises:
        ValueError: the model is already wrapped, a wrapper sits inside a reversible stack, or
            an option cannot work.
    """
    if not tdist.is_available() or not tdist.is_initialized():
        raise ValueError(
            "wrap_ddp needs an initialised process group: start with torchrun, or call "
            "torch.distributed.init_process_group first"
        )
    if is_wrapper(model):
        raise ValueError(f"the model is already wrapped in {type(model).__name__}; wrap it once")
    check_wrapping(model)
    reversible = any(m.engine != "autograd" for _, m in stacks_of(model))
    if reversible and ddp_kwargs.get("find_unused_parameters"):
        raise ValueError(
            "find_unused_parameters=True is not needed with the reversible engines: every "
            "parameter is an input of the engine's autograd Function, so all are used; drop it"
        )
    ddp_kwargs.setdefault("find_unused_parameters", False)
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index if device.index is not None else 0])
    return nn.parallel.DistributedDataParallel(model, static_graph=static_graph, **ddp_kwargs)
