"""The whole state dict of a sharded model, gathered on every process."""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

__all__ = ["full_state_dict"]


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
