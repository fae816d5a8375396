"""``create_detector(..., backbone="detectron2:vitdet_b", pretrained_file=...)``: detectron2's
backbones by name in pareprop's detectors (registered with
:func:`pareprop.detection.register_backbone` under the prefix ``detectron2``).

The backbone starts at the coupling (1, 0) with its precision guard, as every converted model
(``backbone_args``: ``coupling``, ``tolerance`` and detectron2's ``ViT``/``MViT`` arguments).
A model-zoo file's heads (``proposal_generator.*``, ``roi_heads.*``) are not the backbone's:
the builder keeps them in ``backbone.load_report.heads`` and says in one line that the detector's
heads start fresh unless :func:`~pareprop.detection.detectron2.load_detectron2_heads` is called on
the detector (NOTE [ detectron2's heads in torchvision's ] in ``heads.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch.nn as nn

from pareprop.detection.detectron2.build import from_detectron2
from pareprop.detection.detectron2.configs import get_config
from pareprop.detection.names import register_backbone
from pareprop.models.published import PretrainedError

__all__ = ["build_detectron2_backbone_by_name"]

_logger = logging.getLogger("pareprop")


def build_detectron2_backbone_by_name(
    name: str,
    engine: str = "reversible",
    pretrained_backbone: bool = False,
    pretrained_file: Optional[str] = None,
    backbone_args: Optional[Dict[str, Any]] = None,
    fpn_channels: int = 256,
) -> nn.Module:
    """The backbone of detectron2's ``name`` (``vitdet_b``, ``mvitv2_t``, ...) for a detector.

    Args:
        name: a configuration of :data:`pareprop.detection.detectron2.CONFIGS`.
        pretrained_backbone: refused: detectron2's files are not downloaded here; pass the
            file (model zoo ``.pkl`` or the configuration's ImageNet initialisation) as
            ``pretrained_file``.
        pretrained_file: a file :func:`~pareprop.detection.detectron2.from_detectron2` reads.
        backbone_args: ``coupling``, ``tolerance`` and detectron2's ``ViT``/``MViT``
            arguments.
        fpn_channels: the pyramid's width.
    """
    cfg = get_config(name)
    if pretrained_backbone:
        raise PretrainedError(
            f"detectron2:{name} has no download here; fetch {cfg.init_file} (or a model-zoo "
            "model_final_*.pkl) and pass it as pretrained_file")
    args = dict(backbone_args or {})
    model = from_detectron2(pretrained_file, name, engine=engine, out_channels=fpn_channels,
                            **args)
    report = model.load_report
    if report is not None:
        _logger.info("%s", report)
        if report.heads:
            _logger.warning(
                "%s: the model zoo's %d head tensors (proposal_generator.*, roi_heads.*) are "
                "left out of the backbone; torchvision's heads start fresh unless "
                "pareprop.detection.detectron2.load_detectron2_heads(detector) loads those "
                "they take", report.source, len(report.heads))
    if cfg.family == "vit":
        # ViTDet trains and tests at 1024 (large-scale jitter; the longer side resized to
        # 1024, padded square): the detector resizes so. MViTv2 keeps torchvision's 800/1333,
        # detectron2's test size.
        model.fixed_size = (1024, 1024)
    return model


register_backbone("detectron2", build_detectron2_backbone_by_name)
