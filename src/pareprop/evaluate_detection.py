"""The data of a detection run and its COCO evaluation, shared by ``pareprop train --task
detection`` and ``pareprop eval``.

A run's detection data is described by a small JSON mapping, its *data config*, saved in every
checkpoint (``data_config`` in model.json) so that ``pareprop eval --checkpoint RUN/best``
rebuilds the same validation set and loader without being told where it is::

    {"task": "detection", "dataset": "shapes" | DIR, "root": the COCO-layout folder,
     "shapes": {num_train, num_val, image_size, seed} (the built-in set only),
     "train_size": the training crop, "val_batch_size": images per validation forward}

NOTE [ The same AP in training and evaluation ]
    ``pareprop eval`` reproduces the AP a run logged because everything that reaches the
    detector is the same: the validation images in the data set's order, unaugmented, batched
    as in training (``val_batch_size``: torchvision pads a batch to its largest image, so the
    batch size changes the padding and, through it, the numbers), the detector rebuilt from its
    saved spec with its saved weights, in eval mode, under the same autocast. Every process of a
    distributed run evaluates the whole validation set (detection's evaluation is a small part
    of a run, and one code path is what makes the numbers the same).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from pareprop.checkpoint import (
    Checkpoint,
    CheckpointError,
    is_detector_spec,
    load_checkpoint,
    load_weights,
)
from pareprop.data.coco import collate_detection, detection_splits
from pareprop.data.shapes import write_shapes
from pareprop.detection import detector_from_spec
from pareprop.detection.coco_eval import evaluate_detections

__all__ = [
    "SHAPES",
    "load_detector",
    "detector_of_checkpoint",
    "detection_data_config",
    "detection_datasets",
    "detection_val_loader",
    "evaluate_detector",
    "is_detection_config",
]

# The built-in synthetic shapes of the default detection run: enough images for a small
# detector to learn three shapes, few enough to write in seconds (pareprop.data.shapes).
SHAPES: Dict[str, int] = dict(num_train=400, num_val=100, image_size=128, seed=0)


def is_detection_config(config: Any) -> bool:
    """Whether a checkpoint's ``data_config`` describes detection data."""
    return isinstance(config, dict) and config.get("task") == "detection"


def detector_of_checkpoint(ckpt: Checkpoint, **overrides: Any) -> nn.Module:
    """The detector of a loaded checkpoint with its weights (NOTE [ Detector checkpoints ] in
    pareprop/checkpoint.py); ``overrides``: arguments of ``create_detector`` that keep the
    weights' shapes (``engine=...``)."""
    spec = ckpt.meta.get("model")
    if not is_detector_spec(spec):
        raise CheckpointError(f"{ckpt.path!r} holds a classifier, not a detector: load it "
                              "with pareprop.load_model")
    # The engine its stacks ran when it was saved, unless changed here.
    engine = overrides.pop("engine", None) or spec.get("engine")
    if engine is not None:
        overrides["engine"] = engine
    model = detector_from_spec(spec["detector"], **overrides)
    load_weights(model, ckpt)
    return model


def load_detector(path: str, map_location: Any = "cpu", **overrides: Any) -> nn.Module:
    """Rebuild the detector a checkpoint was saved from and load its weights (safetensors:
    nothing in the checkpoint is executed). ``path``: the checkpoint, a link to it
    (``RUN/best``) or its run directory."""
    ckpt = load_checkpoint(path, map_location=map_location, train_state=False)
    return detector_of_checkpoint(ckpt, **overrides)


def _shapes_root(data_dir: str, shapes: Dict[str, int]) -> str:
    """Where the shapes of these settings live under ``data_dir``: one folder per setting, so
    a run never reads a set written with other settings."""
    name = "shapes-{image_size}px-{num_train}-{num_val}-seed{seed}".format(**shapes)
    return os.path.join(data_dir, name)


def detection_data_config(
    dataset: str, data_dir: str, train_size: int, val_batch_size: int,
    shapes: Optional[Dict[str, int]] = None,
) -> Dict[str, Any]:
    """The data config of a run on ``dataset``: ``"shapes"`` (the built-in set, in a folder
    under ``data_dir``) or a folder in COCO's layout."""
    config: Dict[str, Any] = {"task": "detection", "dataset": dataset,
                              "train_size": int(train_size), "val_batch_size": int(val_batch_size)}
    if dataset == "shapes":
        config["shapes"] = dict(shapes or SHAPES)
        config["root"] = os.path.abspath(_shapes_root(data_dir, config["shapes"]))
    else:
        if not os.path.isdir(dataset):
            raise ValueError(
                f"expected --dataset shapes or a folder of COCO-format data (annotations/"
                f"instances_train*.json and its images), got {dataset!r}: no such folder"
            )
        config["root"] = os.path.abspath(dataset)
    return config


def detection_datasets(
    config: Dict[str, Any], augment: bool, prepare: bool = True
) -> Tuple[Dataset, Dataset]:
    """(train, val) of a data config; ``prepare`` writes the shapes first when missing
    (:func:`~pareprop.data.shapes.write_shapes` keeps a set written with the same settings; a
    distributed run writes on process 0 only, then every process reads)."""
    if config["dataset"] == "shapes" and prepare:
        write_shapes(config["root"], **config["shapes"])  # kept when written already
    try:
        return detection_splits(config["root"], config["train_size"], augment)
    except FileNotFoundError as e:  # not COCO's layout: the commands' one-line error
        raise ValueError(str(e)) from None


def detection_val_loader(dataset: Dataset, batch_size: int, workers: int = 0) -> DataLoader:
    """The validation loader: the data set's order, ``batch_size`` images per forward."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                      collate_fn=collate_detection)


def evaluate_detector(
    model: nn.Module,
    config: Dict[str, Any],
    *,
    data_dir: Optional[str] = None,
    device: Any = None,
    amp: str = "none",
    workers: int = 0,
    batch_size: Optional[int] = None,
) -> Dict[str, Any]:
    """COCO AP of a detector on the validation split of a run's data (NOTE [ The same AP in
    training and evaluation ]).

    Args:
        model: a torchvision detector (``pareprop.load_model`` of a detection checkpoint).
        config: the run's data config (``data_config`` of its checkpoint).
        data_dir: evaluate on this COCO-layout folder instead of the run's.
        device: where to run (default: CUDA if available, else CPU).
        amp: ``"none"`` or ``"bf16"``.
        workers: data-loading processes.
        batch_size: images per forward (default: the run's validation batch).

    Returns:
        ``{"bbox_AP", "bbox_AP50", "bbox_AP75", ["segm_AP", ...], "images", "data_dir"}``.
    """
    if amp not in ("none", "bf16"):
        raise ValueError(f"expected amp 'none' or 'bf16', got {amp!r}")
    config = dict(config)
    if data_dir is not None:
        if not os.path.isdir(data_dir):
            raise ValueError(f"expected --data-dir to be a folder of COCO-format data "
                             f"(annotations/instances_val*.json and its images), got {data_dir!r}")
        config.update(dataset=os.path.abspath(data_dir), root=os.path.abspath(data_dir))
        config.pop("shapes", None)
    _, val = detection_datasets(config, augment=False)
    num_classes = len(val.categories) + 1
    spec = getattr(model, "pareprop_spec", None) or {}
    if spec.get("num_classes") not in (None, num_classes):
        raise ValueError(
            f"{config['root']!r} has {num_classes - 1} categories but the detector predicts "
            f"{spec['num_classes'] - 1}; evaluate on data with the categories it was trained on"
        )
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device).eval()
    loader = detection_val_loader(val, batch_size or config["val_batch_size"], workers)
    result = evaluate_detections(model, loader, val, device, autocast=amp)
    return {**result, "images": len(val), "data_dir": config["root"]}
