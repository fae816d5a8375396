"""COCO AP of a detector, with a fake detector that returns chosen predictions (the ground
truth, moved or mislabelled) so no training is needed; and the picture of predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

pytest.importorskip("pycocotools")

from pareprop.data.coco import collate_detection, detection_splits  # noqa: E402
from pareprop.data.shapes import write_shapes  # noqa: E402
from pareprop.detection.coco_eval import evaluate_detections  # noqa: E402
from pareprop.detection.visualize import save_predictions  # noqa: E402

SIDE, EVAL = 48, 96  # images 48 x 48, evaluated at twice the size: predictions map back


class _Replay(nn.Module):
    """A "detector" that answers the i-th image it is given with ``outputs[i]`` (in the
    coordinates of the image it was given, as torchvision's detectors answer)."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs, self.seen = outputs, 0

    def forward(self, images):
        out = []
        for image in images:
            o = self.outputs[self.seen % len(self.outputs)]
            assert image.shape[-2:] == o["size"]
            out.append({k: v for k, v in o.items() if k != "size"})
            self.seen += 1
        return out


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    root = write_shapes(tmp_path_factory.mktemp("shapes"), num_train=1, num_val=6,
                        image_size=SIDE, seed=1)
    return detection_splits(root, EVAL, augment=False)[1]


def _truth(val, masks=True, shift=0.0, relabel=False, empty_masks=False):
    """The validation set's ground truth as predictions (score 1)."""
    outputs = []
    for i in range(len(val)):
        image, target = val[i]
        boxes = target["boxes"].as_subclass(torch.Tensor).clone()
        boxes[:, 0::2] += shift * (boxes[:, 2] - boxes[:, 0])[:, None]
        labels = target["labels"] % 3 + 1 if relabel else target["labels"]
        o = {"boxes": boxes, "labels": labels, "scores": torch.ones(len(boxes)),
             "size": image.shape[-2:]}
        if masks:
            m = target["masks"].as_subclass(torch.Tensor).float()[:, None]  # (N, 1, H, W)
            o["masks"] = torch.zeros_like(m) if empty_masks else m
        outputs.append(o)
    return outputs


def _ap(val, outputs):
    loader = torch.utils.data.DataLoader(val, batch_size=4, collate_fn=collate_detection)
    return evaluate_detections(_Replay(outputs), loader, val)


def test_ground_truth_scores_one(val):
    ap = _ap(val, _truth(val))
    assert set(ap) == {"bbox_AP", "bbox_AP50", "bbox_AP75", "segm_AP", "segm_AP50",
                       "segm_AP75"}
    for key, value in ap.items():
        assert value == pytest.approx(1.0), key


def test_a_shifted_box_lowers_ap(val):
    # Moved by 30% of its width, a box overlaps its object by IoU 0.54: found at 0.5, not 0.75.
    ap = _ap(val, _truth(val, masks=False, shift=0.3))
    assert "segm_AP" not in ap  # no masks predicted, no mask AP
    assert ap["bbox_AP50"] == pytest.approx(1.0)
    assert ap["bbox_AP75"] == 0.0 and 0.0 < ap["bbox_AP"] < 0.5


def test_a_wrong_category_scores_zero(val):
    ap = _ap(val, _truth(val, relabel=True))
    assert all(v == 0.0 for v in ap.values()), ap


def test_masks_are_scored_apart_from_boxes(val):
    ap = _ap(val, _truth(val, empty_masks=True))
    assert ap["bbox_AP"] == pytest.approx(1.0) and ap["segm_AP"] == 0.0


def test_save_predictions_writes_a_png(val, tmp_path):
    from PIL import Image

    path = save_predictions(_Replay(_truth(val)), val, tmp_path / "pred" / "val.png",
                            num_images=3)
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 3 * EVAL and im.size[1] >= EVAL
        # Something was drawn: the boxes' and masks' colours are not the images' greys.
        pixels = torch.from_numpy(np.array(im.convert("RGB"))).int()  # (H, W, 3)
    assert (pixels.amax(dim=-1) - pixels.amin(dim=-1) > 60).any()
