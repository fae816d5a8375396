"""``create_detector``: torchvision's Mask R-CNN, Faster R-CNN or RetinaNet on a reversible
backbone, and the spec that rebuilds one.

NOTE [ A detector acts as a classifier does ]
The detector is torchvision's own class; the reversible stacks sit inside ``detector.backbone``.
pareprop's model-wide setters (``set_engine``, ``set_chunking``, ``set_memory_budget``,
``compile_blocks``) walk ``modules()`` for stacks and blocks, so they reach the backbone's from
the detector. ``set_coupling`` (converted backbones) also reads ``model.precision_guard`` and
records the coupling in ``model.model_kwargs``; the detector carries the backbone trunk's guard
under that name, and ``model_kwargs`` is the spec's ``backbone_args`` dict itself, so a
checkpoint rebuilds the detector at the coupling it was saved at. torchvision's detectors have no
``set_grad_checkpointing`` (timm's name, which the trainer calls): the detector's is the
backbone's, bound to it (``copy.deepcopy`` binds the copy's to the copy's backbone).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, Optional

import torch.nn as nn
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet

from pareprop.detection.backbones import build_backbone
from pareprop.detection.heads import HEADS, head_kwargs
from pareprop.detection.light import set_memory_light
from pareprop.detection.names import DETECTOR_ARCHS, backbone_builder, check_arch
from pareprop.engine import ENGINES

__all__ = ["SMALL_DETECTOR", "create_detector", "detector_from_spec"]

_CLASSES = {"maskrcnn": MaskRCNN, "fasterrcnn": FasterRCNN, "retinanet": RetinaNet}
_SPEC_KEYS = ("arch", "backbone", "num_classes", "backbone_args", "fpn_channels", "kwargs")

# A detector small enough to train on a CPU in minutes (160-pixel images): a Rev-MViTv2 of 8
# blocks 32 wide, with reversible stacks in three of its four stages (2, 1 and 2 blocks), a
# 64-wide pyramid and ViTDet's heads as narrow, and torchvision's proposal counts cut ~7x (2000
# proposals and 512 sampled RoIs an image are sized for 800-pixel COCO images). The spec of
# ``detector_from_spec(dict(SMALL_DETECTOR, num_classes=K + 1))``.
SMALL_DETECTOR: Dict[str, Any] = {
    "arch": "maskrcnn",
    "backbone": "rev_mvitv2_tiny",
    "backbone_args": {"embed_dim": 32, "depth": 8, "last_block_indexes": [1, 3, 6, 7],
                      "img_size": 160},
    "fpn_channels": 64,
    "heads": "vitdet",
    "kwargs": {"min_size": 160, "max_size": 160, "rpn_pre_nms_top_n_train": 600,
               "rpn_post_nms_top_n_train": 300, "rpn_pre_nms_top_n_test": 300,
               "rpn_post_nms_top_n_test": 100, "box_batch_size_per_image": 64},
}


def _plain(value: Any) -> bool:
    """Whether ``value`` is made of JSON values (tuples are kept as lists, which rebuild the
    same)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _body(backbone: nn.Module) -> Optional[nn.Module]:
    return getattr(backbone, "body", None)


def create_detector(
    arch: str,
    backbone: str,
    num_classes: int,
    engine: str = "reversible",
    pretrained_backbone: bool = False,
    pretrained_file: Optional[str] = None,
    backbone_args: Optional[Dict[str, Any]] = None,
    fpn_channels: int = 256,
    heads: str = "torchvision",
    memory_light: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """torchvision's detector ``arch`` on the reversible backbone ``backbone``.

    Example:
        ``create_detector("maskrcnn", "rev_mvitv2_tiny", num_classes=81, min_size=800)``

    Args:
        arch: ``"maskrcnn"``, ``"fasterrcnn"`` or ``"retinanet"``.
        backbone: ``rev_mvitv2_*`` or ``rev_swin_*`` (four stages into an FPN), ``rev_vit_*``
            (ViTDet's simple pyramid; images padded to its ``img_size``), ``converted:SOURCE``
            (a timm or torchvision ViT, MViTv2 or Swin converted at the coupling (1, 0)), or a
            name of a registered prefix (:func:`register_backbone`).
        num_classes: classes including background (torchvision's convention: K + 1).
        engine: the reversible stacks' engine (``pareprop.ENGINES``).
        pretrained_backbone: start the backbone from its published weights (for
            ``converted:SOURCE``, the source library's download).
        pretrained_file: start the backbone from this file instead.
        backbone_args: overrides of the backbone model's config (``depth``, ``embed_dim``,
            ``img_size``, ``window_size``, ``last_block_indexes``...).
        fpn_channels: width of every pyramid level.
        heads: ``"torchvision"`` (its defaults) or ``"vitdet"`` (2-conv RPN head, 4conv+1fc box
            head and mask head with LayerNorm; RetinaNet's head with GroupNorm).
        memory_light: run the pyramid and the R-CNN heads under activation checkpointing
            (:func:`~pareprop.detection.light.set_memory_light`).
        **kwargs: torchvision's constructor's keywords (``min_size``, ``max_size``,
            ``rpn_post_nms_top_n_train``, ``box_detections_per_img``...).

    Returns:
        torchvision's ``MaskRCNN``, ``FasterRCNN`` or ``RetinaNet``, with ``pareprop_spec``
        (plain JSON values) that :func:`detector_from_spec` rebuilds it from.
    """
    check_arch(arch)
    backbone_builder(backbone)  # refuses an unknown name before anything is built
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(
            f"expected num_classes an int >= 2 (the K object classes + 1 for background, "
            f"torchvision's convention), got {num_classes!r}"
        )
    if engine not in ENGINES:
        raise ValueError(f"expected engine in {ENGINES}, got {engine!r}")
    if heads not in HEADS:
        raise ValueError(f"unknown heads {heads!r}; expected one of {', '.join(HEADS)}")
    if backbone_args is not None and not isinstance(backbone_args, dict):
        raise ValueError(f"expected backbone_args a dict, got {backbone_args!r}")
    backbone_args = dict(backbone_args or {})
    if not _plain(backbone_args):
        raise ValueError(f"expected backbone_args of plain values (JSON), got {backbone_args!r}")
    spec_kwargs = copy.deepcopy({k: v for k, v in kwargs.items() if _plain(v)})
    unrecorded = sorted(k for k in kwargs if k not in spec_kwargs)

    net = build_backbone(
        backbone, engine=engine, pretrained_backbone=pretrained_backbone,
        pretrained_file=pretrained_file, backbone_args=backbone_args, fpn_channels=fpn_channels,
    )
    body = _body(net)
    cfg = getattr(body, "pretrained_cfg", None) or getattr(net, "pretrained_cfg", None) or {}
    if "mean" in cfg and "image_mean" not in kwargs:
        kwargs["image_mean"] = list(cfg["mean"])
    if "std" in cfg and "image_std" not in kwargs:
        kwargs["image_std"] = list(cfg["std"])
    fixed = getattr(net, "fixed_size", None)
    if fixed is not None and "min_size" not in kwargs and "max_size" not in kwargs:
        # A trunk of one input size: images resized to fit it once torchvision's transform pads
        # the batch to a multiple of 32 (NOTE [ Backbones of a fixed input size ]).
        kwargs["min_size"] = kwargs["max_size"] = max(min(fixed) // 32 * 32, 32)
    kwargs.update(head_kwargs(heads, arch, net.out_channels, num_classes, kwargs))
    # torchvision takes num_classes only where it builds the predictors itself.
    given_predictor = "box_predictor" in kwargs or "mask_predictor" in kwargs
    detector = _CLASSES[arch](net, num_classes=None if given_predictor else num_classes, **kwargs)

    spec: Dict[str, Any] = {
        "arch": arch,
        "backbone": backbone,
        "num_classes": num_classes,
        "backbone_args": backbone_args,
        "fpn_channels": fpn_channels,
        "kwargs": spec_kwargs,
        "engine": engine,
        "heads": heads,
    }
    if memory_light:
        set_memory_light(detector)
        spec["memory_light"] = True
    if unrecorded:
        spec["unrecorded"] = unrecorded
    detector.pareprop_spec = json.loads(json.dumps(spec))  # plain JSON values (lists)
    # NOTE [ A detector acts as a classifier does ]
    if callable(getattr(net, "set_grad_checkpointing", None)):
        detector.set_grad_checkpointing = net.set_grad_checkpointing
    if body is not None and getattr(body, "precision_guard", None) is not None:
        detector.precision_guard = body.precision_guard
        detector.model_kwargs = detector.pareprop_spec["backbone_args"]
    return detector


def detector_from_spec(spec: Dict[str, Any], **overrides: Any) -> nn.Module:
    """Rebuild a detector from its ``pareprop_spec`` (random weights: load the state dict
    after); ``overrides`` replace arguments of :func:`create_detector` (``engine=...``).

    Raises:
        ValueError: a spec without the keys :func:`create_detector` records, or one of a
            detector built with keywords that are not plain values (modules), named.
    """
    if not isinstance(spec, dict) or any(k not in spec for k in _SPEC_KEYS):
        raise ValueError(
            f"expected a detector spec with keys {', '.join(_SPEC_KEYS)} (detector.pareprop_spec), "
            f"got {spec!r}"
        )
    if spec.get("unrecorded"):
        raise ValueError(
            f"the detector was built with {', '.join(spec['unrecorded'])} given as objects, which "
            "its spec cannot record; rebuild it with create_detector and those objects"
        )
    args: Dict[str, Any] = dict(
        arch=spec["arch"], backbone=spec["backbone"], num_classes=spec["num_classes"],
        backbone_args=copy.deepcopy(spec["backbone_args"]), fpn_channels=spec["fpn_channels"],
        **copy.deepcopy(spec["kwargs"]),
    )
    for key in ("engine", "heads", "memory_light"):
        if key in spec:
            args[key] = spec[key]
    args.update(overrides)
    return create_detector(**args)


assert set(_CLASSES) == set(DETECTOR_ARCHS)
