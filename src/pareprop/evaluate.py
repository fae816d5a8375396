"""Top-1/top-5 accuracy of a classifier on an image folder, with the model's own evaluation
transform (video models: a video folder or CSV, 5 clips x 1 crop averaged; see
:func:`pareprop.video.evaluate_video`).

The folder has ImageNet's validation layout: one sub-folder per class, whose sorted names give
the class indices (``torchvision.datasets.ImageFolder``); for ImageNet-1k that is the order
of the 1000 WordNet ids the published models were trained with. The transform is
:func:`pareprop.data.eval_transform` of the model's data config: timm's ``resolve_data_config``
of its ``pretrained_cfg``, which for a model loaded from a pareprop checkpoint holds the config
its run validated with (NOTE [ One data config ] in pareprop/data.py). For the published
reversible models: resize to 256 (bicubic), centre crop 224, ImageNet mean and standard
deviation.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from torchvision.datasets import ImageFolder
from tqdm.auto import tqdm

from pareprop.data import eval_transform, model_data_config
from pareprop.engine import engine_of, set_stack_engine
from pareprop.video import evaluate_video, is_video_model

__all__ = ["evaluate", "eval_loader"]


def eval_loader(
    model: nn.Module, data_dir: str, batch_size: int = 64, workers: int = 2,
    data_config: Optional[Dict[str, Any]] = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader over ``data_dir`` (an ImageFolder) with the evaluation transform of
    ``data_config`` (default: ``model``'s)."""
    if not os.path.isdir(data_dir):
        raise ValueError(f"expected --data-dir to be a folder of class folders, got {data_dir!r}")
    config = data_config or model_data_config(model)
    dataset = ImageFolder(data_dir, transform=eval_transform(config))
    dataset.data_config = config
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=workers
    )


def evaluate(
    model: nn.Module,
    data_dir: str,
    *,
    batch_size: int = 64,
    workers: int = 2,
    engine: Optional[str] = None,
    amp: str = "none",
    device: Any = None,
    progress: bool = True,
    limit: Optional[int] = None,
    data_config: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Top-1 and top-5 accuracy (percent) of ``model`` on the ImageFolder ``data_dir``.

    Args:
        model: a classifier whose ``num_classes`` equals the folder's class count.
        data_dir: one sub-folder per class.
        batch_size: images per forward.
        workers: data-loading processes.
        engine: switch reversible stacks to this engine first (None: leave them).
        amp: ``"none"`` or ``"bf16"`` (autocast).
        device: where to run (default: CUDA if available, else CPU).
        progress: show a tqdm progress bar.
        limit: evaluate only the first ``limit`` images (in folder order).
        data_config: the transform's data config (default: the model's; NOTE [ One data
            config ] in pareprop/data.py).

    Returns:
        ``{"top1", "top5", "images", "classes", "engine", "amp", "seconds", "data_config"}``.
    """
    if amp not in ("none", "bf16"):
        raise ValueError(f"expected amp 'none' or 'bf16', got {amp!r}")
    if engine is not None:
        set_stack_engine(model, engine)
    if limit is not None and limit < 1:
        raise ValueError(f"expected limit >= 1 (or none for every image), got {limit}")
    if is_video_model(model):  # clips: 5 views per video, averaged (pareprop.video)
        result = evaluate_video(model, data_dir, batch_size=batch_size, workers=workers,
                                amp=amp, device=device, progress=progress, limit=limit)
        return {**result, "engine": engine_of(model)}
    loader = eval_loader(model, data_dir, batch_size, workers, data_config)
    classes = len(loader.dataset.classes)
    num_classes = getattr(model, "num_classes", None)
    if num_classes is not None and num_classes != classes:
        raise ValueError(
            f"{data_dir!r} has {classes} class folders but the model predicts {num_classes} "
            "classes; evaluate on a folder with one sub-folder per class of the model"
        )
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device).eval()
    k5 = min(5, classes)
    correct1 = correct5 = seen = 0
    total = len(loader.dataset) if limit is None else min(limit, len(loader.dataset))
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if amp == "bf16"
        else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with torch.no_grad(), autocast, tqdm(
        total=total, disable=not progress, unit="img", desc="eval", dynamic_ncols=True
    ) as bar:
        for images, labels in loader:
            if seen >= total:
                break
            images, labels = images[: total - seen].to(device), labels[: total - seen].to(device)
            logits = model(images).float()
            top = logits.topk(k5, dim=1).indices  # (B, k)
            hits = top == labels[:, None]
            correct1 += int(hits[:, 0].sum())
            correct5 += int(hits.any(dim=1).sum())
            seen += len(labels)
            bar.update(len(labels))
            bar.set_postfix(top1=f"{100 * correct1 / seen:.2f}")
    if seen == 0:
        raise ValueError(f"{data_dir!r} holds no images")
    config = loader.dataset.data_config
    return {
        "top1": 100.0 * correct1 / seen,
        "top5": 100.0 * correct5 / seen,
        "images": seen,
        "classes": classes,
        "engine": engine_of(model),
        "amp": amp,
        "seconds": time.perf_counter() - start,
        "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
    }

