"""Coefficient schedules from the pretrained network (1, 0) to the reversible coupling (0, 1)."""

import math

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import pareprop

SMALL = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=16, num_heads=2, num_classes=5)


def _model():
    torch.manual_seed(0)
    return pareprop.convert(VisionTransformer(depth=2, **SMALL))


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_schedule_moves_from_pretrained_to_reversible(kind):
    model = _model()
    schedule = pareprop.CouplingSchedule(model, kind, steps=4)
    assert pareprop.coupling_of(model) == (1.0, 0.0)
    seen = [pareprop.coupling_of(model)]
    for _ in range(6):
        schedule.step()
        seen.append(pareprop.coupling_of(model))
    betas = [b for _, b in seen]
    assert betas[4:] == [1.0, 1.0, 1.0] and all(a + b == 1.0 for a, b in seen)
    assert all(x < y for x, y in zip(betas[:4], betas[1:5]))  # beta rises, alpha falls
    want = 0.5 if kind == "linear" else (1 - math.cos(math.pi / 2)) / 2
    assert betas[2] == pytest.approx(want)
    if kind == "cosine":
        assert betas[1] == pytest.approx((1 - math.cos(math.pi / 4)) / 2)
    # the buffers changed in place: every block holds the schedule's values
    for block in model.stack.blocks:
        assert float(block.alpha) == 0.0 and float(block.skip_scale) == 1.0


def test_reversible_from_the_first_step_and_resume():
    model = _model()
    schedule = pareprop.CouplingSchedule(model, "reversible")
    assert pareprop.coupling_of(model) == (0.0, 1.0)
    linear = pareprop.CouplingSchedule(model, "linear", steps=10)
    for _ in range(3):
        linear.step()
    state = linear.state_dict()
    other = _model()
    resumed = pareprop.CouplingSchedule(other, "linear", steps=10)
    resumed.load_state_dict(state)
    assert pareprop.coupling_of(other) == pareprop.coupling_of(model)
    assert pareprop.coupling_of(other)[1] == pytest.approx(0.3)
    assert schedule.state_dict()["kind"] == "reversible"


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="unknown coupling schedule"):
        pareprop.CouplingSchedule(_model(), "step")
    with pytest.raises(ValueError, match="steps >= 1"):
        pareprop.CouplingSchedule(_model(), "linear", steps=0)
    with pytest.raises(ValueError, match="RevViT has no converted blocks"):
        pareprop.set_coupling(pareprop.create_model("rev_vit_tiny_patch4_32"), 0.5, 0.5)


def test_resume_takes_the_saved_kind_and_steps():
    # A resumed run may build its schedule with other arguments: the saved state decides.
    linear = pareprop.CouplingSchedule(_model(), "linear", steps=10)
    for _ in range(3):
        linear.step()
    other = _model()
    resumed = pareprop.CouplingSchedule(other, "cosine", steps=4)
    resumed.load_state_dict(linear.state_dict())
    assert resumed.state_dict() == linear.state_dict()
    assert pareprop.coupling_of(other)[1] == pytest.approx(0.3)
    resumed.step()
    assert pareprop.coupling_of(other)[1] == pytest.approx(0.4)
