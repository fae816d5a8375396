"""pareprop.detection's factory: torchvision's detectors on reversible backbones, their names,
specs and refusals, and pareprop's model-wide setters acting on a detector."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet

import pareprop
from pareprop.detection import (
    DETECTOR_ARCHS,
    create_detector,
    detector_from_spec,
    parse_detector_name,
    register_backbone,
)
from pareprop.engine import ReversibleStack

# Tiny trunks: a training step of each runs in about a second on a CPU core.
TINY_MVIT = dict(embed_dim=16, depth=4, last_block_indexes=[0, 1, 2, 3], window_size=8,
                 kv_stride=2, img_size=64)
TINY_SWIN = dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window=4,
                 img_size=64, drop_path_rate=0.0)
TINY_VIT = dict(embed_dim=32, depth=2, num_heads=2, img_size=96)
# Few proposals and samples, so the heads cost little.
SMALL_HEADS = dict(min_size=64, max_size=64, rpn_pre_nms_top_n_train=50,
                   rpn_post_nms_top_n_train=20, rpn_pre_nms_top_n_test=50,
                   rpn_post_nms_top_n_test=20, box_batch_size_per_image=16,
                   rpn_batch_size_per_image=32)

BACKBONES = {
    "rev_mvitv2_tiny": TINY_MVIT,
    "rev_swin_tiny": TINY_SWIN,
    "rev_vit_tiny_patch16_224": TINY_VIT,
}


def batch(n: int = 2, size: int = 64, seed: int = 0):
    """Images in [0, 1] and Mask R-CNN targets: one or two boxes each, masks inside them."""
    g = torch.Generator().manual_seed(seed)
    images, targets = [], []
    for i in range(n):
        images.append(torch.rand(3, size, size, generator=g))
        boxes, masks = [], []
        for _ in range(1 + i % 2):
            x0, y0 = (torch.randint(0, size // 2, (2,), generator=g)).tolist()
            w, h = (torch.randint(12, size // 2, (2,), generator=g)).tolist()
            boxes.append([x0, y0, x0 + w, y0 + h])
            m = torch.zeros(size, size, dtype=torch.uint8)
            m[y0 : y0 + h, x0 : x0 + w] = 1
            masks.append(m)
        targets.append({
            "boxes": torch.tensor(boxes, dtype=torch.float32),
            "labels": torch.randint(1, 3, (len(boxes),), generator=g),
            "masks": torch.stack(masks),
        })
    return images, targets


def tiny(arch: str = "maskrcnn", backbone: str = "rev_mvitv2_tiny", **kw):
    # ViTDet's heads, as wide as the small pyramid: torchvision's are 256 wide whatever it is.
    args = dict(backbone_args=BACKBONES.get(backbone), fpn_channels=32, heads="vitdet",
                **SMALL_HEADS)
    args.update(kw)
    if arch == "retinanet":
        for k in list(args):
            if k.startswith(("rpn_", "box_batch")):
                args.pop(k)
    return create_detector(arch, backbone, num_classes=3, **args)


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_maskrcnn_trains_and_predicts(backbone):
    torch.manual_seed(0)
    # torchvision's own heads once; ViTDet's elsewhere.
    heads = "torchvision" if backbone == "rev_mvitv2_tiny" else "vitdet"
    model = tiny(backbone=backbone, heads=heads)
    assert type(model) is MaskRCNN
    feats = model.backbone(torch.zeros(1, 3, 64, 96))
    assert list(feats) == ["p2", "p3", "p4", "p5", "p6"]
    assert [tuple(f.shape[-2:]) for f in feats.values()] == [(16, 24), (8, 12), (4, 6), (2, 3),
                                                               (1, 2)]
    assert all(f.shape[1] == 32 for f in feats.values())
    images, targets = batch()
    model.train()
    losses = model(images, targets)
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness",
                           "loss_rpn_box_reg"}
    sum(losses.values()).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without a gradient (DDP would stop): {missing[:5]}"
    model.eval()
    with torch.no_grad():
        out = model(images)
    assert set(out[0]) == {"boxes", "labels", "scores", "masks"}


@pytest.mark.parametrize("arch,cls", [("fasterrcnn", FasterRCNN), ("retinanet", RetinaNet)])
def test_other_archs(arch, cls):
    torch.manual_seed(0)
    model = tiny(arch)
    assert type(model) is cls
    images, targets = batch()
    for t in targets:
        t.pop("masks")
    losses = model.train()(images, targets)
    sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())


def test_vitdet_heads():
    from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead

    model = tiny()
    assert len(model.rpn.head.conv) == 2  # RPNHead(conv_depth=2)
    assert isinstance(model.roi_heads.box_head, FastRCNNConvFCHead)
    norms = [m for m in model.roi_heads.mask_head.modules() if "LayerNorm" in type(m).__name__]
    assert len(norms) == 4


def test_spec_rebuilds_the_detector():
    torch.manual_seed(0)
    model = tiny(engine="autograd")
    spec = json.loads(json.dumps(model.pareprop_spec))  # plain JSON values
    assert spec == model.pareprop_spec
    assert {"arch", "backbone", "num_classes", "backbone_args", "fpn_channels",
            "kwargs"} <= set(spec)
    assert spec["kwargs"]["min_size"] == 64
    again = detector_from_spec(spec)
    again.load_state_dict(model.state_dict())
    images, _ = batch()
    model.eval(), again.eval()
    with torch.no_grad():
        a, b = model(images), again(images)
    assert all(torch.equal(x["boxes"], y["boxes"]) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="expected a detector spec"):
        detector_from_spec({"arch": "maskrcnn"})


def test_spec_of_objects_is_refused():
    from torchvision.models.detection.rpn import RPNHead

    model = tiny(rpn_head=RPNHead(32, 3))
    assert model.pareprop_spec["unrecorded"] == ["rpn_head"]
    assert "rpn_head" not in model.pareprop_spec["kwargs"]
    with pytest.raises(ValueError, match="rpn_head given as objects"):
        detector_from_spec(model.pareprop_spec)


def test_names_and_refusals():
    assert DETECTOR_ARCHS == ("maskrcnn", "fasterrcnn", "retinanet")
    assert parse_detector_name("maskrcnn:rev_mvitv2_tiny") == ("maskrcnn", "rev_mvitv2_tiny")
    assert parse_detector_name("retinanet:converted:vit_tiny_patch16_224") == (
        "retinanet", "converted:vit_tiny_patch16_224")
    with pytest.raises(ValueError, match="maskrcnn, fasterrcnn, retinanet"):
        parse_detector_name("yolo:rev_vit_tiny_patch16_224")
    with pytest.raises(ValueError, match="ARCH:BACKBONE"):
        parse_detector_name("rev_mvitv2_tiny")
    with pytest.raises(ValueError, match="maskrcnn, fasterrcnn, retinanet"):
        create_detector("cascade", "rev_mvitv2_tiny", 3)
    with pytest.raises(ValueError, match=r"rev_mvitv2_\*.*converted:NAME"):
        create_detector("maskrcnn", "resnet50", 3)
    with pytest.raises(ValueError, match="K object classes"):
        create_detector("maskrcnn", "rev_mvitv2_tiny", 1)
    with pytest.raises(ValueError, match="heads"):
        tiny(heads="detectron")


def test_fixed_size_backbone_pads_and_refuses():
    model = tiny(backbone="rev_vit_tiny_patch16_224")
    feats = model.backbone(torch.zeros(1, 3, 32, 64))
    assert [tuple(f.shape[-2:]) for f in feats.values()][:4] == [(8, 16), (4, 8), (2, 4), (1, 2)]
    with pytest.raises(ValueError, match="at most 96x96.*img_size"):
        model.backbone(torch.zeros(1, 3, 128, 64))


def test_register_backbone():
    calls = []

    def builder(rest, **options):
        calls.append((rest, options["engine"]))
        return create_detector("maskrcnn", "rev_mvitv2_tiny", 3, backbone_args=TINY_MVIT,
                               fpn_channels=32).backbone

    register_backbone("mine", builder)
    model = create_detector("fasterrcnn", "mine:thing", 3, engine="autograd", min_size=64,
                            max_size=64)
    assert calls == [("thing", "autograd")]
    assert model.pareprop_spec["backbone"] == "mine:thing"
    with pytest.raises(ValueError, match="letters"):
        register_backbone("a:b", builder)


def test_setters_reach_the_detector():
    model = tiny()
    stacks = [m for m in model.modules() if isinstance(m, ReversibleStack)]
    assert stacks and all(s.engine == "reversible" for s in stacks)
    pareprop.set_engine(model, "autograd")
    assert all(s.engine == "autograd" for s in stacks)
    pareprop.set_chunking(model, chunks=2)
    assert all(s.chunking is not None for s in stacks)
    model.set_grad_checkpointing(True)  # timm's name, as the trainer calls it
    assert all(stage.grad_checkpointing for stage in model.backbone.body.stages)
    other = copy.deepcopy(model)
    other.set_grad_checkpointing(False)  # the copy's own backbone
    assert not any(stage.grad_checkpointing for stage in other.backbone.body.stages)
    assert all(stage.grad_checkpointing for stage in model.backbone.body.stages)


CONVERTED = {
    "converted:vit_tiny_patch16_224": dict(embed_dim=16, depth=2, num_heads=2, img_size=64),
    "converted:mvitv2_tiny": dict(depths=[1, 1, 1, 1], embed_dim=16, num_heads=1, img_size=64),
    "converted:swin_tiny_patch4_window7_224": dict(
        depths=[1, 1, 1, 1], embed_dim=16, num_heads=[1, 1, 1, 1], img_size=64, window_size=4),
}


@pytest.mark.parametrize("backbone", list(CONVERTED))
def test_converted_backbones(backbone):
    """A converted source starts at the coupling (1, 0), its blocks stored, with its precision
    guard; set_coupling on the detector moves it and the spec records it."""
    torch.manual_seed(0)
    model = tiny(backbone=backbone, backbone_args=CONVERTED[backbone])
    assert model.backbone.fixed_size == (64, 64)  # timm's sources take one size
    assert pareprop.coupling_of(model) == (1.0, 0.0)
    stacks = [m for m in model.modules() if isinstance(m, ReversibleStack)]
    assert all(len(s.stored_blocks) == len(s.blocks) for s in stacks)
    pareprop.set_coupling(model, 0.5, 0.5)
    assert model.pareprop_spec["backbone_args"]["coupling"] == [0.5, 0.5]
    images, targets = batch(1)
    losses = model.train()(images, targets)
    sum(losses.values()).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    assert model.precision_guard.report is not None  # the guard measured this step
    again = detector_from_spec(json.loads(json.dumps(model.pareprop_spec)))
    assert pareprop.coupling_of(again) == (0.5, 0.5)


def test_pretrained_file_reaches_the_trunk(tmp_path):
    import timm

    source = timm.create_model("vit_tiny_patch16_224", num_classes=0,
                               **CONVERTED["converted:vit_tiny_patch16_224"])
    torch.save(source.state_dict(), tmp_path / "vit.pth")
    model = tiny(backbone="converted:vit_tiny_patch16_224",
                 backbone_args=CONVERTED["converted:vit_tiny_patch16_224"],
                 pretrained_file=str(tmp_path / "vit.pth"))
    torch.testing.assert_close(model.backbone.body.patch_embed.proj.weight,
                               source.patch_embed.proj.weight, rtol=0, atol=0)
    trunk = pareprop.create_model("rev_mvitv2_tiny", num_classes=0,
                                  **{k: v for k, v in TINY_MVIT.items()})
    torch.save(trunk.state_dict(), tmp_path / "mvit.pth")
    model = tiny(pretrained_file=str(tmp_path / "mvit.pth"))
    torch.testing.assert_close(model.backbone.body.patch_embed.proj.weight,
                               trunk.patch_embed.proj.weight, rtol=0, atol=0)


def test_compile_blocks_reaches_the_detector():
    model = tiny()
    pareprop.compile_blocks(model)
    compiled = pareprop.compiled_blocks(model)
    blocks = [n for n, m in model.named_modules() if isinstance(m, pareprop.ReversibleBlock)]
    assert compiled == blocks and all(n.startswith("backbone.body.") for n in blocks)
    pareprop.uncompile_blocks(model)
    assert pareprop.compiled_blocks(model) == []


def test_memory_budget_reaches_the_detector():
    model = tiny().train()
    images, targets = batch()
    plan = pareprop.set_memory_budget(model, 1.0, (images, targets))
    assert set(plan.stored) == {n for n, m in model.named_modules()
                                if isinstance(m, ReversibleStack)}


def test_torchvision_source_keeps_no_unused_parameter():
    """torchvision's Swin (converted) has no prune_intermediate_layers: its final norm and head
    are dropped all the same, so every parameter left gets a gradient (as DDP needs)."""
    torch.manual_seed(0)
    model = tiny("fasterrcnn", "converted:swin_t", backbone_args=None)
    assert model.backbone.fixed_size is None  # torchvision's Swin takes any size
    images, targets = batch(1)
    targets[0].pop("masks")
    sum(model.train()(images, targets).values()).backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]


def test_small_detector_builds_from_its_spec():
    from pareprop.detection import SMALL_DETECTOR

    model = detector_from_spec(dict(SMALL_DETECTOR, num_classes=4))
    assert type(model) is MaskRCNN and model.transform.min_size == (160,)
    stacks = [m for m in model.modules() if isinstance(m, ReversibleStack)]
    assert [len(s.blocks) for s in stacks] == [2, 1, 2]
