"""One float64 Mask R-CNN training step is the same under every engine: every loss, and the
gradient of every parameter (trunk, pyramid, RPN and RoI heads), for each backbone family, with
chunked branches and with stored blocks. Negative controls show the comparison notices a skipped
block, a stage fed the wrong stream, and a dropped or misordered feature level."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Optional, Sequence

import pytest
import torch

import pareprop
from pareprop.detection import create_detector
from pareprop.engine import ReversibleStack
from pareprop.models._features import StageEnd

SIZE = 64
# Depths of 2-4 blocks, at least one stack of odd depth; drop path on, so the engines must
# replay its masks.
FAMILIES = {
    # Stacks of 3 and 2 blocks in stages 0 and 2; stages 1 and 3 a transition alone. Windows
    # of 12 and 6 on maps of 16 and 8: padded, the padding masked.
    "rev_mvitv2_tiny": dict(embed_dim=8, depth=8, last_block_indexes=[2, 3, 6, 7],
                            window_size=12, kv_stride=2, img_size=SIZE, drop_path_rate=0.1),
    "rev_swin_tiny": dict(embed_dim=8, depths=[2, 1, 1, 1], num_heads=[1, 1, 1, 1], window=4,
                          img_size=SIZE, drop_path_rate=0.1),
    "rev_vit_tiny_patch16_224": dict(embed_dim=16, depth=3, num_heads=2, img_size=SIZE,
                                     drop_path_rate=0.1),
    "converted:vit_tiny_patch16_224": dict(embed_dim=16, depth=3, num_heads=2, img_size=SIZE,
                                           coupling=[0.5, 0.5]),
}
HEADS = dict(min_size=SIZE, max_size=SIZE, rpn_pre_nms_top_n_train=40,
             rpn_post_nms_top_n_train=16, box_batch_size_per_image=8,
             rpn_batch_size_per_image=2048, heads="vitdet")  # every anchor: all levels
# Engine settings compared with plain autograd: (engine, chunks, stored blocks per stack). The
# quick tier runs two per family that between them take every feature; the rest are slow.
SETTINGS = [
    ("reversible", None, None),
    ("pareprop", 2, [0]),
    pytest.param("pareprop", None, None, marks=pytest.mark.slow),
    pytest.param("reversible", 2, None, marks=pytest.mark.slow),
    pytest.param("pareprop", 3, None, marks=pytest.mark.slow),
    pytest.param("reversible", None, [0], marks=pytest.mark.slow),
]


def batch(n: int = 2, size: int = SIZE, seed: int = 0):
    """Images and Mask R-CNN targets (boxes, labels, masks inside the boxes), float64."""
    g = torch.Generator().manual_seed(seed)
    images, targets = [], []
    for i in range(n):
        images.append(torch.rand(3, size, size, generator=g, dtype=torch.float64))
        boxes, masks = [], []
        for _ in range(1 + i % 2):
            x0, y0 = torch.randint(0, size // 2, (2,), generator=g).tolist()
            w, h = torch.randint(12, size // 2, (2,), generator=g).tolist()
            boxes.append([x0, y0, x0 + w, y0 + h])
            m = torch.zeros(size, size, dtype=torch.uint8)
            m[y0 : y0 + h, x0 : x0 + w] = 1
            masks.append(m)
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float64),
                        "labels": torch.randint(1, 3, (len(boxes),), generator=g),
                        "masks": torch.stack(masks)})
    return images, targets


def build(backbone: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_detector("maskrcnn", backbone, num_classes=3, engine="autograd",
                            backbone_args=FAMILIES[backbone], fpn_channels=16, **HEADS)
    return model.double().train()


def step(model: torch.nn.Module, engine: str, chunks: Optional[int] = None,
         stored: Optional[Sequence[int]] = None, grad_checkpointing: bool = False):
    """Losses and every parameter's gradient of one training step of a copy of ``model``."""
    model = copy.deepcopy(model)
    pareprop.set_engine(model, engine)
    model.backbone.set_grad_checkpointing(grad_checkpointing)
    if chunks is not None:
        pareprop.set_chunking(model, chunks=chunks)
    if stored is not None:
        for m in model.modules():
            if isinstance(m, ReversibleStack):
                m.store_blocks(stored)
    images, targets = batch()
    torch.manual_seed(1)  # proposal sampling and drop path draw from the global RNG
    losses = model(images, targets)
    sum(losses.values()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach() for k, v in losses.items()}, grads


def assert_same_step(ref, got):
    ref_losses, ref_grads = ref
    losses, grads = got
    assert set(losses) == set(ref_losses)
    for k in ref_losses:
        torch.testing.assert_close(losses[k], ref_losses[k], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, k=k: f"loss {k}: {m}")
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        assert g is not None, f"{n} has no gradient under autograd"
        assert grads[n] is not None, f"{n} has no gradient"
        torch.testing.assert_close(grads[n], g, rtol=1e-7, atol=1e-10,
                                   msg=lambda m, n=n: f"gradient of {n}: {m}")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """A detector of the family and its autograd step (the reference), built once."""
    model = build(request.param)
    return model, step(model, "autograd")


def test_reference_reaches_every_part(family):
    model, (losses, grads) = family
    assert all(torch.isfinite(v) for v in losses.values())
    assert losses["loss_mask"] > 0 and losses["loss_classifier"] > 0
    parts = {n.split(".")[0] + "." + n.split(".")[1] for n in grads}
    assert {"backbone.body", "backbone.fpn", "rpn.head", "roi_heads.box_head",
            "roi_heads.box_predictor", "roi_heads.mask_head",
            "roi_heads.mask_predictor"} <= parts
    empty = [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert not empty, f"parameters with no gradient: {empty[:5]}"


@pytest.mark.parametrize("engine,chunks,stored", SETTINGS)
def test_step_matches_autograd(family, engine, chunks, stored):
    model, ref = family
    assert_same_step(ref, step(model, engine, chunks, stored))


@pytest.mark.parametrize("backbone", ["rev_mvitv2_tiny", "rev_swin_tiny"])
def test_grad_checkpointing_step_matches_autograd(backbone):
    """The backbone's non-reversible blocks (transitions, mergings, the stem) checkpointed."""
    model = build(backbone)
    ref = step(model, "autograd")
    assert_same_step(ref, step(model, "reversible", chunks=2, grad_checkpointing=True))
    # What the setting turns on: the stem and the blocks between the stacks.
    switched = copy.deepcopy(model)
    switched.backbone.set_grad_checkpointing(True)
    flags = [m.grad_checkpointing for m in switched.backbone.body.modules()
             if hasattr(m, "grad_checkpointing")]
    assert len(flags) > 1 and all(flags)


def test_memory_budget_step_matches_autograd():
    model = build("rev_mvitv2_tiny")
    ref = step(model, "autograd")
    budgeted = copy.deepcopy(model)
    pareprop.set_engine(budgeted, "reversible")
    images, targets = batch()
    plan = pareprop.set_memory_budget(budgeted, 0.5, (images, targets))
    assert 0 < plan.num_stored < len(plan.blocks)  # some stored, some rebuilt
    losses_grads = step_as_is(budgeted)
    assert_same_step(ref, losses_grads)


def step_as_is(model):
    images, targets = batch()
    model = copy.deepcopy(model)
    torch.manual_seed(1)
    losses = model(images, targets)
    sum(losses.values()).backward()
    return ({k: v.detach() for k, v in losses.items()},
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad})


# -- negative controls: the comparison notices what the tests exist to catch ----------------


def _reference_features(backbone, x: torch.Tensor):
    """p2..p6 assembled independently of ``PyramidBackbone.forward``: the trunk's stages run
    one by one (their plain forward, streams joined), the maps put in stride order by their
    sizes, then the pyramid."""
    body = backbone.body
    if hasattr(body, "stages"):
        h = body._stem(x)
        maps = []
        for stage in body.stages:
            h = stage(h)
            maps.append(h.permute(0, 3, 1, 2))
        maps.sort(key=lambda m: -m.shape[-1])  # finest first
        return backbone.fpn(maps)
    tokens = body._tokens(x)  # Rev-ViT: the stack's end, (B, N, 2C)
    grid = body.grid_size
    return backbone.fpn(tokens.transpose(1, 2).reshape(x.shape[0], -1, *grid))


def assert_same_features(a, b):
    assert list(a) == list(b), f"levels {list(a)} != {list(b)}"
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"level {k}: {m}")


@pytest.mark.parametrize("backbone", ["rev_mvitv2_tiny", "rev_swin_tiny",
                                      "rev_vit_tiny_patch16_224"])
def test_levels_are_the_trunks_stages_in_order(backbone):
    model = build(backbone).eval()  # no drop path: the two forwards draw no masks
    x = torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64)
    feats = model.backbone(x)
    assert [f.shape[-1] for f in feats.values()] == [SIZE // s for s in (4, 8, 16, 32, 64)]
    assert_same_features(feats, _reference_features(model.backbone, x))


@pytest.mark.parametrize("fault", ["swapped", "dropped"])
@pytest.mark.parametrize("backbone", ["rev_mvitv2_tiny", "rev_swin_tiny"])
def test_levels_control(backbone, fault):
    """Control: the trunk's maps handed on misordered, or one lost, are seen."""
    model = build(backbone).eval()
    x = torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64)
    body = model.backbone.body
    intermediates = body.forward_intermediates

    def planted(*args, **kwargs):
        maps = list(intermediates(*args, **kwargs))
        if fault == "swapped":
            maps[2], maps[3] = maps[3], maps[2]
        else:
            maps[1] = torch.zeros_like(maps[1])
        return maps
    body.forward_intermediates = planted
    with pytest.raises((AssertionError, RuntimeError)):
        assert_same_features(model.backbone(x), _reference_features(model.backbone, x))


def _faulty_step(model, fault: str):
    """A reversible step of ``model`` with one fault planted."""
    model = copy.deepcopy(model)
    pareprop.set_engine(model, "reversible")
    backbone = model.backbone
    if fault == "skipped block":
        block = next(m for m in model.modules() if isinstance(m, ReversibleStack)).blocks[-1]
        block.f = lambda x, *a, **k: torch.zeros_like(x)
    elif fault == "wrong stream":
        stage = next(s for s in backbone.body.stages if s.stack is not None)
        inner = stage.stack.forward

        def one_stream(x1, x2, **kw):
            y1, y2 = inner(x1, x2, **kw)
            return y1, y1  # the next stage fed Y1 twice
        stage.stack.forward = one_stream
    elif fault in ("dropped level", "misordered levels"):
        forward = backbone.forward

        def planted(images):
            out = forward(images)
            if fault == "dropped level":
                out["p3"] = torch.zeros_like(out["p3"])
                return out
            keys = list(out)
            keys[0], keys[1] = keys[1], keys[0]
            return OrderedDict((k, out[k]) for k in keys)
        backbone.forward = planted
    return step_as_is(model)


@pytest.mark.parametrize("fault", ["skipped block", "wrong stream", "dropped level",
                                   "misordered levels"])
def test_controls_fail(fault):
    """Each planted fault makes the step differ from autograd's, and the check says so."""
    model = build("rev_mvitv2_tiny")
    ref = step(model, "autograd")
    with pytest.raises(AssertionError):
        assert_same_step(ref, _faulty_step(model, fault))


def test_stage_ends_are_streams_under_reversible():
    """The 'wrong stream' control reaches what it means to: under the reversible engine the
    stages hand each other both streams (StageEnd), which a fault can swap."""
    model = build("rev_mvitv2_tiny")
    pareprop.set_engine(model, "reversible")
    seen = []
    stage = model.backbone.body.stages[0]
    forward_ends = stage.forward_ends

    def spy(x):
        out = forward_ends(x)
        seen.append(isinstance(out, StageEnd))
        return out
    stage.forward_ends = spy
    model(*batch())
    assert seen == [True]
