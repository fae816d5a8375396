"""pareprop.convert on timm's MViTv2 (MultiScaleVit): the blocks that keep their shape become
reversible stacks, the blocks that pool the shortcut or change the width stay timm's. Exact at
(1, 0) (torch.equal in float32) for each published configuration at small size, the
dual-residual recursion in between, every engine against autograd in float64, timm's names in
the state dict, the model contract and the named model."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from timm.models.mvitv2 import MultiScaleBlock, MultiScaleVit, model_cfgs

import pareprop
from pareprop.convert import UnsupportedModelError
from pareprop.convert.mvitv2 import keeps_shape
from pareprop.engine import ReversibleStack
from pareprop.engine.testing import engine_errors, worst_error

# Every published configuration, 2-3 blocks a stage (a stack in most stages), 24 wide.
NAMES = sorted(model_cfgs)
DEPTHS = (2, 3, 2, 2)


def _cfg(name="mvitv2_tiny", depths=DEPTHS):
    return dataclasses.replace(model_cfgs[name], depths=depths, embed_dim=24)


def _timm(name="mvitv2_tiny", depths=DEPTHS, **kwargs):
    torch.manual_seed(0)
    return MultiScaleVit(_cfg(name, depths), img_size=32, num_classes=5, **kwargs)


def _images(n=2, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(n, 3, 32, 32, dtype=dtype)


def _engine_errors(model, x):
    # The key norm's bias gets no gradient (softmax ignores a shift shared by every key):
    # its reference is rounding noise, measured against the largest gradient instead.
    return engine_errors(model, x, noise_floor=1e-8)


def _grads(model):
    return {n: p.grad for n, p in model.state_dict(keep_vars=True).items()
            if isinstance(p, nn.Parameter)}


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_features_equal_timm_to_the_bit_at_one_zero(name):
    source = _timm(name).eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    x = _images()
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
        assert torch.equal(model.forward_features(x), source.forward_features(x))
        ours = model.forward_intermediates(x)
        theirs = source.forward_intermediates(x)
        assert torch.equal(ours[0], theirs[0]) and len(ours[1]) == len(theirs[1]) == 4
        assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))


@pytest.mark.parametrize("name,layout", [
    # S: a stack; B: timm's block (pools the shortcut or changes the width), per stage.
    ("mvitv2_tiny", ["S", "B S", "B S", "B S"]),
    ("mvitv2_small_cls", ["S", "B S", "B S", "B S"]),
    # expand_attn=False: the last block of each stage but the last widens through its MLP.
    ("mvitv2_large", ["S B", "B S B", "B B", "B S"]),
])
def test_only_blocks_that_keep_their_shape_are_coupled(name, layout):
    model = pareprop.convert(_timm(name))
    got = [" ".join("S" if isinstance(p, ReversibleStack) else "B" for p in stage.parts)
           for stage in model.stages]
    assert got == layout
    for stage in model.stages:
        for part in stage.parts:
            if not isinstance(part, ReversibleStack):
                assert type(part) is MultiScaleBlock and not keeps_shape(part)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
@pytest.mark.parametrize("name", ["mvitv2_tiny", "mvitv2_small_cls"])
def test_training_step_equals_timm_at_one_zero(engine, name):
    # Drop-path and head dropout on: the blocks draw in timm's order, and at beta = 0 every
    # block is stored, so every engine gives timm's logits and gradients exactly; the kept
    # blocks are checkpointed as timm checkpoints its own.
    source = _timm(name, drop_path_rate=0.3, drop_rate=0.2).train()
    model = pareprop.convert(copy.deepcopy(source), engine=engine).train()
    model.set_grad_checkpointing()
    x = _images()
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
    return (lambda x, fs: block.drop_path1(block.attn(block.norm1(x), fs)[0]),
            lambda x, fs: block.drop_path2(block.mlp(block.norm2(x))))


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
def test_forward_is_the_dual_residual_recursion(alpha, beta):
    source = _timm("mvitv2_small_cls").double().eval()
    model = pareprop.convert(copy.deepcopy(source), engine="autograd").eval()
    pareprop.set_coupling(model, alpha, beta)
    x = _images(dtype=torch.float64)
    alpha, beta = (float(torch.tensor(c, dtype=torch.float32)) for c in (alpha, beta))
    # Each run of blocks that keep their shape: z_{j+1} = alpha z_j + beta z_{j-1} + H_j(z_j)
    # from z_0 = z_1 = its input; the blocks that pool or widen are timm's own.
    z, fs = source.patch_embed(x)
    z = torch.cat((source.cls_token.expand(z.shape[0], -1, -1), z), dim=1)
    for stage in source.stages:
        previous = None
        for block in stage.blocks:
            if not keeps_shape(block):
                z, fs = block(z, fs)
                previous = None
                continue
            previous = z if previous is None else previous
            for h in _sublayers(block):
                z, previous = alpha * z + beta * previous + h(z, fs), z
    torch.testing.assert_close(model(x), source.forward_head(source.norm(z)), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5), (1.0, 0.8)])
@pytest.mark.parametrize("setup", ["plain", "checkpointed", "chunked", "chunked_bytes", "stored"])
def test_engines_match_autograd_on_a_converted_mvitv2(alpha, beta, setup):
    source = _timm("mvitv2_small_cls", drop_path_rate=0.3, drop_rate=0.2).double()
    model = pareprop.convert(source, tolerance=None)
    pareprop.set_coupling(model, alpha, beta)
    if setup == "checkpointed":
        model.set_grad_checkpointing()
    elif setup == "chunked":  # the stacks' branches, and the kept blocks checkpointed
        model.set_grad_checkpointing()
        pareprop.set_chunking(model, chunks=2)
    elif setup == "chunked_bytes":  # chunk counts from each graph's measured bytes
        model.set_grad_checkpointing()
        pareprop.set_chunking(model, max_bytes=2**14)
    elif setup == "stored":
        model.stages[1].parts[1].store_blocks([1])
    report = _engine_errors(model, _images(dtype=torch.float64))
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"


def test_a_kept_block_in_chunks_draws_its_slice_of_the_whole_batchs_draw():
    # A block kept from timm (it pools) is checkpointed in chunks of samples under chunking;
    # each chunk, run from the same RNG state, must draw its slice of the batch's drop-path
    # draw, or the recomputation differs from forward (batch 2 draws agree too often to tell).
    from pareprop.chunking import chunks

    model = pareprop.convert(_timm("mvitv2_tiny", drop_path_rate=0.3).double(),
                             tolerance=None).train()
    runs = model.stages[1]
    p, kept = next(iter(runs._kept.items()))
    block = runs.parts[p]
    block.drop_path1.drop_prob = block.drop_path2.drop_prob = 0.5
    seen = []
    handle = block.register_forward_pre_hook(lambda m, args: seen.append(args))
    model(_images(6, dtype=torch.float64))
    handle.remove()
    x, kept.size = seen[0]
    torch.manual_seed(7)
    whole = kept(x)
    parts = []
    for chunk in chunks(6, 3):
        torch.manual_seed(7)  # the recomputation restores the forward's state for every chunk
        parts.append(kept.forward_chunk(chunk.take(x, 0), chunk))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)


def test_kept_blocks_are_checkpointed_in_chunks_of_samples(monkeypatch):
    # Under set_grad_checkpointing with the stacks chunked, the kept blocks (one a stage after
    # the first) are recomputed in chunks of samples too, not whole (their whole-batch
    # recomputation would set the peak the chunks lower).
    from pareprop.engine import recompute

    counts = []
    real = recompute._checkpoint_chunks

    def spy(module, parts, join, split, count):
        counts.append((type(module).__name__, count))
        return real(module, parts, join, split, count)

    monkeypatch.setattr(recompute, "_checkpoint_chunks", spy)
    model = pareprop.convert(_timm("mvitv2_tiny"), tolerance=None).train()
    pareprop.set_coupling(model, 0.3, 0.5)
    model.set_grad_checkpointing()
    pareprop.set_chunking(model, chunks=3)
    model(_images(3)).sum().backward()
    assert counts == [("KeptBlock", 3)] * 3


def test_schedule_and_precision_guard_over_every_stack():
    model = pareprop.convert(_timm("mvitv2_tiny").double())
    stacks = model.stacks()
    assert len(stacks) == 4 and len(model.precision_guard.stacks) == 4
    schedule = pareprop.CouplingSchedule(model, "linear", steps=2)
    schedule.step()
    assert all(b._alpha_value == 0.5 and float(b.skip_scale) == 0.5
               for s in stacks for b in s.blocks)
    # The guard measures every stack on the step's batch and rebuilds what it can; the
    # gradients then equal autograd's.
    report = _engine_errors(model, _images(dtype=torch.float64))
    assert all(r is not None and r.beta == 0.5 for r in model.precision_guard.reports)
    assert all(s.stored_blocks == () for s in stacks)
    engine, key, err = worst_error(report)
    assert err < 1e-9, f"{engine} disagrees with autograd on {key}: {err:.3e}"
    # a tolerance no rebuild meets: every block of every stack is stored, still exact
    model.precision_guard.tolerance = 1e-300
    model.precision_guard.invalidate()
    report = _engine_errors(model, _images(dtype=torch.float64))
    assert all(s.stored_blocks == tuple(range(len(s.blocks))) for s in stacks)
    assert worst_error(report)[2] < 1e-9


def test_state_dict_has_timm_names_both_ways():
    source = _timm("mvitv2_small_cls")
    model = pareprop.convert(_timm("mvitv2_small_cls"))
    assert list(model.state_dict()) == list(source.state_dict())
    torch.manual_seed(5)
    other = _timm("mvitv2_small_cls")
    for p in other.parameters():
        p.data.normal_()
    model.load_state_dict(other.state_dict(), strict=True)
    fresh = _timm("mvitv2_small_cls")
    fresh.load_state_dict(model.state_dict(), strict=True)
    for (n, a), b in zip(other.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    names = [n for n, _ in model.named_parameters()]
    assert "stages.1.parts.1.blocks.0.attn.qkv.weight" in names  # timm's stages.1.blocks.1
    from timm.optim import param_groups_layer_decay

    groups = param_groups_layer_decay(model, layer_decay=0.5)
    assert len({g["lr_scale"] for g in groups}) == 1 + sum(DEPTHS) + 1  # stem, blocks, head


def test_timm_contract():
    model = pareprop.convert(_timm("mvitv2_small_cls"), engine="autograd")
    assert model.num_features == model.head_hidden_size == 192
    assert model.get_classifier() is model.head.fc
    x = model.example_inputs(2)[0]
    assert x.shape == (2, 3, 32, 32)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 192)
    model.reset_classifier(7, global_pool="avg")
    assert model(x).shape == (2, 7) and model.num_classes == 7
    model.reset_classifier(0)
    assert model(x).shape == (2, 192)
    feats = model.forward_intermediates(x, intermediates_only=True)
    assert [f.shape[1:] for f in feats] == [(24, 8, 8), (48, 4, 4), (96, 2, 2), (192, 1, 1)]
    assert model.set_engine("pareprop") is model
    assert all(s.engine == "pareprop" for s in model.stacks())
    with pytest.raises(ValueError, match="class token"):
        pareprop.convert(_timm("mvitv2_tiny")).reset_classifier(3, global_pool="token")


def test_refusals_name_the_reason():
    class Sub(MultiScaleVit):
        pass

    with pytest.raises(UnsupportedModelError, match="Sub subclasses timm's MultiScaleVit"):
        pareprop.convert(Sub(_cfg(), img_size=32))
    source = _timm()
    source.set_grad_checkpointing()
    with pytest.raises(UnsupportedModelError, match="gradient checkpointing"):
        pareprop.convert(source)
    source = _timm()
    handle = source.stages[1].blocks[1].register_forward_hook(lambda *a: None)
    with pytest.raises(UnsupportedModelError, match="stages.1.blocks.1 has forward hook"):
        pareprop.convert(source)
    handle.remove()
    # a hook on a block timm runs itself (it pools the shortcut) is kept, and runs
    seen = []
    source.stages[1].blocks[0].register_forward_hook(lambda m, i, o: seen.append(o[0].shape))
    pareprop.convert(source).eval()(_images())
    assert seen == [torch.Size([2, 16, 48])]


def test_named_model_from_a_timm_file_and_back_from_a_checkpoint(tmp_path):
    from safetensors.torch import save_file

    from pareprop.checkpoint import load_model, save_checkpoint
    from pareprop.cli.train import resolve_config

    small = dict(depths=[2, 3, 2, 2], embed_dim=24, img_size=32)
    torch.manual_seed(0)
    source = pareprop.create_model("converted_mvitv2", source="mvitv2_tiny", num_classes=5,
                                   **small)
    path = str(tmp_path / "mvitv2.safetensors")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
    torch.manual_seed(1)
    model = pareprop.create_model("converted_mvitv2", source="mvitv2_tiny",
                                  pretrained_file=path, num_classes=5, **small).eval()
    x = _images()
    with torch.no_grad():
        assert torch.equal(model(x), source.eval()(x))
    pareprop.set_coupling(model, 0.25, 0.75)
    save_checkpoint(tmp_path / "run", model, epoch=1, step=1)
    loaded = load_model(tmp_path / "run").eval()
    assert type(loaded) is type(model) and pareprop.coupling_of(loaded) == (0.25, 0.75)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # timm's feature net over the multi-scale forward_intermediates
    features = pareprop.create_model("converted_mvitv2", source="mvitv2_tiny", num_classes=5,
                                     pretrained_file=path, features_only=True, **small).eval()
    with torch.no_grad():
        want = source.forward_intermediates(x, intermediates_only=True)
        got = features(x)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    cfg = resolve_config(["--convert-from", "mvitv2_tiny"])
    assert cfg.model == "converted_mvitv2" and cfg.model_kwargs == {"source": "mvitv2_tiny"}


def test_the_publishers_file_loads_through_timms_filter(tmp_path):
    # PySlowFast's MViTv2 files (MViTv2_T_in1k.pyth): ``model_state``, the blocks numbered
    # through the stages, the shortcut projection ``proj``, the classifier
    # ``head.projection``. timm's own checkpoint filter maps them.
    import re

    from pareprop.convert import load_mvitv2_weights
    from pareprop.pretrained import PretrainedError

    source = _timm().eval()
    starts = [sum(DEPTHS[:s]) for s in range(len(DEPTHS))]
    published = {}
    for key, value in source.state_dict().items():
        m = re.match(r"stages\.(\d+)\.blocks\.(\d+)\.(.*)", key)
        if m:
            key = f"blocks.{starts[int(m[1])] + int(m[2])}.{m[3]}".replace(
                "shortcut_proj_attn", "proj")
        published[key.replace("head.fc", "head.projection")] = value
    torch.save({"model_state": published, "epoch": 300}, tmp_path / "MViTv2_T_in1k.pyth")
    torch.manual_seed(1)
    model = pareprop.convert(MultiScaleVit(_cfg(), img_size=32, num_classes=5)).eval()
    load_mvitv2_weights(model, str(tmp_path / "MViTv2_T_in1k.pyth"))
    x = _images()
    with torch.no_grad():
        assert torch.equal(model(x), source(x))
    # a file of another depth: refused in one line, the model untouched
    deeper = _timm(depths=(2, 3, 3, 2))
    torch.save(deeper.state_dict(), tmp_path / "deeper.pth")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PretrainedError, match="does not fit .*stages.2.blocks.2") as info:
        load_mvitv2_weights(model, str(tmp_path / "deeper.pth"))
    assert "\n" not in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
