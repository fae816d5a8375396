"""`pareprop train --task detection` and `pareprop eval` of its checkpoints (docs/detection.md,
"Training and evaluation"): a tiny Mask R-CNN on a tiny shapes set, a few steps."""

import json
import os
import sys

import pytest
import torch

from pareprop.checkpoint import CheckpointError, load_checkpoint, load_model
from pareprop.cli.bench import main as bench_main
from pareprop.cli.eval import main as eval_main
from pareprop.cli.plan import main as plan_main
from pareprop.cli.train import main as train_main
from pareprop.cli.train import resolve_config
from pareprop.data.shapes import write_shapes
from pareprop.evaluate_detection import load_detector
from pareprop.trainer import DETECTION_DEFAULTS, TIMING_KEYS, TrainConfig

pytest.importorskip("pycocotools")

# A detector whose step takes well under a second: a 4-block Rev-MViTv2 of width 16 on 64x64
# images, a 32-channel pyramid, the small heads and few proposals.
TINY = dict(
    backbone_args=dict(embed_dim=16, depth=4, last_block_indexes=[0, 1, 2, 3], window_size=8,
                       kv_stride=2, img_size=64),
    fpn_channels=32, heads="small", min_size=64, max_size=64,
    rpn_pre_nms_top_n_train=50, rpn_post_nms_top_n_train=20, rpn_pre_nms_top_n_test=50,
    rpn_post_nms_top_n_test=20, box_batch_size_per_image=16, rpn_batch_size_per_image=32,
    box_detections_per_img=10,
)
AP_KEYS = {"bbox_AP", "bbox_AP50", "bbox_AP75", "segm_AP", "segm_AP50", "segm_AP75"}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes(str(tmp_path_factory.mktemp("shapes")), num_train=4, num_val=2,
                        image_size=64)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps({"model_kwargs": TINY}))
    return str(path)


def _train(shapes, config_file, out, *argv):
    return train_main(["--task", "detection", "--dataset", shapes, "--config", config_file,
                       "--batch-size", "2", "--lr", "1e-3", "--out", str(out), "--no-progress",
                       *argv])


def _records(out, kind="epoch"):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in records if r["type"] == kind]


@pytest.fixture(scope="module")
def run(shapes, config_file, tmp_path_factory):
    """One epoch of two steps."""
    out = tmp_path_factory.mktemp("det") / "run"
    assert _train(shapes, config_file, out, "--epochs", "1") == 0
    return out


def test_train_writes_ap_losses_checkpoint_and_picture(run):
    (epoch,) = _records(run)
    assert AP_KEYS <= set(epoch)
    assert all(0.0 <= epoch[k] <= 1.0 for k in AP_KEYS)
    # The summed loss and each of torchvision's, averaged over the epoch.
    losses = {k for k in epoch if k.startswith("train_loss_")}
    assert losses == {"train_loss_classifier", "train_loss_box_reg", "train_loss_mask",
                      "train_loss_objectness", "train_loss_rpn_box_reg"}
    assert epoch["train_loss"] == pytest.approx(sum(epoch[k] for k in losses), rel=1e-6)
    (summary,) = _records(run, "summary")
    assert summary["best_bbox_AP"] == epoch["bbox_AP"] and summary["model"] == \
        DETECTION_DEFAULTS["model"]
    assert os.path.getsize(run / "predictions.png") > 0
    meta = load_checkpoint(run / "best", train_state=False).meta
    assert meta["model"]["detector"]["arch"] == "maskrcnn"
    assert meta["data_config"]["task"] == "detection"
    assert meta["metrics"]["bbox_AP"] == epoch["bbox_AP"]


def test_eval_reproduces_the_runs_ap(run, shapes, tmp_path, capsys):
    (epoch,) = _records(run)
    capsys.readouterr()
    # No --data-dir: the run's own validation data, from its checkpoint.
    assert eval_main(["--checkpoint", str(run / "best"), "--no-progress", "--workers", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {k: result[k] for k in AP_KEYS} == {k: epoch[k] for k in AP_KEYS}
    out = tmp_path / "ap.json"
    assert eval_main(["--checkpoint", str(run / "best"), "--data-dir", shapes, "--no-progress",
                      "--workers", "0", "--json", str(out)]) == 0
    assert {k: json.loads(out.read_text())[k] for k in AP_KEYS} == {k: epoch[k] for k in AP_KEYS}


def test_checkpoint_rebuilds_the_detector_from_its_spec(run):
    model = load_detector(str(run / "best"))
    weights = load_checkpoint(run / "best", train_state=False).state_dict
    own = model.state_dict()
    assert set(own) == set(weights)
    assert all(torch.equal(own[k], weights[k]) for k in weights)
    with pytest.raises(CheckpointError, match="load_detector"):
        load_model(run / "best")


@pytest.mark.parametrize("argv, message", [
    (["--task", "segmentation"], "expected --task one of classification, detection, got "
                                 "'segmentation'"),
    (["--task", "detection", "--dataset", "digits"], "classification data set 'digits'"),
    (["--task", "detection", "--model", "rev_vit_tiny_patch4_32"], "named ARCH:BACKBONE"),
    (["--task", "detection", "--fsdp"], "--fsdp is for classification runs"),
])
def test_bad_detection_options_are_one_line(argv, message, tmp_path, capsys):
    assert train_main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_classification_folder_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "images"
    (folder / "cat").mkdir(parents=True)
    assert train_main(["--task", "detection", "--dataset", str(folder), "--out",
                       str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no COCO layout" in err and len(err.strip().splitlines()) == 1


def test_detection_defaults_leave_classification_alone():
    cfg = resolve_config(["--task", "detection"])
    assert (cfg.model, cfg.dataset, cfg.augment) == (DETECTION_DEFAULTS["model"], "shapes", False)
    assert cfg.model_kwargs["heads"] == "small"  # the shapes preset
    assert resolve_config(["--task", "detection", "--epochs", "3"]).epochs == 3
    plain = resolve_config([])
    assert (plain.task, plain.model, plain.dataset) == ("classification", TrainConfig().model,
                                                         "digits")


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(shapes, config_file, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert _train(shapes, config_file, full, "--epochs", "2") == 0
    assert _train(shapes, config_file, part, "--epochs", "2", "--stop-after-epochs", "1") == 0
    assert train_main(["--resume", str(part), "--no-progress"]) == 0
    assert _records(part) == _records(full)
    a = load_checkpoint(part / "last", train_state=False).state_dict
    b = load_checkpoint(full / "last", train_state=False).state_dict
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_bench_refuses_detectors_in_one_line_and_plan_takes_them(tmp_path, capsys):
    argv = ["--models", "maskrcnn:rev_mvitv2_tiny", "--batch-sizes", "2"]
    assert bench_main([*argv, "--out", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err
    assert "is a detector" in err and "pareprop plan" in err and len(err.strip().splitlines()) == 1
    assert plan_main(["--models", "maskrcnn:nonexistent_backbone", "--batch-sizes", "2",
                      "--out", str(tmp_path / "plan")]) == 2
    assert "unknown detection backbone" in capsys.readouterr().err  # plan reads the name


def test_a_missing_pycocotools_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pycocotools", None)
    assert train_main(["--task", "detection", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'pareprop[detection]'" in err and len(err.splitlines()) == 1
