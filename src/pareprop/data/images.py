"""Data sets for ``pareprop train``: scikit-learn digits (offline default), CIFAR, image folders.

Every builder returns a :class:`Datasets` of a training set, a validation set and the number of
classes, with images already shaped for the model: ``(C, H, W)`` float tensors of the model's
input size and channel count. Shuffling is NOT done here: the trainer draws each epoch's order
from ``(seed, epoch)`` (see :func:`epoch_sampler`) so a resumed run sees the same order as an
uninterrupted one.

The data config each builder reports is NOTE [ One data config ] (pareprop/data/config.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler

from pareprop.data.config import (
    PUBLISHED_CONFIG,
    DataConfig,
    _config,
    eval_transform,
)
from pareprop.data.video import video_splits

__all__ = [
    "Datasets",
    "DatasetNotFoundError",
    "build_datasets",
    "digits",
    "cifar",
    "image_folder",
    "epoch_sampler",
    "DATASETS",
]

DATASETS = ("digits", "cifar10", "cifar100")

# Channel statistics of the training sets, used for normalisation (training from scratch, so the
# data's own statistics rather than ImageNet's).
_CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class DatasetNotFoundError(FileNotFoundError):
    """A data set is not on disk and ``download`` was not asked for."""


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int
    name: str
    # The data config of the validation transform (NOTE [ One data config ]).
    data_config: Optional[DataConfig] = None


class _TensorImages(Dataset):
    """Images held in memory as one ``(N, C, H, W)`` tensor, with an optional per-sample
    transform (random crop and flip use torch's global RNG, which the trainer saves and
    restores for exact resumes)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


def _match_channels(x: torch.Tensor, in_chans: int) -> torch.Tensor:
    """Repeat a 1-channel batch ``(N, 1, H, W)`` to ``in_chans``, or average RGB down to 1."""
    c = x.shape[1]
    if c == in_chans:
        return x
    if c == 1:
        return x.expand(-1, in_chans, -1, -1).contiguous()
    if in_chans == 1:
        return x.mean(dim=1, keepdim=True)
    raise ValueError(f"cannot map images with {c} channels to a model with {in_chans} channels")


def _random_crop_flip(
    size: int, padding: int, flip: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    # torchvision is slow to import: loaded by the datasets that use it, not by the trainer.
    from torchvision.transforms import v2

    steps = [v2.RandomCrop(size, padding=padding, padding_mode="constant")]
    if flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps)


def digits(
    img_size: int = 32,
    in_chans: int = 3,
    val_fraction: float = 0.2,
    seed: int = 0,
    augment: bool = True,
) -> Datasets:
    """The 1797 handwritten 8x8 digits that scikit-learn ships: real data, no download.

    The images are resized (bilinear) to ``img_size`` and repeated to ``in_chans`` channels, then
    normalised by the training split's mean and standard deviation. The train/validation split
    is fixed by ``seed`` and stratified by nothing: 1797 is enough for every class to appear.
    Training augmentation is a random shift of up to one source pixel (no flip: a mirrored digit
    is another symbol).
    """
    # scikit-learn is slow to import and only this dataset needs it.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.long)
    if img_size != 8:
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    x = _match_channels(x, in_chans)  # (N, C, H, W)

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_val = max(1, int(round(val_fraction * len(y))))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std

    shift = max(1, img_size // 8)
    transform = _random_crop_flip(img_size, shift, flip=False) if augment else None
    # Constant padding pads with 0, which after normalisation is the mean, not the background;
    # pad the normalised background value instead by shifting so the background sits at 0.
    background = float(-mean / std)
    if transform is not None:
        transform = _ShiftedPad(transform, background)
    return Datasets(
        train=_TensorImages(x[train_idx], y[train_idx], transform),
        val=_TensorImages(x[val_idx], y[val_idx]),
        num_classes=10,
        name="digits",
        data_config=_config((in_chans, img_size, img_size), [float(mean)], [float(std)]),
    )


class _ShiftedPad:
    """Apply ``transform`` with the background moved to 0, so zero padding is background."""

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor], background: float):
        self.transform, self.background = transform, background

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.transform(x - self.background) + self.background


def _missing(name: str, where: str, how: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"{name} not found in {where!r}; {how} "
        f"(or train offline on the built-in digits with --dataset digits)"
    )


def cifar(
    name: str = "cifar10",
    data_dir: str = "data",
    download: bool = False,
    img_size: int = 32,
    in_chans: int = 3,
    augment: bool = True,
    data_config: Optional[DataConfig] = None,
) -> Datasets:
    """CIFAR-10 or CIFAR-100 from ``data_dir`` through torchvision (the official test split is
    the validation set). Training augmentation: random crop with 4 pixels of padding and a
    horizontal flip; both splits are normalised by the training set's channel statistics, or
    by ``data_config``'s (a pretrained model's), resized with its interpolation."""
    # torchvision is slow to import: loaded by the datasets that use it, not by the trainer.
    import torchvision
    from torchvision.transforms import v2

    if name not in _CIFAR_STATS:
        raise ValueError(f"expected cifar10 or cifar100, got {name!r}")
    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    folder = cls.base_folder
    if not download and not os.path.isdir(os.path.join(data_dir, folder)):
        raise _missing(
            name,
            os.path.join(data_dir, folder),
            f"pass --download to fetch it into {data_dir!r} with torchvision, or unpack "
            f"{cls.filename} from {cls.url} there",
        )
    size = (in_chans, img_size, img_size)
    if data_config is None:
        config = _config(size, *_CIFAR_STATS[name])
    else:  # the whole image, resized: CIFAR's own crop_pct
        config = _config(size, data_config["mean"], data_config["std"],
                         data_config["interpolation"])
    common = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if in_chans == 1:
        common.append(v2.Grayscale(1))
    if img_size != 32:
        mode = v2.InterpolationMode(config["interpolation"])
        common.append(v2.Resize(img_size, interpolation=mode, antialias=True))
    tail = [v2.Normalize(config["mean"], config["std"])]
    aug = [v2.RandomCrop(img_size, padding=img_size // 8), v2.RandomHorizontalFlip()]
    train_tf = v2.Compose(common + (aug if augment else []) + tail)
    val_tf = v2.Compose(common + tail)
    try:
        train = cls(data_dir, train=True, transform=train_tf, download=download)
        val = cls(data_dir, train=False, transform=val_tf, download=download)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
        raise _missing(name, data_dir, f"torchvision said: {e}; pass --download") from e
    return Datasets(train=train, val=val, num_classes=len(train.classes), name=name,
                    data_config=config)


def image_folder(
    path: str,
    img_size: int = 224,
    in_chans: int = 3,
    val_fraction: float = 0.1,
    seed: int = 0,
    augment: bool = True,
    data_config: Optional[DataConfig] = None,
) -> Datasets:
    """An image folder (``path/<class>/<image>``, or ``path/train`` and ``path/val`` each laid
    out so) through ``torchvision.datasets.ImageFolder``. Without ``train``/``val`` folders a
    fixed fraction is held out by ``seed``. Training: random resized crop and flip; validation:
    :func:`eval_transform` of ``data_config`` (a pretrained model's), by default ImageNet's
    statistics, bilinear, resize to 8/7 of the size and centre crop."""
    # torchvision is slow to import: loaded by the datasets that use it, not by the trainer.
    import torchvision
    from torchvision.transforms import v2

    if not os.path.isdir(path):
        raise _missing("image folder", path, "give a folder laid out as <class>/<image>")
    size = (in_chans, img_size, img_size)
    if data_config is None:
        config = _config(size, *_IMAGENET_STATS, crop_pct=0.875)
    else:
        config = _config(size, data_config["mean"], data_config["std"],
                         data_config["interpolation"], data_config["crop_pct"],
                         data_config.get("crop_mode", "center"))
    mode = v2.InterpolationMode(config["interpolation"])
    head = [v2.ToImage()]
    if in_chans == 1:
        head.append(v2.Grayscale(1))
    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(config["mean"], config["std"])]
    if augment:
        aug = [v2.RandomResizedCrop(img_size, interpolation=mode, antialias=True),
               v2.RandomHorizontalFlip()]
    else:
        aug = [v2.Resize(img_size, interpolation=mode, antialias=True), v2.CenterCrop(img_size)]
    train_tf = v2.Compose(head + aug + tail)
    val_tf = eval_transform(config)

    def load(folder: str, transform: Callable) -> torchvision.datasets.ImageFolder:
        try:
            return torchvision.datasets.ImageFolder(folder, transform=transform)
        except FileNotFoundError as e:  # no class folders, or no images in them
            raise _missing(
                "image folder", folder, f"give a folder laid out as <class>/<image> ({e})"
            ) from e

    train_dir, val_dir = os.path.join(path, "train"), os.path.join(path, "val")
    if os.path.isdir(train_dir) and os.path.isdir(val_dir):
        train = load(train_dir, train_tf)
        val = load(val_dir, val_tf)
        if val.classes != train.classes:
            raise ValueError(
                f"expected the same classes in {train_dir!r} and {val_dir!r}, got "
                f"{len(train.classes)} and {len(val.classes)} different ones"
            )
        num_classes = len(train.classes)
    else:
        full_train = load(path, train_tf)
        full_val = load(path, val_tf)
        if len(full_train) < 2:
            raise ValueError(
                f"expected at least 2 images in {path!r} (one to train on, one to validate), "
                f"got {len(full_train)}"
            )
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(full_train), generator=g).tolist()
        n_val = max(1, int(round(val_fraction * len(perm))))
        train = torch.utils.data.Subset(full_train, perm[n_val:])
        val = torch.utils.data.Subset(full_val, perm[:n_val])
        num_classes = len(full_train.classes)
    return Datasets(train=train, val=val, num_classes=num_classes, name=os.path.basename(path),
                    data_config=config)


def build_datasets(
    name: str,
    input_size: Sequence[int],
    data_dir: str = "data",
    download: bool = False,
    seed: int = 0,
    augment: bool = True,
    data_config: Optional[DataConfig] = None,
) -> Datasets:
    """Data set by name (``digits``, ``cifar10``, ``cifar100``) or an image folder path, shaped
    for a model whose ``pretrained_cfg["input_size"]`` is ``input_size`` = ``(C, H, W)``,
    normalised by ``data_config`` (NOTE [ One data config ]; digits keep their own
    statistics) or, when None, by the data set's statistics; for a video model
    (``(C, T, H, W)``) a video folder with ``train`` and ``val`` splits
    (:func:`pareprop.data.video.video_splits`), sampled and normalised by ``data_config`` (the
    model's, :func:`pareprop.data.config.video_data_config`), by default as published."""
    if len(input_size) == 4:
        return _video_datasets(name, input_size, augment, data_config)
    if len(input_size) != 3 or input_size[1] != input_size[2]:
        raise ValueError(f"expected a square input size (C, H, W), got {tuple(input_size)}")
    in_chans, img_size = int(input_size[0]), int(input_size[1])
    if name == "digits":
        return digits(img_size, in_chans, seed=seed, augment=augment)
    if name in _CIFAR_STATS:
        return cifar(name, data_dir, download, img_size, in_chans, augment, data_config)
    if os.sep in name or os.path.isdir(name):
        return image_folder(name, img_size, in_chans, seed=seed, augment=augment,
                            data_config=data_config)
    raise ValueError(
        f"expected --dataset digits, cifar10, cifar100 or a path to an image folder, got {name!r}"
    )


def _video_datasets(name: str, input_size: Sequence[int], augment: bool,
                    data_config: Optional[DataConfig]) -> Datasets:
    if name == "digits" or name in _CIFAR_STATS:
        raise ValueError(
            f"--dataset {name} holds images, and the model takes clips {tuple(input_size)}: "
            "give a folder of videos with train/ and val/ splits, or an image model"
        )
    config = dict(data_config or dict(PUBLISHED_CONFIG, input_size=list(input_size)))
    if [int(v) for v in config["input_size"]] != [int(v) for v in input_size]:
        raise ValueError(
            f"expected the data config's input_size to be the model's {tuple(input_size)}, "
            f"got {tuple(config['input_size'])}"
        )
    try:
        train, val = video_splits(name, config, augment)
    except FileNotFoundError as e:
        raise DatasetNotFoundError(str(e)) from None
    return Datasets(train=train, val=val, num_classes=train.num_classes,
                    name=os.path.basename(os.path.normpath(name)), data_config=config)


def epoch_sampler(
    dataset: Dataset,
    seed: int,
    shuffle: bool = True,
    num_replicas: int = 1,
    rank: int = 0,
    drop_last: bool = False,
) -> DistributedSampler:
    """A sampler whose order is a function of ``(seed, epoch)`` only (call ``set_epoch``).

    One process is the ``num_replicas=1`` case of distributed sampling, so single-process and
    multi-process runs share one code path, and a resumed run needs no sampler state.
    """
    return DistributedSampler(
        dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
