"""A synthetic detection data set written as COCO files: coloured circles, squares and
triangles on a noisy background, for the default detection run and the tests (offline and
deterministic: the same arguments write the same bytes).

Layout: ``root/train/*.png``, ``root/val/*.png`` and ``root/annotations/instances_{train,val}
.json``, each object with its polygon ``segmentation``, ``bbox`` and ``area``, so the files
go through the same reader (:class:`pareprop.data.coco.CocoDetection`) as COCO itself.

The task is made to be learnt by a small detector in minutes on a CPU: each class has its own
hue (red circles, green squares, blue triangles, each hue jittered), objects are 20-55% of the
image's short side and never overlap, and the background is a dim, noisy grey.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Sequence, Tuple, Union

import numpy as np

__all__ = ["SHAPE_CATEGORIES", "write_shapes"]

SHAPE_CATEGORIES = [{"id": 1, "name": "circle", "supercategory": "shape"},
                    {"id": 2, "name": "square", "supercategory": "shape"},
                    {"id": 3, "name": "triangle", "supercategory": "shape"}]
# A base colour per class (RGB in [0, 255]); each object's is jittered around it.
_HUES = {1: (220, 60, 50), 2: (60, 200, 70), 3: (60, 90, 230)}
_FORMAT = "pareprop-shapes-1"  # written into the JSON: files of the same arguments are reused


def _polygon(cat_id: int, cx: float, cy: float, r: float, angle: float) -> List[float]:
    """The outline ``[x1, y1, x2, y2, ...]`` of a shape of ``radius`` r around (cx, cy)."""
    # A circle as a 32-gon; a square (4 corners) or a triangle (3) turned by ``angle``.
    n = {1: 32, 2: 4, 3: 3}[cat_id]
    corners = [(cx + r * math.cos(angle + 2 * math.pi * k / n),
                cy + r * math.sin(angle + 2 * math.pi * k / n)) for k in range(n)]
    return [round(v, 2) for xy in corners for v in xy]


def _bbox(poly: Sequence[float]) -> List[float]:
    xs, ys = poly[0::2], poly[1::2]
    return [round(min(xs), 2), round(min(ys), 2), round(max(xs) - min(xs), 2),
            round(max(ys) - min(ys), 2)]


def _shoelace(poly: Sequence[float]) -> float:
    xs, ys = poly[0::2], poly[1::2]
    n = len(xs)
    return abs(sum(xs[i] * ys[(i + 1) % n] - xs[(i + 1) % n] * ys[i] for i in range(n))) / 2


def _place(rng: np.random.Generator, W: int, H: int, count: int) -> List[Tuple[float, ...]]:
    """Up to ``count`` discs ``(cx, cy, r)`` inside the image that do not touch each other."""
    short = min(W, H)
    placed: List[Tuple[float, ...]] = []
    for _ in range(50 * count):
        if len(placed) == count:
            break
        r = rng.uniform(0.10, 0.275) * short  # diameter 20-55% of the short side
        cx, cy = rng.uniform(r + 1, W - r - 1), rng.uniform(r + 1, H - r - 1)
        if all(math.hypot(cx - x, cy - y) > r + q + 2 for x, y, q in placed):
            placed.append((cx, cy, r))
    return placed


def _draw(rng: np.random.Generator, W: int, H: int, count: int
          ) -> Tuple[np.ndarray, List[Dict[str, Any]]]:
    """One image (H, W, 3) uint8 and its objects ``{"category_id", "segmentation"}``."""
    from PIL import Image, ImageDraw

    base = rng.uniform(70, 130)
    pixels = base + rng.normal(0, 12, size=(H, W, 3))  # dim, noisy grey
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    objects = []
    for cx, cy, r in _place(rng, W, H, count):
        cat_id = int(rng.integers(1, 4))
        poly = _polygon(cat_id, cx, cy, r, rng.uniform(0, 2 * math.pi))
        colour = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in _HUES[cat_id])
        draw.polygon(poly, fill=colour)
        objects.append({"category_id": cat_id, "segmentation": [poly]})
    return np.asarray(image), objects


def _write_split(root: str, split: str, num: int, sizes: Tuple[int, int], seed: int,
                 params: Dict[str, Any]) -> None:
    from PIL import Image

    rng = np.random.default_rng([seed, {"train": 0, "val": 1}[split]])
    os.makedirs(os.path.join(root, split), exist_ok=True)
    images, annotations = [], []
    for i in range(num):
        W, H = (int(v) for v in rng.integers(sizes[0], sizes[1] + 1, size=2))
        pixels, objects = _draw(rng, W, H, int(rng.integers(1, 5)))
        name = f"{i:06d}.png"
        Image.fromarray(pixels).save(os.path.join(root, split, name))
        images.append({"id": i + 1, "file_name": name, "width": W, "height": H})
        for obj in objects:
            poly = obj["segmentation"][0]
            annotations.append(dict(obj, id=len(annotations) + 1, image_id=i + 1,
                                    bbox=_bbox(poly), area=round(_shoelace(poly), 2),
                                    iscrowd=0))
    data = {"info": {"description": "pareprop synthetic shapes", "format": _FORMAT,
                     "params": params},
            "images": images, "annotations": annotations, "categories": SHAPE_CATEGORIES}
    path = os.path.join(root, "annotations", f"instances_{split}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # the JSON last: its presence says the split is complete


def _written(root: str, split: str, params: Dict[str, Any]) -> bool:
    path = os.path.join(root, "annotations", f"instances_{split}.json")
    try:
        with open(path) as f:
            info = json.load(f).get("info", {})
    except (OSError, ValueError):
        return False
    return info.get("format") == _FORMAT and info.get("params") == params


def write_shapes(root: str, num_train: int = 512, num_val: int = 128,
                 image_size: Union[int, Tuple[int, int]] = (96, 160), seed: int = 0) -> str:
    """Write the shapes data set under ``root`` in COCO's layout and return ``root``.

    Args:
        root: the folder (created).
        num_train: training images.
        num_val: validation images.
        image_size: the side of every image, or ``(low, high)``: each image's width and height
            drawn from that range.
        seed: the data set's seed (the same arguments write the same files).

    A split already written with the same arguments is left as it is.
    """
    low, high = (image_size, image_size) if isinstance(image_size, int) else image_size
    if not 16 <= low <= high:
        raise ValueError(f"expected image sizes 16 <= low <= high, got {image_size!r}")
    if num_train < 1 or num_val < 1:
        raise ValueError(f"expected at least one image per split, got {num_train} and {num_val}")
    root = os.fspath(root)
    for split, num in (("train", num_train), ("val", num_val)):
        params = dict(num=int(num), image_size=[int(low), int(high)], seed=int(seed))
        if not _written(root, split, params):
            _write_split(root, split, num, (int(low), int(high)), int(seed), params)
    return root
