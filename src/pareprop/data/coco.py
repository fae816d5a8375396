"""COCO-format detection data: an instances JSON and its images, as COCO and LVIS ship them and
as CVAT and Label Studio export them, read through pycocotools (``pip install
'pareprop[detection]'``).

A sample is ``(image, target)`` in the form torchvision's detectors take in training: the
image a ``tv_tensors.Image`` float32 ``(3, H, W)`` in [0, 1]; the target ``{"boxes":
tv_tensors.BoundingBoxes XYXY float32 (N, 4), "labels": int64 (N,), "masks": tv_tensors.Mask
uint8 (N, H, W), "image_id": int}``. Labels are contiguous, ``1..K`` in the order of the
file's category ids (0 is torchvision's background); :meth:`CocoDetection.label_to_cat_id`
maps them back. ``"masks"`` is there when the file has segmentations (:attr:`has_masks`).

NOTE [ Crowd annotations ]
    COCO marks a group of objects drawn as one region ``iscrowd=1`` (an RLE mask). As COCO's
    own evaluation does, they are left out of the training targets (a detector is not taught
    to find a crowd as one object) and kept in the ground truth, where COCOeval counts a
    detection that falls on a crowd as neither right nor wrong.

NOTE [ Bad annotations ]
    Every annotation is checked when the data set is opened, before any training step:
    a box that reaches more than a pixel outside its image (less is rounding, and is clipped),
    a box or a mask of no area, a category id the file does not define, an image file that is
    not there. ``bad="raise"`` refuses the first with one line naming the image (file name and
    id) and what is wrong; ``bad="skip"`` leaves the annotation (or, for a missing file, the
    image) out with a warning naming it. A degenerate box never reaches torchvision's heads,
    which would fail deep inside the detector with no word of which image it came from.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from pareprop.data.config import MissingPackageError
from pareprop.data.detection_transforms import large_scale_jitter, resize_to_fit

__all__ = [
    "BadAnnotationError",
    "BadAnnotationWarning",
    "CocoDetection",
    "collate_detection",
    "detection_splits",
    "require_pycocotools",
]

_BAD_MODES = ("raise", "skip")
# Show this many skipped items one by one, then one line with the count of the rest.
_MAX_WARNINGS = 10


class BadAnnotationError(ValueError):
    """An annotation or an image of a COCO-format data set is unusable (NOTE [ Bad
    annotations ])."""


class BadAnnotationWarning(UserWarning):
    """An annotation or an image of a COCO-format data set was left out (``bad="skip"``)."""


def require_pycocotools() -> Any:
    """The ``pycocotools`` package, or an error that says how to install it."""
    try:
        import pycocotools.coco
        import pycocotools.mask  # noqa: F401
    except ImportError:
        raise MissingPackageError(
            "COCO-format detection data needs pycocotools: pip install 'pareprop[detection]' "
            "(or pip install pycocotools)"
        ) from None
    return pycocotools


def _load_coco(ann_file: str) -> Any:
    """pycocotools' COCO object of ``ann_file``, without its progress prints."""
    require_pycocotools()
    from pycocotools.coco import COCO

    if not os.path.isfile(ann_file):
        raise FileNotFoundError(f"no COCO annotation file at {ann_file!r}")
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            return COCO(ann_file)
        except Exception as e:  # a JSON error, or a file that is not COCO's layout
            raise ValueError(
                f"{ann_file}: not a COCO instances file ({type(e).__name__}: {e}); expected "
                "JSON with 'images', 'annotations' and 'categories'"
            ) from None


def _segmentation_rle(segm: Any, height: int, width: int) -> Any:
    """One RLE of a polygon list, an uncompressed RLE or a compressed RLE (COCO's three forms)."""
    from pycocotools import mask as mask_utils

    if isinstance(segm, list):  # polygons: [[x1, y1, x2, y2, ...], ...]
        polygons = [p for p in segm if len(p) >= 6]  # fewer than 3 points enclose nothing
        if not polygons:
            return None
        return mask_utils.merge(mask_utils.frPyObjects(polygons, height, width))
    if isinstance(segm, dict) and isinstance(segm.get("counts"), list):  # uncompressed RLE
        return mask_utils.frPyObjects(segm, height, width)
    if isinstance(segm, dict) and "counts" in segm:
        return segm
    return None


class CocoDetection(Dataset):
    """A COCO-format detection data set (module docstring for the sample's form).

    Args:
        image_dir: the folder of the images (``file_name`` in the JSON is relative to it).
        ann_file: the instances JSON.
        transforms: a v2 transform of ``(image, target)`` (e.g.
            :func:`pareprop.data.detection_transforms.large_scale_jitter`); it sees the image
            as uint8 and the dataset makes it float in [0, 1] afterwards.
        bad: ``"raise"`` or ``"skip"`` (NOTE [ Bad annotations ]).
    """

    def __init__(self, image_dir: str, ann_file: str, transforms: Optional[Any] = None,
                 bad: str = "raise"):
        if bad not in _BAD_MODES:
            raise ValueError(f"expected bad 'raise' or 'skip', got {bad!r}")
        self.image_dir, self.ann_file = os.fspath(image_dir), os.fspath(ann_file)
        self.transforms, self.bad = transforms, bad
        if not os.path.isdir(self.image_dir):
            raise FileNotFoundError(f"no image folder at {self.image_dir!r}")
        self.coco = _load_coco(self.ann_file)
        cats = sorted(self.coco.loadCats(self.coco.getCatIds()), key=lambda c: c["id"])
        if not cats:
            raise ValueError(f"{self.ann_file}: no categories; expected at least one")
        self.categories = [{"id": int(c["id"]), "name": str(c["name"])} for c in cats]
        self._label_of = {c["id"]: i + 1 for i, c in enumerate(self.categories)}
        self.has_masks = any(a.get("segmentation") for a in self.coco.anns.values())
        self._skipped: List[str] = []
        self.ids: List[int] = []
        self._anns: Dict[int, List[Dict[str, Any]]] = {}  # image id -> its training annotations
        for image_id in sorted(self.coco.imgs):
            anns = self._check_image(image_id)
            if anns is not None:
                self.ids.append(image_id)
                self._anns[image_id] = anns
        self._summarise_skipped()

    @property
    def num_classes(self) -> int:
        """The classes a torchvision detector of this data predicts: K and the background."""
        return len(self.categories) + 1

    def label_to_cat_id(self, label: int) -> int:
        """The COCO category id of a contiguous label (``1..K``)."""
        if not 1 <= int(label) <= len(self.categories):
            raise ValueError(f"expected a label in 1..{len(self.categories)}, got {label}")
        return self.categories[int(label) - 1]["id"]

    def __len__(self) -> int:
        return len(self.ids)

    # -- checking (NOTE [ Bad annotations ]) --------------------------------------------------

    def _where(self, info: Dict[str, Any]) -> str:
        return f"{self.ann_file}: image {info.get('file_name')!r} (id {info['id']})"

    def _bad(self, message: str) -> None:
        if self.bad == "raise":
            raise BadAnnotationError(message + " (pass bad='skip' to leave such items out)")
        self._skipped.append(message)
        if len(self._skipped) <= _MAX_WARNINGS:
            warnings.warn(f"skipping: {message}", BadAnnotationWarning, stacklevel=4)

    def _summarise_skipped(self) -> None:
        extra = len(self._skipped) - _MAX_WARNINGS
        if extra > 0:
            warnings.warn(f"skipping {extra} more bad annotations or images of "
                          f"{self.ann_file}", BadAnnotationWarning, stacklevel=3)

    def _check_image(self, image_id: int) -> Optional[List[Dict[str, Any]]]:
        """The image's training annotations, checked; None when the image is left out."""
        info = self.coco.imgs[image_id]
        where = self._where(info)
        path = os.path.join(self.image_dir, str(info.get("file_name", "")))
        if not os.path.isfile(path):
            self._bad(f"{where}: the image file {path!r} is missing")
            return None
        H, W = int(info.get("height", 0)), int(info.get("width", 0))
        if H < 1 or W < 1:
            self._bad(f"{where}: height and width {H}x{W}; expected both >= 1")
            return None
        kept = []
        for ann in self.coco.imgToAnns.get(image_id, []):
            problem = self._problem(ann, H, W)
            if problem is not None:
                self._bad(f"{where}: annotation {ann.get('id')} {problem}")
            elif not ann.get("iscrowd", 0):  # NOTE [ Crowd annotations ]
                kept.append(ann)
        return kept

    def _problem(self, ann: Dict[str, Any], H: int, W: int) -> Optional[str]:
        """What is wrong with one annotation, or None."""
        from pycocotools import mask as mask_utils

        if ann.get("category_id") not in self._label_of:
            known = sorted(self._label_of)
            return (f"has category id {ann.get('category_id')!r}, which the file does not "
                    f"define (categories {known[:10]}{'...' if len(known) > 10 else ''})")
        box = ann.get("bbox")
        if not (isinstance(box, (list, tuple)) and len(box) == 4):
            return f"has bbox {box!r}; expected [x, y, width, height]"
        x, y, w, h = (float(v) for v in box)
        if not (w > 0 and h > 0):
            return f"has an empty box {list(box)} (width and height must be > 0)"
        if x < -1 or y < -1 or x + w > W + 1 or y + h > H + 1:
            return f"has box {list(box)} outside the {W}x{H} image"
        if min(x + w, W) - max(x, 0) <= 0 or min(y + h, H) - max(y, 0) <= 0:
            return f"has box {list(box)} of no area inside the {W}x{H} image"
        if self.has_masks:
            segm = ann.get("segmentation")
            rle = _segmentation_rle(segm, H, W) if segm else None
            if rle is None or float(mask_utils.area(rle)) <= 0:
                return "has an empty mask (no polygon of 3 points or more, or an RLE of no area)"
            if tuple(rle.get("size", (H, W))) != (H, W):
                return f"has an RLE mask of size {rle['size']}, not the image's {H}x{W}"
        return None

    # -- samples ------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Tuple[Any, Dict[str, Any]]:
        from PIL import Image
        from torchvision import tv_tensors

        image_id = self.ids[index]
        info = self.coco.imgs[image_id]
        path = os.path.join(self.image_dir, info["file_name"])
        try:
            with Image.open(path) as im:
                pixels = np.asarray(im.convert("RGB"))  # (H, W, 3) uint8
            data = torch.from_numpy(pixels.copy()).permute(2, 0, 1)  # (3, H, W)
        except Exception as e:  # a truncated or foreign file: say which
            raise BadAnnotationError(
                f"{self._where(info)}: cannot decode {path!r} ({type(e).__name__}: {e})"
            ) from None
        H, W = data.shape[-2:]
        if (H, W) != (info["height"], info["width"]):
            raise BadAnnotationError(
                f"{self._where(info)}: the file is {W}x{H} but the annotations say "
                f"{info['width']}x{info['height']}"
            )
        image = tv_tensors.Image(data)
        target = self._target(image_id, H, W)
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        image = tv_tensors.wrap(image.to(torch.float32) / 255, like=image)
        return image, target

    def _target(self, image_id: int, H: int, W: int) -> Dict[str, Any]:
        from pycocotools import mask as mask_utils
        from torchvision import tv_tensors

        anns = self._anns[image_id]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]  # COCO's (x, y, w, h) -> (x1, y1, x2, y2)
        boxes[:, 0::2].clamp_(0, W)  # a box rounding past the edge by under a pixel
        boxes[:, 1::2].clamp_(0, H)
        target: Dict[str, Any] = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(H, W)),
            "labels": torch.tensor([self._label_of[a["category_id"]] for a in anns],
                                   dtype=torch.int64),
            "image_id": int(image_id),
        }
        if self.has_masks:
            if anns:
                rles = [_segmentation_rle(a["segmentation"], H, W) for a in anns]
                with warnings.catch_warnings():  # pycocotools' own NumPy 2 deprecation
                    warnings.simplefilter("ignore", DeprecationWarning)
                    decoded = mask_utils.decode(rles)  # (H, W, N)
                masks = torch.from_numpy(decoded).permute(2, 0, 1)  # (N, H, W)
            else:
                masks = torch.zeros(0, H, W, dtype=torch.uint8)
            target["masks"] = tv_tensors.Mask(masks.contiguous())
        return target


def collate_detection(batch: Sequence[Tuple[Any, Dict[str, Any]]]) -> Tuple[List, List]:
    """A batch as torchvision's detectors take it: a list of images and a list of targets
    (the images differ in size; the detector batches them itself)."""
    images, targets = zip(*batch) if batch else ((), ())
    return list(images), list(targets)


# -- finding a COCO layout ----------------------------------------------------------------------

def _find_split(data_dir: str, split: str) -> Tuple[str, str]:
    """``(image_dir, ann_file)`` of a split: ``annotations/instances_<split>*.json`` and the
    image folder whose name is the file's ``<split>*`` part (``train2017``), else ``<split>``."""
    ann_dir = os.path.join(data_dir, "annotations")
    names = sorted(os.listdir(ann_dir)) if os.path.isdir(ann_dir) else []
    found = [n for n in names if re.fullmatch(rf"instances_{split}\w*\.json", n)]
    if len(found) != 1:
        raise FileNotFoundError(
            f"no COCO layout in {data_dir!r}: expected one annotations/instances_{split}*.json "
            f"(found {found or 'none'}) beside its images in {split}*/ (as COCO's "
            f"annotations/instances_{split}2017.json and {split}2017/)"
        )
    stem = found[0][len("instances_"):-len(".json")]  # "train2017"
    for folder in (stem, split):
        image_dir = os.path.join(data_dir, folder)
        if os.path.isdir(image_dir):
            return image_dir, os.path.join(ann_dir, found[0])
    raise FileNotFoundError(
        f"no image folder for {found[0]} in {data_dir!r}: expected {stem}/ or {split}/"
    )


def detection_splits(data_dir: str, train_size: int, augment: bool = True,
                     bad: str = "raise", eval_size: Optional[int] = None,
                     ) -> Tuple[CocoDetection, CocoDetection]:
    """The training and validation sets of a COCO-format folder: ``annotations/instances_
    {train,val}*.json`` with images in ``{train,val}*/`` (COCO's ``train2017``/``val2017``).
    Training: large-scale jitter to ``train_size`` when ``augment`` (NOTE [ Large-scale
    jitter ]), else the evaluation resize; validation: each image resized so it fits
    ``eval_size`` (default ``train_size``)."""
    if train_size < 1:
        raise ValueError(f"expected train_size >= 1, got {train_size}")
    train_dir, train_ann = _find_split(data_dir, "train")
    val_dir, val_ann = _find_split(data_dir, "val")
    fit = resize_to_fit(eval_size or train_size)
    train = CocoDetection(train_dir, train_ann,
                          large_scale_jitter(train_size) if augment else fit, bad=bad)
    val = CocoDetection(val_dir, val_ann, fit, bad=bad)
    if [c["id"] for c in train.categories] != [c["id"] for c in val.categories]:
        raise ValueError(
            f"expected the same categories in {train_ann!r} and {val_ann!r}, got ids "
            f"{[c['id'] for c in train.categories]} and {[c['id'] for c in val.categories]}"
        )
    return train, val
