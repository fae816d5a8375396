"""A picture of a detector's predictions: boxes, class names, scores and masks drawn on
validation images, in one PNG grid."""

from __future__ import annotations

import os
from typing import Any, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["draw_predictions", "save_predictions"]


def draw_predictions(image: torch.Tensor, output: dict, names: List[str],
                     score_thresh: float = 0.5) -> torch.Tensor:
    """``image`` (3, H, W) in [0, 1] with the predictions of ``output`` scoring at least
    ``score_thresh`` drawn on it: masks (thresholded at 0.5) tinted, boxes outlined and
    labelled ``name score``; ``names[k - 1]`` is label k's. Returns (3, H, W) uint8."""
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

    picture = (image.detach().float().cpu().clamp(0, 1) * 255).to(torch.uint8)  # (3, H, W)
    keep = output["scores"].detach().cpu() >= score_thresh
    if not keep.any():
        return picture
    labels = output["labels"].detach().cpu()[keep]
    scores = output["scores"].detach().cpu()[keep]
    boxes = output["boxes"].detach().float().cpu()[keep]
    masks = output.get("masks")
    if masks is not None:
        masks = masks.detach().float().cpu()[keep].reshape(-1, *picture.shape[-2:]) > 0.5
        picture = draw_segmentation_masks(picture, masks, alpha=0.45)
    text = [f"{names[int(k) - 1] if 0 < int(k) <= len(names) else int(k)} {float(s):.2f}"
            for k, s in zip(labels, scores)]
    return draw_bounding_boxes(picture, boxes, labels=text, width=2)


@torch.no_grad()
def save_predictions(model: nn.Module, dataset: Any, path: Union[str, os.PathLike],
                     num_images: int = 4, score_thresh: float = 0.5,
                     device: Optional[Union[str, torch.device]] = None) -> str:
    """Draw ``model``'s predictions on the first ``num_images`` images of ``dataset`` (a
    :class:`pareprop.data.coco.CocoDetection` with its evaluation transform) and write them as
    one PNG grid at ``path``; returns the path."""
    from PIL import Image
    from torchvision.utils import make_grid

    if num_images < 1:
        raise ValueError(f"expected num_images >= 1, got {num_images}")
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    names = [c["name"] for c in getattr(dataset, "categories", [])]
    was_training = model.training
    model.eval()
    pictures = []
    try:
        for i in range(min(num_images, len(dataset))):
            image, _ = dataset[i]
            image = image.as_subclass(torch.Tensor)
            output = model([image.to(device)])[0]
            pictures.append(draw_predictions(image, output, names, score_thresh))
    finally:
        model.train(was_training)
    if not pictures:
        raise ValueError("expected a data set with at least one image to draw")
    # make_grid needs one size: pad each picture at the bottom and right to the largest.
    H = max(p.shape[-2] for p in pictures)
    W = max(p.shape[-1] for p in pictures)
    pictures = [F.pad(p, (0, W - p.shape[-1], 0, H - p.shape[-2])) for p in pictures]
    grid = make_grid(pictures, nrow=min(len(pictures), 4), padding=4, pad_value=255)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # PIL rather than torchvision.io.write_png, which torchvision 0.29 deprecates.
    Image.fromarray(grid.permute(1, 2, 0).contiguous().numpy()).save(path, format="PNG")
    return path
