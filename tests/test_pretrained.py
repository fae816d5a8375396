"""Published weights: synthetic files in the three published layouts (PySlowFast Rev-ViT,
PySlowFast Rev-MViT-B, mmpretrain Rev-ViT) with the real key names and shapes at small sizes,
checked against independent functional references of the published forwards; pareprop
checkpoints round trip; bad files fail clearly and run no code.

The references below are written from the publishers' code (PySlowFast
``slowfast/models/reversible_mvit.py``, ``attention.py``, ``video_model_builder.py``; mmpretrain
``backbones/revvit.py``) with ``torch.nn.functional`` only, straight from the state dict: they
share nothing with pareprop's modules.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib

import pytest
import timm
import torch
import torch.nn.functional as F

import pareprop
from pareprop.checkpoint import save_checkpoint
from pareprop.pretrained import PretrainedError, detect_layout, read_weights

EPS = 1e-6
VIT = dict(embed_dim=16, depth=3, num_heads=2, img_size=32, patch_size=8, num_classes=5)
MVIT = dict(embed_dim=8, depth=6, transition_blocks=(1, 3), img_size=32, num_classes=5)


# -- synthetic published files --------------------------------------------------------------


class _Maker:
    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.sd = {}

    def rand(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.gen) * scale

    def ln(self, name, dim):
        self.sd[name + ".weight"] = 1 + self.rand(dim, scale=0.2)
        self.sd[name + ".bias"] = self.rand(dim, scale=0.2)

    def lin(self, name, out, inp):
        self.sd[name + ".weight"] = self.rand(out, inp, scale=inp**-0.5)
        self.sd[name + ".bias"] = self.rand(out, scale=0.1)


def slowfast_vit_state(C=16, depth=3, patch=8, img=32, classes=5, seed=0, chans=3):
    m = _Maker(seed)
    m.sd["patch_embed.proj.weight"] = m.rand(C, chans, patch, patch, scale=0.1)
    m.sd["patch_embed.proj.bias"] = m.rand(C, scale=0.1)
    m.sd["pos_embed"] = m.rand(1, (img // patch) ** 2, C, scale=0.2)
    for i in range(depth):
        p = f"rev_backbone.layers.{i}."
        m.ln(p + "F.norm", C)
        for name in "qkv":
            m.lin(p + f"F.attn.{name}", C, C)
        m.lin(p + "F.attn.proj", C, C)
        m.ln(p + "G.norm", C)
        m.lin(p + "G.mlp.fc1", 4 * C, C)
        m.lin(p + "G.mlp.fc2", C, 4 * C)
    m.ln("norm", 2 * C)
    m.lin("head.projection", classes, 2 * C)
    return m.sd


def mmpretrain_vit_state(C=16, depth=3, patch=8, img=32, classes=5, seed=1):
    m = _Maker(seed)
    m.sd["backbone.cls_token"] = m.rand(1, 1, C)
    m.sd["backbone.pos_embed"] = m.rand(1, (img // patch) ** 2 + 1, C, scale=0.2)
    m.sd["backbone.patch_embed.projection.weight"] = m.rand(C, 3, patch, patch, scale=0.1)
    m.sd["backbone.patch_embed.projection.bias"] = m.rand(C, scale=0.1)
    for i in range(depth):
        p = f"backbone.layers.{i}."
        m.ln(p + "ln1", C)
        m.lin(p + "attn.qkv", 3 * C, C)
        m.lin(p + "attn.proj", C, C)
        m.ln(p + "ln2", C)
        m.lin(p + "ffn.layers.0.0", 4 * C, C)
        m.lin(p + "ffn.layers.1", C, 4 * C)
    m.ln("backbone.ln1", 2 * C)
    m.lin("head.fc", classes, 2 * C)
    return m.sd


def slowfast_mvit_state(C=8, depth=6, transitions=(1, 3), img=32, classes=5, heads=1, seed=2):
    m = _Maker(seed)
    m.sd["patch_embed.proj.weight"] = m.rand(C, 3, 7, 7, scale=0.1)
    m.sd["patch_embed.proj.bias"] = m.rand(C, scale=0.1)
    m.sd["pos_embed"] = m.rand(1, (img // 4) ** 2, C, scale=0.2)
    width, nh = C, heads
    for i in range(depth):
        p = f"rev_backbone.layers.{i}."
        if i in transitions:
            width, nh = 2 * width, 2 * nh
            m.lin(p + "pre_q_fuse.fuse_fn.fc1", 2 * width, width)
            m.lin(p + "pre_q_fuse.fuse_fn.fc2", width, 2 * width)
        hd = width // nh
        m.ln(p + "F.norm", width)
        for name in "qkv":
            m.lin(p + f"F.attn.{name}", width, width)
        m.lin(p + "F.attn.proj", width, width)
        pools = "qkv" if i in transitions else "kv"
        for name in pools:
            m.sd[p + f"F.attn.pool_{name}.weight"] = m.rand(hd, 1, 1, 3, 3, scale=0.4)
            m.ln(p + f"F.attn.norm_{name}", hd)
        m.ln(p + "G.norm", width)
        m.lin(p + "G.mlp.fc1", 4 * width, width)
        m.lin(p + "G.mlp.fc2", width, 4 * width)
    m.ln("norm", 2 * width)
    m.lin("head.projection", classes, 2 * width)
    return m.sd


def _slowfast_file(path, state):
    # PySlowFast's checkpoint container (slowfast/utils/checkpoint.py): cfg is a YAML string.
    torch.save(
        {"epoch": 300, "model_state": state, "optimizer_state": {"state": {}, "param_groups": []},
         "cfg": "MVIT:\n  REV:\n    ENABLE: true\n"},
        path,
    )
    return path


# -- independent references of the published forwards ---------------------------------------


def _ln(x, sd, name):
    w = sd[name + ".weight"]
    return F.layer_norm(x, w.shape, w, sd[name + ".bias"], EPS)


def _lin(x, sd, name):
    return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])


def _mlp(x, sd, fc1, fc2):
    return _lin(F.gelu(_lin(x, sd, fc1)), sd, fc2)  # exact GELU


def _heads(x, n):
    B, N, C = x.shape
    return x.reshape(B, N, n, C // n).permute(0, 2, 1, 3)  # (B, n, N, hd)


def _softmax_attention(q, k, v):
    attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    out = attn.softmax(dim=-1) @ v  # (B, n, Nq, hd)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def reference_slowfast_vit(sd, x, heads):
    w = sd["patch_embed.proj.weight"]
    t = F.conv2d(x, w, sd["patch_embed.proj.bias"], stride=w.shape[-1])
    t = t.flatten(2).transpose(1, 2) + sd["pos_embed"]
    x1 = x2 = t  # torch.cat([x, x], -1), then torch.chunk
    depth = len({k.split(".")[2] for k in sd if k.startswith("rev_backbone.")})
    for i in range(depth):
        p = f"rev_backbone.layers.{i}."
        h = _ln(x2, sd, p + "F.norm")
        q, k, v = (_heads(_lin(h, sd, p + f"F.attn.{n}"), heads) for n in "qkv")
        y1 = x1 + _lin(_softmax_attention(q, k, v), sd, p + "F.attn.proj")
        y2 = x2 + _mlp(_ln(y1, sd, p + "G.norm"), sd, p + "G.mlp.fc1", p + "G.mlp.fc2")
        x1, x2 = y1, y2
    z = _ln(torch.cat([x1, x2], dim=-1), sd, "norm")  # norm, then fuse ("concat"), then mean
    return _lin(z.mean(dim=1), sd, "head.projection")


def reference_mmpretrain_vit(sd, x, heads):
    w = sd["backbone.patch_embed.projection.weight"]
    t = F.conv2d(x, w, sd["backbone.patch_embed.projection.bias"], stride=w.shape[-1])
    t = t.flatten(2).transpose(1, 2)
    cls = sd["backbone.cls_token"].expand(t.shape[0], -1, -1)
    t = (torch.cat([cls, t], dim=1) + sd["backbone.pos_embed"])[:, 1:]  # with_cls_token=False
    attn_out = ffn_out = t
    depth = len({k.split(".")[2] for k in sd if k.startswith("backbone.layers.")})
    for i in range(depth):
        p = f"backbone.layers.{i}."
        h = _ln(ffn_out, sd, p + "ln1")
        qkv = _lin(h, sd, p + "attn.qkv")
        q, k, v = (_heads(part, heads) for part in qkv.chunk(3, dim=-1))
        attn_out = attn_out + _lin(_softmax_attention(q, k, v), sd, p + "attn.proj")
        ffn_out = ffn_out + _mlp(
            _ln(attn_out, sd, p + "ln2"), sd, p + "ffn.layers.0.0", p + "ffn.layers.1"
        )
    z = _ln(torch.cat([attn_out, ffn_out], dim=-1), sd, "backbone.ln1")
    return _lin(z.mean(dim=1), sd, "head.fc")


def _slowfast_pool(t, thw, sd, name, stride):
    """attention_pool of PySlowFast: (B, n, N, hd) over a (T=1, H, W) map, Conv3d, norm."""
    B, n, N, hd = t.shape
    t = t.reshape(B * n, 1, thw[0], thw[1], hd).permute(0, 4, 1, 2, 3)
    w = sd[name.replace("norm_", "pool_") + ".weight"]
    t = F.conv3d(t, w, stride=(1, stride, stride), padding=(0, 1, 1), groups=hd)
    H, W = t.shape[-2:]
    t = t.reshape(B, n, hd, H * W).transpose(2, 3)
    return _ln(t, sd, name), (H, W)


def _slowfast_attention(h, sd, p, n, hw, q_stride, kv_stride):
    """MultiScaleAttention (separate q, k, v; pool_first False; mode conv; no cls token)."""
    q, k, v = (_heads(_lin(h, sd, p + f"F.attn.{c}"), n) for c in "qkv")
    q_hw = hw
    if q_stride > 1:
        q, q_hw = _slowfast_pool(q, hw, sd, p + "F.attn.norm_q", q_stride)
    k, _ = _slowfast_pool(k, hw, sd, p + "F.attn.norm_k", kv_stride)
    v, _ = _slowfast_pool(v, hw, sd, p + "F.attn.norm_v", kv_stride)
    return _lin(_softmax_attention(q, k, v), sd, p + "F.attn.proj"), q_hw


def reference_slowfast_mvit(sd, x, heads, transitions, kv_stride=4):
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], 4, 3)
    hw = tuple(t.shape[-2:])
    t = t.flatten(2).transpose(1, 2) + sd["pos_embed"]
    depth = len({k.split(".")[2] for k in sd if k.startswith("rev_backbone.")})
    stage, x1 = 0, None
    for i in range(depth):
        p = f"rev_backbone.layers.{i}."
        if i in transitions:
            stage += 1
        n = heads * 2**stage
        s_kv = max(kv_stride // 2**stage, 1)

        if i in transitions:  # StageTransitionBlock
            t = t + _mlp(t, sd, p + "pre_q_fuse.fuse_fn.fc1", p + "pre_q_fuse.fuse_fn.fc2")
            res, _ = _slowfast_pool(_heads(t, n), hw, sd, p + "F.attn.norm_q", 2)
            res = res.transpose(1, 2).reshape(t.shape[0], -1, t.shape[-1])
            a, new_hw = _slowfast_attention(_ln(t, sd, p + "F.norm"), sd, p, n, hw, 2, s_kv)
            t = res + a
            t = t + _mlp(_ln(t, sd, p + "G.norm"), sd, p + "G.mlp.fc1", p + "G.mlp.fc2")
            hw = new_hw
            continue
        if x1 is None:
            x1 = x2 = t
        y1 = x1 + _slowfast_attention(_ln(x2, sd, p + "F.norm"), sd, p, n, hw, 1, s_kv)[0]
        y2 = x2 + _mlp(_ln(y1, sd, p + "G.norm"), sd, p + "G.mlp.fc1", p + "G.mlp.fc2")
        x1, x2 = y1, y2
        if i + 1 in transitions or i + 1 == depth:
            t, x1 = torch.cat([x1, x2], dim=-1), None
    z = _ln(t, sd, "norm")
    return _lin(z.mean(dim=1), sd, "head.projection")


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("published")
    sf_vit = slowfast_vit_state()
    mm_vit = mmpretrain_vit_state()
    sf_mvit = slowfast_mvit_state()
    torch.save({"meta": {"epoch": 300}, "state_dict": mm_vit}, d / "mm.pth")
    torch.save(mm_vit, d / "mm_bare.pth")
    return {
        "slowfast_vit": (_slowfast_file(d / "REV_VIT.pyth", sf_vit), sf_vit),
        "mmpretrain_vit": (d / "mm.pth", mm_vit),
        "mmpretrain_vit_bare": (d / "mm_bare.pth", mm_vit),
        "slowfast_mvit": (_slowfast_file(d / "REV_MVIT.pyth", sf_mvit), sf_mvit),
    }


def _layout(which):
    return {"slowfast": "pyslowfast", "mmpretrain": "mmpretrain"}[which.split("_")[0]]


def _images(n=3, seed=5):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _vit(**kw):
    return pareprop.create_model("rev_vit_base_patch16_224", **{**VIT, **kw})


def _mvit(**kw):
    return pareprop.create_model("rev_mvit_base", **{**MVIT, **kw})


# -- the published forwards, reproduced -----------------------------------------------------


@pytest.mark.parametrize(
    "which, reference",
    [
        ("slowfast_vit", lambda sd, x: reference_slowfast_vit(sd, x, heads=2)),
        ("mmpretrain_vit", lambda sd, x: reference_mmpretrain_vit(sd, x, heads=2)),
        ("mmpretrain_vit_bare", lambda sd, x: reference_mmpretrain_vit(sd, x, heads=2)),
        ("slowfast_mvit", lambda sd, x: reference_slowfast_mvit(sd, x, 1, (1, 3))),
    ],
)
def test_loaded_model_reproduces_the_published_logits(files, which, reference):
    path, state = files[which]
    model = (_mvit() if "mvit" in which else _vit()).eval()
    report = pareprop.load_pretrained(model, path)
    assert report.layout == _layout(which) and not report.dropped_head
    x = _images()
    with torch.no_grad():
        ref = reference(state, x)
        for engine in pareprop.ENGINES:
            out = model.set_engine(engine)(x)
            assert (out - ref).abs().max() < 1e-5, engine
    assert ref.abs().max() > 0.1  # logits of a real size, not zeros


def test_reference_is_sensitive_to_the_norm_placement(files):
    # The published head normalises every token before the mean; the other order differs by
    # far more than the tolerance, so the comparison above would catch a misplaced norm.
    path, state = files["slowfast_vit"]
    model = _vit(norm_before_pool=False)
    with pytest.raises(PretrainedError, match="norm_before_pool=True"):
        pareprop.load_pretrained(model, path)
    published = _vit().eval()
    pareprop.load_pretrained(published, path)
    moved = {k.replace("norm.", "fc_norm.") if k.startswith("norm.") else k: v
             for k, v in published.state_dict().items()}
    model.load_state_dict(moved)
    x = _images()
    with torch.no_grad():
        assert (model.eval()(x) - reference_slowfast_vit(state, x, heads=2)).abs().max() > 1e-2


def test_timm_and_pareprop_pretrained_take_a_local_file(files):
    path, state = files["slowfast_mvit"]
    x = _images()
    ref = reference_slowfast_mvit(state, x, 1, (1, 3))
    for create in (timm.create_model, pareprop.create_model):
        model = create(
            "rev_mvit_base", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **MVIT
        ).eval()
        with torch.no_grad():
            assert (model(x) - ref).abs().max() < 1e-5
        assert model.pretrained_cfg["file"] == str(path)
        assert model.pretrained_cfg["url"].endswith("REV_MVIT_B.pyth")


def test_models_without_published_weights_say_so():
    with pytest.raises(PretrainedError, match="no published weights"):
        pareprop.create_model("rev_vit_tiny_patch4_32", pretrained=True)


def test_layout_detection(files):
    for which, (path, _) in files.items():
        assert read_weights(path)[1] == _layout(which)
    with pytest.raises(PretrainedError, match="no layout pareprop knows"):
        detect_layout({"conv1.weight": torch.zeros(1)})


# -- heads, sizes, missing tensors ----------------------------------------------------------


def test_other_class_count_drops_the_head_and_says_so(files, caplog):
    path, state = files["slowfast_vit"]
    torch.manual_seed(0)
    model = _vit(num_classes=10)
    fresh_head = model.head.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="pareprop"):
        report = pareprop.load_pretrained(model, path)
    assert report.dropped_head and report.file_classes == 5
    assert "5-class classifier" in caplog.text and "10-class head" in caplog.text
    assert torch.equal(model.head.weight, fresh_head)
    assert torch.equal(model.norm.weight, state["norm.weight"])
    # Through timm's create_model the same: a fine-tuning start.
    model = timm.create_model(
        "rev_vit_base_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
        **{**VIT, "num_classes": 3},
    )
    assert model.head.out_features == 3
    norm1 = state["rev_backbone.layers.0.F.norm.weight"]
    assert torch.equal(model.stack.blocks[0].norm1.weight, norm1)


def test_misshapen_tensor_names_key_and_both_shapes(files):
    path, _ = files["slowfast_vit"]
    with pytest.raises(PretrainedError) as err:
        pareprop.load_pretrained(_vit(embed_dim=24, num_heads=2), path)
    msg = str(err.value)
    assert "(16, 3, 8, 8) in the file but (24, 3, 8, 8) in the model" in msg
    assert "'patch_embed.proj.weight'" in msg


def test_missing_tensor_and_other_depth_are_errors(files, tmp_path):
    path, state = files["slowfast_vit"]
    broken = dict(state)
    del broken["rev_backbone.layers.1.G.norm.weight"]
    p = _slowfast_file(tmp_path / "broken.pyth", broken)
    missing = r"missing from the file, first 'stack\.blocks\.1\.norm2\.weight'"
    with pytest.raises(PretrainedError, match=missing):
        pareprop.load_pretrained(_vit(), p)
    with pytest.raises(PretrainedError, match=r"unknown to the model, first 'stack\.blocks\.2\."):
        pareprop.load_pretrained(_vit(depth=2), path)
    mpath, _ = files["slowfast_mvit"]
    with pytest.raises(PretrainedError, match="create it with the file's depth"):
        pareprop.load_pretrained(_mvit(depth=5), mpath)


def test_wrong_model_is_an_error(files):
    mvit_path, _ = files["slowfast_mvit"]
    with pytest.raises(PretrainedError, match="does not fit RevViT"):
        pareprop.load_pretrained(_vit(), mvit_path)
    vit_path, _ = files["mmpretrain_vit"]
    with pytest.raises(PretrainedError, match="published by PySlowFast only"):
        pareprop.load_pretrained(_mvit(), vit_path)


# -- safe files -----------------------------------------------------------------------------


class _Payload:
    """Unpickling this object creates the file ``marker``: a stand-in for any code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(files, tmp_path):
    _, state = files["slowfast_vit"]
    marker = tmp_path / "the-file-ran-code"
    evil = tmp_path / "evil.pyth"
    torch.save({"model_state": state, "cfg": _Payload(str(marker))}, evil)
    with pytest.raises(PretrainedError, match=r"would run code from the file \(it asks for "):
        pareprop.load_pretrained(_vit(), evil)
    with pytest.raises(PretrainedError, match="would run code"):
        timm.create_model(
            "rev_vit_base_patch16_224", pretrained=True,
            pretrained_cfg_overlay=dict(file=str(evil)), **VIT,
        )
    assert not marker.exists()
    # The control: an unrestricted load of the same file does run the payload.
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_truncated_foreign_and_missing_files(files, tmp_path):
    path, _ = files["slowfast_vit"]
    data = pathlib.Path(path).read_bytes()
    cut = tmp_path / "cut.pyth"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedError, match="truncated or corrupted"):
        pareprop.load_pretrained(_vit(), cut)
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    with pytest.raises(PretrainedError, match="truncated or corrupted"):
        pareprop.load_pretrained(_vit(), empty)
    text = tmp_path / "notes.pth"
    text.write_text("these are not weights")
    with pytest.raises(PretrainedError, match="not a PyTorch weight file"):
        pareprop.load_pretrained(_vit(), text)
    with pytest.raises(PretrainedError, match="no weight file"):
        pareprop.load_pretrained(_vit(), tmp_path / "absent.pth")
    wrapped = {"model_state": {"module." + k: v for k, v in files["slowfast_vit"][1].items()}}
    torch.save(wrapped, tmp_path / "ddp.pyth")  # saved from a DDP wrapper: still loads
    assert pareprop.load_pretrained(_vit(), tmp_path / "ddp.pyth").layout == "pyslowfast"
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(PretrainedError, match="holds no state dict"):
        pareprop.load_pretrained(_vit(), tmp_path / "list.pth")


# -- pareprop's own checkpoints -------------------------------------------------------------


@pytest.mark.parametrize("make", [_vit, _mvit], ids=["vit", "mvit"])
def test_pareprop_checkpoint_round_trip(make, tmp_path):
    torch.manual_seed(0)
    model = make()
    folder = save_checkpoint(tmp_path / "run", model, epoch=1, step=10)
    torch.manual_seed(1)
    other = make()
    assert not torch.equal(other.pos_embed, model.pos_embed)
    for target in (folder, os.path.join(folder, "model.safetensors")):
        report = pareprop.load_pretrained(other, target)
        assert report.layout == "pareprop"
        mine, theirs = model.state_dict(), other.state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_safetensors_file_of_published_keys(files, tmp_path):
    from safetensors.torch import save_file

    path, state = files["slowfast_mvit"]
    st = tmp_path / "rev_mvit.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    model = _mvit().eval()
    pareprop.load_pretrained(model, st)
    x = _images()
    with torch.no_grad():
        assert (model(x) - reference_slowfast_mvit(state, x, 1, (1, 3))).abs().max() < 1e-5


def test_published_table_matches_the_registry():
    from pareprop.pretrained import PUBLISHED

    for name, pub in PUBLISHED.items():
        model = pareprop.create_model(name, device="meta")
        params = sum(p.numel() for p in model.parameters()) / 1e6
        assert math.isclose(round(params, 1), pub.params_m), (name, params)
        assert model.pretrained_cfg["url"] == pub.url and pub.url.startswith("https://")


def test_a_checkpoint_of_the_earlier_vit_head_still_loads(tmp_path):
    from pareprop.checkpoint import load_checkpoint

    torch.manual_seed(0)
    old = pareprop.create_model("rev_vit_tiny_patch4_32", depth=2, norm_before_pool=False)
    folder = save_checkpoint(tmp_path / "run", old, epoch=1, step=1)
    # As written before the option existed: the spec does not name it.
    meta = json.loads((pathlib.Path(folder) / "model.json").read_text())
    assert meta["model"]["kwargs"] == {"depth": 2, "norm_before_pool": False}
    meta["model"]["kwargs"] = {"depth": 2}
    (pathlib.Path(folder) / "model.json").write_text(json.dumps(meta))
    assert load_checkpoint(folder).meta["model"]["kwargs"]["norm_before_pool"] is False
    model = pareprop.load_model(folder).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), old.eval()(x), rtol=0, atol=0)


# Issue 34.5: one small model of every family; pareprop's own files of each load into another.
FAMILIES = {
    "rev_vit": lambda: pareprop.create_model("rev_vit_base_patch16_224", **VIT),
    "rev_mvit": lambda: pareprop.create_model("rev_mvit_base", **MVIT),
    "rev_mvitv2": lambda: pareprop.create_model("rev_mvitv2_tiny_32", embed_dim=8, img_size=32,
                                                num_classes=5),
    "rev_swin": lambda: pareprop.create_model("rev_swin_tiny_32", embed_dim=8, depths=(1, 2),
                                              num_heads=(1, 2), window=4, patch_size=2,
                                              img_size=16, num_classes=5),
    "text": lambda: pareprop.create_model("rev_roberta_small", vocab_size=50, embed_dim=16,
                                          depth=2, num_heads=2, mlp_dim=32, num_classes=3,
                                          max_position_embeddings=16, example_seq_len=12),
    "converted_vit": lambda: pareprop.create_model(
        "converted_vit", source="vit_tiny_patch16_224", img_size=16, patch_size=4,
        embed_dim=16, depth=2, num_heads=2, num_classes=5, tolerance=None),
    "converted_mvitv2": lambda: pareprop.create_model(
        "converted_mvitv2", source="mvitv2_small_cls", depths=(1, 2, 1, 2), embed_dim=8,
        img_size=32, num_classes=5, tolerance=None),
    "converted_tv_mvit": lambda: pareprop.create_model(
        "converted_tv_mvit", source="mvit_v2_s", spatial_size=(32, 32), temporal_size=4,
        embed_dim=8, max_run=1, num_classes=5, tolerance=None),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_its_own_files(family, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = FAMILIES[family]()
    state = model.state_dict()
    torch.save(state, tmp_path / "state.pth")
    # safetensors under a torch name: recognised by content, not refused as a pickle
    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(tmp_path / "st.pth"))
    run = tmp_path / "run"
    save_checkpoint(run, model, epoch=1, step=1, tags=("last", "best"))
    for target in (tmp_path / "state.pth", tmp_path / "st.pth", run, run / "best",
                   run / "best" / "model.safetensors"):
        torch.manual_seed(1)
        other = FAMILIES[family]()
        assert any(not torch.equal(v, other.state_dict()[k]) for k, v in state.items())
        report = pareprop.load_pretrained(other, target)
        assert report.layout == "pareprop", target
        loaded = other.state_dict()
        assert all(torch.equal(v, loaded[k]) for k, v in state.items()), target
