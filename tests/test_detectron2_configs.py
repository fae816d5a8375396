"""detectron2's eight named backbones at full size, built on the meta device (nothing
allocated): the same tensor names and shapes as the plain reference of detectron2's modules
(tests/_detectron2_reference.py) built with the arguments of projects/MViTv2's and
projects/ViTDet's configuration files, and the parameter counts they give. Also
``create_detector(..., backbone="detectron2:NAME", pretrained_file=...)`` on a tiny ViTDet."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import _detectron2_reference as ref
import pareprop
from pareprop.detection import create_detector, detector_from_spec
from pareprop.detection.detectron2 import CONFIGS, build_detectron2_backbone

# Backbone parameters (the pyramid included) of each configuration, counted on the reference;
# with torchvision-sized heads they make the published totals (ViTDet-B Mask R-CNN 111M,
# MViTv2-T 44M).
PARAMS = {"mvitv2_t": 26_135_648, "mvitv2_s": 36_832_544, "mvitv2_b": 53_435_072,
          "mvitv2_l": 215_398_688, "mvitv2_h": 668_444_032, "vitdet_b": 91_449_024,
          "vitdet_l": 311_237_888, "vitdet_h": 641_756_992}


def _reference(name):
    cfg = CONFIGS[name]
    if cfg.family == "vit":
        net = ref.ViT(img_size=1024, patch_size=16, use_rel_pos=True, window_size=14,
                      **cfg.args)
        return ref.SimpleFeaturePyramid(net)
    return ref.FPN(ref.MViT(**cfg.args))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_size_backbones_have_detectron2s_names_and_shapes(name):
    with torch.device("meta"):
        want = _reference(name)
    model = build_detectron2_backbone(name, device="meta")
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == {k: tuple(v.shape) for k, v in want.state_dict().items()}
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    stacked = sum(len(s.blocks) for s in model.stacks())
    if CONFIGS[name].family == "vit":
        assert stacked == CONFIGS[name].args["depth"]  # every block reversible
    else:  # all but the three stage transitions
        assert stacked == CONFIGS[name].args["depth"] - 3


TINY = dict(embed_dim=32, depth=3, num_heads=2, window_size=4, window_block_indexes=[0, 2],
            img_size=128, pretrain_img_size=64)


def _targets(sizes):
    out = []
    for i, (h, w) in enumerate(sizes):
        masks = torch.zeros(1, h, w, dtype=torch.uint8)
        masks[0, 10:50, 12:60] = 1
        out.append({"boxes": torch.tensor([[12.0, 10.0, 60.0, 50.0]]),
                    "labels": torch.tensor([1 + i % 2]), "masks": masks})
    return out


def test_create_detector_from_a_zoo_file_through_the_schedule(tmp_path, caplog):
    net = ref.ViT(patch_size=16, use_rel_pos=True, **TINY)
    source = ref.randomize(ref.SimpleFeaturePyramid(net)).float()
    heads = {"roi_heads.box_predictor.cls_score.weight": torch.zeros(3, 1024),
             "proposal_generator.rpn_head.objectness_logits.weight": torch.zeros(3, 256, 1, 1)}
    path = ref.write_zoo_pickle(tmp_path / "model_final.pkl", source.state_dict(), heads)
    with caplog.at_level(logging.INFO, logger="pareprop"):
        detector = create_detector("maskrcnn", "detectron2:vitdet_b", num_classes=3,
                                   pretrained_file=os.fspath(path), backbone_args=TINY,
                                   rpn_pre_nms_top_n_train=50, rpn_post_nms_top_n_train=20,
                                   rpn_batch_size_per_image=32, box_batch_size_per_image=8)
    assert any("2 head tensors" in r.getMessage() and "left out" in r.getMessage()
               for r in caplog.records)
    own = detector.backbone.state_dict()
    assert all(torch.equal(own[k], v) for k, v in source.state_dict().items())
    assert detector.transform.min_size == (1024,) and detector.transform.max_size == 1024
    assert detector.pareprop_spec["backbone"] == "detectron2:vitdet_b"
    # The coupling schedule and the precision guard reach the backbone's stack.
    schedule = pareprop.CouplingSchedule(detector, "linear", steps=2)
    assert pareprop.coupling_of(detector) == (1.0, 0.0)
    schedule.step()
    detector.transform.min_size, detector.transform.max_size = (128,), 128  # small and quick
    images = [torch.rand(3, 100, 128), torch.rand(3, 128, 96)]
    losses = detector.train()(images, _targets([(100, 128), (128, 96)]))
    sum(losses.values()).backward()
    assert detector.precision_guard.report.beta == 0.5
    assert detector.model_kwargs["coupling"] == [0.5, 0.5]
    assert all(torch.isfinite(v) for v in losses.values())
    rebuilt = detector_from_spec(detector.pareprop_spec)
    assert list(rebuilt.state_dict()) == list(detector.state_dict())


def test_a_download_is_refused_in_one_line():
    with pytest.raises(pareprop.PretrainedError, match="pretrained_file") as info:
        create_detector("fasterrcnn", "detectron2:mvitv2_t", num_classes=3,
                        pretrained_backbone=True)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="vitdet_b"):
        create_detector("fasterrcnn", "detectron2:vitdet_x", num_classes=3)
