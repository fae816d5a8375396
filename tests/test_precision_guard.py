"""The precision guard: a small skip scale never gives a silently wrong gradient, because the
blocks whose rebuilt inputs would be off are stored, from a measurement on the batch."""

import copy
import math

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import pareprop
from pareprop.engine.testing import engine_errors, worst_error

SMALL = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=16, num_heads=2, num_classes=5)


def _source(depth=6, **kwargs):
    torch.manual_seed(0)
    return VisionTransformer(depth=depth, **{**SMALL, **kwargs})


def _images():
    torch.manual_seed(1)
    return torch.randn(3, 3, 16, 16)


def _grad_error(model):
    return worst_error(engine_errors(model, _images(), engines=("reversible", "pareprop")))[2]


def test_beta_zero_stores_every_block_and_says_why():
    model = pareprop.convert(_source(depth=3)).train()
    model(_images())
    report = model.precision_guard.report
    assert report.stored == [0, 1, 2] and model.stack.stored_blocks == (0, 1, 2)
    assert all("beta = 0" in report.reasons[i] for i in report.stored)
    assert report.block_bytes > 0 and report.stored_bytes == 3 * report.block_bytes
    assert "3 of 3 blocks stored" in str(report)


def test_small_beta_is_stored_and_gradients_stay_right():
    # float32, beta = 0.1 at depth 6: rebuilding divides by beta twelve times. Unguarded, the
    # gradients are wrong by more than 100%; guarded, the blocks the measurement flags are
    # stored and the gradients agree with autograd.
    source = _source()
    bare = pareprop.convert(copy.deepcopy(source), tolerance=None)
    pareprop.set_coupling(bare, 0.9, 0.1)
    assert _grad_error(bare) > 0.1
    guarded = pareprop.convert(copy.deepcopy(source), tolerance=1e-3)
    pareprop.set_coupling(guarded, 0.9, 0.1)
    assert _grad_error(guarded) < 1e-3
    report = guarded.precision_guard.report
    assert report.stored and set(report.stored) == set(guarded.stack.stored_blocks)
    assert len(report.stored) < 6  # only what the measurement asks for
    for i in report.stored:
        assert report.errors[i] > 1e-3 and "> 1.0e-03 at beta = 0.1" in report.reasons[i]
    for i, err in enumerate(report.errors):
        assert i in report.stored or math.isnan(err) or err <= 1e-3


def test_large_beta_rebuilds_every_block():
    model = pareprop.convert(_source(drop_path_rate=0.2, proj_drop_rate=0.1))
    pareprop.set_coupling(model, 0.0, 1.0)
    # dropout on: the guard's measurement draws nothing, so the step matches autograd's
    assert _grad_error(model) < 1e-5
    assert model.precision_guard.report.stored == [] and model.stack.stored_blocks == ()
    assert "every block rebuilt" in str(model.precision_guard.report)


def test_measures_again_when_the_coupling_moves_or_after_every_steps():
    model = pareprop.convert(_source(depth=2), guard_every=3).train()
    guard, x = model.precision_guard, _images()

    def step():
        model(x).sum().backward()

    pareprop.set_coupling(model, 0.5, 0.5)
    step()
    assert guard.measurements == 1
    schedule_like = [0.505, 0.51]  # small rises: the last measurement still holds
    for beta in schedule_like:
        for block in model.stack.blocks:
            block.set_skip_scale(beta)
        step()
    assert guard.measurements == 1
    step()  # the third step since the measurement
    assert guard.measurements == 2
    for block in model.stack.blocks:
        block.set_skip_scale(0.5)  # any fall of beta is measured at once
    step()
    assert guard.measurements == 3
    with torch.no_grad():
        model(x)  # no training step, no measurement
    model.eval()(x)
    assert guard.measurements == 3


def test_blocks_stored_by_hand_stay_stored():
    model = pareprop.convert(_source(depth=3))
    pareprop.set_coupling(model, 0.0, 1.0)
    model.stack.store_blocks([1])
    guard = pareprop.PrecisionGuard(model)
    model.train()(_images())
    assert model.stack.stored_blocks == (1,)
    assert "by hand" in guard.report.reasons[1]


def test_bad_arguments():
    model = pareprop.convert(_source(depth=2))
    with pytest.raises(ValueError, match="tolerance > 0"):
        pareprop.PrecisionGuard(model, tolerance=0)
    with pytest.raises(ValueError, match="beta >= 0"):
        pareprop.set_coupling(model, 1.0, -0.5)


def test_a_sharded_stack_is_refused_with_the_way_out():
    model = pareprop.convert(_source(depth=2))
    pareprop.set_coupling(model, 0.5, 0.5)
    model.stack.sharding = object()  # what pareprop.distributed.fsdp.shard sets
    with pytest.raises(RuntimeError, match="tolerance=None"):
        model.train()(_images())


def test_a_copied_model_has_its_own_guard():
    model = pareprop.convert(_source(depth=2))
    pareprop.set_coupling(model, 0.5, 0.5)
    twin = copy.deepcopy(model)
    assert twin.precision_guard is not model.precision_guard
    assert twin.precision_guard.stacks[0] is twin.stack
    twin.train()(_images())
    assert twin.precision_guard.measurements == 1 and model.precision_guard.measurements == 0


def test_set_coupling_and_set_engine_measure_again():
    model = pareprop.convert(_source(depth=2)).train()
    guard, x = model.precision_guard, _images()

    def step():
        model(x).sum().backward()

    pareprop.set_coupling(model, 0.5, 0.5)
    step()
    assert guard.measurements == 1 and model.stack.stored_blocks == ()
    # through (1, 0) and back: every block stored, then measured again and rebuilt, though
    # the coupling is the one measured last
    pareprop.set_coupling(model, 1.0, 0.0)
    pareprop.set_coupling(model, 0.5, 0.5)
    step()
    assert guard.measurements == 2 and model.stack.stored_blocks == ()
    pareprop.set_coupling(model, 0.49, 0.51)  # a move smaller than beta_step, set by hand
    step()
    assert guard.measurements == 3
    pareprop.set_engine(model, "pareprop")  # another engine: measured again
    step()
    assert guard.measurements == 4


def test_below_a_stored_block_the_rebuild_restarts_from_its_exact_inputs():
    # float32, beta = 0.1: block 3's rebuild is off, the blocks below it fine once the chain
    # restarts from block 3's exact inputs (what the engines do below a stored block), so
    # below it the measurement is that of the stack cut at block 3.
    from pareprop.convert.precision_guard import measure_rebuild_errors

    model = pareprop.convert(_source(), tolerance=None)
    pareprop.set_coupling(model, 0.9, 0.1)
    seen = []
    handle = model.stack.register_forward_pre_hook(lambda m, args: seen.append(args))
    model.eval()(_images())
    handle.remove()
    x1, x2 = seen[0][:2]
    errors, stored = measure_rebuild_errors(model.stack, x1, x2, 1e-3)
    top = max(stored)
    assert 0 < top and stored != list(range(top + 1))
    cut = pareprop.ReversibleStack(list(model.stack.blocks)[:top])
    assert measure_rebuild_errors(cut, x1, x2, 1e-3) == (errors[:top], stored[:-1])
