"""pareprop.convert on timm's Swin Transformer (V1, pre-norm) and Swin V2 (post-norm): each
stage's blocks one reversible stack of coupled blocks, patch merging as timm's module. Exact at
(1, 0) (torch.equal in float32) for timm's published configurations, the dual-residual
recursion per stage elsewhere, every engine against autograd (chunked branches and
checkpointed merging included), the coupling schedule and the precision guard over several
stacks, timm's names in the state dict, the model contract, the named model and the refusals."""

import copy

import pytest
import timm
import torch
import torch.nn as nn
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer_v2 import SwinTransformerV2, SwinTransformerV2Block

import pareprop
from pareprop.convert import UnsupportedModelError, converted_model_name
from pareprop.engine import chunked
from pareprop.engine.testing import engine_errors, worst_error

KINDS = {"v1": SwinTransformer, "v2": SwinTransformerV2}
# Two stages of two blocks on an 8x8 patch grid with windows of 4: stage 0 has shifted windows
# (and their mask), stage 1 starts with patch merging and fits one window (no shift).
SMALL = dict(img_size=32, patch_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
             window_size=4, num_classes=5)


def _timm(kind="v1", **kwargs):
    torch.manual_seed(0)
    model = KINDS[kind](**{**SMALL, **kwargs})
    with torch.no_grad():  # V2's post-norms start at zero (its init): make every branch count
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _images(n=2, size=32, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(n, 3, size, size, dtype=dtype)


def _stacks(model):
    return [stage.stack for stage in model.layers]


# timm's published configurations, two blocks a stage, small widths: V1 windows of 7 (padded,
# shifted) and 12, the S3 search's per-stage windows, V2 windows of 8 and V2 with pretrained
# window sizes (its continuous position bias rescaled).
NAMED = {
    "swin_tiny_patch4_window7_224": dict(img_size=64),
    "swin_base_patch4_window12_384": dict(img_size=96),
    "swin_s3_tiny_224": dict(img_size=64),
    "swinv2_tiny_window8_256": dict(img_size=64),
    "swinv2_base_window12to16_192to256": dict(img_size=128),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_timm_named_configs_are_exact_at_one_zero(name):
    torch.manual_seed(0)
    source = timm.create_model(name, depths=(2, 2, 2, 2), embed_dim=16, num_heads=(1, 2, 4, 8),
                               num_classes=7, **NAMED[name]).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    x = _images(2, NAMED[name]["img_size"])
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
        assert torch.equal(model.forward_features(x), source.forward_features(x))
        ours = model.forward_intermediates(x, intermediates_only=True)
        theirs = source.forward_intermediates(x, intermediates_only=True)
    assert len(ours) == len(theirs) == 4  # one feature a stage end
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dynamic_img_size_is_exact_at_one_zero(kind):
    # dynamic_img_size: timm builds each block's mask for the input at hand, inside _attn.
    source = _timm(kind, dynamic_img_size=True).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    x = _images(2, 48)  # 12x12 patches: padded windows in stage 0
    with torch.no_grad():
        assert torch.equal(model(x), source(x))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("resize", [dict(img_size=(48, 48)), dict(img_size=(64, 64), window_size=8),
                                    dict(window_ratio=2)])
def test_set_input_size_follows_timm(kind, resize):
    # timm's resize on both: new windows, shifts and masks in every block, exact at (1, 0), and
    # at (0, 1) every engine still agrees with autograd at the new size.
    if not hasattr(KINDS[kind], "set_input_size"):
        pytest.skip("this timm has no set_input_size")
    source = _timm(kind).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    source.set_input_size(**resize)
    model.set_input_size(**resize)
    size = source.patch_embed.img_size
    assert model.pretrained_cfg["input_size"] == (3, *size)
    assert model.example_inputs()[0].shape[-2:] == size
    for ours, theirs in zip(model.layers, source.layers):
        for a, b in zip(ours.stack.blocks, theirs.blocks):
            assert (a.window_size, a.shift_size) == (b.window_size, b.shift_size)
    assert any(b.window_size != (4, 4) or b.input_resolution != (8, 8)
               for stage in model.layers for b in stage.stack.blocks)
    x = _images(2, size[0])
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
    model = pareprop.convert(source.double(), tolerance=None)
    pareprop.set_coupling(model, 0.0, 1.0)
    engine, key, err = worst_error(engine_errors(model, _images(2, size[0], torch.float64)))
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"])
def test_prune_intermediate_layers_follows_timm(name):
    torch.manual_seed(0)
    source = timm.create_model(name, depths=(2, 2, 2, 2), embed_dim=16, num_heads=(1, 2, 4, 8),
                               num_classes=7, img_size=64).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    assert model.prune_intermediate_layers([0, 2]) == source.prune_intermediate_layers([0, 2])
    assert len(model.layers) == 3 and model.head_hidden_size == source.head_hidden_size == 64
    x = _images(2, 64)
    with torch.no_grad():
        ours = model.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
        theirs = source.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
    assert len(ours) == 2 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not any(k.startswith("layers.3") for k in model.state_dict())


@pytest.mark.parametrize("engine", pareprop.ENGINES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_training_step_equals_timm_at_one_zero(kind, engine):
    # Every dropout and drop-path on: the blocks draw in timm's order, and at beta = 0 every
    # block of every stack is stored, so every engine gives timm's logits and gradients exactly.
    kwargs = dict(drop_path_rate=0.3, proj_drop_rate=0.1, attn_drop_rate=0.1, drop_rate=0.1)
    source = _timm(kind, **kwargs).train()
    model = pareprop.convert(copy.deepcopy(source), engine=engine).train()
    x = _images(3)
    results = []
    for m in (source, model):
        torch.manual_seed(3)
        out = m(x)
        out.square().sum().backward()
        results.append((out, {n: p.grad for n, p in m.state_dict(keep_vars=True).items()
                              if isinstance(p, nn.Parameter)}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name


def _h(block, j):
    """timm's residual sub-layer j (0: attention, 1: MLP) of a block on (B, H, W, C)."""
    v2 = isinstance(block, SwinTransformerV2Block)
    if j == 0:
        if v2:  # post-norm
            return lambda z: block.drop_path1(block.norm1(block._attn(z)))
        return lambda z: block.drop_path1(block._attn(block.norm1(z)))

    def mlp(z):
        t = z.reshape(z.shape[0], -1, z.shape[-1])
        h = block.norm2(block.mlp(t)) if v2 else block.mlp(block.norm2(t))
        return block.drop_path2(h).reshape(z.shape)

    return mlp


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_forward_is_the_dual_residual_recursion_per_stage(kind, alpha, beta):
    source = _timm(kind).double().eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    pareprop.set_coupling(model, alpha, beta)
    x = _images(dtype=torch.float64)
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    # Per stage: merge, then z_{j+1} = alpha z_j + beta z_{j-1} + H_j(z_j) from z_0 = z_1 = x;
    # the next stage reads z_{2L+1}.
    z = source.patch_embed(x)
    for stage in source.layers:
        z = stage.downsample(z)
        previous = z
        for block in stage.blocks:
            for j in range(2):
                z, previous = alpha * z + beta * previous + _h(block, j)(z), z
    want = source.forward_head(source.norm(z))
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_engines_match_autograd(kind, alpha, beta):
    source = _timm(kind, drop_path_rate=0.3, proj_drop_rate=0.2, attn_drop_rate=0.2).double()
    model = pareprop.convert(source, tolerance=None)
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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_chunked_branches_and_checkpointed_merging_match_autograd(kind, monkeypatch):
    # Chunks of samples for F (its window dropouts sliced with nW rows a sample), bands of rows
    # for G; V1's attention unfused so that its attention dropout is drawn outside SDPA and F
    # chunks too; patch merging checkpointed.
    source = _timm(kind, drop_path_rate=0.3, proj_drop_rate=0.2, attn_drop_rate=0.2).double()
    for stage in source.layers:
        for block in stage.blocks:
            block.attn.fused_attn = False
    model = pareprop.convert(source, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    model.set_grad_checkpointing(True)
    pareprop.set_chunking(model, chunks=3)
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, _images(3, dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"
    # samples (3) and rows of both stages' maps (8 and 4) were chunked
    assert {size for size, _ in seen} == {3, 8, 4}


def test_fused_attention_dropout_runs_f_whole(monkeypatch):
    # timm's fused attention draws its attention dropout inside SDPA, which no slice of a chunk
    # reproduces: F runs whole (no chunks of samples), G still chunks, the step stays exact.
    source = _timm("v1", attn_drop_rate=0.2).double()
    for stage in source.layers:
        for block in stage.blocks:
            block.attn.fused_attn = True
    model = pareprop.convert(source, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    pareprop.set_chunking(model, chunks=3)
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, _images(3, dtype=torch.float64), engines=("reversible",))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"
    assert {size for size, _ in seen} == {8, 4}  # rows of the maps only, never the 3 samples


def test_stem_and_merging_are_checkpointed_under_set_grad_checkpointing():
    # Checkpointed, the patch embedding keeps the images and patch merging its input (the
    # stack before keeps it anyway), not their norms' and projections' inputs: each alone
    # makes the step keep less.
    x = _images(2)
    model = pareprop.convert(_timm(), tolerance=None).train()
    pareprop.set_coupling(model, 0.0, 1.0)
    model.set_grad_checkpointing(True)
    assert model.grad_checkpointing and all(stage.grad_checkpointing for stage in model.layers)
    both = pareprop.activation_bytes(model, x)
    model.grad_checkpointing = False  # the stem only
    assert both < pareprop.activation_bytes(model, x)
    model.grad_checkpointing = True
    for stage in model.layers:  # the merging only
        stage.grad_checkpointing = False
    assert both < pareprop.activation_bytes(model, x)


def test_schedule_and_precision_guard_act_on_every_stack():
    model = pareprop.convert(_timm(depths=(2, 3)), tolerance=1e-3).train()
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


def test_state_dict_has_timm_names_both_ways_and_timms_layer_decay():
    from timm.optim import param_groups_layer_decay

    for kind in KINDS:
        source = _timm(kind)
        model = pareprop.convert(_timm(kind))
        assert list(model.state_dict()) == list(source.state_dict())
        torch.manual_seed(5)
        other = _timm(kind)
        for p in other.parameters():
            p.data.normal_()
        model.load_state_dict(other.state_dict(), strict=True)
        fresh = _timm(kind)
        fresh.load_state_dict(model.state_dict(), strict=True)
        for (n, a), b in zip(other.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a, b), n
        names = [n for n, _ in model.named_parameters()]
        assert "layers.1.stack.blocks.0.attn.qkv.weight" in names
        # timm's layer decay gives every parameter the learning-rate scale timm gives it
        scales = {}
        for m in (model, source):
            name_of = {id(p): n.replace("stack.blocks.", "blocks.")
                       for n, p in m.named_parameters()}
            scales[m is model] = {name_of[id(p)]: group["lr_scale"]
                                  for group in param_groups_layer_decay(m, layer_decay=0.5)
                                  for p in group["params"]}
        assert scales[True] == scales[False]
        assert len(set(scales[True].values())) == 1 + 2 + 2 + 1  # stem, 2 x 2 blocks, head
        wd = model.no_weight_decay()
        assert wd and wd <= set(names)


def test_timm_contract():
    model = pareprop.convert(_timm(), engine="autograd")
    assert model.num_features == model.head_hidden_size == 32
    assert model.get_classifier() is model.head.fc
    x = model.example_inputs(2)[0]
    assert x.shape == (2, 3, 32, 32)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 32)
    feats = model.forward_intermediates(x, intermediates_only=True)
    assert [f.shape for f in feats] == [(2, 16, 8, 8), (2, 32, 4, 4)]
    model.reset_classifier(7, global_pool="catavgmax")  # twice the width
    assert model(x).shape == (2, 7) and model.num_classes == 7
    assert model.head_hidden_size == 64
    model.reset_classifier(0)
    assert model(x).shape == (2, 64)
    model.set_engine("pareprop")
    assert {s.engine for s in _stacks(model)} == {"pareprop"}


@pytest.mark.parametrize(
    "build,reason",
    [
        (lambda: type("MySwin", (SwinTransformer,), {})(**SMALL), "subclasses timm's Swin"),
        (lambda: timm.create_model("swinv2_cr_tiny_224", depths=(1, 1), img_size=32,
                                   embed_dim=16, num_heads=(1, 2)),
         "does not know SwinTransformerV2Cr"),
    ],
)
def test_unsupported_models_are_refused_with_the_reason(build, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        pareprop.convert(build())


def test_hooks_and_grad_checkpointing_are_refused():
    for where in ("block", "stage"):
        swin = _timm()
        module = swin.layers[1].blocks[0] if where == "block" else swin.layers[1]
        handle = module.register_forward_hook(lambda *args: None)
        name = "stage 1 block 0" if where == "block" else "stage 1"
        with pytest.raises(UnsupportedModelError, match=f"{name} has forward hook"):
            pareprop.convert(swin)
        handle.remove()
        pareprop.convert(swin)
    swin = _timm()
    swin.set_grad_checkpointing(True)
    with pytest.raises(UnsupportedModelError, match="gradient checkpointing on"):
        pareprop.convert(swin)
    # hooks on a block's submodules and on patch merging run in the converted model: kept
    seen = []
    swin = _timm()
    swin.layers[1].blocks[0].attn.register_forward_hook(lambda m, i, o: seen.append("attn"))
    swin.layers[1].downsample.register_forward_hook(lambda m, i, o: seen.append("merge"))
    pareprop.convert(swin).eval()(_images())
    assert seen == ["merge", "attn"]


# -- the named model ------------------------------------------------------------------------

TINY = dict(depths=(2, 2), embed_dim=16, num_heads=(1, 2), img_size=32, window_size=4)


def _save_timm(tmp_path, name, num_classes=5):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = timm.create_model(name, num_classes=num_classes, **TINY)
    path = str(tmp_path / f"{name}.safetensors")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
    return source.eval(), path


@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"])
def test_converted_swin_from_a_timm_weights_file(tmp_path, name):
    source, path = _save_timm(tmp_path, name)
    model = pareprop.create_model("converted_swin", source=name, pretrained_file=path,
                                  num_classes=5, **TINY).eval()
    assert type(model.layers[0].stack.blocks[0]).__name__ == (
        "ConvertedSwinV2Block" if name.startswith("swinv2") else "ConvertedSwinBlock")
    x = _images()
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
    other = pareprop.create_model("converted_swin", source=name, pretrained_file=path,
                                  num_classes=3, **TINY).eval()
    assert other(x).shape == (2, 3)  # another class count: the body, a fresh head
    with torch.no_grad():
        assert torch.equal(other.forward_features(x), source.forward_features(x))


def test_a_file_that_does_not_fit_leaves_the_model_untouched(tmp_path):
    from pareprop.convert.swin import load_swin_weights
    from pareprop.pretrained import PretrainedError

    _, path = _save_timm(tmp_path, "swin_tiny_patch4_window7_224")
    swin = timm.create_model("swin_tiny_patch4_window7_224", **{**TINY, "depths": (2, 3)})
    before = {k: v.clone() for k, v in swin.state_dict().items()}
    with pytest.raises(PretrainedError, match="missing, first layers.1.blocks.2"):
        load_swin_weights(swin, path)
    assert all(torch.equal(v, before[k]) for k, v in swin.state_dict().items())


def test_checkpoint_rebuilds_at_its_coupling(tmp_path):
    from pareprop.checkpoint import save_checkpoint

    model = pareprop.create_model("converted_swin", source="swinv2_tiny_window8_256",
                                  tolerance=None, **TINY)
    pareprop.set_coupling(model, 0.3, 0.5)
    save_checkpoint(tmp_path, model, epoch=1, step=1)
    loaded = pareprop.load_model(tmp_path / "last").eval()
    assert pareprop.coupling_of(loaded) == pareprop.coupling_of(model)
    assert pareprop.coupling_of(loaded)[1] == pytest.approx(0.5)
    x = _images()
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))


def test_convert_from_names_a_timm_swin():
    from pareprop.cli.train import resolve_config

    for name in ("swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"):
        cfg = resolve_config(["--convert-from", name, "--model-arg", "depths=[2,2]"])
        assert cfg.model == "converted_swin"
        assert cfg.model_kwargs == {"depths": [2, 2], "source": name}
    assert converted_model_name("vit_small_patch16_224") == "converted_vit"
    with pytest.raises(ValueError, match="names no model pareprop converts"):
        converted_model_name("swinv2_cr_tiny_224")


def test_features_only_by_name():
    net = pareprop.create_model("converted_swin", features_only=True, tolerance=None, **TINY)
    assert net.feature_info.channels() == [16, 32] and net.feature_info.reduction() == [4, 8]
    assert [f.shape for f in net(_images())] == [(2, 16, 8, 8), (2, 32, 4, 4)]


def test_merging_in_chunks_equals_the_merging_whole(monkeypatch):
    # Under checkpointing with the stacks chunked, patch merging runs in chunks of samples
    # (MergingInChunks): the step is the unchunked step's, and the merging did run in chunks.
    from pareprop.engine import recompute

    counts = []
    real = recompute._checkpoint_chunks

    def spy(module, parts, join, split, count):
        counts.append((type(module).__name__, count))
        return real(module, parts, join, split, count)

    monkeypatch.setattr(recompute, "_checkpoint_chunks", spy)
    x = _images(3, dtype=torch.float64)
    results = []
    for chunked_step in (False, True):
        model = pareprop.convert(_timm().double(), engine="autograd", tolerance=None)
        pareprop.set_coupling(model, 0.3, 0.5)
        if chunked_step:
            model.set_grad_checkpointing(True)
            pareprop.set_chunking(model, chunks=3)
        out = model(x)
        out.square().sum().backward()
        results.append((out, [p.grad for p in model.parameters()]))
    assert counts == [("MergingInChunks", 3)]
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_trainer_loads_timms_pretrained_weights_of_a_swin(monkeypatch):
    # --convert-from without --pretrained-file: timm's download of the source (answered here
    # by a model of another seed), through the converted model's timm names.
    from pareprop.convert.timm_pretrained import load_timm_pretrained

    real = timm.create_model

    def create(name, pretrained=False, **kw):
        if pretrained:
            torch.manual_seed(7)
        return real(name, **kw)

    monkeypatch.setattr(timm, "create_model", create)
    model = pareprop.create_model("converted_swin", source="swinv2_tiny_window8_256",
                                  num_classes=5, **TINY)
    load_timm_pretrained(model, "swinv2_tiny_window8_256")
    torch.manual_seed(7)
    want = real("swinv2_tiny_window8_256", num_classes=5, **TINY).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
