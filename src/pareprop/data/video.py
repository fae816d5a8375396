"""Video data for the Kinetics models: decoding, clip sampling as published, and a video-folder
data set whose evaluation mode gives the published views ("1 crop x 5 clips", averaged by
:func:`pareprop.evaluate.evaluate_clips`).

Decoding goes through PyAV (``pip install 'pareprop[video]'``): its wheels bundle FFmpeg, so
nothing else needs installing, and it reads every container and codec FFmpeg does. See
docs/video.md for why PyAV rather than torchcodec.

NOTE [ Clips as published ]
PySlowFast's Kinetics recipe (``DATA`` and ``TEST`` of ``REV_MVIT_B_16x4_CONV.yaml``, with its
defaults), which :class:`VideoFolder` follows:

* a clip spans ``num_frames * frame_stride`` frames at 30 fps (16 x 4 = 64; a video of another
  frame rate spans the same time), and ``num_frames`` indices are spaced evenly over it
  (``linspace``, truncated, clamped to the video);
* training: the span starts anywhere (uniformly at random), the short side is scaled to a random
  size in [256, 320], a random 224 x 224 crop is taken and flipped left-right with probability
  1/2;
* evaluation: 5 spans spaced evenly over the video (start ``i * delta / 5``, delta the room
  left after one span), the short side scaled to 224 and the centre 224 x 224 crop of each; the
  model's scores of the 5 views are averaged (PySlowFast sums the softmax probabilities);
* pixels in [0, 1] normalised by mean 0.45 and std 0.225 on every channel.

Training draws (the span's start, the scale, the crop, the flip) come from torch's default
generator (NOTE [ Reproducible clips ]).

PySlowFast's yaml also turns on RandAugment, mixup/cutmix and random erasing for training; those
are training-recipe choices left to the caller here.

NOTE [ Reproducible clips ]
A training clip's random draws come from torch's default generator, as torchvision's random
transforms do (they once came from Python's ``random``, which nothing seeded: the same command
trained on other clips each time). The trainer seeds that generator from ``--seed`` and saves
its state in every checkpoint (NOTE [ Exact resume ] in pareprop/trainer/state.py), so a run
is reproducible and a resumed one draws what an uninterrupted one would. In DataLoader workers,
torch seeds each worker's generator from one draw of the main process's (``base_seed +
worker_id``): each worker draws its own clips, and the run stays reproducible for a given
``--workers`` (another number of workers deals the draws out differently). A generator held by
the data set would be copied into every worker, which would then all draw the same crops.

NOTE [ Undecodable files ]
A file that cannot be decoded (truncated downloads are common in Kinetics mirrors) is skipped
with a warning naming it, never a crash in the middle of an epoch. With ``on_error="drop"``
(evaluation) ``__getitem__`` returns ``None`` for it, and :func:`collate_videos` drops the
``None`` samples from the batch (a batch of none left is ``None``, which
:func:`pareprop.evaluate.evaluate_clips` skips): every video counted was seen once. With
``on_error="substitute"`` (training, and the trainer's validation) it returns the next
decodable video instead, as PySlowFast's loader retries another one: batches keep their size
and need no special collation.
:meth:`VideoFolder.probe` finds such files up front, with a progress bar.
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from pareprop.data.config import PUBLISHED_CONFIG, MissingPackageError, video_data_config

__all__ = [
    "UndecodableVideoWarning",
    "VIDEO_EXTENSIONS",
    "decode_video",
    "clip_indices",
    "VideoFolder",
    "collate_videos",
    "video_dataset",
    "video_splits",
    "folder_options",
    "require_av",
]

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg")
TARGET_FPS = 30.0  # PySlowFast's DATA.TARGET_FPS: clip spans are counted at this rate


class UndecodableVideoWarning(UserWarning):
    """A video file could not be decoded and was skipped."""


def require_av() -> Any:
    """The ``av`` module (PyAV), or an error that says how to install it."""
    try:
        import av
    except ImportError:
        raise MissingPackageError(
            "video decoding needs PyAV: pip install 'pareprop[video]' (or pip install av); "
            "its wheels bundle FFmpeg"
        ) from None
    return av


def decode_video(path: str) -> Tuple[torch.Tensor, float]:
    """All frames of the first video stream of ``path``.

    Returns:
        ``(frames, fps)``: frames ``(N, H, W, 3)`` uint8 RGB, and the stream's frame rate.

    Raises:
        ValueError: the file cannot be decoded, or holds no video frames.
    """
    av = require_av()
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else TARGET_FPS
            frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in
                      container.decode(stream)]
    except ValueError:
        raise
    except Exception as e:  # PyAV raises its own FFmpeg error types, OSError, EOFError...
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not frames:
        raise ValueError("no frames decoded")
    return torch.stack(frames), fps  # (N, H, W, 3)


def clip_indices(
    num_video_frames: int,
    fps: float,
    num_frames: int,
    frame_stride: int,
    clip: Optional[Tuple[int, int]] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Frame indices of one clip (NOTE [ Clips as published ]).

    Args:
        num_video_frames: frames in the video.
        fps: its frame rate (a span of ``num_frames * frame_stride`` frames at 30 fps).
        num_frames: frames per clip.
        frame_stride: sampling stride at 30 fps.
        clip: ``(i, n)``: the i-th of n evenly spaced clips; ``None``: a random start.
        generator: the random source for a random start (default: torch's default one, NOTE
            [ Reproducible clips ]).
    """
    span = num_frames * frame_stride * fps / TARGET_FPS
    delta = max(num_video_frames - span, 0.0)
    if clip is None:
        start = delta * _uniform(generator)
    else:
        i, n = clip
        start = delta * i / n
    index = torch.linspace(start, start + span - 1, num_frames)
    return index.clamp(0, num_video_frames - 1).long()


def folder_options(config: Dict[str, Any]) -> Dict[str, Any]:
    """The :class:`VideoFolder` options of a video data config (NOTE [ One data config ] in
    pareprop/data/config.py): ``num_frames``, ``frame_stride``, ``crop_size``, ``mean`` and
    ``std``."""
    _, frames, side, _ = config["input_size"]
    return dict(num_frames=int(frames), frame_stride=int(config["frame_stride"]),
                crop_size=int(side), mean=tuple(config["mean"]), std=tuple(config["std"]))


def _uniform(generator: Optional[torch.Generator] = None) -> float:
    """A draw from [0, 1) (torch's default generator unless one is given)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _randint(low: int, high: int) -> int:
    """A draw from ``low..high``, both included, from torch's default generator."""
    return int(torch.randint(low, high + 1, ()))


def _scale_short_side(frames: torch.Tensor, size: int) -> torch.Tensor:
    """``(T, C, H, W)`` float, resized (bilinear) so that its short side is ``size``."""
    H, W = frames.shape[-2:]
    if min(H, W) == size:
        return frames
    if H <= W:
        new = (size, max(1, int(math.floor(W * size / H))))
    else:
        new = (max(1, int(math.floor(H * size / W))), size)
    return F.interpolate(frames, size=new, mode="bilinear", align_corners=False)


def _crop(frames: torch.Tensor, size: int, top: int, left: int) -> torch.Tensor:
    return frames[..., top: top + size, left: left + size]


class VideoFolder(Dataset):
    """Labelled videos from class folders (``root/<class>/<video>``, as Kinetics is laid out)
    or from a CSV file of ``path,label`` rows (as Kinetics' annotations; paths relative to the
    CSV's folder, labels class names or integers, an optional ``path,label`` header).

    ``mode="train"`` gives one clip ``(C, T, H, W)`` per video, randomly placed, scaled, cropped
    and flipped; ``mode="eval"`` gives ``num_clips`` views ``(V, C, T, H, W)``; ``mode="val"``
    one view ``(C, T, H, W)``, the centre crop of the middle span (a quick validation in
    training). Each returns ``(clip, label)``; for a file that cannot be decoded, ``None`` or
    another video (``on_error``, NOTE [ Undecodable files ]): with ``"drop"`` use
    :func:`collate_videos` as the loader's ``collate_fn``.

    Args:
        source: a folder of class folders, or a CSV file.
        mode: ``"train"`` or ``"eval"``.
        num_frames: frames per clip (16).
        frame_stride: sampling stride at 30 fps (4).
        num_clips: views per video in ``eval`` mode (5).
        train_scale: range of the random short side in training (256, 320).
        crop_size: side of the square crop (224); in evaluation also the short side.
        mean: per-channel mean of pixels in [0, 1].
        std: per-channel std.
        classes: class names in label order (default: sorted folder names, or the CSV's sorted
            names; integer CSV labels are used as they are).
        on_error: ``"drop"`` (return ``None``) or ``"substitute"`` (the next decodable video)
            for a file that cannot be decoded; either way a warning names it.
    """

    def __init__(
        self,
        source: str,
        mode: str = "train",
        num_frames: int = 16,
        frame_stride: int = 4,
        num_clips: int = 5,
        train_scale: Tuple[int, int] = (256, 320),
        crop_size: int = 224,
        mean: Sequence[float] = (0.45, 0.45, 0.45),
        std: Sequence[float] = (0.225, 0.225, 0.225),
        classes: Optional[Sequence[str]] = None,
        on_error: str = "drop",
    ):
        if mode not in ("train", "val", "eval"):
            raise ValueError(f"expected mode 'train', 'val' or 'eval', got {mode!r}")
        if on_error not in ("drop", "substitute"):
            raise ValueError(f"expected on_error 'drop' or 'substitute', got {on_error!r}")
        self.on_error = on_error
        if num_frames < 1 or frame_stride < 1 or num_clips < 1:
            raise ValueError(
                f"expected num_frames, frame_stride and num_clips >= 1, got {num_frames}, "
                f"{frame_stride}, {num_clips}"
            )
        if not (crop_size <= train_scale[0] <= train_scale[1]) and mode == "train":
            raise ValueError(
                f"expected crop_size <= train_scale[0] <= train_scale[1], got crop_size "
                f"{crop_size} and train_scale {tuple(train_scale)}"
            )
        self.source, self.mode = os.fspath(source), mode
        self.num_frames, self.frame_stride, self.num_clips = num_frames, frame_stride, num_clips
        self.train_scale, self.crop_size = tuple(train_scale), crop_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1, 1)  # (C, 1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1, 1)
        if os.path.isdir(self.source):
            self.samples, self.classes = _scan_folders(self.source, classes)
        elif os.path.isfile(self.source):
            self.samples, self.classes = _read_csv(self.source, classes)
        else:
            raise FileNotFoundError(
                f"no video folder or CSV at {self.source!r}; expected root/<class>/<video> "
                "folders or a CSV of path,label rows"
            )
        if not self.samples:
            raise ValueError(
                f"no videos found in {self.source!r} (extensions {', '.join(VIDEO_EXTENSIONS)})"
            )
        self.skipped: List[str] = []  # files found undecodable in this process

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def _skip(self, path: str, err: Exception) -> None:
        if path not in self.skipped:
            self.skipped.append(path)
        # Located at the video itself: any stack level names a DataLoader line (fetch.py, or a
        # worker's loop), which says nothing of what is wrong. The registry shows each message
        # once per process under the default filter, as warnings.warn would.
        warnings.warn_explicit(
            f"skipping {path}: cannot decode it ({err})", UndecodableVideoWarning, path, 0,
            module=__name__, registry=globals().setdefault("__warningregistry__", {}),
        )

    def __getitem__(self, index: int) -> Optional[Tuple[torch.Tensor, int]]:
        if not -len(self.samples) <= index < len(self.samples):
            raise IndexError(f"video {index} of {len(self.samples)}")  # ends iteration
        for attempt in range(len(self.samples)):
            path, label = self.samples[(index + attempt) % len(self.samples)]
            try:
                frames, fps = decode_video(path)
            except ValueError as e:
                self._skip(path, e)
                if self.on_error == "drop":
                    return None
                continue
            if self.mode == "train":
                return self._train_clip(frames, fps), label
            if self.mode == "val":
                return self._eval_clip(frames, fps, 1, 2), label  # the middle span
            views = [self._eval_clip(frames, fps, i, self.num_clips)
                     for i in range(self.num_clips)]
            return torch.stack(views), label  # (V, C, T, H, W)
        raise ValueError(f"no video in {self.source!r} can be decoded")

    def _normalise(self, frames: torch.Tensor) -> torch.Tensor:
        """``(T, H, W, 3)`` uint8 -> ``(T, 3, H, W)`` float in [0, 1]."""
        return frames.permute(0, 3, 1, 2).float() / 255

    def _finish(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.transpose(0, 1)  # (C, T, H, W)
        return (x - self.mean) / self.std

    def _train_clip(self, frames: torch.Tensor, fps: float) -> torch.Tensor:
        index = clip_indices(len(frames), fps, self.num_frames, self.frame_stride)
        x = self._normalise(frames[index])  # (T, C, H, W)
        x = _scale_short_side(x, _randint(*self.train_scale))
        H, W = x.shape[-2:]
        x = _crop(x, self.crop_size, _randint(0, H - self.crop_size),
                  _randint(0, W - self.crop_size))
        if _uniform() < 0.5:
            x = x.flip(-1)
        return self._finish(x)

    def _eval_clip(self, frames: torch.Tensor, fps: float, i: int, n: int) -> torch.Tensor:
        index = clip_indices(len(frames), fps, self.num_frames, self.frame_stride, clip=(i, n))
        x = _scale_short_side(self._normalise(frames[index]), self.crop_size)
        H, W = x.shape[-2:]
        x = _crop(x, self.crop_size, (H - self.crop_size) // 2, (W - self.crop_size) // 2)
        return self._finish(x)

    def probe(self, progress: bool = True) -> List[str]:
        """Try to decode every file; drop the ones that fail from the data set (each named in a
        warning) and return their paths. Decoding a whole data set takes long: a progress bar
        shows it."""
        from tqdm.auto import tqdm

        bad = []
        for path, _ in tqdm(self.samples, desc="probing videos", unit="video",
                            disable=not progress):
            try:
                decode_video(path)
            except ValueError as e:
                self._skip(path, e)
                bad.append(path)
        dropped = set(bad)
        self.samples = [s for s in self.samples if s[0] not in dropped]
        return bad


def _scan_folders(
    root: str, classes: Optional[Sequence[str]]
) -> Tuple[List[Tuple[str, int]], List[str]]:
    names = sorted(d.name for d in os.scandir(root) if d.is_dir())
    classes = list(classes) if classes is not None else names
    index = {c: i for i, c in enumerate(classes)}
    samples = []
    for name in names:
        if name not in index:
            raise ValueError(f"folder {name!r} in {root!r} is not among the given classes")
        folder = os.path.join(root, name)
        for dirpath, _, files in sorted(os.walk(folder)):
            for f in sorted(files):
                if f.lower().endswith(VIDEO_EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), index[name]))
    return samples, classes


def _read_csv(
    path: str, classes: Optional[Sequence[str]]
) -> Tuple[List[Tuple[str, int]], List[str]]:
    base = os.path.dirname(os.path.abspath(path))
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    if rows and [c.strip().lower() for c in rows[0][:2]] == ["path", "label"]:
        rows = rows[1:]
    for n, row in enumerate(rows, 1):
        if len(row) < 2:
            raise ValueError(f"{path}: row {n} is {row!r}; expected path,label")
    labels = [r[1].strip() for r in rows]
    numeric = all(lbl.lstrip("-").isdigit() for lbl in labels)
    if classes is not None:
        classes = list(classes)
    elif numeric:
        classes = [str(i) for i in range(max((int(lbl) for lbl in labels), default=-1) + 1)]
    else:
        classes = sorted(set(labels))
    index = {c: i for i, c in enumerate(classes)}
    samples = []
    for (file, _), lbl in zip(rows, labels):
        file = file.strip()
        label = int(lbl) if numeric else index.get(lbl)
        if label is None or not 0 <= label < len(classes):
            raise ValueError(f"{path}: label {lbl!r} of {file!r} is not among {len(classes)} "
                             "classes")
        samples.append((file if os.path.isabs(file) else os.path.join(base, file), label))
    return samples, classes


def video_splits(
    path: str, config: Optional[Dict[str, Any]] = None, augment: bool = True
) -> Tuple[VideoFolder, VideoFolder]:
    """Training and validation sets of ``path`` for the trainer: ``path/train`` and
    ``path/val`` (class folders, or ``.csv`` files of ``path,label`` rows), sampled and
    normalised by the data config ``config`` (the model's ``video_data_config``; default: the
    published 16 x 4 clips at 224 px; NOTE [ One data config ] in pareprop/data/config.py).
    Training clips as published (the scale range 256-320 follows the crop: 8/7 to 10/7 of it);
    validation one centre view per video. Undecodable files are substituted (NOTE
    [ Undecodable files ])."""
    def split(name: str) -> str:
        for candidate in (os.path.join(path, name), os.path.join(path, name + ".csv")):
            if os.path.exists(candidate):
                return candidate
        raise FileNotFoundError(
            f"no {name} split in {path!r}: expected {name}/ (class folders of videos) or "
            f"{name}.csv (path,label rows)"
        )

    options = folder_options(config or PUBLISHED_CONFIG)
    crop_size = options["crop_size"]
    scale = (round(crop_size * 256 / 224), round(crop_size * 320 / 224))
    common = dict(options, train_scale=scale, on_error="substitute")
    train = VideoFolder(split("train"), "train" if augment else "val", **common)
    val = VideoFolder(split("val"), "val", classes=train.classes, **common)
    return train, val


def collate_videos(batch: List[Any]) -> Any:
    """``default_collate`` of the samples that decoded (NOTE [ Undecodable files ]); ``None``
    when none did."""
    batch = [b for b in batch if b is not None]
    return default_collate(batch) if batch else None


def video_dataset(model: nn.Module, source: str, mode: str, **kwargs: Any) -> VideoFolder:
    """A :class:`VideoFolder` shaped for ``model`` by its data config (``video_data_config``:
    frames, frame stride, crop size, mean and std), as the trainer's are."""
    options = folder_options(video_data_config(model))
    options.update(kwargs)
    return VideoFolder(source, mode, **options)
