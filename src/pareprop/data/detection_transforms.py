"""Transforms of detection samples (an image and its target of boxes, labels and masks) through
torchvision.transforms.v2 and tv_tensors, so boxes and masks follow every geometric step.

NOTE [ Large-scale jitter ]
    The augmentation of Simple Copy-Paste and ViTDet (detectron2's ``ResizeScale`` and
    ``FixedSizeCrop``): the image is resized, keeping its aspect, so that it would fit a
    ``size x size`` square times a scale drawn uniformly from ``(0.1, 2.0)``; then a
    ``size x size`` window is cut at a random place when the image is larger and the image is
    padded at the bottom and right when it is smaller (the image keeps its top-left corner, as
    detectron2 pads); then a horizontal flip with probability 1/2. Boxes are clipped to the
    window, and boxes (with their labels and masks) that leave it or shrink below a pixel are
    dropped (``v2.SanitizeBoundingBoxes``), so no degenerate box reaches the detector's heads.
    Every draw comes from torch's default generator, which the trainer seeds and saves.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

__all__ = ["FixedSizeCrop", "large_scale_jitter", "resize_to_fit"]


def _image_size(flat_inputs: List[Any]) -> Tuple[int, int]:
    for x in flat_inputs:
        if isinstance(x, tv_tensors.Image):
            return int(x.shape[-2]), int(x.shape[-1])
    raise TypeError("expected a tv_tensors.Image among the inputs of a detection transform")


class FixedSizeCrop(v2.Transform):
    """A ``size x size`` window of the sample: cut at a random place where the image is larger,
    padded (``fill``) at the bottom and right where it is smaller (NOTE [ Large-scale jitter ])."""

    def __init__(self, size: int, fill: float = 0.0):
        super().__init__()
        if size < 1:
            raise ValueError(f"expected a crop size >= 1, got {size}")
        self.size, self.fill = int(size), float(fill)

    def make_params(self, flat_inputs: List[Any]) -> Dict[str, Any]:
        H, W = _image_size(flat_inputs)
        h, w = min(H, self.size), min(W, self.size)
        top = int(torch.randint(0, H - h + 1, ()))
        left = int(torch.randint(0, W - w + 1, ()))
        return dict(top=top, left=left, height=h, width=w,
                    pad=[0, 0, self.size - w, self.size - h])  # left, top, right, bottom

    def transform(self, inpt: Any, params: Dict[str, Any]) -> Any:
        out = TF.crop(inpt, params["top"], params["left"], params["height"], params["width"])
        if any(params["pad"]):
            # Masks pad with 0 (no object) whatever the image's fill.
            fill = 0 if isinstance(inpt, tv_tensors.Mask) else self.fill
            out = TF.pad(out, params["pad"], fill=fill)
        return out

    # torchvision before 0.21 calls these names.
    _get_params = make_params
    _transform = transform


def large_scale_jitter(size: int, scale: Tuple[float, float] = (0.1, 2.0),
                       flip: bool = True) -> v2.Compose:
    """Large-scale jitter to ``size x size`` (NOTE [ Large-scale jitter ]), taking and giving
    ``(image, target)`` with ``target["boxes"]`` and, when present, ``target["masks"]``."""
    if not 0 < scale[0] <= scale[1]:
        raise ValueError(f"expected a scale range 0 < low <= high, got {tuple(scale)}")
    steps = [v2.ScaleJitter((size, size), scale_range=tuple(scale), antialias=True),
             FixedSizeCrop(size)]
    if flip:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes(min_size=1.0)]
    return v2.Compose(steps)


def resize_to_fit(size: int) -> v2.Compose:
    """The evaluation transform: the image resized, keeping its aspect, so that its long side
    is ``size`` (no crop: every object stays, and predictions map back to the original image
    by one scale per axis)."""
    # ScaleJitter at scale 1 is exactly "fit in size x size", and keeps torchvision 0.19's
    # Resize (which cannot take a long-side size alone) out of the way.
    return v2.Compose([v2.ScaleJitter((size, size), scale_range=(1.0, 1.0), antialias=True)])
