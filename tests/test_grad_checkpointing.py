"""set_grad_checkpointing: the blocks that are not reversible run under activation
checkpointing, exactly, under every engine, and keep less."""

from __future__ import annotations

import pytest
import timm
import torch

import pareprop
from pareprop import ENGINES, activation_bytes
from pareprop.engine.testing import relative_error
from pareprop.models._features import StageEnd

TOL = 1e-10
# Float64, drop-path and dropout on, odd map sizes (Swin pads before merging).
TINY = {
    "rev_mvitv2_tiny_32": dict(embed_dim=8, img_size=32, drop_path_rate=0.3),
    "rev_mvit_base": dict(embed_dim=8, img_size=32, depth=4, transition_blocks=(2,),
                          drop_path_rate=0.3),
    "rev_mvit_base_16x4": dict(num_frames=4, embed_dim=8, img_size=32, depth=4,
                               transition_blocks=(2,), kv_stride=(1, 4, 4), drop_path_rate=0.3,
                               drop_rate=0.1),
    "rev_swin_tiny_32": dict(
        embed_dim=8,
        depths=(1, 2, 1),
        num_heads=(1, 2, 2),
        window=4,
        img_size=30,
        drop_path_rate=0.3,
        proj_drop_rate=0.1,
    ),
}


def _model(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return pareprop.create_model(name, num_classes=5, **{**TINY[name], **kw}).double().train()


def _step(model: torch.nn.Module, x: torch.Tensor, seed: int = 1):
    """Seeded forward and backward: (output, input grad, {name: param grad})."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model(x)
        out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _gradient_errors(got: dict, want: dict) -> dict:
    """Relative error per parameter above TOL. MViT's key-norm bias has an exact gradient of 0
    (softmax ignores a shift of the keys' scores), so it is checked for ~0 instead."""
    bad = {}
    for n, g in got.items():
        if n.endswith("norm_k.bias"):
            err = float(g.abs().max())
            if not err < 1e-12:
                bad[n] = err
        elif not relative_error(g, want[n]) < TOL:
            bad[n] = relative_error(g, want[n])
    return bad


def _checkpointed_modules(model: torch.nn.Module) -> list:
    return [n for n, m in model.named_modules() if getattr(m, "grad_checkpointing", False)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(TINY))
def test_checkpointed_step_equals_plain_autograd(name, engine):
    reference = _model(name, engine="autograd")
    model = _model(name, engine=engine)
    model.set_grad_checkpointing()
    assert _checkpointed_modules(model), "some block is checkpointed"
    (x,) = reference.example_inputs(2, dtype=torch.float64)
    want, got = _step(reference, x), _step(model, x)
    assert relative_error(got[0], want[0]) < TOL
    assert relative_error(got[1], want[1]) < TOL
    assert set(got[2]) == set(want[2])
    bad = _gradient_errors(got[2], want[2])
    assert not bad, bad


@pytest.mark.parametrize("name", list(TINY))
def test_checkpointing_keeps_less_and_stays_flat_in_depth(name):
    kept = {}
    for gc in (False, True):
        model = _model(name, engine="reversible")
        model.set_grad_checkpointing(gc)
        (x,) = model.example_inputs(4, dtype=torch.float64)
        kept[gc] = activation_bytes(model, x)
    assert kept[True] < 0.8 * kept[False], kept
    # A deeper last stack: the reversible engines keep the same under checkpointing too.
    depths = [dict(depths=(1, 2, 1)), dict(depths=(1, 2, 5))]
    if name.startswith("rev_mvit"):
        depths = [dict(depth=6), dict(depth=10)]
    flat = []
    for deeper in depths:
        model = _model(name, engine="reversible", **deeper)
        model.set_grad_checkpointing()
        (x,) = model.example_inputs(4, dtype=torch.float64)
        flat.append(activation_bytes(model, x))
    assert flat[0] == flat[1]


@pytest.mark.parametrize("name", list(TINY))
def test_switching_off_and_eval_change_nothing(name):
    model = _model(name, engine="reversible")
    (x,) = model.example_inputs(2, dtype=torch.float64)
    before = _step(model, x)
    model.set_grad_checkpointing(True)
    assert model.grad_checkpointing
    model.set_grad_checkpointing(False)
    assert not _checkpointed_modules(model)
    after = _step(model, x)
    assert torch.equal(before[0], after[0])
    model.set_grad_checkpointing(True)
    model.eval()
    with torch.no_grad():
        plain = model(x)
    model.set_grad_checkpointing(False)
    with torch.no_grad():
        assert torch.equal(model(x), plain)


def test_models_without_such_blocks_accept_it_and_keep_the_same():
    torch.manual_seed(0)
    model = pareprop.create_model(
        "rev_vit_tiny_patch4_32", embed_dim=16, depth=2, num_heads=2, img_size=16,
        engine="reversible",
    )
    (x,) = model.example_inputs(2)
    before = activation_bytes(model, x)
    model.set_grad_checkpointing()
    assert model.grad_checkpointing
    assert activation_bytes(model, x) == before


@pytest.mark.parametrize("name", list(TINY))
def test_features_only_backbone_checkpoints_with_the_same_gradients(name):
    # Detection and segmentation pipelines train features_only backbones this way.
    grads = []
    for gc in (False, True):
        torch.manual_seed(0)
        kw = {k: v for k, v in TINY[name].items() if k not in ("proj_drop_rate", "drop_rate")}
        net = timm.create_model(
            name, features_only=True, dtype=torch.float64, engine="pareprop", **kw
        ).train()
        net.set_grad_checkpointing(gc)
        frames = (kw["num_frames"],) if "num_frames" in kw else ()  # clips (B, C, T, H, W)
        x = torch.randn(2, 3, *frames, kw["img_size"], kw["img_size"], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(2))
        torch.manual_seed(1)
        sum(f.square().mean() for f in net(x)).backward()
        grads.append({n: p.grad for n, p in net.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    bad = _gradient_errors(grads[1], grads[0])
    assert not bad, bad


def _saved_during_forward(model, x):
    """Every tensor autograd saves in a bf16-autocast forward, and each stack's output streams."""
    saved, ends = [], []
    hooks = [s.register_forward_hook(lambda m, a, out: ends.append(out))
             for s in model.modules() if isinstance(s, pareprop.ReversibleStack)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
    finally:
        for h in hooks:
            h.remove()
    return saved, ends


@pytest.mark.parametrize("name", ["rev_mvitv2_tiny_32", "rev_mvit_base", "rev_mvit_base_16x4"])
def test_checkpointed_mvits_keep_each_stage_end_once(name):
    # NOTE [ Stage ends kept once ]: a transition (or the last norm) joins the previous
    # stack's streams inside its checkpoint, so what is kept is the streams, which the engine
    # keeps anyway, not their concatenation beside them. Fails if stages hand on joined maps.
    model = _model(name, engine="reversible").float()
    model.set_grad_checkpointing()
    (x,) = model.example_inputs(2)
    x.requires_grad_(True)
    saved, ends = _saved_during_forward(model, x)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    assert len(ends) >= 2
    for y1, y2 in ends:
        for y in (y1, y2):
            assert y.untyped_storage().data_ptr() in storages  # the streams are kept...
        joined = [t for t in saved
                  if t.numel() == 2 * y1.numel() and t.shape[-1] == 2 * y1.shape[-1]]
        assert not joined, [tuple(t.shape) for t in joined]  # ...and not their join


@pytest.mark.parametrize("name", [*TINY, "rev_vit"])
def test_checkpointed_stems_keep_the_images_not_a_bfloat16_copy(name):
    # Under autocast a patch embedding's convolution saves a bfloat16 copy of the images;
    # checkpointed (hierarchical models under set_grad_checkpointing, Rev-ViT with its stack
    # chunked) the stem keeps the images themselves, which the caller holds anyway.
    if name == "rev_vit":
        model = pareprop.create_model("rev_vit_tiny_patch4_32", embed_dim=16, depth=2,
                                      num_heads=2, num_classes=5, engine="reversible")
        pareprop.set_chunking(model, chunks=2)
    else:
        model = _model(name, engine="reversible").float()
        model.set_grad_checkpointing()
    (x,) = model.example_inputs(2)
    saved, _ = _saved_during_forward(model, x)
    assert any(t is x or t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
               for t in saved)
    assert not [t for t in saved if t.dtype == torch.bfloat16 and t.shape == x.shape]


@pytest.mark.parametrize("engine", ENGINES)
def test_stages_hand_on_streams_only_where_the_stack_keeps_them(engine):
    # Under plain autograd a stack's outputs are not kept: handing them on to a checkpointed
    # transition would keep both streams and make their join again inside it, a map more.
    model = _model("rev_mvitv2_tiny_32", engine=engine)
    model.set_grad_checkpointing()
    (x,) = model.example_inputs(2, dtype=torch.float64)
    stage = model.stages[0]
    handed = stage.forward_ends(model._stem(x))
    assert isinstance(handed, StageEnd) == (engine != "autograd")
    with torch.no_grad():
        assert not isinstance(stage.forward_ends(model._stem(x)), StageEnd)
    model.eval()
    assert not isinstance(stage.forward_ends(model._stem(x)), StageEnd)
