"""Published Rev-MViT-B 16x4 weights: a synthetic file in PySlowFast's layout (the real key names
and shapes, at a small size), checked against an independent functional reference of
PySlowFast's forward; every loading path; another class count keeps a fresh head and says so.

The reference below is written from PySlowFast's code (``slowfast/models/reversible_mvit.py``,
``attention.py``, ``common.py``, ``video_model_builder.py``) with ``torch.nn.functional`` only,
straight from the state dict: it shares nothing with pareprop's modules.
"""

from __future__ import annotations

import logging

import pytest
import timm
import torch
import torch.nn.functional as F

import pareprop
from pareprop.pretrained import PUBLISHED, PretrainedError, read_weights

EPS = 1e-6
NAME = "rev_mvit_base_16x4"
# 4 frames at 32 px: a 2x8x8 first map; transitions at 1 and 3 (stacks of 1, 1, 2 blocks).
TINY = dict(num_frames=4, img_size=32, embed_dim=8, depth=6, transition_blocks=(1, 3),
            kv_stride=(1, 4, 4), num_classes=5)
TRANSITIONS = (1, 3)


# -- a synthetic published file -------------------------------------------------------------


def slowfast_video_state(C=8, depth=6, transitions=TRANSITIONS, frames=4, img=32, classes=5,
                         heads=1, seed=3):
    gen = torch.Generator().manual_seed(seed)
    sd = {}

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    def ln(name, dim):
        sd[name + ".weight"] = 1 + rand(dim, scale=0.2)
        sd[name + ".bias"] = rand(dim, scale=0.2)

    def lin(name, out, inp, bias=True):
        sd[name + ".weight"] = rand(out, inp, scale=inp**-0.5)
        if bias:
            sd[name + ".bias"] = rand(out, scale=0.1)

    sd["patch_embed.proj.weight"] = rand(C, 3, 3, 7, 7, scale=0.05)
    sd["patch_embed.proj.bias"] = rand(C, scale=0.1)
    sd["pos_embed_spatial"] = rand(1, (img // 4) ** 2, C, scale=0.2)
    sd["pos_embed_temporal"] = rand(1, frames // 2, C, scale=0.2)
    width, nh = C, heads
    for i in range(depth):
        p = f"rev_backbone.layers.{i}."
        dim = width
        if i in transitions:
            width, nh = 2 * width, 2 * nh
            lin(p + "res_proj", width, dim)
        hd = width // nh
        ln(p + "F.norm", dim)
        lin(p + "F.attn.qkv", 3 * width, dim, bias=False)  # QKV_BIAS: False
        lin(p + "F.attn.proj", width, width)
        for name in ("qkv" if i in transitions else "kv"):
            sd[p + f"F.attn.pool_{name}.weight"] = rand(hd, 1, 3, 3, 3, scale=0.3)
            ln(p + f"F.attn.norm_{name}", hd)
        ln(p + "G.norm", width)
        lin(p + "G.mlp.fc1", 4 * width, width)
        lin(p + "G.mlp.fc2", width, 4 * width)
    ln("norm", 2 * width)
    lin("head.projection", classes, 2 * width)
    return sd


def _slowfast_file(path, state):
    # PySlowFast's checkpoint container (slowfast/utils/checkpoint.py): cfg is a YAML string.
    torch.save({"epoch": 200, "model_state": state,
                "optimizer_state": {"state": {}, "param_groups": []},
                "cfg": "MVIT:\n  REV:\n    ENABLE: true\n"}, path)
    return path


# -- an independent reference of PySlowFast's forward (eval) ---------------------------------


def _ln(x, sd, name):
    w = sd[name + ".weight"]
    return F.layer_norm(x, w.shape, w, sd[name + ".bias"], EPS)


def _lin(x, sd, name):
    return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))


def _mlp(x, sd, p):
    return _lin(F.gelu(_lin(x, sd, p + "fc1")), sd, p + "fc2")


def _heads(x, n):
    B, N, C = x.shape
    return x.reshape(B, N, n, C // n).permute(0, 2, 1, 3)  # (B, n, N, hd)


def _pool(t, thw, sd, norm, stride):
    """attention_pool: (B, n, N, hd) over a (T, H, W) map, depthwise Conv3d, then LayerNorm."""
    B, n, N, hd = t.shape
    t = t.reshape(B * n, *thw, hd).permute(0, 4, 1, 2, 3)
    w = sd[norm.replace("norm_", "pool_") + ".weight"]
    t = F.conv3d(t, w, stride=stride, padding=(1, 1, 1), groups=hd)
    thw = list(t.shape[2:])
    t = t.reshape(B, n, hd, -1).transpose(2, 3)
    return _ln(t, sd, norm), thw


def _attention(h, sd, p, n, thw, q_stride, kv_stride):
    """MultiScaleAttention: one qkv map (SEPARATE_QKV False), pool_first False, no cls token."""
    B, N, _ = h.shape
    qkv = _lin(h, sd, p + "F.attn.qkv").reshape(B, N, 3, n, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q_thw = thw
    if q_stride is not None:
        q, q_thw = _pool(q, thw, sd, p + "F.attn.norm_q", q_stride)
    k, _ = _pool(k, thw, sd, p + "F.attn.norm_k", kv_stride)
    v, _ = _pool(v, thw, sd, p + "F.attn.norm_v", kv_stride)
    attn = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(B, q.shape[2], -1)
    return _lin(out, sd, p + "F.attn.proj"), q_thw


def reference_slowfast_video(sd, x, heads=1, transitions=TRANSITIONS, kv=(1, 4, 4),
                             q=(1, 2, 2), fusion="avg"):
    t = F.conv3d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"],
                 stride=(2, 4, 4), padding=(1, 3, 3))
    B, _, T, H, W = t.shape
    thw = [T, H, W]
    t = t.flatten(2).transpose(1, 2)
    t = t + (sd["pos_embed_spatial"].repeat(1, T, 1)
             + torch.repeat_interleave(sd["pos_embed_temporal"], H * W, dim=1))
    depth = len({k.split(".")[2] for k in sd if k.startswith("rev_backbone.")})
    stage, x1 = 0, None
    for i in range(depth):
        p = f"rev_backbone.layers.{i}."
        if i in transitions:  # StageTransitionBlock, PRE_Q_FUSION "avg", RES_PATH "conv"
            stage += 1
            kv = [max(a // b, 1) for a, b in zip(kv, q)]
            n = heads * 2**stage
            streams = torch.stack(torch.chunk(t, 2, dim=2))
            t = streams.mean(dim=0) if fusion == "avg" else streams.max(dim=0).values
            res = _lin(t, sd, p + "res_proj")
            width = res.shape[-1]
            res, _ = _pool(_heads(res, n), thw, sd, p + "F.attn.norm_q", q)
            res = res.permute(0, 2, 1, 3).reshape(B, -1, width)
            a, new_thw = _attention(_ln(t, sd, p + "F.norm"), sd, p, n, thw, q, kv)
            t = res + a
            t = t + _mlp(_ln(t, sd, p + "G.norm"), sd, p + "G.mlp.")
            thw = new_thw
            continue
        n = heads * 2**stage
        if x1 is None:
            x1 = x2 = t
        y1 = x1 + _attention(_ln(x2, sd, p + "F.norm"), sd, p, n, thw, None, kv)[0]
        y2 = x2 + _mlp(_ln(y1, sd, p + "G.norm"), sd, p + "G.mlp.")
        x1, x2 = y1, y2
        if i + 1 in transitions or i + 1 == depth:
            t, x1 = torch.cat([x1, x2], dim=-1), None
    z = _ln(t, sd, "norm").mean(dim=1)  # norm, fuse ("concat": the identity), mean
    return _lin(z, sd, "head.projection")  # PySlowFast then applies softmax in eval


# -- tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    state = slowfast_video_state()
    path = _slowfast_file(tmp_path_factory.mktemp("video") / "REV_MVIT_B_16x4.pyth", state)
    return path, state


def _clips(n=2):
    return torch.randn(n, 3, 4, 32, 32, generator=torch.Generator().manual_seed(1))


def _close(model, state, x):
    with torch.no_grad():
        out = model.eval()(x)
    ref = reference_slowfast_video(state, x)
    assert (out - ref).abs().max() < 1e-5, (out - ref).abs().max()
    return out


def test_loaded_model_reproduces_the_published_logits(published):
    path, state = published
    torch.manual_seed(0)
    model = pareprop.create_model(NAME, **TINY)
    x = _clips()
    with torch.no_grad():
        fresh = model.eval()(x)
    report = pareprop.load_pretrained(model, path)
    assert report.layout == "pyslowfast" and not report.dropped_head
    assert report.tensors == len(model.state_dict())
    out = _close(model, state, x)
    assert (out - fresh).abs().max() > 1e-2  # the load changed the model


def test_reference_is_sensitive_to_the_fusion(published):
    # Another stream fusion (TwoStreamFusion "max") gives other logits: the match above is not
    # blind to how the transitions fuse the two streams.
    path, state = published
    model = pareprop.create_model(NAME, **TINY)
    pareprop.load_pretrained(model, path)
    x = _clips()
    with torch.no_grad():
        out = model.eval()(x)
    assert (out - reference_slowfast_video(state, x, fusion="max")).abs().max() > 1e-3


@pytest.mark.parametrize("how", ["pareprop", "timm"])
def test_pretrained_true_takes_a_local_file(published, how):
    path, state = published
    create = pareprop.create_model if how == "pareprop" else timm.create_model
    model = create(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    _close(model, state, _clips())
    assert model.pretrained_cfg["url"] == PUBLISHED[NAME].url


def test_other_class_count_keeps_a_fresh_head_and_says_so(published, caplog):
    path, state = published
    torch.manual_seed(0)
    model = pareprop.create_model(NAME, **{**TINY, "num_classes": 7})
    head = model.head.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="pareprop"):
        report = pareprop.load_pretrained(model, path)
    assert report.dropped_head and report.file_classes == 5
    assert "5-class classifier" in caplog.text and "7-class head" in caplog.text
    torch.testing.assert_close(model.head.weight, head)  # fresh, untouched
    # Everything else is the published model's: features agree with the reference's.
    ref = pareprop.create_model(NAME, **TINY)
    pareprop.load_pretrained(ref, path)
    x = _clips()
    with torch.no_grad():
        torch.testing.assert_close(model.eval().forward_features(x),
                                   ref.eval().forward_features(x))


def test_the_published_layout_is_recognised_by_its_keys(published):
    path, _ = published
    state, layout = read_weights(path)
    assert layout == "pyslowfast" and "pos_embed_temporal" in state


def test_image_and_video_files_do_not_cross(published, tmp_path):
    path, _ = published
    image = pareprop.create_model("rev_mvit_base", img_size=32, embed_dim=8, depth=6,
                                  transition_blocks=(1, 3), num_classes=5)
    with pytest.raises(PretrainedError, match="video Rev-MViT-B 16x4"):
        pareprop.load_pretrained(image, path)
    image_file = _slowfast_file(tmp_path / "REV_MVIT_B.pyth",
                                {"pos_embed": torch.zeros(1, 64, 8),
                                 "rev_backbone.layers.0.F.norm.weight": torch.ones(8)})
    with pytest.raises(PretrainedError, match="image Rev-MViT-B"):
        pareprop.load_pretrained(pareprop.create_model(NAME, **TINY), image_file)


def test_other_depth_is_an_error(published, tmp_path):
    path, _ = published
    with pytest.raises(PretrainedError, match="block 5"):
        pareprop.load_pretrained(
            pareprop.create_model(NAME, **{**TINY, "depth": 5}), path
        )


def test_published_entry():
    pub = PUBLISHED[NAME]
    assert (pub.top1, pub.top5) == (78.4, 93.4) and pub.url.endswith("REV_MVIT_B_16x4.pyth")
    assert "Kinetics-400" in pub.dataset
