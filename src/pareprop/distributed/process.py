"""The process group: torchrun's environment, joined once, and the few collectives the trainer
uses.

``torchrun --nproc_per_node N -m pareprop train ...`` starts N processes; :func:`init` reads
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and joins the process group
(gloo on the CPU, NCCL on CUDA). Without that environment everything here is a no-op for one
process, so the trainer has a single code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as tdist

__all__ = ["DistInfo", "init", "shutdown", "barrier", "all_reduce", "gather_objects"]


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
