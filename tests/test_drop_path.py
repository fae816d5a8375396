"""pareprop.layers.DropPath: timm's stochastic depth with the rate in a float32 buffer."""

from __future__ import annotations

import pytest
import torch

from pareprop.layers import DropPath


def test_each_sample_is_dropped_or_scaled_and_eval_is_identity():
    torch.manual_seed(0)
    layer = DropPath(0.25).train()
    x = torch.randn(4000, 3, 5, dtype=torch.float64)
    y = layer(x)
    dropped = (y == 0).flatten(1).all(dim=1)
    kept = torch.isclose(y, x / 0.75).flatten(1).all(dim=1)
    assert bool((dropped | kept).all())
    assert abs(dropped.double().mean().item() - 0.25) < 0.03
    assert layer.eval()(x) is x


def test_rate_stays_float32_outside_the_state_dict_and_can_be_changed():
    layer = DropPath(0.1).to(torch.bfloat16)
    assert layer.keep_prob.dtype == torch.float32 and layer.keep_prob.item() == pytest.approx(0.9)
    assert "keep_prob" not in layer.state_dict()
    layer.drop_prob = 0.0
    assert layer.drop_prob == 0.0 and layer.keep_prob.item() == 1.0
    x = torch.randn(8, 4)
    assert torch.equal(layer.train()(x), x)  # rate 0: every sample kept, scale 1
    assert "drop_prob=0.000" in repr(layer)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_rates_outside_zero_to_one_are_refused(rate):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        DropPath(rate)
