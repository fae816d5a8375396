"""Fine-tuning a detector on a converted backbone (docs/detection.md, "Fine-tuning a converted
backbone"): detectron2's ViTDet from a model-zoo file, its coupling moved by the schedule from
(1, 0) to (0, 1) during the run, the precision guard's report logged, and the trunk's
no-weight-decay names out of weight decay. A tiny backbone on a tiny shapes set, a few steps."""

import json
import pickle

import pytest
import torch

from pareprop.convert.coupling import coupling_of
from pareprop.data.shapes import write_shapes
from pareprop.detection import create_detector
from pareprop.detection.detectron2 import build_detectron2_backbone
from pareprop.trainer import TrainConfig
from pareprop.trainer.run import DetectionTrainer
from pareprop.trainer.setup import param_groups

pytest.importorskip("pycocotools")

BACKBONE = dict(embed_dim=16, depth=2, num_heads=2, window_size=4, window_block_indexes=[0],
                img_size=64, pretrain_img_size=64)
TINY = dict(
    backbone_args=BACKBONE, fpn_channels=32, heads="small", min_size=64, max_size=64,
    rpn_pre_nms_top_n_train=50, rpn_post_nms_top_n_train=20, rpn_pre_nms_top_n_test=50,
    rpn_post_nms_top_n_test=20, box_batch_size_per_image=16, rpn_batch_size_per_image=32,
    box_detections_per_img=10,
)
MODEL = "maskrcnn:detectron2:vitdet_b"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes(str(tmp_path_factory.mktemp("shapes")), num_train=4, num_val=2,
                        image_size=64)


@pytest.fixture(scope="module")
def zoo_file(tmp_path_factory):
    """The tiny backbone's initial weights in the model zoo's layout."""
    torch.manual_seed(0)
    state = build_detectron2_backbone("vitdet_b", out_channels=TINY["fpn_channels"],
                                      **BACKBONE).state_dict()
    path = tmp_path_factory.mktemp("zoo") / "model_final.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {f"backbone.{k}": v.numpy() for k, v in state.items()}}, f)
    return str(path)


def _config(shapes, out, zoo_file, *, steps=None, **kw):
    return TrainConfig.for_task(
        "detection", model=MODEL, dataset=shapes, model_kwargs=json.loads(json.dumps(TINY)),
        batch_size=2, lr=1e-3, epochs=2, out=str(out), progress=False,
        pretrained_file=zoo_file, coupling_steps=steps, **kw)


def test_schedule_moves_the_backbone_coupling(shapes, zoo_file, tmp_path, capsys):
    trainer = DetectionTrainer(_config(shapes, tmp_path / "run", zoo_file, steps=4))
    assert trainer.coupling is not None
    assert coupling_of(trainer.model) == (1.0, 0.0)  # step 0
    assert trainer.model.backbone.load_report.layout == "zoo"
    trainer.fit()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        epochs = [json.loads(line) for line in f if '"epoch"' in line]
    epochs = [r for r in epochs if r["type"] == "epoch"]
    # 4 images at batch 2: 2 steps an epoch; cosine over 4 steps is halfway after the first.
    assert [r["step"] for r in epochs] == [2, 4]
    assert epochs[0]["coupling"] == pytest.approx([0.5, 0.5])
    assert epochs[1]["coupling"] == [0.0, 1.0]
    assert coupling_of(trainer.model) == (0.0, 1.0)
    # The guard measured on the training batches and its report is logged and recorded.
    assert all("guard_report" in r and isinstance(r["guard_stored"], list) for r in epochs)
    # Measured at each epoch's last training batch, before its step: steps 1 and 3 of 4.
    assert "(alpha, beta) = (0.8536, 0.1464)" in epochs[0]["guard_report"]
    assert "(alpha, beta) = (0.1464, 0.8536)" in epochs[1]["guard_report"]
    assert "precision guard: coupling (alpha, beta)" in capsys.readouterr().err


def test_coupling_options_on_detectors(shapes, zoo_file, tmp_path):
    # --coupling-steps on a detector whose backbone converts nothing: refused in one line.
    with pytest.raises(ValueError, match="--coupling-steps 3 .* converted:SOURCE or detectron2"):
        TrainConfig.for_task("detection", model="maskrcnn:rev_mvitv2_tiny", coupling_steps=3)
    # A coupling given to the backbone would be overridden by the schedule.
    kwargs = json.loads(json.dumps(TINY))
    kwargs["backbone_args"]["coupling"] = [0.5, 0.5]
    with pytest.raises(ValueError, match="coupling schedule sets the backbone's coupling"):
        TrainConfig.for_task("detection", model=MODEL, model_kwargs=kwargs)
    # --coupling-schedule reversible starts at (0, 1).
    cfg = _config(shapes, tmp_path / "rev", zoo_file, coupling_schedule="reversible")
    assert coupling_of(DetectionTrainer(cfg).model) == (0.0, 1.0)


def test_trunk_no_weight_decay_names_are_not_decayed():
    detector = create_detector("maskrcnn", "detectron2:vitdet_b", 3, **TINY)
    trunk = detector.backbone.net  # detectron2's ViT: absolute and relative position tables
    names = {f"backbone.net.{n}" for n in trunk.no_weight_decay()}
    params = dict(detector.named_parameters())
    assert names <= set(params)
    assert any(n.endswith("pos_embed") for n in names)
    assert any(n.endswith("rel_pos_h") for n in names)
    assert all(params[n].ndim > 1 for n in names)  # out of decay by name, not by the 1-D rule
    decay, no_decay = param_groups(detector, 0.05)
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert all(id(params[n]) in no_decay_ids for n in names)
    assert {id(p) for p in decay["params"]}.isdisjoint(no_decay_ids)
    assert decay["params"]  # the rest is decayed
