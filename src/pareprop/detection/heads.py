"""The detectors' anchors, RoI pooling and heads: torchvision's modules, over ``p2``..``p6``.

``heads="torchvision"`` keeps torchvision's default heads (a 1-conv RPN head, two fully connected
layers for boxes, 4 convolutions + deconvolution for masks). ``heads="vitdet"`` selects the
heads of detectron2's ViTDet and MViTv2 configurations (Li et al., ECCV 2022): a 2-conv RPN
head, a box head of 4 convolutions and 1 fully connected layer with a norm after each
convolution, and the mask head with a norm, their convolutions as wide as the pyramid;
RetinaNet's head with GroupNorm (torchvision's v2 recipe). The norm is LayerNorm over channels,
as ViTDet's "LN": it acts on each sample alone, so a step is the same whatever the batch split
(DDP, chunks).
``heads="small"`` keeps torchvision's layout at the pyramid's width: two fully connected layers
of ``4 * out_channels`` features for boxes, 2 convolutions of ``out_channels`` for masks (the
default detection run on the shapes, where torchvision's 256-wide mask head would cost most of
a CPU step).
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch.nn as nn
from timm.layers import LayerNorm2d
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import (
    FastRCNNConvFCHead,
    FastRCNNPredictor,
    TwoMLPHead,
)
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.retinanet import RetinaNetHead
from torchvision.models.detection.rpn import RPNHead
from torchvision.ops import MultiScaleRoIAlign

from pareprop.detection.pyramid import LEVELS

__all__ = ["HEADS", "ANCHOR_SIZES", "head_kwargs"]

HEADS = ("torchvision", "vitdet", "small")
ANCHOR_SIZES = (32, 64, 128, 256, 512)  # one per level, p2..p6
ASPECT_RATIOS = (0.5, 1.0, 2.0)
ROI_LEVELS = list(LEVELS[:4])  # RoI pooling reads p2..p5


def _group_norm(channels: int) -> nn.GroupNorm:
    # torchvision's v2 RetinaNet head uses 32 groups; fewer where the pyramid is narrower.
    return nn.GroupNorm(math.gcd(32, channels), channels)


def _rcnn_anchors() -> AnchorGenerator:
    return AnchorGenerator(tuple((s,) for s in ANCHOR_SIZES), (ASPECT_RATIOS,) * len(ANCHOR_SIZES))


def _retinanet_anchors() -> AnchorGenerator:
    # torchvision's RetinaNet anchors: three scales an octave apart at each level.
    sizes = tuple((s, int(s * 2 ** (1 / 3)), int(s * 2 ** (2 / 3))) for s in ANCHOR_SIZES)
    return AnchorGenerator(sizes, (ASPECT_RATIOS,) * len(sizes))


def head_kwargs(
    heads: str, arch: str, out_channels: int, num_classes: int, given: Dict[str, Any]
) -> Dict[str, Any]:
    """Keywords of torchvision's constructor for ``arch``'s anchors, RoI pooling and heads;
    those in ``given`` (the caller's own) are left to the caller.

    Args:
        heads: ``"torchvision"`` or ``"vitdet"``.
        arch: ``"maskrcnn"``, ``"fasterrcnn"`` or ``"retinanet"``.
        out_channels: the backbone's width.
        num_classes: classes including background.
        given: keywords the caller passes to the constructor.
    """
    if heads not in HEADS:
        raise ValueError(f"unknown heads {heads!r}; expected one of {', '.join(HEADS)}")
    out: Dict[str, Any] = {}
    C = out_channels
    if arch == "retinanet":
        anchors = given.get("anchor_generator") or _retinanet_anchors()
        out["anchor_generator"] = anchors
        if heads == "vitdet":
            out["head"] = RetinaNetHead(
                C, anchors.num_anchors_per_location()[0], num_classes,
                norm_layer=_group_norm,
            )
    else:
        anchors = given.get("rpn_anchor_generator") or _rcnn_anchors()
        out["rpn_anchor_generator"] = anchors
        out["box_roi_pool"] = MultiScaleRoIAlign(ROI_LEVELS, output_size=7, sampling_ratio=2)
        if arch == "maskrcnn":
            out["mask_roi_pool"] = MultiScaleRoIAlign(ROI_LEVELS, output_size=14, sampling_ratio=2)
        if heads == "vitdet":
            out["rpn_head"] = RPNHead(C, anchors.num_anchors_per_location()[0], conv_depth=2)
            # Convolutions as wide as the pyramid (detectron2: 256 and 256); the box predictor
            # reads 1024 features, torchvision's default representation size.
            out["box_head"] = FastRCNNConvFCHead((C, 7, 7), [C] * 4, [1024], LayerNorm2d)
            out["box_predictor"] = FastRCNNPredictor(1024, num_classes)
            if arch == "maskrcnn":
                out["mask_head"] = MaskRCNNHeads(C, [C] * 4, 1, norm_layer=LayerNorm2d)
                out["mask_predictor"] = MaskRCNNPredictor(C, C, num_classes)
        elif heads == "small":
            width = 4 * C
            out["box_head"] = TwoMLPHead(C * 7 * 7, width)
            out["box_predictor"] = FastRCNNPredictor(width, num_classes)
            if arch == "maskrcnn":
                out["mask_head"] = MaskRCNNHeads(C, [C] * 2, 1)
                out["mask_predictor"] = MaskRCNNPredictor(C, C, num_classes)
    return {k: v for k, v in out.items() if k not in given}
