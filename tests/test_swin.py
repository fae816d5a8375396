"""Rev-Swin: every engine against plain autograd (float64), window masks, padding, factories."""

from __future__ import annotations

import dataclasses
import json

import pytest
import timm
import torch

import pareprop
from pareprop.engine.testing import engine_errors
from pareprop.layers.window_attention import WindowAttention, window_mask
from pareprop.models.swin import SWIN_VARIANTS, RevSwinBlock, SwinConfig

TOL = 1e-8


def _tiny(**overrides):
    cfg = dict(
        embed_dim=8,
        depths=(1, 2, 3),
        num_heads=(1, 2, 2),
        window=4,
        patch_size=2,
        img_size=30,
        num_classes=5,
        drop_path_rate=0.2,
        proj_drop_rate=0.1,
        attn_drop_rate=0.1,
        drop_rate=0.1,
    )
    cfg.update(overrides)
    return pareprop.create_model("rev_swin_tiny_32", **cfg).double()


@pytest.mark.parametrize(
    "overrides",
    [
        # 15x15 tokens: padded to 16 in a shifted stage, odd size before merging; then 8x8
        # (even, shifted) and 4x4 (one window, no shift). Depths odd, even, odd.
        dict(img_size=30, depths=(1, 2, 3), num_heads=(1, 2, 2)),
        # 13x13 -> pad 3 (more than the shift), then 7x7 -> pad 1 in a shifted stage.
        dict(img_size=26, depths=(2, 1), num_heads=(1, 2)),
    ],
    ids=["30px-depths123", "26px-depths21"],
)
def test_engines_match_autograd(overrides):
    torch.manual_seed(0)
    model = _tiny(**overrides)
    x = torch.randn(2, 3, overrides["img_size"], overrides["img_size"], dtype=torch.float64)
    report = engine_errors(model, (x,), engines=("reversible", "pareprop"))
    n_params = len(list(model.parameters()))
    for engine, errors in report.items():
        assert "input:0" in errors
        assert sum(k.startswith("param:") for k in errors) == n_params
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = _tiny(img_size=26, depths=(2, 1), num_heads=(1, 2), engine="reversible")
    model.train()
    x = torch.randn(2, 3, 26, 26, dtype=torch.float64)
    model(x).square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def _dense_reference(block: RevSwinBlock, x: torch.Tensor) -> torch.Tensor:
    """Block F from first principles: attention over all tokens with an explicit mask.

    Token a may attend to token b iff both lie in the same window after the cyclic shift AND
    the shift did not wrap either of them across the map's edge relative to the other (their
    offset in the rolled frame equals their offset in the image). Padding does not exist here:
    only real tokens take part.
    """
    B, H, W, C = x.shape
    attn: WindowAttention = block.attn
    w, s, heads = block.window, block.shift, attn.num_heads
    Hp, Wp = -(-H // w) * w, -(-W // w) * w
    r, c = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    r, c = r.flatten(), c.flatten()
    rr, cr = (r - s) % Hp, (c - s) % Wp  # positions in the rolled (padded) frame
    same_window = ((rr[:, None] // w) == (rr[None] // w)) & ((cr[:, None] // w) == (cr[None] // w))
    no_wrap = ((rr[:, None] - rr[None]) == (r[:, None] - r[None])) & (
        (cr[:, None] - cr[None]) == (c[:, None] - c[None])
    )
    allowed = same_window & no_wrap  # (HW, HW)
    dr = (r[:, None] - r[None]).clamp(-(w - 1), w - 1) + (w - 1)
    dc = (c[:, None] - c[None]).clamp(-(w - 1), w - 1) + (w - 1)
    bias = attn.relative_position_bias_table[dr * (2 * w - 1) + dc].permute(2, 0, 1)

    t = block.norm1(x).reshape(B, H * W, C)
    q, k, v = attn.qkv(t).view(B, H * W, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    logits = (q * attn.scale) @ k.transpose(-2, -1) + bias  # (B, heads, HW, HW)
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, H * W, C)
    return attn.proj(out).view(B, H, W, C)


@pytest.mark.parametrize("size", [(8, 8), (7, 7), (5, 7), (3, 2)])
@pytest.mark.parametrize("shift", [0, 2])
def test_window_attention_matches_dense_reference(size, shift):
    torch.manual_seed(0)
    block = RevSwinBlock(dim=8, num_heads=2, window=4, shift=shift).double().eval()
    H, W = size
    x = torch.randn(2, H, W, 8, dtype=torch.float64)
    masks = {"mask": window_mask(H, W, 4, 0), "shift_mask": window_mask(H, W, 4, shift)}
    masks = {k: v for k, v in masks.items() if v is not None}
    got = block.f(x, **masks)
    ref = _dense_reference(block, x)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)


def test_window_mask_needs_no_mask_without_shift_or_padding():
    assert window_mask(8, 8, 4, 0) is None
    mask = window_mask(7, 8, 4, 0)
    assert mask.shape == (4, 16, 16)
    # Every query keeps at least itself, so no softmax row is fully masked.
    assert mask.diagonal(dim1=1, dim2=2).all()


def test_timm_create_model():
    model = timm.create_model("rev_swin_tiny", num_classes=42)
    assert model.num_classes == 42 and model.head.out_features == 42
    assert model.pretrained_cfg["input_size"] == (3, 224, 224)
    assert model.num_features == 2 * 768
    # A forward at 224 px, through timm too, on a narrow copy to keep the test fast.
    small = timm.create_model("rev_swin_tiny", num_classes=42, embed_dim=8, num_heads=(1, 1, 2, 2))
    small.eval()
    with torch.no_grad():
        (x,) = small.example_inputs(1)
        assert small(x).shape == (1, 42)


def test_variant_table_matches_spec():
    dims = {"tiny": 96, "small": 96, "base": 128, "large": 192, "huge": 352, "giant": 512}
    for size, dim in dims.items():
        cfg = SWIN_VARIANTS[f"rev_swin_{size}"]
        depths = {"tiny": (2, 2, 6, 2), "giant": (2, 2, 42, 2)}.get(size, (2, 2, 18, 2))
        assert (cfg.embed_dim, cfg.depths, cfg.window, cfg.img_size) == (
            dim,
            depths,
            7,
            (224, 224),
        )
        assert f"rev_swin_{size}" in pareprop.list_models("rev_swin_*")
    assert SWIN_VARIANTS["rev_swin_tiny_32"].img_size == (32, 32)


def test_model_interface():
    model = _tiny()
    assert model.no_weight_decay() and all(
        "relative_position_bias_table" in n for n in model.no_weight_decay()
    )
    model.set_grad_checkpointing()  # merging and fusion; tests/test_grad_checkpointing.py
    assert all(s.grad_checkpointing for s in model.stages)
    model.set_engine("pareprop")
    assert all(m.engine == "pareprop" for m in model.modules() if hasattr(m, "engine"))
    model.reset_classifier(3)
    (x,) = model.example_inputs(2, dtype=torch.float64)
    assert x.shape == (2, 3, 30, 30)
    feats = model.forward_features(x)
    assert feats.shape[-1] == model.num_features
    assert model.forward_head(feats).shape == (2, 3)
    assert model.forward_head(feats, pre_logits=True).shape == (2, model.num_features)


def test_config_json_round_trip():
    model = _tiny()
    data = json.loads(json.dumps(dataclasses.asdict(model.cfg)))
    assert SwinConfig(**data) == model.cfg
    rebuilt = pareprop.create_model(model.model_name, **json.loads(json.dumps(model.model_kwargs)))
    assert rebuilt.cfg == model.cfg


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        ((2, 1, 30, 30), torch.float64, "with 3 channels|\\(B, 3, H, W\\)"),
        ((3, 30, 30), torch.float64, "\\(B, 3, H, W\\)"),
        ((2, 3, 31, 30), torch.float64, "multiples of patch_size=2"),
        ((2, 3, 30, 30), torch.int64, "floating-point image"),
    ],
)
def test_bad_input(shape, dtype, match):
    model = _tiny()
    with pytest.raises(ValueError, match=match):
        model(torch.zeros(shape, dtype=dtype))


def test_bad_config():
    with pytest.raises(ValueError, match="valid fields"):
        pareprop.create_model("rev_swin_tiny", not_a_field=1)
    with pytest.raises(ValueError, match="num_heads"):
        pareprop.create_model("rev_swin_tiny", depths=(2, 2), num_heads=(3, 6, 12))
    with pytest.raises(ValueError, match="engine"):
        pareprop.create_model("rev_swin_tiny_32", engine="fast")


def test_patch_embedding_is_the_shared_layer_with_its_norm():
    # Swin's stem is layers.PatchEmbed with a LayerNorm: a patch convolution, channels-last,
    # normalised per token, under the state-dict names Swin checkpoints use.
    from pareprop.layers import PatchEmbed

    torch.manual_seed(0)
    embed = PatchEmbed(3, 8, 4, 4, flatten=False, norm_layer=torch.nn.LayerNorm).double()
    x = torch.randn(2, 3, 16, 12, dtype=torch.float64)
    want = embed.norm(embed.proj(x).permute(0, 2, 3, 1))  # (B, H/4, W/4, C)
    torch.testing.assert_close(embed(x), want, rtol=0, atol=0)
    model = pareprop.create_model("rev_swin_tiny_32", num_classes=3)
    assert isinstance(model.patch_embed, PatchEmbed)
    assert [k for k in model.state_dict() if k.startswith("patch_embed.")] == [
        "patch_embed.proj.weight",
        "patch_embed.proj.bias",
        "patch_embed.norm.weight",
        "patch_embed.norm.bias",
    ]
