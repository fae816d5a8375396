"""The competitor on the same model: a reversible model's ``checkpointed`` mode (autograd, each
block in torch.utils.checkpoint) is exact, keeps less than autograd, and is planned as it runs."""

from __future__ import annotations

import pytest
import torch

from pareprop.catalog import ModelRequest, build_model, example_inputs
from pareprop.engine import ReversibleStack
from pareprop.engine.testing import one_step, relative_error
from pareprop.memory import activation_bytes, memory_report, plan_memory

TOL = 1e-10
# One small model per family, float64, with dropout and drop-path on where the family has them.
FAMILIES = {
    "rev_vit_tiny_patch4_32": dict(depth=3, overrides=dict(
        embed_dim=16, num_heads=2, drop_path_rate=0.3, proj_drop_rate=0.1)),
    "rev_mvitv2_tiny_32": dict(overrides=dict(embed_dim=8, drop_path_rate=0.3)),
    "rev_mvit_base": dict(img_size=32, overrides=dict(
        embed_dim=8, depth=4, transition_blocks=(2,), drop_path_rate=0.3)),
    "rev_mvit_base_16x4": dict(img_size=32, overrides=dict(
        num_frames=4, embed_dim=8, depth=4, transition_blocks=(2,), kv_stride=(1, 4, 4),
        drop_path_rate=0.3, drop_rate=0.1)),
    "rev_swin_tiny_32": dict(img_size=30, overrides=dict(
        embed_dim=8, depths=(1, 2, 1), num_heads=(1, 2, 2), window=4, drop_path_rate=0.3,
        proj_drop_rate=0.1)),
    "rev_roberta_small": dict(depth=3, seq_len=8, overrides=dict(
        vocab_size=64, embed_dim=16, num_heads=2, drop_rate=0.1)),
}


def _build(name: str, mode: str) -> tuple:
    request = ModelRequest(model=name, engine=mode, num_classes=5, **FAMILIES[name])
    request.overrides = dict(request.overrides)
    torch.manual_seed(0)
    model = build_model(request).double().train()
    inputs = example_inputs(model, request, 3)
    return model, tuple(t.double() if t.is_floating_point() else t for t in inputs)


def _stacks(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, ReversibleStack)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_checkpointed_mode_gives_autograds_gradients_and_keeps_less(name):
    reference, inputs = _build(name, "autograd")
    model, _ = _build(name, "checkpointed")
    assert all(s.engine == "autograd" and s.checkpoint_blocks for s in _stacks(model))
    assert not any(s.checkpoint_blocks for s in _stacks(reference))

    want = one_step(reference, inputs, "autograd", 1, None, {})
    got = one_step(model, inputs, "autograd", 1, None, {})
    assert relative_error(got[0][0], want[0][0]) < TOL
    for a, b in zip(got[1], want[1]):
        assert relative_error(a, b) < TOL
    assert set(got[2]) == set(want[2])
    bad = {n: relative_error(g, want[2][n]) for n, g in got[2].items()
           if not relative_error(g, want[2][n]) < TOL and float(want[2][n].abs().max()) > 0}
    # MViT's key-norm bias has an exact gradient of 0 (softmax ignores a shift of the keys).
    zero = {n: float(g.abs().max()) for n, g in got[2].items()
            if float(want[2][n].abs().max()) == 0 and not float(g.abs().max()) < 1e-12}
    assert not bad and not zero, (bad, zero)

    def kept(m):
        return activation_bytes(lambda *x: m(*x), *inputs)

    assert kept(model) < kept(reference)  # the blocks keep only their inputs


def test_a_wrong_block_would_fail_the_comparison():
    # The comparison can fail: a checkpointed model whose weights differ by one element.
    reference, inputs = _build("rev_vit_tiny_patch4_32", "autograd")
    model, _ = _build("rev_vit_tiny_patch4_32", "checkpointed")
    with torch.no_grad():
        model.stack.blocks[1].mlp.fc1.weight[0, 0] += 1e-3
    want = one_step(reference, inputs, "autograd", 1, None, {})
    got = one_step(model, inputs, "autograd", 1, None, {})
    assert max(relative_error(g, want[2][n]) for n, g in got[2].items()) > 1e-6


@pytest.mark.slow  # a real step and its plan
@pytest.mark.parametrize("name, overrides", [
    ("rev_vit_tiny_patch4_32", {}),
    ("rev_swin_tiny_32", {"embed_dim": 24, "num_heads": (1, 2, 3, 4)}),
    # All 16 blocks: plan_memory reads depth as a total (the catalog's depth_overrides).
    ("rev_mvit_base_16x4", {"num_frames": 4, "img_size": 32, "embed_dim": 8,
                            "kv_stride": (1, 4, 4)}),
])
def test_checkpointed_plan_agrees_with_the_real_step(name, overrides):
    plan = plan_memory(name, 2, "checkpointed", device="cpu", num_classes=10, **overrides)
    autograd = plan_memory(name, 2, "autograd", device="cpu", num_classes=10, **overrides)
    request = ModelRequest(model=name, engine="checkpointed", num_classes=10,
                           overrides=dict(overrides))
    torch.manual_seed(0)
    model = build_model(request)
    real = memory_report(model, example_inputs(model, request, 2), engine="checkpointed")
    assert plan.peak == pytest.approx(real.peak, rel=0.02)
    assert plan.activations == pytest.approx(real.activations, rel=0.02)
    assert plan.activations < autograd.activations


def test_memory_report_puts_a_reversible_model_in_and_out_of_the_checkpointed_mode():
    model, _ = _build("rev_vit_tiny_patch4_32", "reversible")
    model.float()
    (x,) = model.example_inputs(2)
    memory_report(model, x, engine="checkpointed")
    assert model.stack.engine == "autograd" and model.stack.checkpoint_blocks
    memory_report(model, x, engine="reversible")
    assert model.stack.engine == "reversible" and not model.stack.checkpoint_blocks
