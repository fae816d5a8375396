"""pareprop.convert: a timm ViT rewired as a dual-residual reversible model. Exact at (1, 0)
(torch.equal in float32), Rev-ViT's coupling at (0, 1), the recursion in between, timm's names
in the state dict, every engine against autograd, and the refusals."""

import copy

import pytest
import torch
import torch.nn as nn
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import (
    Block,
    ParallelScalingBlock,
    ResPostBlock,
    VisionTransformer,
)

import pareprop
from pareprop.convert import UnsupportedModelError
from pareprop.engine.testing import engine_errors, worst_error

SMALL = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=16, num_heads=2, num_classes=5)
# Each row a kind of timm ViT: class token, register tokens + mean pooling, layer scale,
# no class token, DeiT-III position embedding, pre-norm (CLIP style).
VARIANTS = {
    "token": dict(),
    "reg_avg": dict(reg_tokens=2, global_pool="avg"),
    "layer_scale": dict(init_values=0.1),
    "no_class_token": dict(class_token=False, global_pool="avg"),
    "no_embed_class": dict(no_embed_class=True, init_values=1e-2),
    "pre_norm": dict(pre_norm=True, qk_norm=True),
}


def _timm(depth=3, **kwargs):
    torch.manual_seed(0)
    return VisionTransformer(depth=depth, **{**SMALL, **kwargs})


def _images(n=3, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(n, 3, 16, 16, dtype=dtype)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_timm_to_the_bit_at_one_zero(variant):
    source = _timm(**VARIANTS[variant]).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    x = _images()
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
        assert torch.equal(model.forward_features(x), source.forward_features(x))


@pytest.mark.parametrize("variant", ["token", "no_embed_class"])
def test_set_input_size_follows_timm(variant):
    source = _timm(**VARIANTS[variant]).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    source.set_input_size(img_size=(24, 32))
    model.set_input_size(img_size=(24, 32))
    assert model.pretrained_cfg["input_size"] == (3, 24, 32)
    assert model.example_inputs()[0].shape[-2:] == (24, 32)
    torch.manual_seed(2)
    x = torch.randn(2, 3, 24, 32)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
        assert model.forward_intermediates(x, intermediates_only=True)[0].shape[-2:] == (6, 8)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_training_step_equals_timm_at_one_zero(engine):
    # Dropout and drop-path on: the blocks draw in timm's order, and at beta = 0 every block is
    # stored, so every engine gives timm's logits and gradients exactly.
    kwargs = dict(drop_path_rate=0.2, proj_drop_rate=0.1)
    source = _timm(**kwargs).train()
    model = pareprop.convert(copy.deepcopy(source), engine=engine).train()
    x = _images()
    results = []
    for m in (source, model):
        torch.manual_seed(3)
        out = m(x)
        out.square().sum().backward()
        results.append((out, {n: p.grad for n, p in m.state_dict(keep_vars=True).items()
                              if isinstance(p, nn.Parameter)}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name


def _h(block, j):
    """timm's residual sub-layer j (0: attention, 1: MLP) of a block."""
    if j == 0:
        return lambda x: block.drop_path1(block.ls1(block.attn(block.norm1(x))))
    return lambda x: block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_forward_is_the_dual_residual_recursion(alpha, beta):
    source = _timm(init_values=0.5).double().eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    pareprop.set_coupling(model, alpha, beta)
    x = _images(dtype=torch.float64)
    # The coefficients are float32 buffers (so nothing recompiles when they change).
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    # z_{j+1} = alpha z_j + beta z_{j-1} + H_j(z_j), z_0 = z_1 = x; the head reads z_{2L+1}.
    z = source.norm_pre(source._pos_embed(source.patch_embed(x)))
    previous = z
    for block in source.blocks:
        for j in range(2):
            z, previous = alpha * z + beta * previous + _h(block, j)(z), z
    want = source.forward_head(source.norm(z))
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)
    if (alpha, beta) == (0.0, 1.0):  # Rev-ViT's coupling Y1 = X1 + F(X2), Y2 = X2 + G(Y1)
        x0 = source.norm_pre(source._pos_embed(source.patch_embed(x)))
        x1, x2 = x0, x0
        for block in source.blocks:
            x1 = x1 + _h(block, 0)(x2)
            x2 = x2 + _h(block, 1)(x1)
        torch.testing.assert_close(model.forward_features(x), source.norm(x2), rtol=1e-12,
                                   atol=1e-12)


def _recursion(source, x, alpha, beta):
    """timm's logits of the dual-residual recursion, coefficients rounded to float32."""
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    z = source.norm_pre(source._pos_embed(source.patch_embed(x)))
    previous = z
    for block in source.blocks:
        for j in range(2):
            z, previous = alpha * z + beta * previous + _h(block, j)(z), z
    return source.forward_head(source.norm(z))


def test_coupling_survives_a_cast_and_stays_float32():
    # alpha is a buffer: a cast (.double(), .to(device)) must keep its value, and keep it
    # float32's (0.3 set after the cast is float32's 0.3, as the skip scale's).
    source = _timm(init_values=0.5).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    pareprop.set_coupling(model, 0.3, 0.5)
    model.double()
    source.double()
    x = _images(dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _recursion(source, x, 0.3, 0.5), rtol=1e-12,
                                   atol=1e-12)
        pareprop.set_coupling(model, 0.3, 0.5)
        assert all(b.alpha.dtype == torch.float32 for b in model.stack.blocks)
        torch.testing.assert_close(model(x), _recursion(source, x, 0.3, 0.5), rtol=1e-12,
                                   atol=1e-12)


def test_convert_keeps_the_sources_mode():
    for training in (False, True):
        model = pareprop.convert(_timm().train(training))
        assert {m.training for m in model.modules()} == {training}


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_engines_match_autograd_on_a_converted_model(depth, alpha, beta):
    source = _timm(depth=depth, drop_path_rate=0.3, proj_drop_rate=0.2, attn_drop_rate=0.2,
                   reg_tokens=1, init_values=0.5).double()
    model = pareprop.convert(source, tolerance=None)
    pareprop.set_coupling(model, alpha, beta)
    assert model.stack.stored_blocks == ()
    report = engine_errors(model, _images(dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def test_state_dict_has_timm_names_both_ways():
    source = _timm(reg_tokens=1)
    model = pareprop.convert(_timm(reg_tokens=1, depth=3))
    assert list(model.state_dict()) == list(source.state_dict())
    torch.manual_seed(5)
    other = _timm(reg_tokens=1)
    for p in other.parameters():
        p.data.normal_()
    model.load_state_dict(other.state_dict(), strict=True)
    fresh = _timm(reg_tokens=1)
    fresh.load_state_dict(model.state_dict(), strict=True)
    for (n, a), b in zip(other.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    # named parameters are the stack's; timm's layer decay groups them by block
    names = [n for n, _ in model.named_parameters()]
    assert "stack.blocks.2.attn.qkv.weight" in names
    from timm.optim import param_groups_layer_decay

    groups = param_groups_layer_decay(model, layer_decay=0.5)
    scales = sorted({g["lr_scale"] for g in groups})
    assert len(scales) == 3 + 2  # stem, three blocks, head


def test_timm_contract():
    model = pareprop.convert(_timm(), engine="autograd")
    assert model.num_features == model.head_hidden_size == 16
    assert model.get_classifier() is model.head
    x = model.example_inputs(2)[0]
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 16)
    model.reset_classifier(7, global_pool="avg")
    assert model(x).shape == (2, 7) and model.num_classes == 7
    model.reset_classifier(0)
    assert model(x).shape == (2, 16)
    feats = model.forward_intermediates(x, intermediates_only=True)
    assert feats[0].shape == (2, 16, 4, 4)
    with pytest.raises(ValueError, match="class token"):
        pareprop.convert(_timm(class_token=False, global_pool="avg")).reset_classifier(
            3, global_pool="token")


@pytest.mark.parametrize(
    "build,reason",
    [
        (lambda: _timm(block_fn=ResPostBlock), "post-norm"),
        (lambda: _timm(block_fn=ParallelScalingBlock), "in parallel"),
        (lambda: nn.Sequential(nn.Linear(2, 2)), "does not know Sequential; it converts timm"),
        (lambda: VisionTransformerDistilled(depth=2, **SMALL), "subclasses"),
    ],
)
def test_unsupported_models_are_refused_with_the_reason(build, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        pareprop.convert(build())


def test_a_subclass_of_timms_block_is_refused():
    # A subclass may change forward (another residual, a third branch): only Block itself.
    class MyBlock(Block):
        pass

    with pytest.raises(UnsupportedModelError, match="block 0 is a MyBlock"):
        pareprop.convert(_timm(block_fn=MyBlock))


def test_activation_memory_is_flat_in_depth_at_zero_one():
    x = _images(2)
    kept = []
    for depth in (2, 4):
        model = pareprop.convert(_timm(depth=depth), engine="reversible").train()
        pareprop.set_coupling(model, 0.0, 1.0)
        model(x)  # the guard measures once: nothing stored at beta = 1 in float32
        assert model.stack.stored_blocks == ()
        kept.append(pareprop.activation_bytes(model, x))
    assert kept[0] == kept[1]


def test_stack_keeps_what_rev_vit_keeps_at_zero_one():
    # At (0, 1) the converted stack keeps exactly what Rev-ViT's stack keeps: its two outputs.
    x = torch.randn(2, 17, 16)
    model = pareprop.convert(_timm(depth=4)).train()
    pareprop.set_coupling(model, 0.0, 1.0)
    rev = pareprop.create_model("rev_vit_tiny_patch4_32", embed_dim=16, depth=4, num_heads=2)
    kept = [pareprop.activation_bytes(m.stack, x, x) for m in (model, rev.train())]
    assert kept[0] == kept[1] == 2 * x.numel() * x.element_size()


@pytest.mark.parametrize("name", [
    "vit_small_patch16_224", "deit3_small_patch16_224", "vit_small_patch14_reg4_dinov2",
    "vit_medium_patch16_gap_256", "vit_base_patch32_clip_224", "vit_base_patch16_siglip_224",
])
def test_timm_named_configs_are_exact_at_one_zero(name):
    # timm's own configurations (DeiT-III layer scale, DINOv2 registers, mean pooling, CLIP
    # pre-norm and quick-GELU, SigLIP attention pooling), two blocks deep, 32x32 input.
    import timm

    torch.manual_seed(0)
    source = timm.create_model(name, pretrained=False, depth=2, img_size=32, num_classes=7)
    model = pareprop.convert(copy.deepcopy(source.eval()), engine="autograd").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), source(x))


@pytest.mark.parametrize("name,reason", [
    ("vit_small_patch16_18x2_224", "in parallel"),
    ("vit_base_patch16_rpn_224", "post-norm"),
    ("deit_small_distilled_patch16_224", "subclasses"),
])
def test_timm_named_configs_that_are_refused(name, reason):
    import timm

    source = timm.create_model(name, pretrained=False, depth=2, img_size=32, num_classes=7)
    with pytest.raises(UnsupportedModelError, match=reason):
        pareprop.convert(source)


def test_hooks_on_the_blocks_are_refused_naming_the_block():
    # Issue 34.8: the converted model never calls a Block's forward, so its hooks were dropped.
    seen = []
    for register in ("register_forward_hook", "register_forward_pre_hook",
                     "register_full_backward_hook"):
        vit = _timm()
        handle = getattr(vit.blocks[1], register)(lambda *args: seen.append(args))
        with pytest.raises(UnsupportedModelError, match="block 1 has .* hook"):
            pareprop.convert(vit)
        handle.remove()  # what the message says to do
        pareprop.convert(vit)
    vit = _timm()
    vit.blocks.register_forward_hook(lambda *args: None)
    with pytest.raises(UnsupportedModelError, match="model.blocks has forward hook"):
        pareprop.convert(vit)
    # hooks on a block's submodules run in the converted model: kept
    vit = _timm()
    vit.blocks[0].attn.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    pareprop.convert(vit).eval()(_images())
    assert seen == [torch.Size([3, 17, 16])]


def test_a_failed_load_timm_weights_leaves_the_model_untouched(tmp_path):
    from safetensors.torch import save_file

    from pareprop.convert import load_timm_weights
    from pareprop.pretrained import PretrainedError

    vit = _timm(depth=2)
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    other = _timm(depth=3)  # one block more: its first two fit, the third does not
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()},
              str(tmp_path / "deeper.pth"))  # safetensors named .pth: read by content
    with pytest.raises(PretrainedError, match="unexpected, first blocks.2"):
        load_timm_weights(vit, str(tmp_path / "deeper.pth"))
    assert all(torch.equal(v, before[k]) for k, v in vit.state_dict().items())
