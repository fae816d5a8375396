"""A memory-light detector: the pyramid and the heads keep only their outputs for backward.

NOTE [ A memory-light detector ]
Under the reversible engines the backbone keeps almost nothing for backward, and what is left
of a detector's activations is in the pyramid (the maps at stride 4 and their intermediates)
and the heads (the RPN's convolutions over every level, the RoI heads' conv towers): at
1024x1024 these cap the batch (BENCHMARKS.md, "Detection memory"). :func:`set_memory_light`
runs each of them under ``torch.utils.checkpoint`` (non-reentrant): the pyramid level by
level (ViTDet's simple feature pyramid: ``pareprop.detection.pyramid.SimpleFeaturePyramid``
and detectron2's) or its top-down pass whole (the FPNs, torchvision's and detectron2's, whose
levels share the sums),
the RPN head, the box head, the mask head and the mask predictor (whose deconvolution makes
the largest map of the RoI heads, 28x28 per positive RoI) whole. Their inputs are kept anyway (the
backbone's maps, the RoI-pooled features), their outputs are what the step needs next, and
backward recomputes the rest with the same autocast state, so gradients are unchanged to the
bit. The cost is one more forward of these parts.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["is_memory_light", "set_memory_light"]

# The torchvision heads run whole under checkpointing (attribute paths from the detector).
_HEADS = ("rpn.head", "roi_heads.box_head", "roi_heads.mask_head",
          "roi_heads.mask_predictor")


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``type(self).forward`` under non-reentrant checkpointing while gradients are on."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def _get(root: nn.Module, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def set_memory_light(detector: nn.Module, enable: bool = True) -> nn.Module:
    """Run ``detector``'s pyramid and heads under activation checkpointing (or stop).

    Args:
        detector: torchvision's ``MaskRCNN`` / ``FasterRCNN`` from ``create_detector``; its
            backbone needs a ``memory_light`` attribute (pareprop's and detectron2's
            backbones have one; a backbone registered with ``register_backbone`` may).
        enable: on or off.

    Returns:
        ``detector``, with ``memory_light`` set.
    """
    backbone = getattr(detector, "backbone", None)
    if backbone is None or not hasattr(backbone, "memory_light"):
        raise ValueError(f"expected a detector whose backbone has memory_light (pareprop's "
                         f"and detectron2's backbones), got backbone {type(backbone).__name__}")
    backbone.memory_light = bool(enable)
    for path in _HEADS:
        head = _get(detector, path)
        if not isinstance(head, nn.Module):
            continue
        # An instance attribute shadows the class's forward; deleting it restores that.
        if enable:
            head.forward = types.MethodType(_checkpointed_forward, head)
        elif "forward" in head.__dict__:
            del head.forward
    detector.memory_light = bool(enable)
    return detector


def is_memory_light(detector: nn.Module) -> bool:
    """Whether :func:`set_memory_light` turned ``detector`` memory-light."""
    return bool(getattr(detector, "memory_light", False))
