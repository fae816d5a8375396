"""Multi-process training: torchrun environment, DDP wrapping for the reversible engines.

``torchrun --nproc_per_node N -m pareprop train ...`` starts N processes; :func:`init` reads
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and joins the process group
(gloo on the CPU, NCCL on CUDA). Without that environment everything here is a no-op for one
process, so the trainer has a single code path.

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

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Iterator, List, Optional

import torch
import torch.distributed as tdist
import torch.nn as nn

# FSDP2 with each reversible block as a unit lives in pareprop.distributed.fsdp (it needs only
# the engine); it is offered here too, beside DDP's wrap_ddp.
from pareprop.distributed.fsdp import is_wrapper, shard  # noqa: F401
from pareprop.engine import ReversibleStack

__all__ = [
    "DistInfo",
    "init",
    "shutdown",
    "barrier",
    "all_reduce",
    "gather_objects",
    "no_sync",
    "wrap_ddp",
    "check_wrapping",
    "shard",
    "is_sharded",
    "full_state_dict",
]


@dataclass
class DistInfo:
    """This process's place in the job: one process unless torchrun started several."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None
    owns_group: bool = False

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init(device: str = "auto") -> DistInfo:
    """Join torchrun's process group if this process was started by torchrun.

    The backend is NCCL when the run uses CUDA, gloo otherwise. A group that already exists
    (e.g. made by the caller) is used as it is and not destroyed by :func:`shutdown`.
    """
    if tdist.is_available() and tdist.is_initialized():
        return DistInfo(
            tdist.get_rank(),
            tdist.get_world_size(),
            int(os.environ.get("LOCAL_RANK", tdist.get_rank())),
            tdist.get_backend(),
            owns_group=False,
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not tdist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Without CUDA, --device cuda joins with gloo and the trainer then says what is wrong.
    use_cuda = torch.cuda.is_available() and (device == "auto" or device.startswith("cuda"))
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    tdist.init_process_group(backend=backend)
    return DistInfo(tdist.get_rank(), tdist.get_world_size(), local_rank, backend, owns_group=True)


def shutdown(info: DistInfo) -> None:
    if info.owns_group and tdist.is_initialized():
        tdist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.active:
        tdist.barrier()


def all_reduce(t: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """Sum (or min/max) ``t`` over processes; returns ``t`` itself for one process.

    The reduction runs on the process group's device (CPU for gloo, CUDA for NCCL) and the
    result comes back on ``t``'s device.
    """
    if not info.active:
        return t
    ops = {"sum": tdist.ReduceOp.SUM, "min": tdist.ReduceOp.MIN, "max": tdist.ReduceOp.MAX}
    device = torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else "cpu"
    buf = t.detach().to(device).clone()
    tdist.all_reduce(buf, op=ops[op])
    return buf.to(t.device)


def gather_objects(obj: Any, info: DistInfo) -> List[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every process."""
    if not info.active:
        return [obj]
    out: List[Any] = [None] * info.world_size
    tdist.all_gather_object(out, obj)
    return out


def no_sync(model: nn.Module) -> ContextManager:
    """Skip the gradient reduction of this backward: DDP's ``no_sync``, or for a model sharded
    with FSDP2 ``set_requires_gradient_sync(False)`` (gradients accumulate unreduced) until the
    block ends; a no-op otherwise."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(model)
    return nullcontext()


def is_sharded(model: nn.Module) -> bool:
    """True if ``model`` is an FSDP2 module (``fully_shard`` / :func:`shard` applied)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


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
    for name, stack in model.named_modules():
        if not isinstance(stack, ReversibleStack):
            continue
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
    reversible = any(
        isinstance(m, ReversibleStack) and m.engine != "autograd" for m in model.modules()
    )
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



def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The whole, unsharded state dict of a model sharded with :func:`shard`, on the CPU.

    Each sharded entry is gathered with ``DTensor.full_tensor()``, a collective: every process
    must call this, in the same order (the state dict's order is the same on all of them).
    Entries that are the same tensor under two names (tied weights) are kept once, under the
    first name, as ``safetensors.torch.save_model`` does for an unsharded model.
    """
    # The DTensor machinery loads only for a sharded model's state dict.
    from torch.distributed.tensor import DTensor

    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, DTensor):
            value = value.detach().full_tensor()
        out[name] = value.detach().to("cpu").contiguous()
    return out
