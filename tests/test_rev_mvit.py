"""The published Rev-MViT-B (MViTv1 pooling attention): every engine against plain autograd
(float64) over stacks of 1, 2 and 3 blocks, the published sizes, the timm interface."""

from __future__ import annotations

import pytest
import timm
import torch

import pareprop
from pareprop.engine.testing import engine_errors
from pareprop.layers.multiscale_attention import MultiScaleAttention
from pareprop.models.rev_mvit import RevMViTv1Transition

TOL = 1e-8


def _tiny(**overrides):
    kw = dict(img_size=32, embed_dim=8, depth=7, transition_blocks=(1, 3), num_classes=5,
              drop_path_rate=0.3, drop_rate=0.1)
    kw.update(overrides)
    return pareprop.create_model("rev_mvit_base", **kw).double()


def _check(model, x):
    # Key-norm biases shift every key alike, which softmax ignores: their exact gradient is 0
    # (tests/test_mvit.py), so a relative error would compare rounding noise.
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("norm_k.bias"))
    try:
        report = engine_errors(model, (x,), engines=("reversible", "pareprop"))
    finally:
        model.requires_grad_(True)
    for engine, errors in report.items():
        assert "input:0" in errors and len(errors) > 50
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"


@pytest.mark.parametrize(
    "overrides, sizes",
    [
        (dict(), [1, 1, 3]),  # odd stacks, 1 and 3
        (dict(depth=6), [1, 1, 2]),  # an even stack
        (dict(depth=4, transition_blocks=(2,)), [2, 1]),
    ],
    ids=["stacks113", "stacks112", "stacks21"],
)
def test_every_engine_matches_autograd(overrides, sizes):
    torch.manual_seed(0)
    model = _tiny(**overrides)
    assert [len(s.stack.blocks) for s in model.stages] == sizes
    (x,) = model.example_inputs(2, dtype=torch.float64)
    _check(model, x)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_eval_logits_equal_under_every_engine(engine):
    torch.manual_seed(0)
    model = _tiny(drop_path_rate=0.0, drop_rate=0.0).eval()
    (x,) = model.example_inputs(2, dtype=torch.float64)
    with torch.no_grad():
        ref = model.set_engine("autograd")(x)
        out = model.set_engine(engine)(x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_memory_budget_keeps_gradients_exact():
    torch.manual_seed(0)
    model = _tiny(drop_path_rate=0.0)
    (x,) = model.example_inputs(2, dtype=torch.float64)
    plan = pareprop.set_memory_budget(model, 0.5, x, cost="flops")
    assert 0 < plan.num_stored < 5
    _check(model, x)


def test_published_sizes():
    model = pareprop.create_model("rev_mvit_base", device="meta")
    assert sum(p.numel() for p in model.parameters()) == 39_689_320  # 39.7M as published
    widths = [s.stack.blocks[0].norm1.normalized_shape[0] for s in model.stages]
    heads = [s.stack.blocks[0].attn.num_heads for s in model.stages]
    kv = [s.stack.blocks[0].attn.pool_k.stride[0] for s in model.stages]
    assert widths == [96, 192, 384, 768] and heads == [1, 2, 4, 8] and kv == [4, 2, 1, 1]
    assert [len(s.stack.blocks) for s in model.stages] == [1, 1, 10, 1]
    assert model.num_features == 1536 and model.pos_embed.shape == (1, 3136, 96)
    # Queries are pooled only in the transitions; keys and values everywhere.
    for s in model.stages:
        assert all(b.attn.pool_q is None for b in s.stack.blocks)
        if s.transition is not None:
            assert s.transition.attn.pool_q.stride == (2, 2)
    assert model.pretrained_cfg["crop_pct"] == 0.875
    assert model.pretrained_cfg["url"].endswith("REV_MVIT_B.pyth")


def test_transition_shortcut_is_the_query_pooling():
    torch.manual_seed(0)
    block = RevMViTv1Transition(8, 2, kv_stride=1, fusion_mlp_ratio=0.0).double().eval()
    x = torch.randn(2, 5, 7, 8, dtype=torch.float64)
    # With the attention and the MLP silenced, what is left is the shortcut alone.
    for m in (block.attn.proj, block.mlp.fc2):
        torch.nn.init.zeros_(m.weight)
        torch.nn.init.zeros_(m.bias)
    out = block(x)
    assert out.shape == (2, 3, 4, 8)
    per_head = x.reshape(2, 5, 7, 2, 4).permute(0, 3, 4, 1, 2).reshape(4, 4, 5, 7)
    pooled = block.attn.pool_q(per_head)  # (B * heads, hd, 3, 4)
    ref = block.attn.norm_q(pooled.reshape(2, 2, 4, 3, 4).permute(0, 3, 4, 1, 2))
    torch.testing.assert_close(out, ref.reshape(2, 3, 4, 8))


def test_attention_pools_keys_always_queries_only_with_a_stride():
    a = MultiScaleAttention(8, 2, stride_q=1, stride_kv=1)
    assert a.pool_q is None and a.pool_k is not None
    b = MultiScaleAttention(8, 2, stride_q=2, stride_kv=4)
    out, hw = b(torch.randn(1, 35, 8), (5, 7))
    assert hw == (3, 4) and out.shape == (1, 12, 8)


def test_timm_interface():
    torch.manual_seed(0)
    model = timm.create_model("rev_mvit_base", **dict(
        img_size=32, embed_dim=8, depth=4, transition_blocks=(2,), num_classes=3))
    (x,) = model.example_inputs(2)
    assert model(x).shape == (2, 3)
    assert model.forward_features(x).shape == (2, 4, 4, 32)
    net = timm.create_model("rev_mvit_base", features_only=True, img_size=32, embed_dim=8,
                            depth=4, transition_blocks=(2,))
    assert [f.shape[1] for f in net(x)] == [16, 32]
    model.set_grad_checkpointing()
    model.set_engine("pareprop")
    model(x).sum().backward()
    assert model.no_weight_decay() == {"pos_embed"}


def test_catalog_depth_grows_the_deepest_stage():
    from pareprop.catalog import depth_overrides

    cfg = pareprop.create_model("rev_mvit_base", device="meta").cfg
    assert depth_overrides(cfg, 20) == {"depth": 20, "transition_blocks": (1, 3, 18)}
    assert depth_overrides(cfg, 7) == {"depth": 7, "transition_blocks": (1, 3, 5)}
    with pytest.raises(ValueError, match="at least 7"):
        depth_overrides(cfg, 6)


def test_bad_config():
    with pytest.raises(ValueError, match="transition_blocks"):
        pareprop.create_model("rev_mvit_base", depth=4, transition_blocks=(2, 3))
    with pytest.raises(ValueError, match="transition_blocks"):
        pareprop.create_model("rev_mvit_base", depth=4, transition_blocks=(0,))
    with pytest.raises(ValueError, match="heads"):
        pareprop.create_model("rev_mvit_base", embed_dim=6, num_heads=4, device="meta")
    with pytest.raises(ValueError, match=r"expected input 32x32"):
        _tiny()(torch.randn(1, 3, 48, 48, dtype=torch.float64))
