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
  map of the RoI heads, 28x28 per positive RoI) in pieces of :data:`ROI_ROWS` RoIs.

Their inputs are kept anyway (the backbone's maps, the RoI-pooled features), their outputs are
what the step needs next, and backward recomputes the rest with the same autocast state, so
the gradients are those of the detector without the option (tests/test_detection_light.py, in
float64: the same losses, gradients within 1e-12; a convolution run image by image may round
differently from the whole batch's in lower precision). The cost is one more forward of these
parts.

In pieces (:func:`checkpoint_in_pieces`), because backward recomputes a checkpointed part for
everything it was given at once: at 1024x1024 ViTDet-B's stride-4 level recomputed for the
whole batch held 0.46 GiB an image and capped the batch (BENCHMARKS.md, "Detection memory").
Every layer of the pyramids acts on each image alone (convolutions, channel LayerNorms, max
pooling, nearest upsampling), as does the RPN head's (convolutions over each level) and the
RoI heads' on each RoI (convolutions and LayerNorms over a RoI's map, linear layers on its
row), so the pieces give the whole batch's result. A head with batch norm mixes the rows in
training and runs whole.
"""

from __future__ import annotations

import types
from typing import Any, Callable, List

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ROI_ROWS", "MemoryLightMixin", "checkpoint_in_pieces", "is_memory_light",
           "set_memory_light"]

# The torchvision heads under checkpointing (attribute paths from the detector).
_RPN_HEAD = "rpn.head"
_ROI_HEADS = ("roi_heads.box_head", "roi_heads.mask_head", "roi_heads.mask_predictor")
# RoIs in a piece of the RoI heads: a training image's sampled RoIs (torchvision's
# box_batch_size_per_image), a few images' positives in the mask head.
ROI_ROWS = 512


class MemoryLightMixin:
    """A pyramid's ``memory_light`` switch (set by :func:`set_memory_light`): ``_light()`` says
    whether to run under checkpointing now (on, and gradients on)."""

    memory_light = False

    def _light(self) -> bool:
        return bool(self.memory_light) and torch.is_grad_enabled()


def checkpoint_in_pieces(fn: Callable[..., Any], *maps: torch.Tensor, rows: int = 1) -> Any:
    """``fn(*maps)`` on ``rows`` rows (images, RoIs) at a time under non-reentrant
    checkpointing, the outputs joined along the first dimension, so that backward recomputes
    one piece's intermediates at a time.

    ``fn`` must act on each row alone; it returns a tensor or a sequence of tensors, and the
    result has the same form for all the rows.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"expected rows a positive integer, got {rows!r}")
    if not maps or any(m.shape[:1] != maps[0].shape[:1] for m in maps):
        raise ValueError(f"expected one or more tensors with the same first dimension, got "
                         f"shapes {[tuple(m.shape) for m in maps]}")
    if maps[0].shape[0] == 0:
        return fn(*maps)  # nothing to recompute
    # split, not slices: one backward node joins the pieces' gradients once, where a slice's
    # backward would write each piece's gradient into a zero map of the whole batch.
    pieces = [checkpoint(fn, *piece, use_reentrant=False)
              for piece in zip(*(m.split(rows) for m in maps))]
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces)
    return [torch.cat(parts) for parts in zip(*pieces)]


def _mixes_rows(module: nn.Module) -> bool:
    """Whether ``module`` in training computes a row from the others' (batch norm)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def _roi_head_in_pieces(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A RoI head's ``forward`` on :data:`ROI_ROWS` RoIs at a time under checkpointing while
    gradients are on (whole where it mixes rows, or has no RoI)."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, x)
    if _mixes_rows(self):
        return checkpoint(forward, self, x, use_reentrant=False)
    return checkpoint_in_pieces(lambda rois: forward(self, rois), x, rows=ROI_ROWS)


def _rpn_head_per_image(self: nn.Module, levels: List[torch.Tensor]) -> Any:
    """torchvision's ``RPNHead.forward`` (a list of levels to the lists of objectness logits
    and box deltas) image by image under checkpointing while gradients are on (whole where it
    mixes images)."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, levels)
    if _mixes_rows(self):
        return checkpoint(forward, self, levels, use_reentrant=False)

    def flat(*maps: torch.Tensor) -> List[torch.Tensor]:
        logits, deltas = forward(self, list(maps))
        return [*logits, *deltas]

    out = checkpoint_in_pieces(flat, *levels)
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
    for path in (_RPN_HEAD, *_ROI_HEADS):
        head = _get(detector, path)
        if not isinstance(head, nn.Module):
            continue
        # An instance attribute shadows the class's forward; deleting it restores that.
        if enable:
            head.forward = types.MethodType(
                _rpn_head_per_image if path == _RPN_HEAD else _roi_head_in_pieces, head)
        elif "forward" in head.__dict__:
            del head.forward
    detector.memory_light = bool(enable)
    return detector


def is_memory_light(detector: nn.Module) -> bool:
    """Whether :func:`set_memory_light` turned ``detector`` memory-light."""
    return bool(getattr(detector, "memory_light", False))
