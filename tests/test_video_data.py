"""Video data: clips sampled as published (16 x 4 at 30 fps, 5 evenly spaced views), train and
eval transforms, class folders and CSV lists, undecodable files skipped with a warning naming
them, multi-view top-k. The tests write their own tiny videos with PyAV; nothing is downloaded.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from pareprop.data import (
    UndecodableVideoWarning,
    VideoFolder,
    clip_indices,
    collate_videos,
    decode_video,
    require_av,
)
from pareprop.evaluate import evaluate_clips

av = pytest.importorskip("av")

FRAMES, H, W = 24, 40, 48  # a short side of 40, landscape
STEP = 10  # frame i is gray level STEP * i: the decoded level says which frame it was


def write_video(path, frames=FRAMES, height=H, width=W, fps=30, base=0):
    import numpy as np

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            level = min(base + STEP * i, 255)
            img = np.full((height, width, 3), level, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    for name, base in (("archery", 0), ("bowling", 5)):
        (root / name).mkdir()
        for j in range(2):
            write_video(root / name / f"{name}_{j}.mp4", base=base)
    return root


SMALL = dict(num_frames=4, frame_stride=2, num_clips=3, train_scale=(32, 36), crop_size=32,
             mean=(0.0,) * 3, std=(1.0,) * 3)


def test_decode_gives_rgb_frames_and_fps(folder):
    frames, fps = decode_video(str(folder / "archery" / "archery_0.mp4"))
    assert frames.shape == (FRAMES, H, W, 3) and frames.dtype == torch.uint8
    assert fps == 30.0
    levels = frames.float().mean(dim=(1, 2, 3))
    assert (levels - STEP * torch.arange(FRAMES)).abs().max() < 4  # lossy, but in order


def test_clip_indices_as_published():
    # A 10-second Kinetics video at 30 fps: 300 frames; a clip spans 64 of them.
    views = [clip_indices(300, 30.0, 16, 4, clip=(i, 5)) for i in range(5)]
    starts = [int(v[0]) for v in views]
    assert starts == [0, 47, 94, 141, 188]  # 236 * i / 5, truncated
    assert all(len(v) == 16 and int(v[-1] - v[0]) == 63 for v in views)
    assert torch.equal(views[0], torch.linspace(0, 63, 16).long())
    # At 15 fps the same 64/30 s spans 32 frames; a short video is clamped, never overrun.
    assert int(clip_indices(300, 15.0, 16, 4, clip=(0, 1))[-1]) == 31
    short = clip_indices(20, 30.0, 16, 4, clip=(2, 5))
    assert int(short.min()) == 0 and int(short.max()) == 19
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = clip_indices(300, 30.0, 16, 4, generator=generator)
        assert 0 <= int(idx[0]) <= 236 and int(idx[-1] - idx[0]) in (62, 63)


def test_train_clips_are_scaled_cropped_and_flipped(folder):
    ds = VideoFolder(str(folder), "train", **SMALL)
    assert ds.classes == ["archery", "bowling"] and len(ds) == 4
    torch.manual_seed(0)
    clip, label = ds[0]
    assert clip.shape == (3, 4, 32, 32) and label == 0
    levels = clip.mean(dim=(0, 2, 3)) * 255
    # 4 frames at stride 2 from a random start: levels STEP * (s, s+2, s+4, s+7) or so.
    steps = (levels[1:] - levels[:-1]) / STEP
    assert steps.min() > 1 and steps.max() < 3.5


def test_train_clips_follow_torchs_seed(folder):
    # NOTE [ Reproducible clips ]: they drew from Python's random, which the trainer never
    # seeded, so the same command trained on other clips each time.
    ds = VideoFolder(str(folder), "train", **SMALL)

    def clips(seed):
        torch.manual_seed(seed)
        return torch.stack([ds[i][0] for i in range(len(ds))])

    first = clips(0)
    assert torch.equal(clips(0), first)
    assert not torch.equal(clips(1), first)


def test_each_loader_worker_draws_its_own_reproducible_clips(folder):
    # Worker i is seeded by torch from one draw of the main generator (+ i): the loader is
    # reproducible from torch's seed, and two workers never draw the same crops.
    ds = VideoFolder(str(folder), "train", **SMALL)
    same_video = [0, 1]  # archery_0 and archery_1 hold the same frames

    def batches(seed):
        torch.manual_seed(seed)
        loader = DataLoader(torch.utils.data.Subset(ds, same_video), batch_size=1,
                            num_workers=2)
        return torch.cat([clip for clip, _ in loader])

    first = batches(0)
    assert torch.equal(batches(0), first)
    assert not torch.equal(first[0], first[1])


def test_eval_views_are_evenly_spaced_centre_crops(folder):
    ds = VideoFolder(str(folder), "eval", **SMALL)
    views, label = ds[2]
    assert views.shape == (3, 3, 4, 32, 32) and label == 1
    firsts = views[:, :, 0].mean(dim=(1, 2, 3)) * 255  # level of each view's first frame
    # span 8 of 24 frames: starts 16 * i / 3 -> 0, 5, 10
    expected = 5 + STEP * torch.tensor([0.0, 5.0, 10.0])
    assert (firsts - expected).abs().max() < 4
    again, _ = ds[2]
    assert torch.equal(again, views)  # evaluation is deterministic


def test_published_normalisation(folder):
    ds = VideoFolder(str(folder), "eval", num_frames=2, frame_stride=1, num_clips=1,
                     crop_size=32)
    views, _ = ds[0]
    raw = VideoFolder(str(folder), "eval", num_frames=2, frame_stride=1, num_clips=1,
                      crop_size=32, mean=(0.0,) * 3, std=(1.0,) * 3)[0][0]
    torch.testing.assert_close(views, (raw - 0.45) / 0.225)


def test_csv_lists_with_names_or_integers(folder, tmp_path):
    names = tmp_path / "train.csv"
    names.write_text(
        "path,label\n"
        f"{folder}/bowling/bowling_0.mp4,bowling\n"
        f"{folder}/archery/archery_1.mp4,archery\n"
    )
    ds = VideoFolder(str(names), "eval", **SMALL)
    assert ds.classes == ["archery", "bowling"] and [s[1] for s in ds.samples] == [1, 0]
    (tmp_path / "clips").mkdir()
    write_video(tmp_path / "clips" / "a.mp4")
    ints = tmp_path / "val.csv"
    ints.write_text("clips/a.mp4,3\n")  # relative to the CSV's folder
    ds = VideoFolder(str(ints), "train", **SMALL)
    assert ds.num_classes == 4 and ds[0][1] == 3 and ds[0][0].shape == (3, 4, 32, 32)
    bad = tmp_path / "bad.csv"
    bad.write_text("clips/a.mp4\n")
    with pytest.raises(ValueError, match="expected path,label"):
        VideoFolder(str(bad))


def test_undecodable_files_are_skipped_with_a_warning_naming_them(folder, tmp_path):
    root = tmp_path / "mixed"
    (root / "a").mkdir(parents=True)
    good = write_video(root / "a" / "good.mp4")
    broken = root / "a" / "broken.mp4"
    broken.write_bytes(good.read_bytes()[:200])  # a truncated download
    (root / "a" / "noise.avi").write_bytes(b"not a video at all")
    ds = VideoFolder(str(root), "train", **SMALL)
    assert len(ds) == 3
    loader = DataLoader(ds, batch_size=3, collate_fn=collate_videos)
    with pytest.warns(UndecodableVideoWarning) as caught:
        (batch,) = list(loader)
    named = " ".join(str(w.message) for w in caught)
    assert "broken.mp4" in named and "noise.avi" in named and "good.mp4" not in named
    clips, labels = batch
    assert clips.shape == (1, 3, 4, 32, 32)  # the good one only, no crash
    assert collate_videos([None, None]) is None
    # Substituting: the next decodable video takes the undecodable one's place.
    sub = VideoFolder(str(root), "train", on_error="substitute", **SMALL)
    with pytest.warns(UndecodableVideoWarning, match="broken.mp4"):
        clip, label = sub[[p for p, _ in sub.samples].index(str(broken))]
    assert clip.shape == (3, 4, 32, 32)
    with pytest.warns(UndecodableVideoWarning):
        assert len(list(sub)) == 3  # iteration ends
    with pytest.warns(UndecodableVideoWarning) as caught:
        bad = ds.probe(progress=False)
    assert len(caught) == 2
    assert sorted(p.rsplit("/", 1)[1] for p in bad) == ["broken.mp4", "noise.avi"]
    assert len(ds) == 1


def test_the_undecodable_warning_points_at_the_video_not_the_data_loader(tmp_path):
    # issue 39.6: the warning's location was torch's fetch.py, the DataLoader's line
    (tmp_path / "a").mkdir()
    broken = tmp_path / "a" / "broken.mp4"
    broken.write_bytes(b"not a video at all")
    loader = DataLoader(VideoFolder(str(tmp_path), "eval", **SMALL), collate_fn=collate_videos)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(loader) == [None]
    (w,) = [w for w in caught if w.category is UndecodableVideoWarning]
    shown = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
    assert w.filename == str(broken) and "fetch.py" not in shown, shown
    assert len(shown.strip().splitlines()) == 1  # no source line quoted under it


class _Brightness(nn.Module):
    """Class 0 for dark clips, 1 for bright ones (the scores of each view)."""

    def forward(self, x):
        m = x.mean(dim=(1, 2, 3, 4))
        return torch.stack([-m, m, torch.full_like(m, -100.0)], dim=-1)


def test_multi_view_top_k(folder, tmp_path):
    root = tmp_path / "two"
    for name, base in (("dark", 0), ("bright", 200)):
        (root / name).mkdir(parents=True)
        write_video(root / name / "v.mp4", frames=8, base=base)
    ds = VideoFolder(str(root), "eval", num_frames=2, frame_stride=1, num_clips=2,
                     crop_size=32)
    assert ds.classes == ["bright", "dark"]
    loader = DataLoader(ds, batch_size=2, collate_fn=collate_videos)
    result = evaluate_clips(_Brightness(), loader, topk=(1, 2))
    assert result == {"top1": 0.0, "top2": 100.0, "videos": 2.0}  # labels are swapped
    flipped = VideoFolder(str(root), "eval", num_frames=2, frame_stride=1, num_clips=2,
                          crop_size=32, classes=["dark", "bright"])
    loader = DataLoader(flipped, batch_size=1, collate_fn=collate_videos)
    for average in ("softmax", "logits"):
        assert evaluate_clips(_Brightness(), loader, average=average)["top1"] == 100.0


def test_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="root/<class>/<video>"):
        VideoFolder(str(tmp_path / "nowhere"))
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="no videos found"):
        VideoFolder(str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ImportError, match=r"pareprop\[video\]"):
        require_av()
