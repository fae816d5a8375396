"""Multi-process training: the process group, DDP and FSDP2 for the reversible engines.

One concern a module:

* ``process``: torchrun's environment and the process group (:func:`init`, :func:`shutdown`),
  and the collectives the trainer uses;
* ``fsdp``: :func:`shard`, FSDP2 with each reversible block as a unit (the engine gathers
  its blocks itself, through :class:`pareprop.engine.BlockSharding`);
* ``ddp``: :func:`wrap_ddp`, the checks that refuse a wrapper inside a stack, :func:`no_sync`;
* ``state_dict``: :func:`full_state_dict`, a sharded model's whole state dict.
"""

from pareprop.distributed.ddp import check_wrapping, no_sync, wrap_ddp
from pareprop.distributed.fsdp import is_sharded, is_wrapper, shard
from pareprop.distributed.process import (
    DistInfo,
    all_reduce,
    barrier,
    gather_objects,
    init,
    shutdown,
)
from pareprop.distributed.state_dict import full_state_dict

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
    "is_wrapper",
    "full_state_dict",
]
