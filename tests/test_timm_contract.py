"""timm's model contract, point by point, for every registered image model.

Big variants are built on the meta device (shapes only); forwards run on tiny overrides.
"""

from __future__ import annotations

import dataclasses

import pytest
import timm
import torch

import pareprop
from pareprop.layers._config import ConfigError
from pareprop.models._registry import _MODEL_FACTORIES

# The library's own models: other test modules register small ones of their own.
OWN_MODELS = [n for n in pareprop.list_models()
              if _MODEL_FACTORIES[n].__module__.startswith("pareprop.models")]
IMAGE_MODELS = [n for n in OWN_MODELS if timm.is_model(n)]
TEXT_MODELS = [n for n in OWN_MODELS if not timm.is_model(n)]


def _tiny_overrides(name: str) -> dict:
    """Small enough that a float64 forward on CPU takes milliseconds."""
    if name.startswith("rev_vit"):
        return dict(embed_dim=16, depth=2, num_heads=2, img_size=32, patch_size=8, num_classes=3)
    if name == "rev_mvit_base":
        return dict(embed_dim=8, depth=4, transition_blocks=(2,), img_size=32, num_classes=3)
    if name == "rev_mvit_base_16x4":
        return dict(embed_dim=8, depth=4, transition_blocks=(2,), num_frames=4, img_size=32,
                    kv_stride=(1, 4, 4), num_classes=3)
    if name.startswith("rev_mvitv2"):
        patch4 = pareprop.create_model(name, device="meta").cfg.patch_stride == 4
        return dict(embed_dim=8, img_size=32 if patch4 else 16, num_classes=3)
    if name.startswith("rev_swin"):
        return dict(
            embed_dim=8,
            depths=(1, 1, 1),
            num_heads=(1, 1, 2),
            window=4,
            patch_size=2,
            img_size=30,
            num_classes=3,
        )
    raise AssertionError(f"no tiny overrides for {name}")


def test_image_and_text_registries_are_split():
    # Other tests may register toy models, so check the shipped families by name.
    image = [
        n for n in pareprop.list_models() if n.startswith(("rev_vit", "rev_mvitv2", "rev_swin"))
    ]
    text = pareprop.list_models("*roberta*") + pareprop.list_models("text_encoder*")
    assert image and text
    assert all(timm.is_model(n) for n in image)
    assert not any(timm.is_model(n) for n in text)
    with pytest.raises(RuntimeError, match="Unknown model"):
        timm.create_model("rev_roberta_base")


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_meta_device_and_dtype_build_allocates_nothing_and_stores_neither(name):
    model = timm.create_model(name, device="meta", dtype=torch.bfloat16)
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    fields = {f.name for f in dataclasses.fields(model.cfg)}
    assert not fields & {"device", "dtype"}
    assert "device" not in model.model_kwargs and "dtype" not in model.model_kwargs
    # The same under a torch.device context instead of the keyword.
    with torch.device("meta"):
        assert all(p.is_meta for p in timm.create_model(name).parameters())


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_pretrained_cfg_names_real_modules(name):
    model = timm.create_model(name, device="meta")
    cfg = model.pretrained_cfg
    for key in (
        "input_size",
        "num_classes",
        "mean",
        "std",
        "crop_pct",
        "crop_mode",
        "interpolation",
        "first_conv",
        "classifier",
        "fixed_input_size",
        "pool_size",
        "url",
    ):
        assert key in cfg, key
    modules = dict(model.named_modules())
    assert cfg["first_conv"] in modules and cfg["classifier"] in modules
    first = modules[cfg["first_conv"]]
    assert isinstance(first, (torch.nn.Conv2d, torch.nn.Conv3d))  # Conv3d: video models
    assert first.in_channels == model.in_chans
    assert cfg["input_size"][0] == model.in_chans == model.cfg.in_chans
    assert len(cfg["mean"]) == len(cfg["std"]) == model.in_chans
    assert cfg["num_classes"] == model.num_classes == model.get_classifier().out_features


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_reset_classifier_keeps_device_and_dtype(name):
    model = timm.create_model(name, device="meta", dtype=torch.float64).eval()
    model.reset_classifier(7)
    head = model.get_classifier()
    assert head.weight.is_meta and head.weight.dtype == torch.float64
    assert not any(m.training for m in model.modules())  # the new head too
    assert model.num_classes == model.pretrained_cfg["num_classes"] == head.out_features == 7
    model.reset_classifier(0, "avg")
    assert isinstance(model.get_classifier(), torch.nn.Identity) and model.num_classes == 0
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(3, "token")


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_tiny_forward_widths_match_num_features_and_head_hidden_size(name):
    torch.manual_seed(0)
    model = timm.create_model(name, dtype=torch.float64, **_tiny_overrides(name)).eval()
    (x,) = model.example_inputs(2, dtype=torch.float64)
    feats = model.forward_features(x)
    # timm's rule: the channel axis is the model's feature_dim, else -1 for tokens (B, N, C)
    # and 1 for maps (B, C, H, W); our maps are channels-last and say so.
    axis = getattr(model, "feature_dim", None)
    axis = (-1 if feats.ndim == 3 else 1) if axis is None else axis
    assert feats.shape[axis] == model.num_features
    pooled = model.forward_head(feats, pre_logits=True)
    assert pooled.shape == (2, model.head_hidden_size)
    assert model(x).shape == (2, 3)
    model.reset_classifier(0)
    assert model(x).shape == (2, model.num_features)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("rev_vit_tiny_patch4_32", "ViTConfig"),
        ("rev_mvitv2_tiny_32", "MViTConfig"),
        ("rev_swin_tiny_32", "SwinConfig"),
        ("rev_roberta_small", "TextConfig"),
    ],
)
def test_one_config_error_format_for_every_family(name, cls):
    with pytest.raises(ConfigError) as err:
        pareprop.create_model(name, dpth=3, device="meta")
    assert isinstance(err.value, ValueError)
    valid = ", ".join(
        f.name for f in dataclasses.fields(type(pareprop.create_model(name, device="meta").cfg))
    )
    assert str(err.value) == f"unknown {cls} field(s) dpth; valid fields: {valid}"


def test_dtype_must_be_floating():
    with pytest.raises(ValueError, match="floating torch.dtype"):
        pareprop.create_model("rev_vit_tiny_patch4_32", dtype=torch.int64, device="meta")


@pytest.mark.parametrize(
    "name", ["rev_vit_tiny_patch4_32", "rev_mvitv2_tiny_32", "rev_swin_tiny_32"]
)
def test_meta_forward_after_dtype_change(name):
    # timm checks shapes on the meta device, then casts the model and runs it again; the meta
    # device has no autocast, which the engine must not ask about.
    model = timm.create_model(name, device="meta", dtype=torch.float32).eval()
    (x,) = model.example_inputs(1, device="meta")
    assert model(x).is_meta
    model.to(torch.bfloat16)
    assert model(x.bfloat16()).dtype == torch.bfloat16
    model.train().set_engine("pareprop")
    out = model(x.bfloat16().requires_grad_())
    assert out.shape == (1, model.num_classes) and out.requires_grad
