"""A model-zoo detector's heads into torchvision's, where they correspond.

NOTE [ detectron2's heads in torchvision's ]
detectron2's Mask R-CNN heads and torchvision's hold the same layers under other names: the
RPN's shared convolutions (``rpn_head.conv.conv0`` or ``rpn_head.conv``; torchvision
``rpn.head.conv.0.0``), objectness and deltas (``cls_logits``, ``bbox_pred``), the box head's
convolutions with their LayerNorms and its fully connected layers (ViTDet's 4conv1fc:
``box_head.conv1``, ``.norm``, ``fc1``; torchvision's ``FastRCNNConvFCHead`` ``box_head.0.0``,
``0.1``, ``5``; the 2fc head's ``fc1``, ``fc2`` are torchvision's ``fc6``, ``fc7``), and the
mask head (``mask_fcn1`` .. ``mask_fcn4``, ``deconv``, ``predictor``; torchvision
``mask_head.0`` .., ``mask_predictor.conv5_mask``, ``mask_fcn_logits``). Two things differ in
meaning and are rewritten: detectron2's classifier puts background last (K + 1 scores, the
background at K), torchvision first; detectron2's box and mask predictors have K class rows,
torchvision's K + 1 with the background's first (their values never used: they start at
zero). A tensor whose torchvision counterpart is missing (another head layout, cascade stages)
or of another shape (another class count) is left out and named in the report.

What stays different: torchvision's RoI pooling (``MultiScaleRoIAlign``, ``aligned=False``,
sampling ratio 2) is not detectron2's ROIAlignV2 (half-pixel aligned, adaptive sampling), and
torchvision rounds its anchors to whole pixels. The loaded heads are a start for fine-tuning,
not detectron2's detector to the bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["HeadsReport", "load_detectron2_heads"]

StateDict = Dict[str, torch.Tensor]


@dataclass
class HeadsReport:
    """The zoo's head tensors loaded into the detector (torchvision's names) and left out."""

    loaded: List[str] = field(default_factory=list)
    left_out: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        line = f"{len(self.loaded)} of detectron2's head tensors loaded into torchvision's heads"
        if self.left_out:
            line += f"; {len(self.left_out)} left out, first {self.left_out[0]}"
        return line


def _box_head_layout(own: Mapping[str, torch.Tensor]) -> Tuple[int, bool]:
    """(number of convolutions, whether the fully connected layers are TwoMLPHead's)."""
    convs = {int(m.group(1)) for k in own
             if (m := re.match(r"roi_heads\.box_head\.(\d+)\.0\.weight$", k))}
    return len(convs), "roi_heads.box_head.fc6.weight" in own


def _conv_norm(prefix: str, m: "re.Match[str]") -> str:
    """A detectron2 ``Conv2d(norm=...)`` tensor (``conv{n}.weight``, ``conv{n}.norm.bias``,
    numbered from 1) in torchvision's ``Conv2dNormActivation`` (``{n - 1}.0.weight``,
    ``{n - 1}.1.bias``); ``m``'s groups: the number, ``norm.`` or None, the tensor."""
    return f"{prefix}.{int(m.group(1)) - 1}.{1 if m.group(2) else 0}.{m.group(3)}"


def _target(name: str, own: Mapping[str, torch.Tensor]) -> Optional[str]:
    """torchvision's name for detectron2's head tensor ``name`` (None: no counterpart)."""
    rpn = re.match(r"proposal_generator\.rpn_head\.(.+)$", name)
    if rpn:
        rest = rpn.group(1)
        m = re.match(r"conv\.conv(\d+)\.(weight|bias)$", rest)
        if m:
            return f"rpn.head.conv.{m.group(1)}.0.{m.group(2)}"
        m = re.match(r"conv\.(weight|bias)$", rest)
        if m:
            return f"rpn.head.conv.0.0.{m.group(1)}"
        rest = rest.replace("objectness_logits", "cls_logits").replace("anchor_deltas",
                                                                         "bbox_pred")
        return f"rpn.head.{rest}"
    convs, two_mlp = _box_head_layout(own)
    m = re.match(r"roi_heads\.box_head\.conv(\d+)\.(norm\.)?(weight|bias)$", name)
    if m:
        return _conv_norm("roi_heads.box_head", m)
    m = re.match(r"roi_heads\.box_head\.fc(\d+)\.(weight|bias)$", name)
    if m:
        k = int(m.group(1))
        if two_mlp:
            return f"roi_heads.box_head.fc{5 + k}.{m.group(2)}"
        return f"roi_heads.box_head.{convs + 2 * k - 1}.{m.group(2)}"  # after Flatten
    m = re.match(r"roi_heads\.box_predictor\.(cls_score|bbox_pred)\.(weight|bias)$", name)
    if m:
        return f"roi_heads.box_predictor.{m.group(1)}.{m.group(2)}"
    m = re.match(r"roi_heads\.mask_head\.mask_fcn(\d+)\.(norm\.)?(weight|bias)$", name)
    if m:
        return _conv_norm("roi_heads.mask_head", m)
    m = re.match(r"roi_heads\.mask_head\.(deconv|predictor)\.(weight|bias)$", name)
    if m:
        layer = "conv5_mask" if m.group(1) == "deconv" else "mask_fcn_logits"
        return f"roi_heads.mask_predictor.{layer}.{m.group(2)}"
    return None


def _rewrite(name: str, value: torch.Tensor, target: str) -> torch.Tensor:
    """detectron2's tensor in torchvision's meaning (background first, K + 1 rows)."""
    if target.startswith("roi_heads.box_predictor.cls_score"):
        return torch.cat([value[-1:], value[:-1]])  # background from last to first
    if target.startswith("roi_heads.box_predictor.bbox_pred"):
        return torch.cat([torch.zeros_like(value[:4]), value])  # a (never used) background box
    if target.startswith("roi_heads.mask_predictor.mask_fcn_logits"):
        return torch.cat([torch.zeros_like(value[:1]), value])  # a (never used) background mask
    return value


def load_detectron2_heads(detector: nn.Module, heads: Optional[Mapping[str, torch.Tensor]] = None
                          ) -> HeadsReport:
    """Load a model-zoo file's head tensors into ``detector``'s torchvision heads where they
    correspond (NOTE [ detectron2's heads in torchvision's ]).

    Args:
        detector: torchvision's ``MaskRCNN`` / ``FasterRCNN`` (``create_detector``'s).
        heads: detectron2's ``proposal_generator.*`` and ``roi_heads.*`` tensors; by default
            those the backbone's file held (``detector.backbone.load_report.heads``).
    """
    if heads is None:
        report = getattr(detector.backbone, "load_report", None)
        heads = report.heads if report is not None else {}
    own = detector.state_dict()
    state: StateDict = {}
    out = HeadsReport()
    for name, value in sorted(heads.items()):
        target = _target(name, own)
        if target is not None and target in own:
            value = _rewrite(name, value, target)
            if value.shape == own[target].shape:
                state[target] = value
                out.loaded.append(target)
                continue
        out.left_out.append(name)
    detector.load_state_dict(state, strict=False)
    return out
