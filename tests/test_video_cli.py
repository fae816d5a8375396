"""``pareprop eval`` on a video folder: top-1/top-5 over 5-clip averages, equal to the same
computation by hand; published weights from a file in PySlowFast's layout."""

from __future__ import annotations

import json

import pytest
import torch

import pareprop
from pareprop.cli import main as cli
from pareprop.data import VideoFolder

pytest.importorskip("av")

from test_video_data import write_video  # noqa: E402
from test_video_pretrained import TINY, _slowfast_file, slowfast_video_state  # noqa: E402

ARGS = [f"--model-arg={k}={json.dumps(v)}" for k, v in TINY.items()]


def test_eval_cli_on_a_video_folder(tmp_path, capsys):
    root = tmp_path / "val"
    for c in range(5):  # the file's 5 classes
        (root / f"class{c}").mkdir(parents=True)
        write_video(root / f"class{c}" / "v.mp4", frames=12, height=36, width=44, base=20 * c)
    weights = _slowfast_file(tmp_path / "REV_MVIT_B_16x4.pyth", slowfast_video_state())
    out = tmp_path / "result.json"
    rc = cli(["eval", "--model", "rev_mvit_base_16x4", "--checkpoint", str(weights),
              "--data-dir", str(root), "--device", "cpu", "--workers", "0", "--batch-size", "2",
              "--no-progress", "--json", str(out), *ARGS])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["videos"] == 5 and result["views"] == "5 clips x 1 crop"
    assert result["skipped"] == 0 and result["engine"] == "reversible"

    # By hand: the same model, 5 views per video, softmax averaged, top-1 / top-5.
    model = pareprop.create_model("rev_mvit_base_16x4", **TINY)
    pareprop.load_pretrained(model, weights)
    ds = VideoFolder(str(root), "eval", num_frames=4, frame_stride=4, num_clips=5,
                     crop_size=32)
    top1 = top5 = 0
    with torch.no_grad():
        for views, label in ds:
            scores = model.eval()(views).softmax(-1).mean(0)
            top1 += int(scores.argmax() == label)
            top5 += int(label in scores.topk(5).indices)
    assert result["top1"] == pytest.approx(100 * top1 / 5)
    assert result["top5"] == pytest.approx(100 * top5 / 5) == 100.0


def test_eval_cli_says_when_classes_differ(tmp_path, capsys):
    root = tmp_path / "val"
    (root / "only").mkdir(parents=True)
    write_video(root / "only" / "v.mp4", frames=8)
    weights = _slowfast_file(tmp_path / "w.pyth", slowfast_video_state())
    rc = cli(["eval", "--model", "rev_mvit_base_16x4", "--checkpoint", str(weights),
              "--data-dir", str(root), "--device", "cpu", "--workers", "0", "--no-progress",
              *ARGS])
    assert rc == 2 and "has 1 classes but the model predicts 5" in capsys.readouterr().err


def _video_splits(root, classes=2):
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for j in range(2 if split == "train" else 1):
                write_video(folder / f"v{j}.mp4", frames=10, height=36, width=40,
                            base=100 * c + 5 * j)
    return root


def test_train_cli_on_a_video_folder(tmp_path, capsys):
    from pareprop.cli.train import main as train

    root = _video_splits(tmp_path / "videos")
    (root / "train" / "class1" / "broken.mp4").write_bytes(b"truncated")
    small = [a for a in ARGS if "num_classes" not in a]
    argv = ["--model", "rev_mvit_base_16x4", "--dataset", str(root), "--epochs", "1",
            "--batch-size", "2", "--device", "cpu", "--workers", "0", "--no-progress",
            "--out", str(tmp_path / "run"), *small]
    with pytest.warns(UserWarning, match="broken.mp4"):
        rc = train(argv)
    assert rc == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics[0]["epoch"] == 1 and 0.0 <= metrics[0]["val_acc"] <= 1.0
    model = pareprop.load_model(str(tmp_path / "run" / "last"))
    assert model.num_classes == 2 and model.cfg.num_frames == 4


def test_train_grad_checkpointing_flag_checkpoints_the_transitions(tmp_path):
    from pareprop.cli.train import resolve_config
    from pareprop.trainer import Trainer

    root = _video_splits(tmp_path / "videos")
    small = [a for a in ARGS if "num_classes" not in a]
    cfg = resolve_config(["--model", "rev_mvit_base_16x4", "--dataset", str(root),
                          "--epochs", "1", "--max-steps", "1", "--batch-size", "2",
                          "--device", "cpu", "--workers", "0", "--no-progress",
                          "--grad-checkpointing", "--out", str(tmp_path / "run"), *small])
    trainer = Trainer(cfg)
    stages = trainer.model.stages
    assert [s.transition is not None for s in stages] == [False, True, True]
    assert all(s.grad_checkpointing for s in stages)
    assert trainer.fit()


def test_train_cli_says_which_split_is_missing(tmp_path, capsys):
    from pareprop.cli.train import main as train

    (tmp_path / "videos" / "train" / "a").mkdir(parents=True)
    write_video(tmp_path / "videos" / "train" / "a" / "v.mp4", frames=8)
    small = [a for a in ARGS if "num_classes" not in a]
    rc = train(["--model", "rev_mvit_base_16x4", "--dataset", str(tmp_path / "videos"),
                "--device", "cpu", "--out", str(tmp_path / "run"), *small])
    assert rc == 2 and "no val split" in capsys.readouterr().err


def test_bench_takes_num_frames():
    from pareprop.cli.bench import _config, build_parser

    args = build_parser().parse_args(["--models", "rev_mvit_base_16x4", "mvit_v1_b",
                                      "--num-frames", "8", "--img-size", "64"])
    config = _config(args)
    assert config.model_overrides == {"num_frames": 8} and config.img_size == 64
