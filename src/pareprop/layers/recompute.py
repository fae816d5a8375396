"""Activation checkpointing of the blocks that are not reversible (timm's
``set_grad_checkpointing``).

# NOTE [ Checkpointing what is not reversible ]
# A reversible stack keeps nothing of its blocks; what the hierarchical models keep after
# forward is what their other blocks keep: Rev-MViTv2's stage transitions (pooling attention
# and an MLP at the previous stage's resolution) and Rev-Swin's patch merging and stream
# fusion (LayerNorm and MLP on 2C channels of the 56x56 stage-1 map). Those blocks are few and
# do not grow with depth, but at high resolution they are most of the step's activations.
# Under ``set_grad_checkpointing()`` they run in torch.utils.checkpoint (non-reentrant): they
# keep their input, which is a stage end the engines keep anyway, and run again in backward,
# with the same RNG state (drop-path) and autocast state as in forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["maybe_checkpoint"]


def maybe_checkpoint(module: Optional[nn.Module], x: torch.Tensor, enabled: bool) -> torch.Tensor:
    """``module(x)``, under ``torch.utils.checkpoint`` when ``enabled`` and autograd records
    (in eval or under ``no_grad`` there is nothing to save); ``x`` when ``module`` is None."""
    if module is None:
        return x
    if enabled and torch.is_grad_enabled() and not torch.jit.is_scripting():
        return checkpoint(module, x, use_reentrant=False)
    return module(x)
