"""COCO-format detection data: the reader (boxes, polygon and RLE masks, crowds, contiguous
labels), the refusals and skips of bad annotations, large-scale jitter and the evaluation
resize, the synthetic shapes and the COCO layout finder."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("pycocotools")

from pycocotools import mask as mask_utils  # noqa: E402
from torchvision import tv_tensors  # noqa: E402

from pareprop.data.coco import (  # noqa: E402
    BadAnnotationError,
    BadAnnotationWarning,
    CocoDetection,
    collate_detection,
    detection_splits,
)
from pareprop.data.detection_transforms import large_scale_jitter, resize_to_fit  # noqa: E402
from pareprop.data.shapes import write_shapes  # noqa: E402

W, H = 40, 30


def _write_png(path, width=W, height=H):
    from PIL import Image

    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(path)


def _coco(tmp_path, annotations, images=None, categories=None, write_images=True):
    """A one-image (by default) COCO folder: ``img/`` and ``ann.json``."""
    images = images or [{"id": 7, "file_name": "a.png", "width": W, "height": H}]
    categories = categories or [{"id": 3, "name": "cat"}, {"id": 11, "name": "dog"}]
    os.makedirs(tmp_path / "img", exist_ok=True)
    if write_images:
        for im in images:
            _write_png(tmp_path / "img" / im["file_name"], im["width"], im["height"])
    for i, a in enumerate(annotations):
        a.setdefault("id", i + 1)
        a.setdefault("image_id", images[0]["id"])
        a.setdefault("iscrowd", 0)
        a.setdefault("area", 1.0)
    path = tmp_path / "ann.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": categories}))
    return str(tmp_path / "img"), str(path)


def _rect(x, y, w, h):
    return [[x, y, x + w, y, x + w, y + h, x, y + h]]


def test_boxes_labels_and_polygon_masks(tmp_path):
    ds = CocoDetection(*_coco(tmp_path, [
        {"category_id": 11, "bbox": [2, 3, 10, 5], "segmentation": _rect(2, 3, 10, 5)},
        {"category_id": 3, "bbox": [20, 10, 8, 12], "segmentation": _rect(20, 10, 8, 12)},
    ]))
    assert ds.categories == [{"id": 3, "name": "cat"}, {"id": 11, "name": "dog"}]
    assert [ds.label_to_cat_id(k) for k in (1, 2)] == [3, 11] and ds.num_classes == 3
    image, target = ds[0]
    assert isinstance(image, tv_tensors.Image) and image.dtype == torch.float32
    assert image.shape == (3, H, W) and abs(float(image.max()) - 128 / 255) < 1e-6
    boxes = target["boxes"]
    assert isinstance(boxes, tv_tensors.BoundingBoxes) and boxes.format.value == "XYXY"
    torch.testing.assert_close(boxes.as_subclass(torch.Tensor),
                               torch.tensor([[2., 3., 12., 8.], [20., 10., 28., 22.]]))
    assert target["labels"].tolist() == [2, 1] and target["labels"].dtype == torch.int64
    masks = target["masks"]
    assert isinstance(masks, tv_tensors.Mask) and masks.dtype == torch.uint8
    assert masks.shape == (2, H, W) and target["image_id"] == 7
    # Each mask covers its rectangle (pycocotools rasterises the polygon's inside).
    ys, xs = torch.nonzero(masks[1], as_tuple=True)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (20, 27, 10, 21)


def test_rle_masks_compressed_and_uncompressed_and_crowds(tmp_path):
    m = np.zeros((H, W), np.uint8, order="F")
    m[5:9, 6:16] = 1
    compressed = mask_utils.encode(m)
    compressed["counts"] = compressed["counts"].decode()
    # Uncompressed RLE: run lengths in column-major order, starting with zeros.
    flat = m.flatten(order="F")
    runs, current, count = [], 0, 0
    for v in flat:
        if v == current:
            count += 1
        else:
            runs.append(count)
            current, count = v, 1
    runs.append(count)
    ds = CocoDetection(*_coco(tmp_path, [
        {"category_id": 3, "bbox": [6, 5, 10, 4], "segmentation": compressed},
        {"category_id": 11, "bbox": [6, 5, 10, 4],
         "segmentation": {"counts": runs, "size": [H, W]}},
        {"category_id": 3, "bbox": [0, 0, 40, 30], "segmentation": compressed, "iscrowd": 1},
    ]))
    _, target = ds[0]
    assert target["labels"].tolist() == [1, 2]  # the crowd is not a training target
    for mask in target["masks"]:
        assert torch.equal(mask, torch.from_numpy(m))


def test_files_without_segmentation_give_boxes_only(tmp_path):
    ds = CocoDetection(*_coco(tmp_path, [{"category_id": 3, "bbox": [1, 1, 5, 5]}]))
    assert not ds.has_masks and "masks" not in ds[0][1]


@pytest.mark.parametrize("change,says", [
    (dict(bbox=[30, 20, 20, 5]), "outside the 40x30 image"),
    (dict(bbox=[3, 3, 0, 5]), "empty box"),
    (dict(segmentation=[[1, 1, 2, 2]]), "empty mask"),
    (dict(category_id=99), "category id 99"),
])
def test_bad_annotations_are_refused_or_skipped(tmp_path, change, says):
    good = {"category_id": 3, "bbox": [2, 2, 6, 6], "segmentation": _rect(2, 2, 6, 6)}
    bad = dict(good, **change)
    args = _coco(tmp_path, [good, bad])
    with pytest.raises(BadAnnotationError) as info:
        CocoDetection(*args)
    line = str(info.value)
    assert "'a.png' (id 7)" in line and "annotation 2" in line and says in line
    assert "\n" not in line
    with pytest.warns(BadAnnotationWarning, match=r"'a\.png' \(id 7\).*annotation 2"):
        ds = CocoDetection(*args, bad="skip")
    assert len(ds) == 1 and ds[0][1]["labels"].tolist() == [1]


def test_a_missing_image_file_is_refused_or_skipped(tmp_path):
    images = [{"id": 1, "file_name": "a.png", "width": W, "height": H},
              {"id": 2, "file_name": "gone.png", "width": W, "height": H}]
    args = _coco(tmp_path, [{"category_id": 3, "bbox": [2, 2, 6, 6]}], images=images,
                 write_images=False)
    _write_png(tmp_path / "img" / "a.png")
    with pytest.raises(BadAnnotationError, match=r"'gone\.png' \(id 2\).*missing"):
        CocoDetection(*args)
    with pytest.warns(BadAnnotationWarning, match="gone.png"):
        ds = CocoDetection(*args, bad="skip")
    assert ds.ids == [1]


def _box_of(mask):
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return torch.stack([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]).float()


def test_large_scale_jitter_moves_boxes_and_masks_together(tmp_path):
    root = write_shapes(tmp_path / "shapes", num_train=6, num_val=2, image_size=(60, 90))
    train, _ = detection_splits(root, 64)
    torch.manual_seed(0)
    for _ in range(4):
        for i in range(len(train)):
            image, target = train[i]
            assert image.shape == (3, 64, 64)
            boxes, masks = target["boxes"], target["masks"]
            assert len(boxes) == len(masks) == len(target["labels"])
            assert ((boxes[:, 2:] - boxes[:, :2]) >= 1).all()  # sanitised: no degenerate box
            assert (boxes >= 0).all() and (boxes <= 64).all()
            for box, mask in zip(boxes, masks):
                # Inside the window, the mask's extent is the box, within rasterisation (a box
                # cut by the window is the clipped box, wider than a cut triangle's mask).
                if (box > 0.5).all() and (box < 63.5).all():
                    assert (box - _box_of(mask)).abs().max() < 2.5
    # The same seed draws the same samples (torch's default generator, NOTE [ Large-scale
    # jitter ]).
    torch.manual_seed(1)
    a = train[0]
    torch.manual_seed(1)
    b = train[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["boxes"], b[1]["boxes"])


def test_jitter_drops_boxes_that_leave_the_window(tmp_path):
    ds = CocoDetection(*_coco(tmp_path, [
        {"category_id": 3, "bbox": [0, 0, 6, 6], "segmentation": _rect(0, 0, 6, 6)},
        {"category_id": 11, "bbox": [32, 22, 8, 8], "segmentation": _rect(32, 22, 8, 8)},
    ]), transforms=large_scale_jitter(20, scale=(2.0, 2.0), flip=False))
    counts = set()
    torch.manual_seed(0)
    for _ in range(30):
        _, target = ds[0]
        counts.add(len(target["boxes"]))
        assert len(target["masks"]) == len(target["labels"]) == len(target["boxes"])
    # A 20 px window of the image at twice the size (80 x 53) holds one corner box or none.
    assert counts <= {0, 1} and 0 in counts


def test_resize_to_fit_keeps_every_object(tmp_path):
    ds = CocoDetection(*_coco(tmp_path, [
        {"category_id": 3, "bbox": [20, 10, 20, 20], "segmentation": _rect(20, 10, 20, 20)},
    ]), transforms=resize_to_fit(80))
    image, target = ds[0]
    assert image.shape == (3, 60, 80)  # the long side is 80, the aspect kept
    torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor),
                               torch.tensor([[40., 20., 80., 60.]]))


def _digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(dirpath, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_shapes_are_deterministic_coco_files(tmp_path):
    a = write_shapes(tmp_path / "a", num_train=5, num_val=3, image_size=(48, 64), seed=3)
    b = write_shapes(tmp_path / "b", num_train=5, num_val=3, image_size=(48, 64), seed=3)
    c = write_shapes(tmp_path / "c", num_train=5, num_val=3, image_size=(48, 64), seed=4)
    assert _digest(a) == _digest(b) != _digest(c)
    train, val = detection_splits(a, 64)
    assert (len(train), len(val)) == (5, 3)
    assert [c["name"] for c in train.categories] == ["circle", "square", "triangle"]
    for ann in train.coco.anns.values():
        assert 1 <= ann["category_id"] <= 3 and ann["area"] > 0 and ann["segmentation"]
    per_image = [len(train.coco.getAnnIds(imgIds=i)) for i in train.ids]
    assert min(per_image) >= 1 and max(per_image) <= 4


def test_detection_splits_finds_coco_layout_or_says_what_it_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"annotations/instances_train\*\.json"):
        detection_splits(str(tmp_path), 64)
    root = write_shapes(tmp_path / "s", num_train=2, num_val=2, image_size=32)
    # COCO's own names: instances_train2017.json beside train2017/.
    for split in ("train", "val"):
        os.rename(os.path.join(root, split), os.path.join(root, f"{split}2017"))
        os.rename(os.path.join(root, "annotations", f"instances_{split}.json"),
                  os.path.join(root, "annotations", f"instances_{split}2017.json"))
    train, val = detection_splits(root, 32, augment=False)
    assert train.image_dir.endswith("train2017") and len(val) == 2


def test_collate_keeps_images_of_different_sizes(tmp_path):
    root = write_shapes(tmp_path / "s", num_train=2, num_val=2, image_size=(40, 60))
    _, val = detection_splits(root, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = torch.utils.data.DataLoader(val, batch_size=2, collate_fn=collate_detection)
        images, targets = next(iter(loader))
    assert len(images) == len(targets) == 2
    assert {t["image_id"] for t in targets} == set(val.ids)
