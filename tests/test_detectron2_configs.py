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


def _zoo_heads(K, C=256, gen=None):
    """detectron2's Mask R-CNN ViTDet heads (2-conv RPN, 4conv1fc box head with LN, mask head
    with LN), random, under detectron2's names and shapes, for K classes."""
    gen = gen or torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    heads = {}
    for k in range(2):
        heads[f"proposal_generator.rpn_head.conv.conv{k}.weight"] = r(C, C, 3, 3)
        heads[f"proposal_generator.rpn_head.conv.conv{k}.bias"] = r(C)
    heads.update({"proposal_generator.rpn_head.objectness_logits.weight": r(3, C, 1, 1),
                  "proposal_generator.rpn_head.objectness_logits.bias": r(3),
                  "proposal_generator.rpn_head.anchor_deltas.weight": r(12, C, 1, 1),
                  "proposal_generator.rpn_head.anchor_deltas.bias": r(12)})
    for k in range(1, 5):
        heads[f"roi_heads.box_head.conv{k}.weight"] = r(256, C, 3, 3)
        heads[f"roi_heads.box_head.conv{k}.norm.weight"] = 1 + r(256)
        heads[f"roi_heads.box_head.conv{k}.norm.bias"] = r(256)
        heads[f"roi_heads.mask_head.mask_fcn{k}.weight"] = r(256, C, 3, 3)
        heads[f"roi_heads.mask_head.mask_fcn{k}.norm.weight"] = 1 + r(256)
        heads[f"roi_heads.mask_head.mask_fcn{k}.norm.bias"] = r(256)
    heads.update({"roi_heads.box_head.fc1.weight": r(1024, 256 * 49) * 0.1,
                  "roi_heads.box_head.fc1.bias": r(1024),
                  "roi_heads.box_predictor.cls_score.weight": r(K + 1, 1024),
                  "roi_heads.box_predictor.cls_score.bias": r(K + 1),
                  "roi_heads.box_predictor.bbox_pred.weight": r(4 * K, 1024),
                  "roi_heads.box_predictor.bbox_pred.bias": r(4 * K),
                  "roi_heads.mask_head.deconv.weight": r(256, 256, 2, 2),
                  "roi_heads.mask_head.deconv.bias": r(256),
                  "roi_heads.mask_head.predictor.weight": r(K, 256, 1, 1),
                  "roi_heads.mask_head.predictor.bias": r(K),
                  "roi_heads.box_head.0.conv1.weight": r(2)})  # a cascade stage's: no place
    return heads


def _ln(x, w, b):  # detectron2's LN over channels
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return w[:, None, None] * ((x - u) / torch.sqrt(s + 1e-6)) + b[:, None, None]


def test_zoo_heads_load_into_torchvisions_vitdet_heads_with_the_same_function():
    from pareprop.detection.detectron2 import load_detectron2_heads

    F = torch.nn.functional
    K = 2
    heads = _zoo_heads(K)
    detector = create_detector("maskrcnn", "detectron2:vitdet_b", num_classes=K + 1,
                               backbone_args=TINY, heads="vitdet").eval()
    report = load_detectron2_heads(detector, heads)
    assert report.left_out == ["roi_heads.box_head.0.conv1.weight"]
    assert len(report.loaded) == len(heads) - 1
    torch.manual_seed(0)
    with torch.no_grad():
        x = torch.randn(2, 256, 8, 8)
        h = x
        for k in range(2):  # RPN: shared convs with ReLU, then objectness and deltas
            h = F.relu(F.conv2d(h, heads[f"proposal_generator.rpn_head.conv.conv{k}.weight"],
                                heads[f"proposal_generator.rpn_head.conv.conv{k}.bias"],
                                padding=1))
        logits, deltas = detector.rpn.head([x])
        want = F.conv2d(h, heads["proposal_generator.rpn_head.objectness_logits.weight"],
                        heads["proposal_generator.rpn_head.objectness_logits.bias"])
        torch.testing.assert_close(logits[0], want)
        want = F.conv2d(h, heads["proposal_generator.rpn_head.anchor_deltas.weight"],
                        heads["proposal_generator.rpn_head.anchor_deltas.bias"])
        torch.testing.assert_close(deltas[0], want)
        r = torch.randn(3, 256, 7, 7)  # box head: 4 x (conv, LN, ReLU), flatten, fc, ReLU
        h = r
        for k in range(1, 5):
            h = F.relu(_ln(F.conv2d(h, heads[f"roi_heads.box_head.conv{k}.weight"], padding=1),
                           heads[f"roi_heads.box_head.conv{k}.norm.weight"],
                           heads[f"roi_heads.box_head.conv{k}.norm.bias"]))
        h = F.relu(F.linear(h.flatten(1), heads["roi_heads.box_head.fc1.weight"],
                            heads["roi_heads.box_head.fc1.bias"]))
        feats = detector.roi_heads.box_head(r)
        torch.testing.assert_close(feats, h, rtol=1e-4, atol=1e-5)
        scores, boxes = detector.roi_heads.box_predictor(h)
        d2 = F.linear(h, heads["roi_heads.box_predictor.cls_score.weight"],
                      heads["roi_heads.box_predictor.cls_score.bias"])
        torch.testing.assert_close(scores, torch.cat([d2[:, -1:], d2[:, :-1]], 1))  # bg first
        d2 = F.linear(h, heads["roi_heads.box_predictor.bbox_pred.weight"],
                      heads["roi_heads.box_predictor.bbox_pred.bias"])
        torch.testing.assert_close(boxes[:, 4:], d2)
    own = detector.state_dict()
    for k in range(1, 5):  # the mask head's convolutions and norms in torchvision's places
        assert torch.equal(own[f"roi_heads.mask_head.{k - 1}.0.weight"],
                           heads[f"roi_heads.mask_head.mask_fcn{k}.weight"])
        assert torch.equal(own[f"roi_heads.mask_head.{k - 1}.1.bias"],
                           heads[f"roi_heads.mask_head.mask_fcn{k}.norm.bias"])
    logits = own["roi_heads.mask_predictor.mask_fcn_logits.weight"]
    assert not torch.any(logits[0])  # the background's mask, never used
    assert torch.equal(logits[1:], heads["roi_heads.mask_head.predictor.weight"])
