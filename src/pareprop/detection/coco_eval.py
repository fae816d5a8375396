"""COCO AP of a detector (box and mask AP, AP50, AP75) through pycocotools' COCOeval.

NOTE [ Predictions in COCO's terms ]
    A torchvision detector returns, per image, boxes XYXY in the coordinates of the image it was
    given, contiguous labels ``1..K``, scores and (Mask R-CNN) soft masks ``(N, 1, h, w)`` in
    [0, 1]. COCOeval compares against the annotation file, so each prediction is put back into
    the file's terms first: boxes scaled to the original image (the evaluation transform,
    ``resize_to_fit``, only scales, one factor per axis) and written ``[x, y, w, h]``; labels
    mapped back to the file's category ids; masks resized to the original image (bilinear),
    thresholded at 0.5 as torchvision's reference and detectron2 do, and RLE-encoded. Box and
    mask results are two lists, so each COCOeval run reads the areas of its own kind.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["evaluate_detections", "predictions_to_coco", "coco_ap"]

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# COCOeval's stats: index of AP, AP50, AP75.
_STATS = {"AP": 0, "AP50": 1, "AP75": 2}


def _autocast(device: torch.device, autocast: Union[None, str, torch.dtype]) -> Any:
    if autocast is None or autocast == "none":
        return contextlib.nullcontext()
    dtype = _AMP_DTYPES.get(autocast, autocast) if isinstance(autocast, str) else autocast
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"expected autocast None, 'none', 'bf16', 'fp16' or a dtype, got "
                         f"{autocast!r}")
    return torch.autocast(device.type, dtype=dtype)


def predictions_to_coco(output: Dict[str, torch.Tensor], image_size: Any, image_id: int,
                        dataset: Any) -> Dict[str, List[Dict[str, Any]]]:
    """One image's detector output as COCO results (NOTE [ Predictions in COCO's terms ]).

    Args:
        output: ``{"boxes", "labels", "scores"[, "masks"]}`` for an image of ``image_size``.
        image_size: ``(h, w)`` of the image the detector was given.
        image_id: the image's id in ``dataset.coco``.
        dataset: a :class:`pareprop.data.coco.CocoDetection` (its ``coco`` and
            ``label_to_cat_id``).

    Returns:
        ``{"bbox": [...], "segm": [...]}`` (``segm`` empty when there are no masks).
    """
    info = dataset.coco.imgs[int(image_id)]
    H, W = int(info["height"]), int(info["width"])
    h, w = int(image_size[0]), int(image_size[1])
    boxes = output["boxes"].detach().float().cpu()
    boxes = boxes * torch.tensor([W / w, H / h, W / w, H / h])  # to the original image
    boxes[:, 2:] -= boxes[:, :2]  # (x1, y1, x2, y2) -> (x, y, w, h)
    scores = output["scores"].detach().float().cpu().tolist()
    cats = [dataset.label_to_cat_id(int(k)) for k in output["labels"].tolist()]
    bbox = [{"image_id": int(image_id), "category_id": c, "bbox": [round(v, 2) for v in b],
             "score": s} for c, b, s in zip(cats, boxes.tolist(), scores)]
    segm: List[Dict[str, Any]] = []
    masks = output.get("masks")
    if masks is not None and len(masks):
        from pycocotools import mask as mask_utils

        soft = masks.detach().float().reshape(-1, 1, *masks.shape[-2:]).cpu()  # (N, 1, h, w)
        hard = F.interpolate(soft, size=(H, W), mode="bilinear", align_corners=False)[:, 0] > 0.5
        fortran = np.asfortranarray(hard.permute(1, 2, 0).numpy().astype(np.uint8))  # (H, W, N)
        for c, s, rle in zip(cats, scores, mask_utils.encode(fortran)):
            rle["counts"] = rle["counts"].decode("ascii")  # JSON-able, as COCO's files keep it
            segm.append({"image_id": int(image_id), "category_id": c, "segmentation": rle,
                         "score": s})
    return {"bbox": bbox, "segm": segm}


def coco_ap(coco_gt: Any, results: List[Dict[str, Any]], iou_type: str,
            image_ids: List[int]) -> Dict[str, float]:
    """``{"AP", "AP50", "AP75"}`` (fractions) of ``results`` against ``coco_gt`` on
    ``image_ids``, by COCOeval run quietly; 0 for no results."""
    from pycocotools.cocoeval import COCOeval

    if not results:  # loadRes refuses an empty list; nothing found is AP 0
        return {k: 0.0 for k in _STATS}
    with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints every step
        coco_dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, coco_dt, iou_type)
        ev.params.imgIds = sorted(set(image_ids))
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    # COCOeval says -1 where no image holds ground truth: no AP is defined, report 0.
    return {k: max(float(ev.stats[i]), 0.0) for k, i in _STATS.items()}


@torch.no_grad()
def evaluate_detections(model: nn.Module, loader: Any, dataset: Any,
                        device: Union[str, torch.device, None] = None,
                        autocast: Union[None, str, torch.dtype] = None,
                        limit: Optional[int] = None) -> Dict[str, float]:
    """COCO AP of a torchvision detector on ``dataset`` (NOTE [ Predictions in COCO's terms ]).

    Args:
        model: a torchvision detector (put in eval mode here), taking a list of images.
        loader: batches ``(images, targets)`` of ``dataset`` (``collate_detection``); each
            target's ``image_id`` names the image in ``dataset.coco``.
        dataset: the :class:`pareprop.data.coco.CocoDetection` the loader reads.
        device: where to run (default: the model's).
        autocast: None or ``"none"``, ``"bf16"``, ``"fp16"`` or a dtype.
        limit: stop after this many images (AP over those only).

    Returns:
        ``{"bbox_AP", "bbox_AP50", "bbox_AP75"}`` and, when the model predicts masks,
        ``{"segm_AP", "segm_AP50", "segm_AP75"}``: fractions in [0, 1].
    """
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    results: Dict[str, List[Dict[str, Any]]] = {"bbox": [], "segm": []}
    image_ids: List[int] = []
    predicts_masks = False
    try:
        for images, targets in loader:
            if limit is not None:
                room = limit - len(image_ids)
                if room <= 0:
                    break
                images, targets = images[:room], targets[:room]
            with _autocast(device, autocast):
                outputs = model([im.as_subclass(torch.Tensor).to(device) for im in images])
            for image, target, output in zip(images, targets, outputs):
                predicts_masks = predicts_masks or "masks" in output
                found = predictions_to_coco(output, image.shape[-2:], target["image_id"],
                                            dataset)
                results["bbox"] += found["bbox"]
                results["segm"] += found["segm"]
                image_ids.append(int(target["image_id"]))
    finally:
        model.train(was_training)
    if not image_ids:
        raise ValueError("expected at least one image to evaluate; the loader gave none")
    metrics = {f"bbox_{k}": v for k, v in
               coco_ap(dataset.coco, results["bbox"], "bbox", image_ids).items()}
    if predicts_masks:
        if not dataset.has_masks:
            warnings.warn("the model predicts masks but the annotations hold none: no mask AP",
                          stacklevel=2)
        else:
            metrics.update({f"segm_{k}": v for k, v in
                            coco_ap(dataset.coco, results["segm"], "segm", image_ids).items()})
    return metrics
