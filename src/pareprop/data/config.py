"""The data config: how a model's inputs are made from images or videos, read from the model.

NOTE [ One data config ]
    A model is trained, validated and evaluated by ``pareprop eval`` on inputs made from one
    data config, read from the model's ``pretrained_cfg`` and saved with every checkpoint:

    * images: timm's keys (``input_size`` (C, H, W), ``interpolation``, ``mean``, ``std``,
      ``crop_pct``, ``crop_mode``), turned into the validation transform by
      :func:`eval_transform`. A run that starts from pretrained weights takes the model's own
      (:func:`model_data_config`, timm's ``resolve_data_config``); one from scratch, the data
      set's statistics. Each builder reports the config its validation set uses
      (``Datasets.data_config``).
    * videos: ``input_size`` (C, T, H, W), ``frame_stride``, ``mean`` and ``std``, always the
      model's own (:func:`video_data_config`; ``--model-arg frame_stride=1`` changes it),
      turned into ``VideoFolder`` options by ``pareprop.data.video.folder_options``, the one
      place training and evaluation both call. Clips sampled otherwise than the model says
      would evaluate it on other clips than it learnt from.

    The trainer saves the config in every checkpoint, and :func:`pareprop.load_model` puts it
    back into the model's ``pretrained_cfg``, where ``pareprop eval`` (and timm) read it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn

__all__ = [
    "MissingPackageError",
    "DATA_CONFIG_KEYS",
    "DataConfig",
    "PUBLISHED_CONFIG",
    "eval_transform",
    "is_video_model",
    "model_data_config",
    "video_data_config",
]


class MissingPackageError(ImportError):
    """An optional package that this data needs is not installed; the message says how to
    install it (the command-line tools print it as one line)."""

# The keys of an image data config (timm's resolve_data_config), NOTE [ One data config ].
DATA_CONFIG_KEYS = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
DataConfig = Dict[str, Any]

# The published video recipe (NOTE [ Clips as published ] in pareprop/data/video.py), for a
# video data set built without a model.
PUBLISHED_CONFIG: DataConfig = dict(input_size=[3, 16, 224, 224], frame_stride=4,
                                    mean=[0.45] * 3, std=[0.225] * 3)


def _config(input_size: Sequence[int], mean: Sequence[float], std: Sequence[float],
            interpolation: str = "bilinear", crop_pct: float = 1.0,
            crop_mode: str = "center") -> DataConfig:
    """An image data config as JSON keeps it (lists, not tuples), ``mean``/``std`` per
    channel."""
    in_chans = int(input_size[0])
    mean, std = [float(m) for m in mean], [float(v) for v in std]
    if len(mean) != in_chans:  # RGB statistics for a grey model, or one value for all
        mean, std = [sum(mean) / len(mean)] * in_chans, [sum(std) / len(std)] * in_chans
    return dict(input_size=[int(v) for v in input_size], interpolation=str(interpolation),
                mean=mean, std=std, crop_pct=float(crop_pct), crop_mode=str(crop_mode))


def model_data_config(model: Any, input_size: Optional[Sequence[int]] = None) -> DataConfig:
    """The model's own image data config (timm's ``resolve_data_config`` of its
    ``pretrained_cfg``), at ``input_size`` = ``(C, H, W)`` (default: the model's)."""
    from timm.data import resolve_data_config

    c = resolve_data_config({}, model=model)
    return _config(input_size or c["input_size"], c["mean"], c["std"], c["interpolation"],
                   c["crop_pct"], c.get("crop_mode", "center"))


def eval_transform(config: DataConfig) -> Callable[[Any], torch.Tensor]:
    """The evaluation transform of an image data config (timm's ``create_transform``: resize
    to ``size / crop_pct``, centre crop, normalise), taking an image (PIL) to ``(C, H, W)``;
    for a 1-channel model, the image is made grey first."""
    from timm.data import create_transform
    from torchvision import transforms

    c = _config(config["input_size"], config["mean"], config["std"],
                config.get("interpolation", "bilinear"), config.get("crop_pct", 1.0),
                config.get("crop_mode", "center"))
    tf = create_transform(input_size=tuple(c["input_size"]), interpolation=c["interpolation"],
                          mean=tuple(c["mean"]), std=tuple(c["std"]), crop_pct=c["crop_pct"],
                          crop_mode=c["crop_mode"], is_training=False)
    if c["input_size"][0] == 1:
        tf = transforms.Compose([transforms.Grayscale(1), tf])
    return tf


def is_video_model(model: nn.Module) -> bool:
    """Whether ``model`` takes clips: its ``pretrained_cfg["input_size"]`` is ``(C, T, H, W)``."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return len(cfg.get("input_size") or ()) == 4


def video_data_config(model: nn.Module) -> DataConfig:
    """The data config of a video model (NOTE [ One data config ]), from its
    ``pretrained_cfg``: ``input_size`` (C, T, H, W) with square frames, ``frame_stride``
    (4 when the model names none), and ``mean`` and ``std`` per channel, as JSON keeps them."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    name = getattr(model, "model_name", type(model).__name__)
    size = [int(v) for v in cfg.get("input_size") or ()]
    if len(size) != 4 or size[2] != size[3] or min(size) < 1:
        raise ValueError(
            f"expected a video model, whose pretrained_cfg input_size is (C, T, H, W) with "
            f"square frames; {name} has {cfg.get('input_size')!r}"
        )
    stride = cfg.get("frame_stride", 4)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"expected {name}'s frame_stride an int >= 1, got {stride!r}")
    mean, std = [float(v) for v in cfg["mean"]], [float(v) for v in cfg["std"]]
    if len(mean) != size[0] or len(std) != size[0]:
        raise ValueError(
            f"expected {name}'s mean and std with one value per channel ({size[0]}), got "
            f"{mean} and {std}"
        )
    return dict(input_size=size, frame_stride=stride, mean=mean, std=std)
