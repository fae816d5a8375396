"""Data for training and evaluation: the data config (``config``), image data sets
(``images``), video decoding and clip data sets (``video``), and COCO-format detection data
(``coco``, ``shapes``, ``detection_transforms``: imported by their module names, so that image
and video training loads neither pycocotools nor torchvision's transforms).
"""

from pareprop.data.config import (
    DATA_CONFIG_KEYS,
    PUBLISHED_CONFIG,
    DataConfig,
    MissingPackageError,
    eval_transform,
    is_video_model,
    model_data_config,
    video_data_config,
)
from pareprop.data.images import (
    DATASETS,
    DatasetNotFoundError,
    Datasets,
    build_datasets,
    cifar,
    digits,
    epoch_sampler,
    image_folder,
)
from pareprop.data.video import (
    VIDEO_EXTENSIONS,
    UndecodableVideoWarning,
    VideoFolder,
    clip_indices,
    collate_videos,
    decode_video,
    folder_options,
    require_av,
    video_dataset,
    video_splits,
)

__all__ = [
    # the data config
    "DATA_CONFIG_KEYS",
    "DataConfig",
    "MissingPackageError",
    "PUBLISHED_CONFIG",
    "eval_transform",
    "is_video_model",
    "model_data_config",
    "video_data_config",
    # images
    "DATASETS",
    "DatasetNotFoundError",
    "Datasets",
    "build_datasets",
    "cifar",
    "digits",
    "epoch_sampler",
    "image_folder",
    # video
    "VIDEO_EXTENSIONS",
    "UndecodableVideoWarning",
    "VideoFolder",
    "clip_indices",
    "collate_videos",
    "decode_video",
    "folder_options",
    "require_av",
    "video_dataset",
    "video_splits",
]
