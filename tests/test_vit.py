"""Rev-ViT: every engine against plain autograd (float64), the timm interface, bad input."""

from __future__ import annotations

import pytest
import torch

import pareprop
from pareprop.engine.testing import engine_errors
from pareprop.models.vit import VIT_CONFIGS, RevViTBlock

TOL = 1e-8
ENGINES = ("reversible", "pareprop")


def _tiny(name: str = "rev_vit_tiny_patch4_32", **overrides) -> pareprop.models.vit.RevViT:
    cfg = VIT_CONFIGS[name]
    kw = dict(
        img_size=2 * cfg.patch_size,  # 2x2 patches (4 tokens)
        embed_dim=8,
        depth=3,
        num_heads=2,
        num_classes=5,
        drop_path_rate=0.3,
        attn_drop_rate=0.1,
        proj_drop_rate=0.1,
        drop_rate=0.1,
    )
    kw.update(overrides)
    return pareprop.create_model(name, **kw).double()


def _assert_exact(report):
    for engine, errors in report.items():
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"


@pytest.mark.parametrize("name", pareprop.list_models("rev_vit*"))
def test_every_variant_matches_autograd(name):
    torch.manual_seed(0)
    model = _tiny(name)
    (x,) = model.example_inputs(2, dtype=torch.float64)
    report = engine_errors(model, (x,), engines=ENGINES)
    n_params = len(list(model.parameters()))
    for errors in report.values():
        assert "input:0" in errors and "output" in errors
        assert sum(k.startswith("param:") for k in errors) == n_params
    _assert_exact(report)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_depths_match_autograd(depth):
    torch.manual_seed(1)
    model = _tiny(depth=depth, img_size=12, drop_path_rate=0.5)
    report = engine_errors(model, model.example_inputs(3, dtype=torch.float64), engines=ENGINES)
    _assert_exact(report)


def test_stochastic_layers_are_active():
    # The engine comparisons above are only meaningful if the masks really vary.
    model = _tiny().train()
    (x,) = model.example_inputs(4, dtype=torch.float64)
    torch.manual_seed(0)
    a = model(x)
    torch.manual_seed(1)
    b = model(x)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_eval_equals_training_forward_without_stochastic_layers(engine):
    torch.manual_seed(0)
    model = _tiny(drop_path_rate=0.0, attn_drop_rate=0.0, proj_drop_rate=0.0, drop_rate=0.0)
    (x,) = model.example_inputs(2, dtype=torch.float64)
    model.set_engine("autograd").train()
    ref = model(x)
    model.set_engine(engine).eval()
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


def test_coupling_reads_x2_in_f():
    torch.manual_seed(0)
    block = RevViTBlock(8, 2).double()
    x1, x2 = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    y1, y2 = block(x1, x2)
    torch.testing.assert_close(y1, x1 + block.f(x2))
    torch.testing.assert_close(y2, x2 + block.g(y1))


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = _tiny(engine="pareprop")
    # Enough samples that drop-path (0.3 at most) keeps every branch for one of them.
    (x,) = model.example_inputs(16, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_model_interface():
    model = _tiny(num_classes=7)
    assert model.num_features == 16
    assert model.pretrained_cfg["input_size"] == (3, 8, 8)
    assert model.default_cfg["num_classes"] == 7
    assert {"input_size", "num_classes", "mean", "std"} <= set(model.pretrained_cfg)
    (x,) = model.example_inputs(3, dtype=torch.float64)
    feats = model.forward_features(x)
    assert feats.shape == (3, 4, 16)  # (B, tokens, 2 * embed_dim)
    assert model.forward_head(feats, pre_logits=True).shape == (3, 16)
    assert model(x).shape == (3, 7)
    names = dict(model.named_parameters())
    assert model.no_weight_decay() and model.no_weight_decay() <= set(names)
    model.reset_classifier(4)
    assert model.num_classes == 4 and model.cfg.num_classes == 4 and model(x).shape == (3, 4)
    assert model.head.weight.dtype == torch.float64
    model.reset_classifier(0)
    assert model(x).shape == (3, 16)
    model.set_grad_checkpointing(True)  # accepted; the stack is the whole body
    assert model.grad_checkpointing
    model.set_engine("pareprop")
    assert model.stack.engine == "pareprop"


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.randn(2, 1, 8, 8), r"expected input.*3 channels, got \(2, 1, 8, 8\)"),
        (torch.randn(2, 3, 16, 16), r"expected input 8x8 with 3 channels, got \(2, 3, 16, 16\)"),
        (torch.randint(0, 255, (2, 3, 8, 8)), r"floating-point.*torch.int64"),
        (torch.randn(3, 8, 8), r"expected input \(B, 3, H, W\).*got \(3, 8, 8\)"),
    ],
    ids=["channels", "size", "integer", "rank"],
)
def test_bad_input(bad, match):
    model = _tiny().float()
    with pytest.raises(ValueError, match=match):
        model(bad)


def test_bad_config():
    with pytest.raises(ValueError, match="divisible by patch_size"):
        pareprop.create_model("rev_vit_tiny_patch4_32", img_size=30)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        pareprop.create_model("rev_vit_tiny_patch4_32", embed_dim=10, num_heads=3)
