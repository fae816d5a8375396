"""detectron2's two pyramids over a backbone, each the whole ``model.backbone`` of a detector:
maps ``p2 .. p6`` (strides 4 .. 64) of ``out_channels`` (256) channels, in an ordered dict.

* :class:`SimpleFeaturePyramid` (ViTDet; detectron2's ``modeling/backbone/vit.py``): every
  level from the ViT's last map (stride 16) alone: x4 by two 2x2 deconvolutions (LayerNorm over
  channels and GELU between), x2 by one, x1 as it is, /2 by a 2x2 max-pool; each then a 1x1
  and a 3x3 convolution, each followed by a channel LayerNorm (no biases); p6 a stride-2
  subsampling of p5.
* :class:`FPN` (MViTv2; detectron2's ``modeling/backbone/fpn.py``): lateral 1x1 and output
  3x3 convolutions (with biases, no norm) per level, top-down by nearest x2 upsampling and
  sums; p6 the same subsampling of p5.

Module and parameter names are detectron2's (``simfp_2.0.weight``, ``fpn_lateral3.bias``,
``net.``/``bottom_up.`` the backbone), so a model-zoo file's ``backbone.*`` names load as they
are.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from pareprop.detection.detectron2.layers import ChannelLayerNorm, ConvNorm
from pareprop.detection.light import MemoryLightMixin, checkpoint_in_pieces
from pareprop.engine import ReversibleStack, set_stack_engine

__all__ = ["FPN", "LastLevelMaxPool", "SimpleFeaturePyramid"]

Tensor = torch.Tensor


class LastLevelMaxPool(nn.Module):
    """p6 from p5: a max-pool of kernel 1 and stride 2 (every other pixel)."""

    num_levels = 1
    in_feature = "p5"

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, kernel_size=1, stride=2, padding=0)


class _BackboneMixin(MemoryLightMixin):
    """What the two pyramids share: the engine and coupling of the backbone's stacks, and
    ``memory_light``: the pyramid under activation checkpointing, only its outputs kept for
    backward (NOTE [ A memory-light detector ] in ``pareprop/detection/light.py``)."""

    @property
    def body(self):
        """The module whose stacks, guard and ``pretrained_cfg`` a detector reads: this one
        (a property, so that it is no submodule of itself)."""
        return self

    def stacks(self):
        return [m for m in self.modules() if isinstance(m, ReversibleStack)]

    def set_engine(self, name: str):
        set_stack_engine(self, name)
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Checkpoint the blocks kept as they are (MViT's stage transitions); the stacks are
        their engine's business."""
        for module in self.modules():
            if module is not self and hasattr(module, "grad_checkpointing"):
                module.grad_checkpointing = bool(enable)


class SimpleFeaturePyramid(_BackboneMixin, nn.Module):
    """ViTDet's simple feature pyramid over ``net`` (a :class:`~.vitdet.ViT`).

    Args:
        net: returns one map ``(B, C, H/s, W/s)`` and has ``out_channels`` C and ``stride`` s.
        out_channels: channels of every level.
        scale_factors: of each level relative to the net's map, from 4 (p2 at stride 16) down.
        square_pad: the side detectron2 pads every batch to (1024), recorded for the detector.
    """

    def __init__(self, net: nn.Module, out_channels: int = 256,
                 scale_factors: Sequence[float] = (4.0, 2.0, 1.0, 0.5), square_pad: int = 1024,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        dim, stride = net.out_channels, net.stride
        strides = [int(stride / s) for s in scale_factors]
        for a, b in zip(strides, strides[1:]):
            if b != 2 * a:
                raise ValueError(f"expected scale factors halving the stride each level, got "
                                 f"{tuple(scale_factors)}")
        self.scale_factors = tuple(scale_factors)
        names = []
        for scale, s in zip(scale_factors, strides):
            if scale == 4.0:
                layers = [nn.ConvTranspose2d(dim, dim // 2, 2, stride=2, **kw),
                          ChannelLayerNorm(dim // 2, **kw), nn.GELU(),
                          nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2, **kw)]
                width = dim // 4
            elif scale == 2.0:
                layers, width = [nn.ConvTranspose2d(dim, dim // 2, 2, stride=2, **kw)], dim // 2
            elif scale == 1.0:
                layers, width = [], dim
            elif scale == 0.5:
                layers, width = [nn.MaxPool2d(kernel_size=2, stride=2)], dim
            else:
                raise ValueError(f"expected scale factors among 4, 2, 1, 0.5, got {scale}")
            layers += [
                ConvNorm(width, out_channels, 1, bias=False,
                         norm=ChannelLayerNorm(out_channels, **kw), **kw),
                ConvNorm(out_channels, out_channels, 3, padding=1, bias=False,
                         norm=ChannelLayerNorm(out_channels, **kw), **kw),
            ]
            level = int(math.log2(s))
            self.add_module(f"simfp_{level}", nn.Sequential(*layers))
            names.append(f"p{level}")
        self.net = net
        self.top_block = LastLevelMaxPool()
        self._levels = names
        self.out_channels = out_channels
        self.size_divisibility = strides[-1]
        self.square_pad = square_pad

    @property
    def out_features(self):
        return self._levels + [f"p{int(self._levels[-1][1:]) + 1}"]

    def forward(self, images: Tensor) -> "OrderedDict[str, Tensor]":
        x = self.net(images)
        out: Dict[str, Tensor] = OrderedDict()
        for name in self._levels:
            level = getattr(self, f"simfp_{name[1:]}")
            # Level by level, image by image: the recomputation in backward holds one image's
            # intermediates of one level.
            out[name] = checkpoint_in_pieces(level, x) if self._light() else level(x)
        out[f"p{int(self._levels[-1][1:]) + 1}"] = self.top_block(out[self._levels[-1]])
        return out


class FPN(_BackboneMixin, nn.Module):
    """detectron2's FPN (sum fusion, no norm) over ``bottom_up``'s maps, plus p6.

    Args:
        bottom_up: returns an ordered dict of maps named by ``in_features`` (high to low
            resolution) and has ``out_feature_channels`` and ``out_feature_strides`` for them.
        out_channels: channels of every level.
    """

    def __init__(self, bottom_up: nn.Module, in_features: Sequence[str], out_channels: int = 256,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        strides = [bottom_up.out_feature_strides[f] for f in in_features]
        for a, b in zip(strides, strides[1:]):
            if b != 2 * a:
                raise ValueError(f"expected strides doubling each level, got {strides}")
        self._levels = []
        for f, s in zip(in_features, strides):
            level = int(math.log2(s))
            lateral = nn.Conv2d(bottom_up.out_feature_channels[f], out_channels, 1, **kw)
            output = nn.Conv2d(out_channels, out_channels, 3, padding=1, **kw)
            if kw["device"] is None or torch.device(kw["device"]).type != "meta":
                for conv in (lateral, output):  # detectron2's c2_xavier_fill
                    nn.init.kaiming_uniform_(conv.weight, a=1)
                    nn.init.zeros_(conv.bias)
            self.add_module(f"fpn_lateral{level}", lateral)
            self.add_module(f"fpn_output{level}", output)
            self._levels.append(f"p{level}")
        self.top_block = LastLevelMaxPool()
        self.in_features = tuple(in_features)
        self.bottom_up = bottom_up
        self.out_channels = out_channels
        self.size_divisibility = strides[-1]
        self.square_pad = 0

    @property
    def out_features(self):
        return self._levels + [f"p{int(self._levels[-1][1:]) + 1}"]

    def forward(self, images: Tensor) -> "OrderedDict[str, Tensor]":
        features = self.bottom_up(images)
        maps = [features[name] for name in self.in_features]
        if self._light():
            # The levels share the top-down sums: the pass runs whole, image by image.
            results = checkpoint_in_pieces(self._top_down, *maps)
        else:
            results = self._top_down(*maps)
        out: Dict[str, Tensor] = OrderedDict(zip(self._levels, results))
        out[f"p{int(self._levels[-1][1:]) + 1}"] = self.top_block(results[-1])
        return out

    def _top_down(self, *maps: Tensor) -> List[Tensor]:
        """The output maps from the bottom-up maps (high to low resolution)."""
        features = dict(zip(self.in_features, maps))
        results: List[Tensor] = []
        prev = None
        # Top-down, from the coarsest level: lateral, plus the coarser sum upsampled.
        for name, level in zip(reversed(self.in_features), reversed(self._levels)):
            lateral = getattr(self, f"fpn_lateral{level[1:]}")(features[name])
            prev = lateral if prev is None else (
                lateral + F.interpolate(prev, scale_factor=2.0, mode="nearest"))
            results.insert(0, getattr(self, f"fpn_output{level[1:]}")(prev))
        return results
