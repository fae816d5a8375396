"""Stored blocks: any subset of a stack keeps its activations, the rest are recomputed, and every
engine still equals plain autograd (float64, CPU)."""

import random
import weakref

import pytest
import torch

import pareprop
from pareprop.engine import backward, function
from pareprop.engine.testing import engine_errors, relative_error, worst_error
from test_engine import DIM, TOL, MixerBlock, Model

pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py

ENGINES = ("reversible", "pareprop")


def _subsets(depth):
    rng = random.Random(depth)
    every = list(range(depth))
    return {
        "none": [],
        "all": every,
        "first": [0],
        "last": [depth - 1],
        "alternate": every[::2],
        "alternate-odd": every[1::2],
        "random": sorted(rng.sample(every, rng.randint(1, depth))),
    }


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_every_subset_matches_autograd_with_dropout_and_drop_path(depth):
    for label, subset in _subsets(depth).items():
        torch.manual_seed(depth)
        model = Model(depth)
        model.stack.store_blocks(subset)
        x = torch.randn(2, 3, DIM)
        report = engine_errors(model, (x,), engines=ENGINES, scale=torch.tensor(0.5))
        engine, key, err = worst_error(report)
        assert err < TOL, f"stored {label} {subset}: {engine} {key} relative error {err:.3e}"
        assert set(report[engine]) >= {"output", "input:0"}


def _tiny_models():
    vit = pareprop.create_model(
        "rev_vit_tiny_patch4_32", img_size=8, embed_dim=8, depth=4, num_heads=2,
        num_classes=5, drop_path_rate=0.3, attn_drop_rate=0.1, proj_drop_rate=0.1,
    )
    mvit = pareprop.create_model(
        "rev_mvitv2_tiny_32", img_size=16, embed_dim=8, num_classes=5, drop_path_rate=0.3,
        last_block_indexes=(0, 3),
    )
    swin = pareprop.create_model(
        "rev_swin_tiny_32", embed_dim=8, depths=(2, 3), num_heads=(1, 2), window=4,
        patch_size=2, img_size=16, num_classes=5, drop_path_rate=0.2, attn_drop_rate=0.1,
    )
    text = pareprop.create_model(
        "rev_roberta_small", vocab_size=20, max_position_embeddings=16, example_seq_len=8,
        embed_dim=16, depth=4, num_heads=2, mlp_dim=32, num_classes=3, attn_drop_rate=0.1,
        drop_path_rate=0.2,
    )
    rev_mvit = pareprop.create_model(
        "rev_mvit_base", img_size=32, embed_dim=8, depth=7, transition_blocks=(1, 3),
        num_classes=5, drop_path_rate=0.3,
    )
    video = pareprop.create_model(
        "rev_mvit_base_16x4", num_frames=4, img_size=32, embed_dim=8, depth=7,
        transition_blocks=(1, 3), kv_stride=(1, 4, 4), num_classes=5, drop_path_rate=0.3,
        drop_rate=0.1,
    )
    return {"vit": vit, "mvit": mvit, "swin": swin, "text": text, "rev_mvit": rev_mvit,
            "video": video}


def _stacks(model):
    return [m for m in model.modules() if isinstance(m, pareprop.ReversibleStack)]


@pytest.mark.parametrize("family", ["vit", "mvit", "swin", "text", "rev_mvit", "video"])
def test_one_model_of_each_family_with_stored_blocks(family):
    torch.manual_seed(0)
    model = _tiny_models()[family].double()
    for stack in _stacks(model):  # first and last of every stack: both neighbours kinds
        stack.store_blocks([0] if len(stack.blocks) == 1 else [0, -1])
    inputs = model.example_inputs(2, dtype=torch.float64)
    # The key norm's bias has an exact zero gradient (see test_mvit.py).
    if family in ("mvit", "rev_mvit", "video"):
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith("norm_k.bias"))
    report = engine_errors(model, inputs, engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < 1e-8, f"{family}: {engine} {key} relative error {err:.3e}"
    assert any(s.stored_blocks for s in _stacks(model))


def _kept_bytes(model, x):
    return pareprop.activation_bytes(model, x)


def test_activation_bytes_rise_with_every_stored_block_from_reversible_to_autograd():
    torch.manual_seed(0)
    depth = 6
    model = Model(depth)
    x = torch.randn(4, 16, DIM, requires_grad=True)
    floor = _kept_bytes(model, x)
    order = random.Random(0).sample(range(depth), depth)
    previous, stored = floor, []
    for index in order:
        stored.append(index)
        model.stack.store_blocks(stored)
        kept = _kept_bytes(model, x)
        assert kept > previous, f"storing {stored} kept {kept} bytes, not more than {previous}"
        previous = kept
    model.stack.set_engine("autograd")
    assert previous == _kept_bytes(model, x)  # every block stored: exactly autograd's bytes
    model.stack.set_engine("reversible").store_blocks([])
    assert _kept_bytes(model, x) == floor


def test_pareprop_schedule_with_stored_blocks(monkeypatch):
    events, alive = [], []
    recover, grads = backward._recover, backward._grads

    def logged_recover(plan, index, *args):
        rebuilt = recover(plan, index, *args)
        alive.append(weakref.ref(rebuilt))
        events.append(("recover", index, plan.stored[index]))
        return rebuilt

    def logged_grads(plan, index, *args):
        assert sum(ref() is not None for ref in alive) <= 2
        events.append(("grads", index, plan.stored[index]))
        return grads(plan, index, *args)

    monkeypatch.setattr(backward, "_recover", logged_recover)
    monkeypatch.setattr(backward, "_grads", logged_grads)
    model = Model(4, engine="pareprop")
    model.stack.store_blocks([1, 3])
    model(torch.randn(2, 3, DIM)).sum().backward()
    assert events == [
        ("recover", 3, True), ("recover", 2, False), ("grads", 3, True), ("recover", 1, True),
        ("grads", 2, False), ("recover", 0, False), ("grads", 1, True), ("grads", 0, False),
    ]


@pytest.mark.parametrize("name", ENGINES)
def test_stored_graphs_are_freed_by_backward(name, monkeypatch):
    refs = []
    store = function._store

    def logged_store(*args):
        rebuilt = store(*args)
        refs.append(weakref.ref(rebuilt.g_out))
        return rebuilt

    monkeypatch.setattr(function, "_store", logged_store)
    model = Model(3, engine=name)
    model.stack.store_blocks([0, 2])
    out = model(torch.randn(2, 3, DIM))
    assert len(refs) == 2 and all(r() is not None for r in refs)
    out.sum().backward()
    assert all(r() is None for r in refs)  # as under autograd, nothing outlives backward


@pytest.mark.parametrize("name", ENGINES)
def test_second_backward_with_stored_blocks_is_refused_clearly(name):
    model = Model(3, engine=name)
    model.stack.store_blocks([1])
    loss = model(torch.randn(2, 3, DIM)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="block 1 is stored"):
        loss.backward()


@pytest.mark.parametrize("name", ENGINES)
def test_global_rng_and_parameter_hooks_with_stored_blocks(name):
    states, calls = {}, {}
    for engine in ("autograd", name):
        torch.manual_seed(0)
        model = Model(4, engine=engine)
        model.stack.store_blocks([0, 2])
        counts = {}
        for pname, p in model.named_parameters():
            def count(p, pname=pname, counts=counts):
                counts[pname] = counts.get(pname, 0) + 1

            p.register_post_accumulate_grad_hook(count)
        model(torch.randn(2, 3, DIM)).sum().backward()
        states[engine], calls[engine] = torch.get_rng_state(), counts
    assert torch.equal(states[name], states["autograd"])
    assert calls[name] == calls["autograd"] and set(calls[name].values()) == {1}


@pytest.mark.parametrize("name", ENGINES)
def test_autograd_grad_and_autocast_with_stored_blocks(name):
    torch.manual_seed(0)
    model = Model(3, engine=name, drop=0.0, drop_path=0.0).float()
    model.stack.store_blocks([1])
    x = torch.randn(2, 3, DIM, dtype=torch.float32)
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.float32  # the streams stay float32 under autocast
    got = torch.autograd.grad(out.sum(), params)
    model.stack.set_engine("autograd")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(model(x).sum(), params)
    assert max(relative_error(a, b) for a, b in zip(got, want)) < 1e-6
    assert all(p.grad is None for p in params)


def test_bad_block_indices_are_refused():
    stack = pareprop.ReversibleStack([MixerBlock() for _ in range(3)])
    with pytest.raises(IndexError, match="out of range for a stack of 3 blocks"):
        stack.store_blocks([3])
    with pytest.raises(TypeError, match="integers"):
        stack.store_blocks([1.0])
    assert stack.store_blocks([-1, 0, 0]).stored_blocks == (0, 2)
    assert pareprop.ReversibleStack([MixerBlock()], stored_blocks=[0]).stored_blocks == (0,)
    assert "stored_blocks=[0, 2]" in repr(stack)
