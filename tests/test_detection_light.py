"""A memory-light detector (the pyramid and the R-CNN heads under activation checkpointing)
takes one float64 Mask R-CNN step exactly as the same detector without: every loss and every
parameter's gradient, on ViTDet's simple feature pyramid and on MViTv2's FPN. Controls: the
parts are recomputed (the option acts), a perturbed weight is noticed, and the plan's peak
falls."""

from __future__ import annotations

import copy

import pytest
import torch

import pareprop
from pareprop.detection import (
    create_detector,
    detector_from_spec,
    is_memory_light,
    set_memory_light,
)
from pareprop.detection import light as light_module
from pareprop.engine.chunk_cost import Chunking
from pareprop.memory.detection import synthetic_targets

VITDET = dict(embed_dim=32, depth=3, num_heads=2, window_size=4, window_block_indexes=(0, 2),
              img_size=64, pretrain_img_size=32, coupling=(0.5, 0.5), tolerance=None)
MVIT = dict(embed_dim=8, depth=6, num_heads=1, last_block_indexes=(1, 3, 4, 5), img_size=64,
            adaptive_window_size=6, adaptive_kv_stride=2, coupling=(0.5, 0.5), tolerance=None)
# pareprop's own backbones: torchvision's FPN over Rev-MViTv2's stages, ViTDet's simple
# pyramid over Rev-ViT.
REV_MVIT = dict(embed_dim=8, depth=4, last_block_indexes=[0, 1, 2, 3], window_size=8,
                kv_stride=2, img_size=64, drop_path_rate=0.1)
REV_VIT = dict(embed_dim=16, depth=2, num_heads=2, img_size=64)
CASES = {"detectron2:vitdet_b": (VITDET, 64), "detectron2:mvitv2_t": (MVIT, 64),
         "rev_mvitv2_tiny": (REV_MVIT, 64), "rev_vit_tiny_patch16_224": (REV_VIT, 64)}
SLOW_CASES = ("rev_vit_tiny_patch16_224",)  # the quick tier has ViTDet's pyramid above
HEADS = dict(rpn_pre_nms_top_n_train=40, rpn_post_nms_top_n_train=16,
             box_batch_size_per_image=8, rpn_batch_size_per_image=64, heads="vitdet")


IMAGES = 2  # a step's batch


def _detector(backbone, **kw):
    args, size = CASES[backbone]
    torch.manual_seed(0)
    det = create_detector("maskrcnn", backbone, num_classes=3, backbone_args=dict(args),
                          min_size=size, max_size=size, **HEADS, **kw)
    return det.double().train(), size


def _step(det, size):
    torch.manual_seed(1)
    images = [torch.rand(3, size, size, dtype=torch.float64) for _ in range(IMAGES)]
    targets = synthetic_targets(IMAGES, (size, size), 3, 3, masks=True)
    torch.manual_seed(2)
    det.zero_grad(set_to_none=True)
    losses = det(images, targets)
    sum(losses.values()).backward()
    grads = {n: p.grad.clone() for n, p in det.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads


def _pyramid_conv(det):
    """A convolution of the pyramid (detectron2's ``simfp_*`` and ``fpn_*``, pareprop's
    ``fpn``), not of the trunk."""
    return next(m for n, m in det.named_modules()
                if n.startswith(("backbone.simfp", "backbone.fpn"))
                and isinstance(m, torch.nn.Conv2d))


@pytest.mark.parametrize("backbone", [
    pytest.param(b, marks=pytest.mark.slow) if b in SLOW_CASES else b for b in sorted(CASES)])
def test_memory_light_step_has_the_same_losses_and_gradients(backbone):
    det, size = _detector(backbone)
    light = set_memory_light(copy.deepcopy(det))
    assert is_memory_light(light) and not is_memory_light(det)
    calls = {(key, part): 0 for key in ("plain", "light") for part in ("rpn", "pyramid")}
    for key, model in (("plain", det), ("light", light)):
        for part, conv in (("rpn", model.rpn.head.conv), ("pyramid", _pyramid_conv(model))):
            def count(*_, key=key, part=part):
                calls[key, part] += 1
            conv.register_forward_pre_hook(count)
    want_losses, want = _step(det, size)
    got_losses, got = _step(light, size)
    # The option acts: the RPN head and the pyramid ran image by image, in forward and again
    # in backward.
    for part in ("rpn", "pyramid"):
        assert calls["light", part] == 2 * IMAGES * calls["plain", part] > 0, part
    assert want_losses.keys() == got_losses.keys()
    for k in want_losses:
        torch.testing.assert_close(got_losses[k], want_losses[k], rtol=0, atol=0)
    assert want.keys() == got.keys()
    assert any(n.startswith("backbone.simfp") or n.startswith("backbone.fpn") for n in want)
    assert any(n.startswith("roi_heads.mask_head") for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14, msg=n)

    # Negative control: one element of a pyramid weight moved by 1e-6 is noticed by the same
    # comparison (one element: a uniform shift would vanish in the channel LayerNorm).
    name = next(n for n in want if n.startswith("backbone.simfp") or n.startswith("backbone.fpn"))
    with torch.no_grad():
        dict(light.named_parameters())[name].view(-1)[0] += 1e-6
    _, moved = _step(light, size)
    assert any(not torch.allclose(moved[n], want[n], rtol=1e-12, atol=1e-14) for n in want)


def test_the_roi_heads_run_in_pieces_of_rois_with_the_same_gradients(monkeypatch):
    # Pieces of 5 RoIs (a training image samples 8 here): the box head runs in pieces, the
    # gradients stay those of the detector without the option.
    monkeypatch.setattr(light_module, "ROI_ROWS", 5)
    det, size = _detector("rev_mvitv2_tiny")
    light = set_memory_light(copy.deepcopy(det))
    rows = []
    conv = next(m for m in light.roi_heads.box_head.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    _, want = _step(det, size)
    _, got = _step(light, size)
    assert max(rows) == 5 and sum(rows) == 2 * IMAGES * HEADS["box_batch_size_per_image"]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14, msg=n)


def test_heads_with_batch_norm_run_whole_with_the_same_gradients(monkeypatch):
    # Batch norm in training computes each row from all of them: pieces would change the
    # result, so such an RPN head and RoI head run whole (and the gradients stay the same).
    monkeypatch.setattr(light_module, "ROI_ROWS", 5)
    det, size = _detector("rev_mvitv2_tiny")
    torch.manual_seed(3)
    det.rpn.head.conv.append(torch.nn.BatchNorm2d(det.backbone.out_channels).double())
    box = det.roi_heads.box_head
    det.roi_heads.box_head = torch.nn.Sequential(
        torch.nn.BatchNorm2d(box[0][0].in_channels).double(), box)
    light = set_memory_light(copy.deepcopy(det))
    seen = {"rpn": [], "box": []}
    light.rpn.head.conv.register_forward_pre_hook(lambda _, a: seen["rpn"].append(a[0].shape[0]))
    light.roi_heads.box_head.register_forward_pre_hook(
        lambda _, a: seen["box"].append(a[0].shape[0]))
    want_losses, want = _step(det, size)
    got_losses, got = _step(light, size)
    assert min(seen["rpn"]) == IMAGES  # every level of the whole batch at once
    assert min(seen["box"]) == IMAGES * HEADS["box_batch_size_per_image"]
    for k in want_losses:
        torch.testing.assert_close(got_losses[k], want_losses[k], rtol=1e-12, atol=1e-14)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14, msg=n)


def test_checkpoint_in_pieces_joins_the_pieces_and_refuses_bad_input():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    out = light_module.checkpoint_in_pieces(lambda t: [2 * t, t.sum(1)], x, rows=3)
    torch.testing.assert_close(out[0], 2 * x, rtol=0, atol=0)
    torch.testing.assert_close(out[1], x.sum(1), rtol=0, atol=0)
    empty = light_module.checkpoint_in_pieces(lambda t: t + 1, x[:0], rows=3)
    assert empty.shape == (0, 3)
    with pytest.raises(ValueError, match="expected rows a positive integer"):
        light_module.checkpoint_in_pieces(lambda t: t, x, rows=0)
    with pytest.raises(ValueError, match="the same first dimension"):
        light_module.checkpoint_in_pieces(lambda a, b: a, x, x[:2])


def test_memory_light_off_restores_the_detector_and_bad_backbones_are_refused():
    det, _ = _detector("detectron2:vitdet_b", memory_light=True)
    assert det.pareprop_spec["memory_light"] is True
    assert is_memory_light(detector_from_spec(det.pareprop_spec))
    assert "forward" in det.rpn.head.__dict__ and det.backbone.memory_light
    set_memory_light(det, False)
    assert "forward" not in det.rpn.head.__dict__ and not det.backbone.memory_light
    torch.manual_seed(0)
    ours = create_detector("fasterrcnn", "rev_vit_tiny_patch16_224", num_classes=3,
                           backbone_args=dict(REV_VIT), memory_light=True)
    assert ours.backbone.memory_light and ours.backbone.fpn.memory_light
    set_memory_light(ours, False)
    assert not ours.backbone.fpn.memory_light and "forward" not in ours.rpn.head.__dict__
    ours.backbone = torch.nn.Conv2d(3, 8, 1)  # a backbone without the option
    with pytest.raises(ValueError, match="memory_light"):
        set_memory_light(ours)


def test_the_plan_of_a_memory_light_detector_keeps_less():
    # Chunks given as a Chunking, as a plan sweep passes them on.
    kw = dict(device="cpu", img_size=128, num_classes=3, gt_per_image=3, amp=None,
              optimizer="none", backbone_args=dict(VITDET), chunk_bytes=Chunking(max_bytes=2**20),
              **HEADS)
    plain = pareprop.plan_memory("maskrcnn:detectron2:vitdet_b", 2, "reversible", **kw)
    light = pareprop.plan_memory("maskrcnn:detectron2:vitdet_b", 2, "reversible",
                                 memory_light=True, **kw)
    assert light.peak < plain.peak
    assert light.split["pyramid"] + light.split["heads"] < plain.split["pyramid"] + \
        plain.split["heads"]


@pytest.mark.slow
def test_the_plan_of_pareprops_own_memory_light_backbone_keeps_less_in_the_pyramid():
    kw = dict(device="cpu", img_size=128, num_classes=3, gt_per_image=3, amp=None,
              optimizer="none", backbone_args=dict(REV_MVIT, img_size=128), **HEADS)
    plain = pareprop.plan_memory("maskrcnn:rev_mvitv2_tiny", 2, "reversible", **kw)
    light = pareprop.plan_memory("maskrcnn:rev_mvitv2_tiny", 2, "reversible",
                                 memory_light=True, **kw)
    # Kept for backward: the pyramid's and the RPN head's outputs, not their insides.
    assert light.peak < plain.peak and light.activations < 0.5 * plain.activations
