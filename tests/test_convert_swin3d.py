"""pareprop.convert on torchvision's Video Swin (swin3d_t/s/b): each stage of ``features`` one
reversible stack of coupled blocks, the patch mergings torchvision's modules. Exact at (1, 0)
(torch.equal in float32) for the published configurations, the dual-residual recursion per
stage elsewhere, every engine against autograd (chunked branches and checkpointed mergings
included), torchvision's names in the state dict, the model contract, the named model with
torchvision's weights, and the refusals."""

import copy

import pytest
import torch
import torch.nn as nn
import torchvision
from torchvision.models.video.swin_transformer import SwinTransformer3d

import pareprop
from pareprop.convert import UnsupportedModelError, converted_model_name
from pareprop.convert.swin3d import SWIN3D_SOURCES, build_swin3d, load_torchvision_pretrained
from pareprop.engine import chunked
from pareprop.engine.testing import engine_errors, worst_error

# Two blocks a stage, small widths; clips of 8 frames of 32x32: a (4, 8, 8) patch grid, so the
# first stage's 8x7x7 windows shift in space (padded to 14) and fit the 4 frames whole.
SMALL = dict(embed_dim=16, depths=[2, 2], num_heads=[1, 2], num_classes=5)


def _torchvision(source="swin3d_t", **kwargs):
    torch.manual_seed(0)
    return build_swin3d(source, **{**SMALL, **kwargs})


def _clips(n=2, frames=8, size=32, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(n, 3, frames, size, size, dtype=dtype)


def _stacks(model):
    return [part.stack for part in model.features if hasattr(part, "stack")]


@pytest.mark.parametrize("source", sorted(SWIN3D_SOURCES))
def test_the_table_is_torchvisions_configuration(source):
    with torch.device("meta"):
        theirs = getattr(torchvision.models.video, source)()
        ours = build_swin3d(source)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == \
        [(k, v.shape) for k, v in theirs.state_dict().items()]
    rates = [[b.stochastic_depth.p for b in m.modules() if hasattr(b, "stochastic_depth")]
             for m in (ours, theirs)]
    assert rates[0] == rates[1]
    attn = [(m.features[0][1].attn.window_size, m.features[0][1].attn.shift_size,
             m.patch_embed.tuple_patch_size) for m in (ours, theirs)]
    assert attn[0] == attn[1]


@pytest.mark.parametrize("source", sorted(SWIN3D_SOURCES))
@pytest.mark.parametrize("clip", [(8, 32), (7, 30)])  # (7, 30): padded by the patch embedding
def test_published_configs_are_exact_at_one_zero(source, clip):
    src = _torchvision(source, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]).eval()
    model = pareprop.convert(copy.deepcopy(src), engine="autograd").eval()
    x = _clips(2, *clip)
    with torch.no_grad():
        assert torch.equal(model(x), src(x))
        features = src.norm(src.features(src.pos_drop(src.patch_embed(x))))
        assert torch.equal(model.forward_features(x), features)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_training_step_equals_torchvision_at_one_zero(engine):
    # Dropout, attention dropout and stochastic depth on: at beta = 0 every block is stored,
    # so every engine gives torchvision's logits and gradients exactly.
    src = _torchvision(dropout=0.1, attention_dropout=0.1, stochastic_depth_prob=0.4).train()
    model = pareprop.convert(copy.deepcopy(src), engine=engine).train()
    x = _clips(3)
    results = []
    for m in (src, model):
        torch.manual_seed(3)
        out = m(x)
        out.square().sum().backward()
        results.append((out, {n: p.grad for n, p in m.state_dict(keep_vars=True).items()
                              if isinstance(p, nn.Parameter)}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_forward_is_the_dual_residual_recursion_per_stage(alpha, beta):
    src = _torchvision().double().eval()
    model = pareprop.convert(copy.deepcopy(src), engine="autograd").eval()
    pareprop.set_coupling(model, alpha, beta)
    x = _clips(dtype=torch.float64)
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    z = src.pos_drop(src.patch_embed(x))
    for i, part in enumerate(src.features):
        if i % 2:  # patch merging
            z = part(z)
            continue
        previous = z
        for b in part:  # pre-norm sub-layers, torchvision's
            for norm, layer in ((b.norm1, b.attn), (b.norm2, b.mlp)):
                z, previous = alpha * z + beta * previous + b.stochastic_depth(layer(norm(z))), z
    want = src.head(torch.flatten(src.avgpool(src.norm(z).permute(0, 4, 1, 2, 3)), 1))
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_engines_match_autograd(alpha, beta):
    src = _torchvision(dropout=0.2, attention_dropout=0.2, stochastic_depth_prob=0.4).double()
    model = pareprop.convert(src, tolerance=None)
    pareprop.set_coupling(model, alpha, beta)
    assert all(stack.stored_blocks == () for stack in _stacks(model))
    report = engine_errors(model, _clips(dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def _spy_chunks(monkeypatch):
    seen = []
    real = chunked.chunks

    def spy(size, count):
        seen.append((size, count))
        return real(size, count)

    monkeypatch.setattr(chunked, "chunks", spy)
    return seen


# (0.2, 0.0): the attention's output dropout alone, also drawn inside torchvision's function.
@pytest.mark.parametrize("dropout,attention_dropout", [(0.0, 0.0), (0.2, 0.2), (0.2, 0.0)])
def test_chunked_branches_and_checkpointed_mergings_match_autograd(dropout, attention_dropout,
                                                                   monkeypatch):
    # F in chunks of clips (stochastic depth: the chunk's slice of the batch's draw) unless
    # torchvision's functional attention dropout is on (then whole); G in bands of frames (its
    # MLP dropouts sliced); mergings checkpointed.
    src = _torchvision(dropout=dropout, attention_dropout=attention_dropout,
                       stochastic_depth_prob=0.4).double()
    model = pareprop.convert(src, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    model.set_grad_checkpointing(True)
    pareprop.set_chunking(model, chunks=3)
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, _clips(3, dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"
    # frames of both stages' maps (4) always; the 3 clips only while F can chunk
    assert {size for size, _ in seen} == ({4} if dropout else {3, 4})


def test_stem_and_mergings_are_checkpointed_under_set_grad_checkpointing(monkeypatch):
    from pareprop.convert import swin3d, torchvision_swin_base

    x = _clips(2)
    kept, seen = {}, []
    real = swin3d.maybe_checkpoint

    def spy(module, x, enabled, *args):
        seen.append((type(module).__name__, enabled))
        return real(module, x, enabled, *args)

    # the stem is Video Swin's own, the mergings run in the part shared with the 2-D Swin
    for module in (swin3d, torchvision_swin_base):
        monkeypatch.setattr(module, "maybe_checkpoint", spy)
    for enable in (False, True):
        model = pareprop.convert(_torchvision(), tolerance=None).train()
        pareprop.set_coupling(model, 0.0, 1.0)
        model.set_grad_checkpointing(enable)
        seen.clear()
        kept[enable] = pareprop.activation_bytes(model, x)
        assert seen == [("PatchEmbed3d", enable), ("MergingInChunks", enable)]
    assert kept[True] < kept[False]


def test_state_dict_has_torchvisions_names_both_ways():
    from timm.optim import param_groups_layer_decay

    src = _torchvision()
    model = pareprop.convert(_torchvision())
    assert list(model.state_dict()) == list(src.state_dict())
    torch.manual_seed(5)
    other = _torchvision()
    for p in other.parameters():
        p.data.normal_()
    model.load_state_dict(other.state_dict(), strict=True)
    fresh = _torchvision()
    fresh.load_state_dict(model.state_dict(), strict=True)
    for (n, a), b in zip(other.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    names = [n for n, _ in model.named_parameters()]
    assert "features.2.stack.blocks.1.attn.qkv.weight" in names
    assert model.no_weight_decay() == {n for n in names if "relative_position_bias_table" in n}
    groups = param_groups_layer_decay(model, layer_decay=0.5)
    # stem, 2 + 2 blocks, the merging between, the final norm and head
    assert len({g["lr_scale"] for g in groups}) == 1 + 4 + 1 + 1


def test_model_contract():
    model = pareprop.convert(_torchvision(), engine="autograd").eval()  # no stochastic depth
    assert model.num_features == model.head_hidden_size == 32
    assert model.get_classifier() is model.head
    x = _clips(2)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 32)
    final, feats = model.forward_intermediates(x)
    assert [f.shape for f in feats] == [(2, 16, 4, 8, 8), (2, 32, 4, 4, 4)]
    assert torch.equal(final, model.forward_features(x))
    last = model.forward_intermediates(x, indices=1, norm=True, output_fmt="NHWC",
                                       intermediates_only=True)
    assert len(last) == 1 and torch.equal(last[0], model.forward_features(x))
    first = model.forward_intermediates(x, indices=[0], stop_early=True,
                                        intermediates_only=True)
    assert torch.equal(first[0], feats[0])
    assert [i["num_chs"] for i in model.feature_info] == [16, 32]
    model.reset_classifier(7)
    assert model(x).shape == (2, 7) and model.num_classes == 7
    model.set_engine("pareprop")
    assert {s.engine for s in _stacks(model)} == {"pareprop"}
    with pytest.raises(ValueError, match="global_pool 'avg'"):
        model.reset_classifier(7, global_pool="max")


def test_unsupported_models_and_hooks_are_refused():
    with pytest.raises(UnsupportedModelError, match="subclasses torchvision's"):
        pareprop.convert(type("MySwin3d", (SwinTransformer3d,), {})(
            patch_size=[2, 4, 4], window_size=[8, 7, 7], **SMALL))
    with pytest.raises(UnsupportedModelError, match="converts .*torchvision SwinTransformer3d"):
        pareprop.convert(torchvision.models.video.r3d_18(num_classes=5))
    src = _torchvision()
    handle = src.features[2][0].register_forward_pre_hook(lambda *args: None)
    with pytest.raises(UnsupportedModelError, match="features.2.0 has forward pre hook"):
        pareprop.convert(src)
    handle.remove()
    seen = []
    src.features[1].register_forward_hook(lambda *args: seen.append("merge"))
    pareprop.convert(src).eval()(_clips())
    assert seen == ["merge"]


# -- the named model ------------------------------------------------------------------------

NAMED = dict(SMALL, num_frames=8, img_size=32)


def test_converted_swin3d_by_name_from_a_torchvision_state_dict(tmp_path):
    src = _torchvision().eval()
    torch.save(src.state_dict(), tmp_path / "swin3d_t.pth")
    kwargs = {k: v for k, v in NAMED.items() if k != "num_classes"}
    model = pareprop.create_model("converted_swin3d", source="swin3d_t",
                                  pretrained_file=str(tmp_path / "swin3d_t.pth"),
                                  num_classes=5, **kwargs).eval()
    assert model.pretrained_cfg["input_size"] == (3, 8, 32, 32)
    x = model.example_inputs(2)[0]
    with torch.no_grad():
        assert torch.equal(model(x), src(x))
    other = pareprop.create_model("converted_swin3d", source="swin3d_t",
                                  pretrained_file=str(tmp_path / "swin3d_t.pth"),
                                  num_classes=3, **kwargs).eval()
    with torch.no_grad():  # another class count: torchvision's body, a fresh head
        assert torch.equal(other.forward_features(x), model.forward_features(x))
    assert other(x).shape == (2, 3)


def test_checkpoint_rebuilds_at_its_coupling(tmp_path):
    from pareprop.checkpoint import save_checkpoint

    model = pareprop.create_model("converted_swin3d", tolerance=None, **NAMED)
    pareprop.set_coupling(model, 0.3, 0.5)
    save_checkpoint(tmp_path, model, epoch=1, step=1)
    loaded = pareprop.load_model(tmp_path / "last").eval()
    assert pareprop.coupling_of(loaded) == pareprop.coupling_of(model)
    x = _clips()
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))


def test_torchvisions_weights_online_and_the_refusal_offline(monkeypatch):
    from pareprop.pretrained import PretrainedError

    # torchvision's download (load_state_dict_from_url), answered here: the published file
    # stands in as a model of another seed with Kinetics-400's 400 classes.
    published = _torchvision(num_classes=400).state_dict()
    asked = []

    def download(url, **kw):
        asked.append(url)
        return dict(published)

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", download)
    model = pareprop.create_model("converted_swin3d", tolerance=None, **NAMED)  # 5 classes
    load_torchvision_pretrained(model, "swin3d_t")
    assert asked == [torchvision.models.video.Swin3D_T_Weights.DEFAULT.url]
    assert all(torch.equal(v, published[k]) for k, v in model.state_dict().items()
               if not k.startswith("head."))

    def offline(url, **kw):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", offline)
    with pytest.raises(PretrainedError, match="offline, pass a local copy .*--pretrained-file"):
        load_torchvision_pretrained(model, "swin3d_t")


def test_convert_from_names_a_torchvision_video_swin():
    from pareprop.cli.train import resolve_config

    assert converted_model_name("swin3d_b") == "converted_swin3d"
    cfg = resolve_config(["--convert-from", "swin3d_t", "--model-arg", "depths=[2,2]"])
    assert cfg.model == "converted_swin3d"
    assert cfg.model_kwargs == {"depths": [2, 2], "source": "swin3d_t"}


def test_features_only_by_name():
    net = pareprop.create_model("converted_swin3d", features_only=True, tolerance=None, **NAMED)
    assert net.feature_info.channels() == [16, 32] and net.feature_info.reduction() == [4, 8]
    assert [f.shape for f in net(_clips())] == [(2, 16, 4, 8, 8), (2, 32, 4, 4, 4)]
