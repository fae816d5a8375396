"""A memory-light detector: the pyramid and the heads keep only their outputs for backward.

NOTE [ A memory-light detector ]
Under the reversible engines the backbone keeps almost nothing for backward, and what is left
of a detector's activations is in the pyramid (the maps at stride 4 and their intermediates)
and the heads (the RPN's convolutions over every level, the RoI heads' conv towers): at
1024x1024 these cap the batch (BENCHMARKS.md, "Detection memory"). :func:`set_memory_light`
runs each of them under ``torch.utils.checkpoint`` (non-reentrant):

* the pyramid image by image, ViTDet's simple feature pyramid also level by level
  (``pareprop.detection.pyramid.SimpleFeaturePyramid`` and detectron2's), the FPNs with their
  top-down pass whole (torchvision's and detectron2's: the levels share the sums);
* the RPN head image by image;
* the box head, the mask head and the mask predictor (whose deconvolution makes the largest
  map of the RoI heads, 28x28 per positive RoI) whole.

Their inputs are kept anyway (the backbone's maps, the RoI-pooled features), their outputs are
what the step needs next, and backward recomputes the rest with the same autocast state, so
the gradients are those of the detector without the option (tests/test_detection_light.py, in
float64: the same losses, gradients within 1e-12; a convolution run image by image may round
differently from the whole batch's in lower precision). The cost is one more forward of these
parts.

Image by image (:func:`checkpoint_per_image`), because backward recomputes a checkpointed
part for everything it was given at once: at 1024x1024 ViTDet-B's stride-4 level recomputed for
the whole batch held 0.46 GiB an image and capped the batch (BENCHMARKS.md, "Detection memory").
Every layer of the pyramids acts on each image alone (convolutions, channel LayerNorms, max
pooling, nearest upsampling), as does the RPN head's (convolutions over each level), so the
pieces give the whole batch's result exactly. The RoI heads take the RoIs of every image
together and run whole.
"""

from __future__ import annotations

import types
from typing import Any, Callable, List

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torchvision.models.detection.rpn import RPNHead

__all__ = ["checkpoint_per_image", "is_memory_light", "set_memory_light"]

# The torchvision heads under checkpointing (attribute paths from the detector): the RPN head
# image by image, the RoI heads whole.
_HEADS = ("rpn.head", "roi_heads.box_head", "roi_heads.mask_head",
          "roi_heads.mask_predictor")


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``type(self).forward`` under non-reentrant checkpointing while gradients are on."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_per_image(fn: Callable[..., Any], *maps: torch.Tensor) -> Any:
    """``fn(*maps)`` one image at a time under non-reentrant checkpointing, the outputs joined
    along the batch, so that backward recomputes one image's intermediates at a time.

    ``fn`` must act on each image alone; it returns a tensor or a sequence of tensors, and the
    result has the same form for the whole batch.
    """
    # split, not slices: one backward node joins the images' gradients once, where a slice's
    # backward would write each image's gradient into a zero map of the whole batch.
    images = zip(*(m.split(1) for m in maps))
    pieces = [checkpoint(fn, *image, use_reentrant=False) for image in images]
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces)
    return [torch.cat(parts) for parts in zip(*pieces)]


def _rpn_head_per_image(self: nn.Module, levels: List[torch.Tensor]) -> Any:
    """torchvision's ``RPNHead.forward`` (a list of levels to the lists of objectness logits
    and box deltas) image by image under checkpointing while gradients are on."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, levels)

    def flat(*maps: torch.Tensor) -> List[torch.Tensor]:
        logits, deltas = forward(self, list(maps))
        return [*logits, *deltas]

    out = checkpoint_per_image(flat, *levels)
    return out[:len(levels)], out[len(levels):]


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
            per_image = path == "rpn.head" and isinstance(head, RPNHead)
            head.forward = types.MethodType(
                _rpn_head_per_image if per_image else _checkpointed_forward, head)
        elif "forward" in head.__dict__:
            del head.forward
    detector.memory_light = bool(enable)
    return detector


def is_memory_light(detector: nn.Module) -> bool:
    """Whether :func:`set_memory_light` turned ``detector`` memory-light."""
    return bool(getattr(detector, "memory_light", False))
