"""Top-1/top-5 accuracy of a classifier on an image folder, with the model's own evaluation
transform; of a video model on a video folder or CSV, 5 clips x 1 crop averaged
(:func:`evaluate_video`, :func:`evaluate_clips`).

The folder has ImageNet's validation layout: one sub-folder per class, whose sorted names give
the class indices (``torchvision.datasets.ImageFolder``); for ImageNet-1k that is the order
of the 1000 WordNet ids the published models were trained with. The transform is
:func:`pareprop.data.eval_transform` of the model's data config: timm's ``resolve_data_config``
of its ``pretrained_cfg``, which for a model loaded from a pareprop checkpoint holds the config
its run validated with (NOTE [ One data config ] in pareprop/data/config.py). For the published
reversible models: resize to 256 (bicubic), centre crop 224, ImageNet mean and standard
deviation.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torchvision.datasets import ImageFolder
from tqdm.auto import tqdm

from pareprop.data import (
    collate_videos,
    eval_transform,
    is_video_model,
    model_data_config,
    video_data_config,
    video_dataset,
)
from pareprop.engine import ReversibleStack, set_engine

__all__ = ["evaluate", "eval_loader", "evaluate_clips", "evaluate_video"]


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
            config ] in pareprop/data/config.py).

    Returns:
        ``{"top1", "top5", "images", "classes", "engine", "amp", "seconds", "data_config"}``.
    """
    if amp not in ("none", "bf16"):
        raise ValueError(f"expected amp 'none' or 'bf16', got {amp!r}")
    if engine is not None:
        set_engine(model, engine)
    if limit is not None and limit < 1:
        raise ValueError(f"expected limit >= 1 (or none for every image), got {limit}")
    if is_video_model(model):  # clips: 5 views per video, averaged
        result = evaluate_video(model, data_dir, batch_size=batch_size, workers=workers,
                                amp=amp, device=device, progress=progress, limit=limit)
        return {**result, "engine": _engine_of(model)}
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
        "engine": _engine_of(model),
        "amp": amp,
        "seconds": time.perf_counter() - start,
        "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
    }


@torch.no_grad()
def evaluate_clips(
    model: nn.Module,
    loader: Any,
    device: Any = "cpu",
    average: str = "softmax",
    topk: Tuple[int, ...] = (1, 5),
    amp: str = "none",
    limit: Optional[int] = None,
    progress: bool = False,
) -> Dict[str, float]:
    """Top-k accuracy over multi-view averages: each video's ``(V, C, T, H, W)`` views go
    through the model and their scores are averaged per video.

    Args:
        model: the classifier (put in eval mode here).
        loader: batches ``(views (B, V, C, T, H, W), labels (B,))`` from an ``eval``-mode
            :class:`pareprop.data.VideoFolder` with :func:`pareprop.data.collate_videos`;
            ``None`` batches are skipped.
        device: where to run.
        average: ``"softmax"`` (the mean of the views' probabilities, as PySlowFast's test
            sums them) or ``"logits"``.
        topk: the k of each reported accuracy.
        amp: ``"none"`` or ``"bf16"`` (autocast).
        limit: stop after this many videos.
        progress: show a progress bar (decoding dominates: it counts videos).

    Returns:
        ``{"top1": ..., "top5": ..., "videos": n}`` (accuracies in percent).
    """
    if average not in ("softmax", "logits"):
        raise ValueError(f"expected average 'softmax' or 'logits', got {average!r}")
    if amp not in ("none", "bf16"):
        raise ValueError(f"expected amp 'none' or 'bf16', got {amp!r}")
    device = torch.device(device)
    model.eval()
    correct = {k: 0 for k in topk}
    seen = 0
    total = len(loader.dataset) if hasattr(loader, "dataset") else None
    total = limit if total is None else min(total, limit or total)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if amp == "bf16"
                else contextlib.nullcontext())
    with autocast, tqdm(total=total, disable=not progress, unit="video", desc="eval",
                        dynamic_ncols=True) as bar:
        for batch in loader:
            if batch is None:
                continue
            if limit is not None and seen >= limit:
                break
            views, labels = batch
            if limit is not None:
                views, labels = views[: limit - seen], labels[: limit - seen]
            B, V = views.shape[:2]
            out = model(views.flatten(0, 1).to(device)).float()  # (B * V, K)
            if average == "softmax":
                out = out.softmax(dim=-1)
            scores = out.view(B, V, -1).mean(dim=1).cpu()  # (B, K)
            top = scores.topk(min(max(topk), scores.shape[-1]), dim=-1).indices  # (B, k)
            hits = top == labels.view(-1, 1)
            for k in topk:
                correct[k] += int(hits[:, :k].any(dim=1).sum())
            seen += B
            bar.update(B)
            bar.set_postfix(top1=f"{100 * correct[topk[0]] / seen:.2f}")
    result = {f"top{k}": 100.0 * correct[k] / max(seen, 1) for k in topk}
    result["videos"] = float(seen)
    return result


def evaluate_video(
    model: nn.Module,
    source: str,
    *,
    batch_size: int = 4,
    workers: int = 2,
    num_clips: int = 5,
    average: str = "softmax",
    amp: str = "none",
    device: Any = None,
    progress: bool = True,
    limit: Optional[int] = None,
) -> Dict[str, Any]:
    """Top-1/top-5 of a video model on a video folder or CSV (``pareprop eval`` on videos):
    ``num_clips`` evenly spaced clips x 1 centre crop per video, scores averaged.

    Returns:
        ``{"top1", "top5", "videos", "views", "classes", "skipped", "amp", "seconds",
        "data_config"}``.
    """
    config = video_data_config(model)
    dataset = video_dataset(model, source, "eval", num_clips=num_clips)
    num_classes = getattr(model, "num_classes", None)
    if num_classes is not None and num_classes != dataset.num_classes:
        raise ValueError(
            f"{source!r} has {dataset.num_classes} classes but the model predicts {num_classes}; "
            "evaluate on data with one class per output of the model"
        )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False,
                                         num_workers=workers, collate_fn=collate_videos)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    result: Dict[str, Any] = dict(evaluate_clips(
        model.to(device), loader, device, average=average, amp=amp, limit=limit,
        progress=progress,
    ))
    if result["videos"] == 0:
        raise ValueError(f"{source!r} holds no decodable videos")
    result.update(videos=int(result["videos"]), views=f"{num_clips} clips x 1 crop",
                  classes=dataset.num_classes, skipped=len(dataset) - int(result["videos"])
                  if limit is None else None, average=average, amp=amp,
                  seconds=time.perf_counter() - start, data_config=config)
    return result


def _engine_of(model: nn.Module) -> Optional[str]:
    for m in model.modules():
        if isinstance(m, ReversibleStack):
            return m.engine
    return None
