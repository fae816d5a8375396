"""Feature pyramids: maps of several strides to the ``p2``..``p6`` maps detectors read.

* :class:`FPN`: torchvision's ``FeaturePyramidNetwork`` with ``LastLevelMaxPool`` over the four
  stage maps of a hierarchical backbone (strides 4, 8, 16, 32), as detectron2 builds MViTv2 and
  Swin detectors (Lin et al., "Feature Pyramid Networks for Object Detection", CVPR 2017).
* :class:`SimpleFeaturePyramid`: ViTDet's pyramid from the one map of a plain ViT (Li et al.,
  "Exploring Plain Vision Transformer Backbones for Object Detection", ECCV 2022):
  deconvolutions up, identity, max-pooling down, each level then a 1x1 and a 3x3 convolution
  with LayerNorm over channels.

Both take ``memory_light`` (NOTE [ A memory-light detector ] in ``pareprop/detection/light.py``):
while gradients are on, the pyramid runs under activation checkpointing and keeps only its
outputs for backward.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from pareprop.detection.light import MemoryLightMixin, checkpoint_in_pieces

__all__ = ["LEVELS", "LEVEL_STRIDES", "FPN", "SimpleFeaturePyramid"]

LEVELS = ("p2", "p3", "p4", "p5", "p6")
LEVEL_STRIDES = {"p2": 4, "p3": 8, "p4": 16, "p5": 32, "p6": 64}


class FPN(MemoryLightMixin, nn.Module):
    """torchvision's FPN (top-down, lateral 1x1 and output 3x3 convolutions) plus p6 by
    max-pooling p5, on four maps of strides 4..32 to ``p2``..``p6``.

    Args:
        in_channels: widths of the four input maps, finest first.
        out_channels: width of every level.
    """

    def __init__(self, in_channels: Sequence[int], out_channels: int = 256):
        super().__init__()
        if len(in_channels) != 4:
            raise ValueError(f"expected four input widths (strides 4..32), got {in_channels}")
        self.fpn = FeaturePyramidNetwork(
            list(in_channels), out_channels, extra_blocks=LastLevelMaxPool()
        )
        self.out_channels = out_channels

    def forward(self, features: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
        # The levels share the top-down sums: under memory_light the pass runs whole, image
        # by image.
        maps = (checkpoint_in_pieces(self._maps, *features) if self._light()
                else self._maps(*features))
        return OrderedDict(zip(LEVELS, maps))

    def _maps(self, *features: torch.Tensor) -> List[torch.Tensor]:
        """p2..p5, then LastLevelMaxPool's "pool" (p6)."""
        return list(self.fpn(OrderedDict(zip(LEVELS[:4], features))).values())


def _up(dim: int, steps: int) -> nn.Sequential:
    """``steps`` stride-2 deconvolutions, halving the width each, LayerNorm2d + GELU between."""
    layers: List[nn.Module] = []
    for i in range(steps):
        if i:
            layers += [LayerNorm2d(dim), nn.GELU()]
        layers.append(nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2))
        dim //= 2
    return nn.Sequential(*layers)


class SimpleFeaturePyramid(MemoryLightMixin, nn.Module):
    """ViTDet's simple feature pyramid: from one map of stride ``in_stride`` to ``p2``..``p6``.

    Each of p2..p5 is the map rescaled to its stride (stride-2 deconvolutions up, max-pooling
    down, nothing at ``in_stride``), then a 1x1 convolution to ``out_channels``, LayerNorm2d, a
    3x3 convolution, LayerNorm2d (convolutions without bias: the norm follows). p6 max-pools p5
    (kernel 1, stride 2), as ``LastLevelMaxPool``.

    Args:
        in_channels: width of the input map.
        in_stride: its stride (16 for ViT-B/16); a power of two.
        out_channels: width of every level.
    """

    def __init__(self, in_channels: int, in_stride: int = 16, out_channels: int = 256):
        super().__init__()
        if in_stride < 1 or in_stride & (in_stride - 1):
            raise ValueError(f"expected the input stride a power of two, got {in_stride}")
        self.in_stride = in_stride
        self.out_channels = out_channels
        self.stages = nn.ModuleDict()
        for name in LEVELS[:4]:
            stride = LEVEL_STRIDES[name]
            steps = int(math.log2(in_stride / stride))  # > 0: up, < 0: down
            if steps > 0:
                if in_channels % 2**steps:
                    raise ValueError(
                        f"expected in_channels divisible by {2**steps} (halved by each of "
                        f"{steps} deconvolutions to {name}), got {in_channels}"
                    )
                rescale: nn.Module = _up(in_channels, steps)
                width = in_channels // 2**steps
            elif steps < 0:
                rescale = nn.MaxPool2d(kernel_size=2**-steps, stride=2**-steps)
                width = in_channels
            else:
                rescale, width = nn.Identity(), in_channels
            self.stages[name] = nn.Sequential(
                rescale,
                nn.Conv2d(width, out_channels, kernel_size=1, bias=False),
                LayerNorm2d(out_channels),
                nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
                LayerNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``(B, C, H, W)`` at ``in_stride`` to the ordered maps ``p2``..``p6``."""
        # Under memory_light level by level, image by image: backward recomputes one image's
        # maps of one level at a time.
        out = OrderedDict(
            (name, checkpoint_in_pieces(stage, x) if self._light() else stage(x))
            for name, stage in self.stages.items()
        )
        out["p6"] = F.max_pool2d(out["p5"], kernel_size=1, stride=2)
        return out
