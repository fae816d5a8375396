"""Rev-MViTv2: every engine against plain autograd (float64) over stacks of 1, 2 and 3 blocks,
windows with padding, relative positions, the timm interface, bad input."""

from __future__ import annotations

import pytest
import torch

import pareprop
from pareprop.engine.testing import engine_errors
from pareprop.layers import PoolingAttention, rel_pos_table, window_partition, window_unpartition
from pareprop.models.mvit import MVIT_CONFIGS, MViTTransitionBlock, RevMViTBlock

TOL = 1e-8
ENGINES = ("reversible", "pareprop")


def _tiny(name: str = "rev_mvitv2_tiny_32", **overrides):
    kw = dict(embed_dim=8, num_classes=5, drop_path_rate=0.3, drop_rate=0.1)
    if MVIT_CONFIGS[name].patch_stride == 4:
        kw.update(img_size=32)  # 8x8 tokens
    else:
        kw.update(img_size=16)  # 8x8 tokens
    kw.update(overrides)
    return pareprop.create_model(name, **kw).double()


def _check(model, x):
    # The bias of the key norm adds the same vector to every key, which softmax ignores: its
    # exact gradient is 0, so a relative error would compare rounding noise with rounding
    # noise. It is checked for (near) zero instead, in test_key_norm_bias_gradient_is_zero.
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("norm_k.bias"))
    try:
        report = engine_errors(model, (x,), engines=ENGINES)
    finally:
        model.requires_grad_(True)
    for engine, errors in report.items():
        assert "input:0" in errors
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"
    return report


def _stack_sizes(model):
    return [len(s.stack.blocks) if s.stack is not None else 0 for s in model.stages]


@pytest.mark.parametrize("name", pareprop.list_models("rev_mvitv2*"))
def test_every_variant_matches_autograd(name):
    torch.manual_seed(0)
    model = _tiny(name)
    (x,) = model.example_inputs(2, dtype=torch.float64)
    _check(model, x)


@pytest.mark.parametrize(
    "overrides, sizes",
    [
        # Stacks of 1, 2 and 3 reversible blocks behind two transitions.
        (dict(depth=8, last_block_indexes=(0, 3)), [1, 2, 3]),
        # Windowed stages on a 10x10 map (window 4: padded to 12, keys 5 -> 6, masked),
        # odd sizes after the transition (5x5), rel-pos tables resized.
        (
            dict(depth=5, last_block_indexes=(1,), img_size=20, window_size=4, global_stages=0),
            [2, 2],
        ),
        # The SPEC CIFAR layout: a last stage with only its transition block.
        (dict(), [1, 1, 0]),
    ],
    ids=["stacks123", "windows-padded", "cifar-layout"],
)
def test_stack_layouts_match_autograd(overrides, sizes):
    torch.manual_seed(0)
    model = _tiny(**overrides)
    assert _stack_sizes(model) == sizes
    (x,) = model.example_inputs(2, dtype=torch.float64)
    _check(model, x)


def test_other_input_sizes_work_and_match():
    # Not a multiple of the window or of the strides: padding, cropping, resized tables.
    torch.manual_seed(0)
    model = _tiny(window_size=4, global_stages=1)
    x = torch.randn(2, 3, 21, 15, dtype=torch.float64)
    assert model(x).shape == (2, 5)
    assert model.forward_features(x).shape == (2, 3, 2, model.num_features)
    _check(model, x)


def test_key_norm_bias_gradient_is_zero():
    torch.manual_seed(0)
    model = _tiny(drop_path_rate=0.0, drop_rate=0.0).set_engine("autograd")
    (x,) = model.example_inputs(2, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        if name.endswith("norm_k.bias"):
            assert p.grad.abs().max() < 1e-12, name
        elif name.endswith("norm_k.weight"):
            assert p.grad.abs().max() > 1e-8, name  # the keys themselves do matter


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_eval_equals_training_forward_without_stochastic_layers(engine):
    torch.manual_seed(0)
    model = _tiny(drop_path_rate=0.0, drop_rate=0.0, depth=5, last_block_indexes=(1,))
    (x,) = model.example_inputs(2, dtype=torch.float64)
    model.set_engine("autograd").train()
    ref = model(x)
    model.set_engine(engine).eval()
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


def test_stochastic_layers_are_active():
    model = _tiny().train()
    (x,) = model.example_inputs(4, dtype=torch.float64)
    torch.manual_seed(0)
    a = model(x)
    torch.manual_seed(1)
    b = model(x)
    assert not torch.allclose(a, b)


def test_coupling_reads_x2_in_f():
    # The reference Rev-MViT computed F(X1) in forward but inverted with F(X2) (SPEC 6).
    torch.manual_seed(0)
    block = RevMViTBlock(8, 2, kv_stride=2, window=0, input_size=(4, 6)).double()
    x1, x2 = torch.randn(2, 2, 24, 8, dtype=torch.float64)
    y1, y2 = block(x1, x2, hw=(4, 6))
    torch.testing.assert_close(y1, x1 + block.f(x2, hw=(4, 6)))
    torch.testing.assert_close(y2, x2 + block.g(y1, hw=(4, 6)))
    assert not torch.allclose(y1, x1 + block.f(x1, hw=(4, 6)))


def test_transition_halves_the_map():
    block = MViTTransitionBlock(8, 2, kv_stride=1, window=0, input_size=(7, 5)).double()
    out = block(torch.randn(2, 7, 5, 8, dtype=torch.float64))
    assert out.shape == (2, 4, 3, 8)


def test_window_partition_round_trip():
    x = torch.randn(2, 7, 5, 3)
    windows, padded = window_partition(x, 3)
    assert windows.shape == (2 * 3 * 2, 3, 3, 3) and padded == (9, 6)
    torch.testing.assert_close(window_unpartition(windows, 3, padded, (7, 5)), x)


def test_padded_keys_are_masked():
    # Pointwise pooling (kernel 1, stride 1): each window then attends exactly like global
    # attention over its crop, including the partial windows at the border, only if the
    # zero-padded keys get no weight.
    torch.manual_seed(0)
    attn = PoolingAttention(8, 8, 2, pool_kernel=1, window_size=4, use_rel_pos=False).double()
    x = torch.randn(1, 6, 7, 8, dtype=torch.float64)
    out = attn(x)
    for rows, cols in [(slice(0, 4), slice(0, 4)), (slice(4, 6), slice(4, 7))]:
        torch.testing.assert_close(out[:, rows, cols], attn(x[:, rows, cols]))


def test_window_covering_the_map_is_global():
    torch.manual_seed(0)
    kw = dict(stride_kv=2, input_size=(6, 6))
    windowed = PoolingAttention(8, 8, 2, window_size=8, **kw).double()
    full = PoolingAttention(8, 8, 2, window_size=0, **kw).double()
    full.load_state_dict(windowed.state_dict())
    x = torch.randn(2, 6, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(windowed(x), full(x))


def test_rel_pos_table_indexes_and_resizes():
    table = torch.arange(7.0)[:, None].repeat(1, 2)  # length 2 * 4 - 1
    r = rel_pos_table(table, 4, 4)
    assert r.shape == (4, 4, 2)
    assert r[0, 0, 0] == 3 and r[3, 0, 0] == 6 and r[0, 3, 0] == 0  # offset q - k, centred
    r = rel_pos_table(table, 4, 2)  # k positions scaled by 2
    assert r.shape == (4, 2, 2) and r[0, 0, 0] == 2 and r[0, 1, 0] == 0 and r[3, 0, 0] == 5
    r = rel_pos_table(table, 8, 8)  # resized to 15 rows
    assert r.shape == (8, 8, 2) and r[0, 0, 0] == 3  # the centre stays the centre
    assert r[0, 7, 0] == 0 and r[7, 0, 0] == 6 and (r[1:, 0, 0] > r[:-1, 0, 0]).all()


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = _tiny(
        engine="reversible",
        depth=8,
        last_block_indexes=(0, 3),
        fusion_mlp_ratio=2.0,
        drop_path_rate=0.0,
    )
    (x,) = model.example_inputs(2, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if not name.endswith("norm_k.bias"):
            assert p.grad.abs().sum() > 0, name


def test_model_interface():
    model = _tiny(num_classes=7)
    assert model.num_features == 32  # 8 -> 16 (stack) -> 32 (stack), then a transition
    assert model.pretrained_cfg["input_size"] == (3, 16, 16)
    assert {"input_size", "num_classes", "mean", "std"} <= set(model.pretrained_cfg)
    (x,) = model.example_inputs(3, dtype=torch.float64)
    feats = model.forward_features(x)
    assert feats.shape == (3, 2, 2, 32)  # (B, H/8, W/8, C)
    assert model.forward_head(feats, pre_logits=True).shape == (3, 32)
    names = dict(model.named_parameters())
    nwd = model.no_weight_decay()
    assert nwd and nwd <= set(names) and all("rel_pos" in n for n in nwd)
    model.reset_classifier(4)
    assert model.num_classes == 4 and model(x).shape == (3, 4)
    model.set_grad_checkpointing()  # the transitions; tests/test_grad_checkpointing.py
    assert all(s.grad_checkpointing for s in model.stages)
    model.set_engine("pareprop")
    assert all(s.stack.engine == "pareprop" for s in model.stages if s.stack is not None)


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.randn(2, 4, 16, 16), r"expected input \(B, 3, H, W\).*got \(2, 4, 16, 16\)"),
        (torch.randn(2, 3, 4, 16), r"expected input at least 8x8 .*got \(2, 3, 4, 16\)"),
        (torch.zeros(2, 3, 16, 16, dtype=torch.uint8), r"floating-point.*torch.uint8"),
    ],
    ids=["channels", "too-small", "integer"],
)
def test_bad_input(bad, match):
    model = _tiny().float()
    with pytest.raises(ValueError, match=match):
        model(bad)


def test_bad_config():
    with pytest.raises(ValueError, match="last_block_indexes"):
        pareprop.create_model("rev_mvitv2_tiny_32", last_block_indexes=(2, 0))
    with pytest.raises(ValueError, match="divisible by the kv stride"):
        pareprop.create_model("rev_mvitv2_tiny_32", window_size=3, global_stages=0)
    with pytest.raises(ValueError, match="heads"):
        pareprop.create_model("rev_mvitv2_tiny_32", embed_dim=6, num_heads=4)
