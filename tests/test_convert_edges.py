"""Converted models at the edges: planned at any coupling (the precision guard is not run on
fake tensors), pickled and restored with the same outputs, hooks on a coupled block refused
instead of silently never firing, and set_coupling's refusal of a model that is not converted."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import pareprop

VIT = dict(source="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=16, depth=2,
           num_heads=2, num_classes=3)
FAMILIES = {
    "converted_vit": VIT,
    "converted_swin": dict(source="swin_tiny_patch4_window7_224", img_size=32, embed_dim=16,
                           depths=[2, 2], num_heads=[1, 2], window_size=4, num_classes=3),
    "converted_tv_mvit": dict(source="mvit_v2_s", num_frames=4, img_size=32, embed_dim=16,
                              max_run=1, num_classes=3),
}


@pytest.mark.parametrize("coupling", [(0.0, 1.0), (0.5, 0.5), (1.0, 0.0)])
def test_plan_of_a_guarded_converted_model_at_any_coupling(coupling):
    # converted_vit attaches a precision guard by default; it measured on fake tensors (a
    # crash at beta > 0, a data_ptr() warning at beta = 0).
    kwargs = dict(img_size=32, depth=2, device="cpu", coupling=coupling)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's data_ptr() warning on a FakeTensor included
        guarded = pareprop.plan_memory("converted_vit", 2, "reversible", **kwargs)
    # What the guard would store: every block at beta = 0, none above (the plan of the same
    # model built without a guard).
    plain = pareprop.plan_memory("converted_vit", 2, "reversible", tolerance=None, **kwargs)
    assert (guarded.peak, guarded.activations) == (plain.peak, plain.activations)
    if coupling[1] > 0:
        stored = pareprop.plan_memory("converted_vit", 2, "reversible", **{
            **kwargs, "coupling": (1.0, 0.0)})
        assert guarded.activations < stored.activations  # rebuilt blocks keep less


def _outputs(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_converted_model_pickles_with_the_same_outputs(name):
    torch.manual_seed(0)
    model = pareprop.create_model(name, **FAMILIES[name])
    pareprop.set_coupling(model, 0.25, 0.75)
    x = model.example_inputs(2)[0]
    want = _outputs(model, x)
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(_outputs(restored, x), want)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, as users of torch.save(model) do
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(_outputs(loaded, x), want)
    # The source's names still travel both ways, and a training step runs (guard included).
    assert list(loaded.state_dict()) == list(model.state_dict())
    loaded.load_state_dict(model.state_dict())
    loaded.train()
    loaded(x).sum().backward()
    assert pareprop.coupling_of(loaded) == (0.25, 0.75)


@pytest.mark.parametrize("engine", ["autograd", "reversible", "pareprop"])
@pytest.mark.parametrize("kind", ["register_forward_hook", "register_forward_pre_hook",
                                  "register_full_backward_hook"])
def test_hooks_on_a_coupled_block_are_refused(engine, kind):
    model = pareprop.create_model("converted_vit", engine=engine, coupling=(0.0, 1.0),
                                  tolerance=None, **VIT)
    x = model.example_inputs(2)[0]
    block = model.stack.blocks[1]
    handle = getattr(block, kind)(lambda *args: None)
    with pytest.raises(RuntimeError, match="block 1 of a reversible stack .* would not fire"):
        model(x)
    handle.remove()
    # On its submodules they run, as the message says.
    seen = []
    block.attn.register_forward_hook(lambda *args: seen.append("attn"))
    model(x).sum().backward()
    assert seen


def test_set_coupling_names_the_model_that_is_not_converted():
    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=2)
    with pytest.raises(ValueError, match="RevViT has no converted blocks") as caught:
        pareprop.set_coupling(model, 0.0, 1.0)
    assert "timm ViT" not in str(caught.value)


def test_a_deep_copy_keeps_its_own_coupling():
    # copy.deepcopy (timm's ModelEmaV3 makes its copy so) carries the hooks and the coupling.
    model = pareprop.create_model("converted_vit", **VIT)
    twin = copy.deepcopy(model)
    pareprop.set_coupling(model, 0.0, 1.0)
    assert pareprop.coupling_of(twin) == (1.0, 0.0)
    assert list(twin.state_dict()) == list(model.state_dict())


def _eval_forward(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.slow
def test_a_converted_model_reaches_a_spawned_process():
    import multiprocessing

    torch.manual_seed(0)
    model = pareprop.create_model("converted_vit", **VIT)
    x = model.example_inputs(2)[0]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_eval_forward, (model, x))
    assert torch.equal(out, _eval_forward(model, x))
