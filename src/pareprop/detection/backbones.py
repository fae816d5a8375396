"""Detection backbones: a reversible trunk's multi-scale features through a feature pyramid.

The backbone contract (what torchvision's detectors and every builder here share): a module with
``out_channels`` whose ``forward(images (B, 3, H, W))`` returns an ordered dict of maps ``p2``..
``p6`` (strides 4..64), as detectron2's backbones do.

NOTE [ Backbones of a fixed input size ]
Rev-ViT and the converted timm models learn absolute positions (or relative-position tables) for
one input size, so they take only that size. As ViTDet pads every image to 1024x1024, the backbone
pads the batch (bottom, right, with zeros: the normalised mean colour) to the trunk's size and
refuses larger batches. torchvision's detectors read the strides of their anchors and of RoI
pooling from the ratio of the batch to each map, so the maps are cropped back to the batch they
came from (``ceil(H / stride)``): the padding only adds context, as in ViTDet.

NOTE [ Features at stage ends ]
The pyramid reads the trunk's ``forward_intermediates`` (timm's interface): for the hierarchical
families the four stage outputs of strides 4, 8, 16 and 32, which the reversible stages keep for
backward anyway (NOTE [ Features from stage ends only ] in models/_features.py), and for a plain
ViT its stack's end. The trunk's classifier and final norm are pruned: the pyramid does not use
them, and a parameter without a gradient would stop DDP.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from pareprop.convert import converted_model_name
from pareprop.detection.names import backbone_builder, register_backbone
from pareprop.detection.pyramid import FPN, SimpleFeaturePyramid
from pareprop.models import create_model
from pareprop.pretrained import PretrainedError, load_pretrained

__all__ = [
    "PyramidBackbone",
    "build_backbone",
    "build_converted_backbone",
    "build_pareprop_backbone",
    "pyramid_backbone",
]

_STAGE_STRIDES = (4, 8, 16, 32)


class PyramidBackbone(nn.Module):
    """A trunk's features (``forward_intermediates``) through a pyramid to ``p2``..``p6``.

    Args:
        body: the trunk: a model with ``forward_intermediates`` and ``feature_info``.
        fpn: :class:`~pareprop.detection.pyramid.FPN` (four maps) or
            :class:`~pareprop.detection.pyramid.SimpleFeaturePyramid` (one map).
        indices: the trunk's feature indices the pyramid reads, finest first.
        strides: the stride of each of those features.
        fixed_size: ``(H, W)`` the trunk takes only (NOTE [ Backbones of a fixed input size ]);
            None for a trunk of any size.
    """

    def __init__(
        self,
        body: nn.Module,
        fpn: nn.Module,
        indices: Sequence[int],
        strides: Sequence[int],
        fixed_size: Optional[Tuple[int, int]] = None,
    ):
        super().__init__()
        self.body = body
        self.fpn = fpn
        self.indices = list(indices)
        self.strides = list(strides)
        self.fixed_size = None if fixed_size is None else (int(fixed_size[0]), int(fixed_size[1]))
        self.out_channels = fpn.out_channels

    def forward(self, images: torch.Tensor) -> Dict[str, torch.Tensor]:
        H, W = images.shape[-2:]
        x = images
        if self.fixed_size is not None:
            fh, fw = self.fixed_size
            if H > fh or W > fw:
                raise ValueError(
                    f"expected images of at most {fh}x{fw} (the backbone's img_size) after "
                    f"resizing, got a batch of {H}x{W}; lower max_size/min_size of the detector "
                    "or build the backbone with backbone_args={'img_size': ...}"
                )
            x = F.pad(x, (0, fw - W, 0, fh - H))  # (B, 3, fh, fw)
        features = self.body.forward_intermediates(
            x, indices=self.indices, intermediates_only=True
        )  # NCHW, finest first
        if self.fixed_size is not None:
            features = [
                f[..., : math.ceil(H / s), : math.ceil(W / s)]
                for f, s in zip(features, self.strides)
            ]
        return self.fpn(features[0] if len(features) == 1 else features)

    @property
    def memory_light(self) -> bool:
        """Whether the pyramid runs under activation checkpointing (NOTE [ A memory-light
        detector ] in ``pareprop/detection/light.py``)."""
        return bool(self.fpn.memory_light)

    @memory_light.setter
    def memory_light(self, enable: bool) -> None:
        self.fpn.memory_light = bool(enable)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """The trunk's ``set_grad_checkpointing``: its non-reversible blocks under activation
        checkpointing (the reversible stacks are their engine's business)."""
        self.body.set_grad_checkpointing(enable)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        inner = getattr(self.body, "no_weight_decay", None)
        return {f"body.{n}" for n in (inner() if inner is not None else ())}


def _pick_features(body: nn.Module) -> Tuple[List[int], List[int], List[int]]:
    """(indices, strides, widths) of the features a pyramid reads: the stages of strides 4..32,
    or the one map of a plain ViT."""
    info = getattr(body, "feature_info", None)
    if info is None:
        raise ValueError(f"{type(body).__name__} has no feature_info: it offers no feature maps")
    info = list(info.get_dicts() if hasattr(info, "get_dicts") else info)
    if len(info) == 1:
        return [0], [int(info[0]["reduction"])], [int(info[0]["num_chs"])]
    by_stride = {int(d["reduction"]): i for i, d in enumerate(info)}
    missing = [s for s in _STAGE_STRIDES if s not in by_stride]
    if missing:
        raise ValueError(
            f"expected a trunk with stages of strides 4, 8, 16 and 32 for the FPN, got strides "
            f"{sorted(by_stride)}; keep four stages (e.g. last_block_indexes of length 4) and a "
            "stride-4 patch embedding"
        )
    indices = [by_stride[s] for s in _STAGE_STRIDES]
    return indices, list(_STAGE_STRIDES), [int(info[i]["num_chs"]) for i in indices]


def _prune(body: nn.Module, indices: List[int], keep_norm: bool) -> None:
    """Drop what the pyramid does not read (NOTE [ Features at stage ends ])."""
    prune = getattr(body, "prune_intermediate_layers", None)
    if prune is not None:
        prune(indices, prune_norm=not keep_norm, prune_head=True)
        return
    body.reset_classifier(0)
    if not keep_norm and isinstance(getattr(body, "norm", None), nn.Module):
        body.norm = nn.Identity()  # read by the classifier's path only


def pyramid_backbone(
    body: nn.Module, fpn_channels: int = 256, fixed_size: Optional[Tuple[int, int]] = None,
    keep_norm: bool = False,
) -> PyramidBackbone:
    """``body``'s features through the pyramid that fits them: an FPN over four stages, or
    ViTDet's simple pyramid over one map.

    Args:
        body: the trunk.
        fpn_channels: width of every pyramid level.
        fixed_size: the only input size the trunk takes (None: any).
        keep_norm: keep the trunk's final norm (a trunk whose features pass through it).
    """
    if not isinstance(fpn_channels, int) or fpn_channels < 1:
        raise ValueError(f"expected fpn_channels a positive int, got {fpn_channels!r}")
    indices, strides, widths = _pick_features(body)
    _prune(body, indices, keep_norm)
    if len(indices) == 1:
        fpn: nn.Module = SimpleFeaturePyramid(widths[0], strides[0], fpn_channels)
    else:
        fpn = FPN(widths, fpn_channels)
    return PyramidBackbone(body, fpn, indices, strides, fixed_size)


def _fixed_size(body: nn.Module) -> Optional[Tuple[int, int]]:
    cfg = getattr(body, "pretrained_cfg", {}) or {}
    if not cfg.get("fixed_input_size", False):
        return None
    return tuple(cfg["input_size"][-2:])  # type: ignore[return-value]


def _own_args(backbone_args: Optional[Dict[str, Any]], reserved: Tuple[str, ...]
              ) -> Dict[str, Any]:
    """A copy of ``backbone_args``, refusing the keywords the builder itself passes."""
    args = dict(backbone_args or {})
    for key in reserved:
        if key in args:
            raise ValueError(f"backbone_args may not set {key!r}: the detector sets it")
    return args


def build_pareprop_backbone(
    name: str,
    engine: str = "reversible",
    pretrained_backbone: bool = False,
    pretrained_file: Optional[str] = None,
    backbone_args: Optional[Dict[str, Any]] = None,
    fpn_channels: int = 256,
) -> PyramidBackbone:
    """A pareprop model (``rev_mvitv2_*``, ``rev_swin_*``, ``rev_vit_*``) as a backbone.

    Args:
        name: the registered model.
        engine: its stacks' engine.
        pretrained_backbone: start from its published weights.
        pretrained_file: start from this weight file (published layout or pareprop's).
        backbone_args: overrides of the model's config (``depth``, ``embed_dim``,
            ``img_size``, ``window_size``...).
        fpn_channels: width of every pyramid level.
    """
    args = _own_args(backbone_args, ("num_classes", "engine"))
    body = create_model(name, num_classes=0, engine=engine, pretrained=pretrained_backbone, **args)
    if pretrained_file is not None:
        load_pretrained(body, pretrained_file)
    return pyramid_backbone(body, fpn_channels, _fixed_size(body))


def _load_source_pretrained(body: nn.Module, source: str, args: Dict[str, Any]) -> None:
    """The library's pretrained weights of ``source`` into the converted ``body``."""
    own = getattr(body, "load_source_pretrained", None)
    if own is not None:  # torchvision's sources
        own(source)
        return
    try:
        model = timm.create_model(source, pretrained=True, num_classes=0, **args)
    except (OSError, RuntimeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise PretrainedError(
            f"backbone converted:{source}: cannot load timm's pretrained weights "
            f"({type(e).__name__}: {first}); pass a local copy as pretrained_file"
        ) from None
    body.load_state_dict(model.state_dict())


def build_converted_backbone(
    source: str,
    engine: str = "reversible",
    pretrained_backbone: bool = False,
    pretrained_file: Optional[str] = None,
    backbone_args: Optional[Dict[str, Any]] = None,
    fpn_channels: int = 256,
) -> PyramidBackbone:
    """A timm or torchvision model ``source`` converted by :func:`pareprop.convert` (ViT, MViTv2,
    Swin) as a backbone, at the coupling (1, 0) of the pretrained network with its precision
    guard; :func:`pareprop.set_coupling` and :class:`pareprop.CouplingSchedule` move it.

    Args:
        source: the source's name in its library (``vit_base_patch16_224``, ``mvitv2_tiny``,
            ``swin_tiny_patch4_window7_224``...).
        engine, fpn_channels: as in :func:`build_pareprop_backbone`.
        pretrained_backbone: start from the library's pretrained weights (its download).
        pretrained_file: start from a local copy of them.
        backbone_args: keywords of the converted factory and of the source's constructor
            (``img_size``, ``depth``, ``coupling``, ``tolerance``...).
    """
    if pretrained_backbone and pretrained_file is not None:
        raise ValueError("expected pretrained_backbone=True or a pretrained_file, not both")
    args = _own_args(backbone_args, ("num_classes", "engine", "source", "pretrained_file"))
    body = create_model(
        converted_model_name(source), source=source, pretrained_file=pretrained_file,
        engine=engine, num_classes=0, **args,
    )
    if pretrained_backbone:
        timm_args = {k: v for k, v in args.items() if k not in ("coupling", "tolerance")}
        _load_source_pretrained(body, source, timm_args)
    # A converted ViT's features pass through timm's final norm (its forward_intermediates).
    keep_norm = len(_pick_features(body)[0]) == 1
    return pyramid_backbone(body, fpn_channels, _fixed_size(body), keep_norm=keep_norm)


register_backbone("converted", build_converted_backbone)


def build_backbone(
    name: str,
    engine: str = "reversible",
    pretrained_backbone: bool = False,
    pretrained_file: Optional[str] = None,
    backbone_args: Optional[Dict[str, Any]] = None,
    fpn_channels: int = 256,
) -> nn.Module:
    """A backbone by name (pareprop.detection.names): a pareprop family's model, or a name of a
    registered prefix (``converted:SOURCE``, ``detectron2:...``)."""
    builder, rest = backbone_builder(name)
    if builder is None:
        builder = build_pareprop_backbone
    backbone = builder(
        rest, engine=engine, pretrained_backbone=pretrained_backbone,
        pretrained_file=pretrained_file, backbone_args=backbone_args, fpn_channels=fpn_channels,
    )
    if not isinstance(getattr(backbone, "out_channels", None), int):
        raise ValueError(f"backbone {name!r} has no int out_channels (the backbone contract)")
    return backbone
