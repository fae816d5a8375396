"""Multi-scale features: forward_intermediates, features_only backbones, every engine; images and
video clips (the video model's maps keep their time axis: (B, C, T, H, W))."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn

import pareprop
from pareprop.engine.testing import engine_errors

# Tiny float64 backbones with a stride-4 stem (MViTv2 ``_tiny``: 4x4 patches; Swin: patch 4).
TINY = {
    "rev_mvitv2_tiny": dict(embed_dim=8, num_heads=1, img_size=64, drop_path_rate=0.2),
    "rev_mvit_base": dict(embed_dim=8, img_size=64, depth=7, transition_blocks=(1, 3, 5),
                          drop_path_rate=0.2),
    "rev_swin_tiny": dict(
        embed_dim=8,
        depths=(1, 1, 2, 1),
        num_heads=(1, 1, 2, 2),
        window=4,
        img_size=64,
        drop_path_rate=0.2,
    ),
    # 4 frames: a 2 x 16 x 16 first map; time stays 2 through the stages.
    "rev_mvit_base_16x4": dict(num_frames=4, embed_dim=8, img_size=64, depth=7,
                               transition_blocks=(1, 3, 5), drop_path_rate=0.2),
}
VIDEO = {"rev_mvit_base_16x4"}


def _backbone(name: str, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, features_only=True, dtype=torch.float64, **{**TINY[name], **kw})


def _images(name: str, n: int = 2) -> torch.Tensor:
    """Images (n, 3, 64, 64), or clips (n, 3, 4, 64, 64) for a video model."""
    frames = (TINY[name]["num_frames"],) if name in VIDEO else ()
    return torch.randn(
        n, 3, *frames, 64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )


@pytest.mark.parametrize("name", list(TINY))
def test_stage_features_shapes_and_strides(name):
    net = _backbone(name)
    assert net.feature_info.reduction() == [4, 8, 16, 32]
    feats = net(_images(name))
    assert len(feats) == 4
    time = (2,) if name in VIDEO else ()  # the stem halves time; the stages keep it
    for f, c, r in zip(feats, net.feature_info.channels(), net.feature_info.reduction()):
        assert f.shape == (2, c, *time, 64 // r, 64 // r)


@pytest.mark.parametrize("name", list(TINY))
def test_out_indices_prune_later_stages(name):
    net = _backbone(name, out_indices=(1, 2))
    assert net.feature_info.reduction() == [8, 16]
    assert len(net.model.stages) == 3  # the last stage is never run
    assert [f.shape[-1] for f in net(_images(name))] == [8, 4]


@pytest.mark.parametrize("name", list(TINY))
def test_forward_intermediates_matches_forward_features(name):
    torch.manual_seed(0)
    model = timm.create_model(name, dtype=torch.float64, **TINY[name]).eval()
    x = _images(name)
    final, feats = model.forward_intermediates(x, output_fmt="NHWC")
    torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
    assert (
        model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)[
            0
        ].shape
        == feats[0].movedim(-1, 1).shape
    )
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NLC")


@pytest.mark.parametrize("name", list(TINY))
def test_every_engine_gives_autograd_features_and_gradients(name):
    net = _backbone(name)
    for pname, p in net.named_parameters():
        # A key-norm bias shifts every logit of a query alike: its true gradient is zero, so a
        # relative error would measure rounding noise (as in test_mvit.py).
        p.requires_grad_(not pname.endswith("norm_k.bias"))
    report = engine_errors(net, _images(name))
    assert set(report) == {"reversible", "pareprop"}
    for engine, errors in report.items():
        worst = max(errors.values())
        assert worst < 1e-9, (engine, max(errors, key=errors.get), worst)


class _DenseHead(nn.Module):
    """A per-pixel (per-voxel for clips) classifier on the stride-8 and stride-16 maps (FPN-like
    sum)."""

    def __init__(self, chs, classes: int = 3, video: bool = False) -> None:
        super().__init__()
        conv = nn.Conv3d if video else nn.Conv2d
        self.proj = nn.ModuleList(conv(c, 8, 1) for c in chs)
        self.cls = conv(8, classes, 1)

    def forward(self, feats):
        a, b = (p(f) for p, f in zip(self.proj, feats))
        return self.cls(a + nn.functional.interpolate(b, size=a.shape[2:]))


@pytest.mark.parametrize("engine", pareprop.ENGINES)
@pytest.mark.parametrize("name", list(TINY))
def test_dense_head_trains_one_step_under_each_engine(name, engine):
    net = _backbone(name, out_indices=(1, 2), drop_path_rate=0.0)
    pareprop.set_engine(net, engine)
    head = _DenseHead(net.feature_info.channels(), video=name in VIDEO).double()
    params = list(net.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    x = _images(name)
    time = (2,) if name in VIDEO else ()
    target = torch.randint(0, 3, (2, *time, 8, 8), generator=torch.Generator().manual_seed(2))

    def loss():
        return nn.functional.cross_entropy(head(net(x)), target)

    # Training mode (the engines run only there), no drop-path, so the two losses compare.
    net.train()
    before = loss()
    opt.zero_grad()
    before.backward()
    assert all(p.grad is not None for p in params)
    opt.step()
    with torch.no_grad():
        assert loss() < before


def test_rev_vit_offers_its_stack_end_only():
    torch.manual_seed(0)
    kw = dict(embed_dim=16, depth=2, num_heads=2, img_size=32, patch_size=8)
    net = timm.create_model("rev_vit_tiny_patch4_32", features_only=True, **kw)
    assert net.feature_info.reduction() == [8] and net.feature_info.channels() == [32]
    (f,) = net(torch.randn(2, 3, 32, 32))
    assert f.shape == (2, 32, 4, 4)
    model = pareprop.create_model("rev_vit_tiny_patch4_32", **kw).eval()
    x = torch.randn(2, 3, 32, 32)
    # forward_features ends with the published per-token norm; norm=True applies it too.
    tokens, (g,) = model.forward_intermediates(x, output_fmt="NHWC", norm=True)
    torch.testing.assert_close(g.reshape(2, 16, 32), tokens, rtol=0, atol=0)
    _, (raw,) = model.forward_intermediates(x, output_fmt="NHWC")
    assert not torch.allclose(raw.reshape(2, 16, 32), tokens)
    with pytest.raises(AssertionError):  # a block inside the stack: never kept
        model.forward_intermediates(x, indices=[1])


def test_features_only_refuses_text_models():
    with pytest.raises(ValueError, match="features_only=True needs an image or video model"):
        pareprop.create_model("rev_roberta_small", features_only=True, device="meta")
