"""pareprop.convert on torchvision's 2-D Swin (swin_t/s/b) and Swin V2 (swin_v2_t/s/b): each
stage of ``features`` one reversible stack of coupled blocks, the stem and patch mergings
torchvision's modules. Exact at (1, 0) (torch.equal in float32) for the published
configurations, the dual-residual recursion per stage elsewhere (V1 pre-norm, V2 post-norm),
every engine against autograd (chunked branches, checkpointed mergings and stored blocks
included), torchvision's names in the state dict, the model contract, the named model with
torchvision's weights and data presets, and the refusals."""

import copy

import pytest
import torch
import torch.nn as nn
import torchvision
from torchvision.models.swin_transformer import SwinTransformer

import pareprop
from pareprop.convert import UnsupportedModelError, converted_model_name
from pareprop.convert.torchvision_swin import (
    TV_SWIN_SOURCES,
    build_tv_swin,
    published_name,
    weights_data_config,
)
from pareprop.convert.torchvision_swin_base import load_torchvision_pretrained
from pareprop.engine import chunked
from pareprop.engine.testing import engine_errors, worst_error

# Two blocks a stage, small widths; 32 x 32 images: an 8 x 8 patch grid, so V1's 7 x 7 windows
# pad (to 14) and shift, V2's 8 x 8 windows fit and shift; the second stage's 4 x 4 map is one
# window, unshifted (torchvision drops the shift of a window as large as the map).
SMALL = dict(embed_dim=16, depths=[2, 2], num_heads=[1, 2], num_classes=5)
FAMILIES = ("swin_t", "swin_v2_t")


def _torchvision(source="swin_t", **kwargs):
    torch.manual_seed(0)
    return build_tv_swin(source, **{**SMALL, **kwargs})


def _images(n=2, size=32, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(n, 3, size, size, dtype=dtype)


def _stacks(model):
    return [part.stack for part in model.features if hasattr(part, "stack")]


@pytest.mark.parametrize("source", sorted(TV_SWIN_SOURCES))
def test_the_table_is_torchvisions_configuration(source):
    with torch.device("meta"):
        theirs = getattr(torchvision.models, source)()
        ours = build_tv_swin(source)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == \
        [(k, v.shape) for k, v in theirs.state_dict().items()]
    kinds = [[(type(m).__name__, getattr(m, "p", None)) for m in net.modules()]
             for net in (ours, theirs)]
    assert kinds[0] == kinds[1]  # blocks, mergings and stochastic depth rates
    attn = [(m.features[1][1].attn.window_size, m.features[1][1].attn.shift_size)
            for m in (ours, theirs)]
    assert attn[0] == attn[1]
    assert published_name(theirs) == source


@pytest.mark.parametrize("source", sorted(TV_SWIN_SOURCES))
def test_the_data_config_is_the_weights_transform(source):
    # timm's eval transform of the converted model's pretrained_cfg is torchvision's preset.
    from PIL import Image

    from pareprop.data import eval_transform, model_data_config

    preset = torchvision.models.get_model_weights(source).DEFAULT.transforms()
    config = weights_data_config(source)
    crop = config["input_size"][1]
    assert [crop] == list(preset.crop_size) and config["interpolation"] == \
        preset.interpolation.value
    assert list(config["mean"]) == list(preset.mean) and list(config["std"]) == list(preset.std)
    torch.manual_seed(2)
    image = Image.fromarray((torch.rand(300, 410, 3) * 255).to(torch.uint8).numpy())
    with torch.device("meta"):
        model = pareprop.create_model("converted_tv_swin", source=source, tolerance=None)
    ours = eval_transform(model_data_config(model))(image)
    torch.testing.assert_close(ours, preset(image))


@pytest.mark.parametrize("source", sorted(TV_SWIN_SOURCES))
@pytest.mark.parametrize("size", [32, 30])  # 30: a 7 x 7 grid, which the mergings pad
def test_published_configs_are_exact_at_one_zero(source, size):
    src = _torchvision(source, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]).eval()
    model = pareprop.convert(copy.deepcopy(src), engine="autograd").eval()
    x = _images(2, size)
    with torch.no_grad():
        assert torch.equal(model(x), src(x))
        assert torch.equal(model.forward_features(x), src.norm(src.features(x)))


@pytest.mark.parametrize("source", FAMILIES)
@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_training_step_equals_torchvision_at_one_zero(source, engine):
    # Dropout, attention dropout and stochastic depth on: at beta = 0 every block is stored,
    # so every engine gives torchvision's logits and gradients exactly.
    src = _torchvision(source, dropout=0.1, attention_dropout=0.1,
                       stochastic_depth_prob=0.4).train()
    model = pareprop.convert(copy.deepcopy(src), engine=engine).train()
    x = _images(3)
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


@pytest.mark.parametrize("source", FAMILIES)
@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_forward_is_the_dual_residual_recursion_per_stage(source, alpha, beta):
    src = _torchvision(source).double().eval()
    model = pareprop.convert(copy.deepcopy(src), engine="autograd").eval()
    pareprop.set_coupling(model, alpha, beta)
    x = _images(dtype=torch.float64)
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    post_norm = source.startswith("swin_v2")
    z = src.features[0](x)  # the stem
    for i, part in enumerate(src.features[1:], start=1):
        if i % 2 == 0:  # patch merging
            z = part(z)
            continue
        previous = z
        for b in part:  # V1: z + sd(layer(norm(z))); V2: z + sd(norm(layer(z)))
            for norm, layer in ((b.norm1, b.attn), (b.norm2, b.mlp)):
                h = norm(layer(z)) if post_norm else layer(norm(z))
                z, previous = alpha * z + beta * previous + b.stochastic_depth(h), z
    want = src.head(src.flatten(src.avgpool(src.permute(src.norm(z)))))
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("source", FAMILIES)
@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_engines_match_autograd(source, alpha, beta):
    src = _torchvision(source, dropout=0.2, attention_dropout=0.2,
                       stochastic_depth_prob=0.4).double()
    model = pareprop.convert(src, tolerance=None)
    pareprop.set_coupling(model, alpha, beta)
    assert all(stack.stored_blocks == () for stack in _stacks(model))
    report = engine_errors(model, _images(dtype=torch.float64))
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


@pytest.mark.parametrize("source", FAMILIES)
@pytest.mark.parametrize("attention_dropout", [0.0, 0.2])
def test_chunked_branches_checkpointed_mergings_and_stored_blocks_match_autograd(
        source, attention_dropout, monkeypatch):
    # F in chunks of images (stochastic depth: the chunk's slice of the batch's draw) unless
    # torchvision's functional attention dropout is on (then whole); G in bands of rows (its
    # MLP dropouts sliced); stem and mergings checkpointed; one block of each stage stored.
    src = _torchvision(source, dropout=0.2 if attention_dropout else 0.0,
                       attention_dropout=attention_dropout, stochastic_depth_prob=0.4).double()
    model = pareprop.convert(src, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    model.set_grad_checkpointing(True)
    pareprop.set_chunking(model, chunks=3)
    for stack in _stacks(model):
        stack.store_blocks([1])
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, _images(3, dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"
    # rows of the two stages' maps (8, 4) always; the 3 images only while F can chunk
    assert {size for size, _ in seen} == ({8, 4} if attention_dropout else {3, 8, 4})


@pytest.mark.parametrize("source", FAMILIES)
def test_schedule_and_precision_guard_act_on_every_stack(source):
    model = pareprop.convert(_torchvision(source, depths=[2, 3]), tolerance=1e-3).train()
    schedule = pareprop.CouplingSchedule(model, "linear", steps=2)
    assert all(stack.stored_blocks == tuple(range(len(stack.blocks))) for stack in _stacks(model))
    schedule.step()  # (0.5, 0.5) on every block of every stack
    assert {(b._alpha_value, pareprop.engine.skip_scale_value(b))
            for stack in _stacks(model) for b in stack.blocks} == {(0.5, 0.5)}
    guard = model.precision_guard
    assert len(guard.stacks) == 2
    x = _images(2)
    # A tolerance nothing meets stores every block of every stack; one everything meets, none.
    for tolerance, stored in ((1e-30, True), (10.0, False)):
        guard.tolerance = tolerance
        guard.invalidate()
        model(x).sum().backward()
        assert all(r is not None and r.tolerance == tolerance for r in guard.reports)
        for stack in _stacks(model):
            want = tuple(range(len(stack.blocks))) if stored else ()
            assert stack.stored_blocks == want


def test_stem_and_mergings_are_checkpointed_under_set_grad_checkpointing(monkeypatch):
    from pareprop.convert import torchvision_swin, torchvision_swin_base

    x = _images(2)
    kept, seen = {}, []
    real = torchvision_swin.maybe_checkpoint

    def spy(module, x, enabled, *args):
        seen.append((type(module).__name__, enabled))
        return real(module, x, enabled, *args)

    for module in (torchvision_swin, torchvision_swin_base):
        monkeypatch.setattr(module, "maybe_checkpoint", spy)
    for enable in (False, True):
        model = pareprop.convert(_torchvision(), tolerance=None).train()
        pareprop.set_coupling(model, 0.0, 1.0)
        model.set_grad_checkpointing(enable)
        seen.clear()
        kept[enable] = pareprop.activation_bytes(model, x)
        assert seen == [("Sequential", enable), ("MergingInChunks", enable)]
    assert kept[True] < kept[False]


@pytest.mark.parametrize("source", FAMILIES)
def test_state_dict_has_torchvisions_names_both_ways(source):
    from timm.optim import param_groups_layer_decay

    src = _torchvision(source)
    model = pareprop.convert(_torchvision(source))
    assert list(model.state_dict()) == list(src.state_dict())
    torch.manual_seed(5)
    other = _torchvision(source)
    for p in other.parameters():
        p.data.normal_()
    model.load_state_dict(other.state_dict(), strict=True)
    fresh = _torchvision(source)
    fresh.load_state_dict(model.state_dict(), strict=True)
    for (n, a), b in zip(other.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    names = [n for n, _ in model.named_parameters()]
    assert "features.3.stack.blocks.1.attn.qkv.weight" in names
    assert model.no_weight_decay() == {n for n in names if "relative_position_bias_table" in n}
    groups = param_groups_layer_decay(model, layer_decay=0.5)
    # stem, 2 + 2 blocks, the merging between, the final norm and head
    assert len({g["lr_scale"] for g in groups}) == 1 + 4 + 1 + 1
    stem = {id(p) for p in model.features[0].parameters()}  # torchvision's features.0
    assert {g["lr_scale"] for g in groups if any(id(p) in stem for p in g["params"])} == \
        {min(g["lr_scale"] for g in groups)}


def test_model_contract():
    model = pareprop.convert(_torchvision(), engine="autograd").eval()  # no stochastic depth
    assert model.num_features == model.head_hidden_size == 32
    assert model.get_classifier() is model.head
    x = _images(2)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 32)
    final, feats = model.forward_intermediates(x)
    assert [f.shape for f in feats] == [(2, 16, 8, 8), (2, 32, 4, 4)]
    assert torch.equal(final, model.forward_features(x))
    last = model.forward_intermediates(x, indices=1, norm=True, output_fmt="NHWC",
                                       intermediates_only=True)
    assert len(last) == 1 and torch.equal(last[0], model.forward_features(x))
    first = model.forward_intermediates(x, indices=[0], stop_early=True,
                                        intermediates_only=True)
    assert torch.equal(first[0], feats[0])
    assert [i["num_chs"] for i in model.feature_info] == [16, 32]
    assert [i["reduction"] for i in model.feature_info] == [4, 8]
    assert model.example_inputs(3)[0].shape == (3, 3, 224, 224)
    model.reset_classifier(7)
    assert model(x).shape == (2, 7) and model.num_classes == 7
    model.set_engine("pareprop")
    assert {s.engine for s in _stacks(model)} == {"pareprop"}
    with pytest.raises(ValueError, match="global_pool 'avg'"):
        model.reset_classifier(7, global_pool="max")


def test_each_family_converts_to_its_own_model():
    import timm
    from torchvision.models.video import SwinTransformer3d

    from pareprop.convert import ConvertedSwin, ConvertedSwin3d, ConvertedTorchvisionSwin

    assert type(pareprop.convert(_torchvision("swin_v2_t"))) is ConvertedTorchvisionSwin
    timm_swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False,
                                  embed_dim=16, depths=(2, 2), num_heads=(1, 2), img_size=32,
                                  window_size=4, num_classes=5)
    assert type(pareprop.convert(timm_swin)) is ConvertedSwin
    video = SwinTransformer3d(patch_size=[2, 4, 4], window_size=[8, 7, 7], **SMALL)
    assert type(pareprop.convert(video)) is ConvertedSwin3d


def test_unsupported_models_and_hooks_are_refused():
    with pytest.raises(UnsupportedModelError, match="subclasses torchvision's SwinTransformer"):
        pareprop.convert(type("MySwin", (SwinTransformer,), {})(
            patch_size=[4, 4], window_size=[7, 7], **SMALL))
    with pytest.raises(UnsupportedModelError, match="converts .*torchvision SwinTransformer"):
        pareprop.convert(torchvision.models.resnet18(num_classes=5))
    src = _torchvision()
    src.features[3][1] = nn.Identity()
    with pytest.raises(UnsupportedModelError, match="features.3.1 is a Identity"):
        pareprop.convert(src)
    src = _torchvision()
    del src.features[2]  # the second stage now sits where a merging belongs
    with pytest.raises(UnsupportedModelError, match="features.2 is a Sequential, not .*PatchM"):
        pareprop.convert(src)
    src = _torchvision()
    src.features[3] = src.features[2]
    with pytest.raises(UnsupportedModelError, match="features.3 is a PatchMerging, not a stage"):
        pareprop.convert(src)
    src = _torchvision()
    src.features[2] = nn.Identity()
    with pytest.raises(UnsupportedModelError, match="features.2 is a Identity, not .*PatchMerg"):
        pareprop.convert(src)
    src = _torchvision()
    src.features[1][0].norm2 = nn.BatchNorm2d(8)
    with pytest.raises(UnsupportedModelError, match="features.1.0.norm2 is a BatchNorm2d"):
        pareprop.convert(src)
    src = _torchvision()
    handle = src.features[3][0].register_forward_pre_hook(lambda *args: None)
    with pytest.raises(UnsupportedModelError, match="features.3.0 has forward pre hook"):
        pareprop.convert(src)
    handle.remove()
    seen = []
    src.features[2].register_forward_hook(lambda *args: seen.append("merge"))
    src.features[0].register_forward_hook(lambda *args: seen.append("stem"))
    pareprop.convert(src).eval()(_images())
    assert seen == ["stem", "merge"]


# -- the named model ------------------------------------------------------------------------

NAMED = dict(SMALL, img_size=32)


@pytest.mark.parametrize("source", FAMILIES)
def test_converted_tv_swin_by_name_from_a_torchvision_state_dict(source, tmp_path):
    src = _torchvision(source).eval()
    torch.save(src.state_dict(), tmp_path / f"{source}.pth")
    kwargs = {k: v for k, v in NAMED.items() if k != "num_classes"}
    model = pareprop.create_model("converted_tv_swin", source=source,
                                  pretrained_file=str(tmp_path / f"{source}.pth"),
                                  num_classes=5, **kwargs).eval()
    assert model.pretrained_cfg["input_size"] == (3, 32, 32)
    assert model.pretrained_cfg["crop_pct"] == weights_data_config(source)["crop_pct"]
    x = model.example_inputs(2)[0]
    with torch.no_grad():
        assert torch.equal(model(x), src(x))
    other = pareprop.create_model("converted_tv_swin", source=source,
                                  pretrained_file=str(tmp_path / f"{source}.pth"),
                                  num_classes=3, **kwargs).eval()
    with torch.no_grad():  # another class count: torchvision's body, a fresh head
        assert torch.equal(other.forward_features(x), model.forward_features(x))
    assert other(x).shape == (2, 3)


def test_a_file_of_the_other_family_is_refused_before_anything_is_copied(tmp_path):
    from pareprop.pretrained import PretrainedError

    torch.save(_torchvision("swin_v2_t").state_dict(), tmp_path / "v2.pth")
    with pytest.raises(PretrainedError, match="does not fit SwinTransformer"):
        pareprop.create_model("converted_tv_swin", source="swin_t",
                              pretrained_file=str(tmp_path / "v2.pth"), **NAMED)


def test_checkpoint_rebuilds_at_its_coupling(tmp_path):
    from pareprop.checkpoint import save_checkpoint

    model = pareprop.create_model("converted_tv_swin", source="swin_v2_t", tolerance=None,
                                  **NAMED)
    pareprop.set_coupling(model, 0.3, 0.5)
    save_checkpoint(tmp_path, model, epoch=1, step=1)
    loaded = pareprop.load_model(tmp_path / "last").eval()
    assert type(loaded).__name__ == "ConvertedTorchvisionSwin"
    assert pareprop.coupling_of(loaded) == pareprop.coupling_of(model)
    assert loaded.pretrained_cfg["input_size"] == (3, 32, 32)
    x = _images()
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))


@pytest.mark.parametrize("source,weights", [("swin_t", "Swin_T_Weights"),
                                            ("swin_v2_b", "Swin_V2_B_Weights")])
def test_torchvisions_weights_online_and_the_refusal_offline(source, weights, monkeypatch):
    from pareprop.pretrained import PretrainedError

    # torchvision's download (load_state_dict_from_url), answered here: the published file
    # stands in as a model of another seed with ImageNet-1k's 1000 classes.
    published = _torchvision(source, num_classes=1000).state_dict()
    asked = []

    def download(url, **kw):
        asked.append(url)
        return dict(published)

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", download)
    model = pareprop.create_model("converted_tv_swin", source=source, tolerance=None,
                                  **NAMED)  # 5 classes
    model.load_source_pretrained(source)
    assert asked == [getattr(torchvision.models, weights).DEFAULT.url]
    assert all(torch.equal(v, published[k]) for k, v in model.state_dict().items()
               if not k.startswith("head."))

    def offline(url, **kw):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", offline)
    with pytest.raises(PretrainedError, match="offline, pass a local copy .*--pretrained-file"):
        load_torchvision_pretrained(model, source)


def test_convert_from_names_a_torchvision_swin_not_timms():
    from pareprop.cli.train import resolve_config

    for name in TV_SWIN_SOURCES:
        assert converted_model_name(name) == "converted_tv_swin"
    for name in ("swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"):
        assert converted_model_name(name) == "converted_swin"
    assert converted_model_name("swin3d_t") == "converted_swin3d"
    cfg = resolve_config(["--convert-from", "swin_v2_s", "--model-arg", "depths=[2,2]"])
    assert cfg.model == "converted_tv_swin"
    assert cfg.model_kwargs == {"depths": [2, 2], "source": "swin_v2_s"}


def test_features_only_by_name():
    net = pareprop.create_model("converted_tv_swin", features_only=True, tolerance=None,
                                **NAMED)
    assert net.feature_info.channels() == [16, 32] and net.feature_info.reduction() == [4, 8]
    assert [f.shape for f in net(_images())] == [(2, 16, 8, 8), (2, 32, 4, 4)]


def test_catalog_builds_converted_torchvision_swin_at_the_reversible_coupling():
    from pareprop.catalog import ModelRequest, build_model, model_facts

    assert model_facts("converted:swin_v2_t").family == "ConvertedTorchvisionSwin"
    request = ModelRequest("converted:swin_v2_t", "reversible", img_size=32,
                           overrides=dict(SMALL))
    model = build_model(request)
    assert pareprop.coupling_of(model) == (0.0, 1.0)
    assert getattr(model, "precision_guard", None) is None
    assert all(s.stored_blocks == () and s.engine == "reversible" for s in _stacks(model))
    assert model.example_inputs(2)[0].shape == (2, 3, 32, 32)


def test_trainer_fine_tunes_from_a_torchvision_file_with_the_weights_data_config(tmp_path):
    # pareprop train --convert-from swin_t --pretrained-file: torchvision's body, a fresh head
    # for the data's classes, and the weights' preset (bicubic, 224 of 232) at the model's size.
    from PIL import Image

    from pareprop.trainer import TrainConfig, Trainer

    for c in range(2):
        (tmp_path / "data" / f"c{c}").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (40, 44), (80 * c, 40 * i, 9)).save(
                tmp_path / "data" / f"c{c}" / f"{i}.png")
    src = _torchvision(num_classes=1000)
    torch.save(src.state_dict(), tmp_path / "swin_t.pth")
    trainer = Trainer(TrainConfig(
        convert_from="swin_t", pretrained_file=str(tmp_path / "swin_t.pth"),
        model_kwargs=dict(embed_dim=16, depths=[2, 2], num_heads=[1, 2], img_size=32),
        dataset=str(tmp_path / "data"), epochs=1, max_steps=1, batch_size=4, warmup_epochs=0,
        out=str(tmp_path / "run"), progress=False))
    config = trainer.data.data_config
    assert config["input_size"] == [3, 32, 32] and config["interpolation"] == "bicubic"
    assert config["crop_pct"] == pytest.approx(224 / 232)
    assert trainer.model.num_classes == 2
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in trainer.model.state_dict().items()
               if not k.startswith("head."))
    trainer.fit()
    loaded = pareprop.load_model(tmp_path / "run" / "last")
    assert type(loaded).__name__ == "ConvertedTorchvisionSwin"
    assert pareprop.coupling_of(loaded) == pareprop.coupling_of(trainer.model)


def test_torchvisions_swin_is_a_catalog_baseline_checkpointed_per_block(monkeypatch):
    # `pareprop plan --models converted:swin_t swin_t`: the source as plain and checkpointed.
    from torch.utils import checkpoint as torch_checkpoint

    from pareprop.catalog import ModelRequest, build_model, model_facts, model_source
    from pareprop.models import torchvision_swin as baseline

    assert model_source("swin_v2_t") == "torchvision" and model_source("swin_t") == "torchvision"
    facts = model_facts("swin_v2_t")
    assert not facts.reversible and facts.input_size == (3, 256, 256)
    with pytest.raises(ValueError, match="takes images"):
        build_model(ModelRequest("swin_t", "plain", overrides=dict(num_frames=4)))
    calls = []
    real = torch_checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(type(fn).__name__)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(baseline, "checkpoint", spy)
    x = _images(2)
    outs = {}
    for engine in ("plain", "checkpointed"):
        torch.manual_seed(0)
        model = build_model(ModelRequest("swin_t", engine, num_classes=5, img_size=32)).eval()
        assert model.example_inputs(2)[0].shape == (2, 3, 32, 32)
        outs[engine] = model(x)  # eval: no stochastic depth; checkpointed while grad records
    assert calls == ["SwinTransformerBlock"] * 12  # swin_t's 2 + 2 + 6 + 2 blocks
    assert torch.equal(outs["plain"], outs["checkpointed"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.net(x), rtol=0, atol=0)
