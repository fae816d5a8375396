"""pareprop.convert on torchvision's video MViT (mvit_v1_b, mvit_v2_s): the blocks that keep
their shape become reversible stacks, the blocks that pool the shortcut or change the width
stay torchvision's. Exact at (1, 0) (torch.equal in float32) for both published
configurations at small size, the dual-residual recursion in between, every engine against
autograd in float64, torchvision's names in the state dict, the model contract and the named
model."""

import copy

import pytest
import torch
import torch.nn as nn
import torchvision
from torchvision.models.video.mvit import MultiscaleBlock, MViT

import pareprop
from pareprop.convert import UnsupportedModelError
from pareprop.convert.torchvision_mvit import SOURCES, keeps_shape, published_mvit
from pareprop.engine import ReversibleStack
from pareprop.engine.testing import engine_errors, worst_error

# The published block layouts, 16 wide, two blocks a stack, 4 frames of 32x32.
SMALL = dict(spatial_size=(32, 32), temporal_size=4, embed_dim=16, max_run=2, num_classes=5)


def _tv(name="mvit_v2_s", **kwargs):
    torch.manual_seed(0)
    return published_mvit(name, **{**SMALL, **kwargs})


def _clips(n=2, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(n, 3, 4, 32, 32, dtype=dtype)


def _features(source, x):
    """torchvision's forward up to its final norm (it has no forward_features)."""
    x = source.pos_encoding(source.conv_proj(x).flatten(2).transpose(1, 2))
    thw = (source.pos_encoding.temporal_size,) + source.pos_encoding.spatial_size
    for block in source.blocks:
        x, thw = block(x, thw)
    return source.norm(x)


def _engine_errors(model, x):
    # The key norm's bias gets no gradient (softmax ignores a shift shared by every key):
    # its reference is rounding noise, measured against the largest gradient instead.
    return engine_errors(model, x, noise_floor=1e-8)


def _grads(model):
    return {n: p.grad for n, p in model.state_dict(keep_vars=True).items()
            if isinstance(p, nn.Parameter)}


@pytest.mark.parametrize("name", SOURCES)
def test_logits_and_features_equal_torchvision_to_the_bit_at_one_zero(name):
    source = _tv(name).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    x = _clips()
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
        assert torch.equal(model.forward_features(x), _features(source, x))


@pytest.mark.parametrize("name,layout", [
    # S: a stack (its length); B: torchvision's block (pools the shortcut or widens).
    # mvit_v1_b widens in the block before each pooling one (MViTv1's MLP projection).
    ("mvit_v1_b", "B B B B S9 B B S1"),
    ("mvit_v2_s", "S1 B S1 B S10 B S1"),
])
def test_published_layouts_couple_only_blocks_that_keep_their_shape(name, layout):
    with torch.device("meta"):  # full size, nothing allocated
        model = pareprop.convert(torchvision.models.get_model(name), tolerance=None)
    got = " ".join(f"S{len(p.blocks)}" if isinstance(p, ReversibleStack) else "B"
                   for p in model.encoder.parts)
    assert got == layout
    for part in model.encoder.parts:
        if not isinstance(part, ReversibleStack):
            assert type(part) is MultiscaleBlock and not keeps_shape(part)


@pytest.mark.parametrize("name", SOURCES)
def test_published_mvit_rebuilds_torchvisions_architecture(name):
    # The smaller builds come from the published blocks read back: at full size they are
    # torchvision's own model, name for name and shape for shape.
    with torch.device("meta"):
        ours = published_mvit(name, embed_dim=96)  # forces the rebuild at the published width
        theirs = torchvision.models.get_model(name)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()]
    assert ours.blocks[-1].stochastic_depth.p == theirs.blocks[-1].stochastic_depth.p


@pytest.mark.parametrize("engine", pareprop.ENGINES)
@pytest.mark.parametrize("name", SOURCES)
def test_training_step_equals_torchvision_at_one_zero(engine, name):
    # Stochastic depth, attention and MLP dropout and head dropout on; the kept blocks are
    # checkpointed. At beta = 0 every block is stored: torchvision's logits and gradients.
    source = _tv(name, stochastic_depth_prob=0.4, attention_dropout=0.2, dropout=0.2).train()
    model = pareprop.convert(copy.deepcopy(source), engine=engine).train()
    model.set_grad_checkpointing()
    x = _clips()
    results = []
    for m in (source, model):
        torch.manual_seed(3)
        out = m(x)
        out.square().sum().backward()
        results.append((out, _grads(m)))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    for key, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][key]), key


def _sublayers(block):
    return (lambda x, thw: block.stochastic_depth(block.attn(block.norm1(x), thw)[0]),
            lambda x, thw: block.stochastic_depth(block.mlp(block.norm2(x))))


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_forward_is_the_dual_residual_recursion(alpha, beta):
    source = _tv("mvit_v1_b").double().eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    pareprop.set_coupling(model, alpha, beta)
    x = _clips(dtype=torch.float64)
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    z = source.pos_encoding(source.conv_proj(x).flatten(2).transpose(1, 2))
    thw = (source.pos_encoding.temporal_size,) + source.pos_encoding.spatial_size
    previous = None
    for block in source.blocks:
        if not keeps_shape(block):
            z, thw = block(z, thw)
            previous = None
            continue
        previous = z if previous is None else previous
        for h in _sublayers(block):
            z, previous = alpha * z + beta * previous + h(z, thw), z
    torch.testing.assert_close(model(x), source.head(source.norm(z)[:, 0]), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
@pytest.mark.parametrize("setup", ["plain", "checkpointed", "chunked", "stored"])
@pytest.mark.parametrize("name", SOURCES)
def test_engines_match_autograd_on_a_converted_mvit(name, alpha, beta, setup):
    source = _tv(name, stochastic_depth_prob=0.4, attention_dropout=0.2, dropout=0.2)
    model = pareprop.convert(source.double(), tolerance=None)
    pareprop.set_coupling(model, alpha, beta)
    if setup == "checkpointed":
        model.set_grad_checkpointing()
    elif setup == "chunked":  # the stacks' branches, and the kept blocks checkpointed
        model.set_grad_checkpointing()  # stochastic depth: a chunk draws its slice
        pareprop.set_chunking(model, chunks=2)
    elif setup == "stored":
        model.stacks()[-2].store_blocks([0])
    report = _engine_errors(model, _clips(dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def test_schedule_and_precision_guard_over_every_stack():
    model = pareprop.convert(_tv("mvit_v2_s").double())
    stacks = model.stacks()
    assert len(stacks) == 4 and len(model.precision_guard.stacks) == 4
    schedule = pareprop.CouplingSchedule(model, "cosine", steps=2)
    schedule.step()
    assert pareprop.coupling_of(model) == pytest.approx((0.5, 0.5))
    report = _engine_errors(model, _clips(dtype=torch.float64))
    assert all(r is not None and r.beta == pytest.approx(0.5)
               for r in model.precision_guard.reports)
    assert all(s.stored_blocks == () for s in stacks)
    assert worst_error(report)[2] < 1e-9
    model.precision_guard.tolerance = 1e-300  # no rebuild meets it: all stored, still exact
    model.precision_guard.invalidate()
    report = _engine_errors(model, _clips(dtype=torch.float64))
    assert all(s.stored_blocks == tuple(range(len(s.blocks))) for s in stacks)
    assert worst_error(report)[2] < 1e-9


def test_state_dict_has_torchvision_names_both_ways():
    source = _tv("mvit_v1_b")
    model = pareprop.convert(_tv("mvit_v1_b"))
    assert list(model.state_dict()) == list(source.state_dict())
    torch.manual_seed(5)
    other = _tv("mvit_v1_b")
    for p in other.parameters():
        p.data.normal_()
    model.load_state_dict(other.state_dict(), strict=True)
    fresh = _tv("mvit_v1_b")
    fresh.load_state_dict(model.state_dict(), strict=True)
    for (n, a), b in zip(other.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    names = [n for n, _ in model.named_parameters()]
    assert "encoder.parts.4.blocks.1.attn.qkv.weight" in names  # torchvision's blocks.5
    from timm.optim import param_groups_layer_decay

    groups = param_groups_layer_decay(model, layer_decay=0.5)
    assert len({g["lr_scale"] for g in groups}) == 1 + len(source.blocks) + 1


def test_model_contract():
    model = pareprop.convert(_tv("mvit_v2_s"), engine="autograd")
    assert model.num_features == model.head_hidden_size == 128
    assert model.get_classifier() is model.head[1]
    x = model.example_inputs(2)[0]
    assert x.shape == (2, 3, 4, 32, 32) and model.pretrained_cfg["input_size"] == (3, 4, 32, 32)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 128)
    feats = model.forward_intermediates(x, intermediates_only=True)
    assert [f.shape for f in feats] == [(2, 128, 2, 1, 1)]
    model.reset_classifier(7)
    assert model(x).shape == (2, 7) and model.num_classes == 7
    model.reset_classifier(0)
    assert model(x).shape == (2, 128)
    assert model.set_engine("pareprop") is model
    assert all(s.engine == "pareprop" for s in model.stacks())
    with pytest.raises(ValueError, match=r"expected clips \(B, 3, 4, 32, 32\)"):
        model(torch.randn(2, 3, 8, 32, 32))
    with pytest.raises(ValueError, match="class token"):
        model.reset_classifier(3, global_pool="avg")


def test_refusals_name_the_reason():
    class Sub(MViT):
        pass

    source = _tv()
    source.__class__ = Sub
    with pytest.raises(UnsupportedModelError, match="Sub subclasses torchvision's MViT"):
        pareprop.convert(source)
    source = _tv(norm_layer=nn.BatchNorm1d)
    with pytest.raises(UnsupportedModelError, match="blocks.0 normalises with BatchNorm1d"):
        pareprop.convert(source)
    source = _tv()
    source.blocks[2].register_forward_hook(lambda *a: None)
    with pytest.raises(UnsupportedModelError, match="blocks.2 has forward hook"):
        pareprop.convert(source)


def test_named_model_from_a_torchvision_file_and_back_from_a_checkpoint(tmp_path, monkeypatch):
    from pareprop.checkpoint import load_model, save_checkpoint
    from pareprop.cli.train import resolve_config
    from pareprop.pretrained import PretrainedError

    small = dict(SMALL, spatial_size=[32, 32])  # as a checkpoint's JSON gives it back
    source = _tv("mvit_v1_b").eval()
    path = tmp_path / "mvit_v1_b.pth"
    torch.save(source.state_dict(), path)  # torchvision's layout
    torch.manual_seed(1)
    model = pareprop.create_model("converted_tv_mvit", source="mvit_v1_b",
                                  pretrained_file=str(path), **small).eval()
    x = _clips()
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
    pareprop.set_coupling(model, 0.25, 0.75)
    save_checkpoint(tmp_path / "run", model, epoch=1, step=1)
    loaded = load_model(tmp_path / "run").eval()
    assert type(loaded) is type(model) and pareprop.coupling_of(loaded) == (0.25, 0.75)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    cfg = resolve_config(["--convert-from", "mvit_v2_s"])
    assert cfg.model == "converted_tv_mvit" and cfg.model_kwargs == {"source": "mvit_v2_s"}
    # offline: torchvision's download fails, and says what to do instead, in one line
    weights = torchvision.models.get_model_weights("mvit_v1_b").DEFAULT

    def offline(*args, **kwargs):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(type(weights), "get_state_dict", offline)
    with pytest.raises(PretrainedError, match="--pretrained-file") as info:
        model.load_source_pretrained("mvit_v1_b")
    assert "\n" not in str(info.value)
    # torchvision's published weights do not fit a smaller model: refused, naming the size
    monkeypatch.setattr(type(weights), "get_state_dict",
                        lambda *a, **k: torchvision.models.get_model("mvit_v1_b").state_dict())
    with pytest.raises(PretrainedError, match=r"16 frames of \(224, 224\)"):
        model.load_source_pretrained("mvit_v1_b")
    # weights of this size and class count load whole, the classifier too
    monkeypatch.setattr(type(weights), "get_state_dict", lambda *a, **k: source.state_dict())
    fresh = pareprop.create_model("converted_tv_mvit", source="mvit_v1_b", **small).eval()
    fresh.load_source_pretrained("mvit_v1_b")
    with torch.no_grad():
        assert torch.equal(fresh(x), source(x))
