"""The scaled coupling Y1 = beta X1 + F(X2), Y2 = beta X2 + G(Y1) under every engine, in
float64 against plain autograd, with alpha folded into F and G (F(x) = alpha x + H(x)) as
pareprop.convert does (NOTE [ Skip scale of the coupling ] in pareprop/engine/block.py)."""

import pytest
import torch
import torch.nn as nn
from timm.layers import DropPath

import pareprop
from pareprop.engine.testing import engine_errors, worst_error

DIM = 8


class DualResidualBlock(pareprop.ReversibleBlock):
    """F(x) = alpha x + H1(x), G(y) = alpha y + H2(y), H with dropout and drop-path."""

    def __init__(self, alpha, drop=0.2, drop_path=0.3):
        super().__init__()
        self.alpha = alpha
        self.h1 = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.Dropout(drop),
                                DropPath(drop_path))
        self.h2 = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                nn.Dropout(drop), nn.Linear(2 * DIM, DIM), DropPath(drop_path))

    def f(self, x):
        return self.alpha * x + self.h1(x)

    def g(self, x):
        return self.alpha * x + self.h2(x)


class Model(nn.Module):
    def __init__(self, depth, alpha, beta):
        super().__init__()
        blocks = [DualResidualBlock(alpha).set_skip_scale(beta) for _ in range(depth)]
        self.stack = pareprop.ReversibleStack(blocks, engine="reversible")

    def forward(self, x):
        return torch.cat(self.stack(x, 0.5 * x), dim=-1)


pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


def _assert_agree(report, tol):
    engine, key, err = worst_error(report)
    assert err < tol, f"{engine} disagrees with autograd on {key}: relative error {err:.3e}"


@pytest.mark.parametrize("depth", [3, 4])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("beta", [0.5, 0.8, 1.0])
def test_scaled_coupling_matches_autograd(depth, alpha, beta):
    model = Model(depth, alpha, beta)
    report = engine_errors(model, torch.randn(2, 5, DIM), engines=("reversible", "pareprop"))
    assert all(len(errs) == 2 + len(list(model.parameters())) for errs in report.values())
    # Rebuilding divides by beta twice a block: float64 keeps ~16 digits, (1/0.5)^8 costs 2-3.
    _assert_agree(report, 1e-9)


@pytest.mark.parametrize("stored", [(0,), (1,), (0, 2), (0, 1, 2)])
def test_scaled_coupling_with_stored_blocks(stored):
    model = Model(3, 0.3, 0.5)
    model.stack.store_blocks(stored)
    _assert_agree(engine_errors(model, torch.randn(2, 5, DIM)), 1e-9)


def test_beta_zero_needs_stored_blocks():
    # (alpha, beta) = (1, 0) is the plain residual network: not invertible, but exact when
    # every block keeps its graph.
    model = Model(3, 1.0, 0.0)
    with pytest.raises(ValueError, match="beta = 0"):
        model.train()(torch.randn(2, 5, DIM, requires_grad=True)).sum().backward()
    model.stack.store_blocks([0, 1, 2])
    _assert_agree(engine_errors(model, torch.randn(2, 5, DIM)), 1e-12)


def test_forward_is_the_scaled_coupling():
    model = Model(2, 0.3, 0.5).eval()
    x = torch.randn(2, 5, DIM)
    x1, x2 = x, 0.5 * x
    for block in model.stack.blocks:
        y1 = 0.5 * x1 + 0.3 * x2 + block.h1(x2)
        x1, x2 = y1, 0.5 * x2 + 0.3 * y1 + block.h2(y1)
    torch.testing.assert_close(model(x), torch.cat([x1, x2], dim=-1), rtol=1e-14, atol=1e-14)


def test_beta_changes_between_steps_without_rebuilding():
    model = Model(3, 0.3, 0.5)
    for block in model.stack.blocks:
        block.set_skip_scale(0.8)
    buffers = [block.skip_scale for block in model.stack.blocks]
    for block in model.stack.blocks:
        block.set_skip_scale(1.0)
    assert all(b is block.skip_scale for b, block in zip(buffers, model.stack.blocks))
    assert all(float(b) == 1.0 for b in buffers)
    assert "skip_scale" not in model.state_dict()  # not persistent: checkpoints are unchanged
    _assert_agree(engine_errors(model, torch.randn(2, 5, DIM)), 1e-10)
    # float32 and exact through dtype casts, as DropPath's rate
    model.float()
    assert model.stack.blocks[0].skip_scale.dtype == torch.float32
    with pytest.raises(ValueError, match="beta >= 0"):
        model.stack.blocks[0].set_skip_scale(-0.1)


def test_beta_changed_between_forward_and_backward_is_refused():
    model = Model(2, 0.3, 0.5).train()
    out = model(torch.randn(2, 5, DIM, requires_grad=True)).sum()
    model.stack.blocks[1].set_skip_scale(0.9)
    with pytest.raises(RuntimeError, match=r"skip scale of block 1 \(DualResidualBlock\) changed"):
        out.backward()


def test_compiled_blocks_do_not_recompile_for_a_new_beta():
    torch._dynamo.reset()
    model = Model(2, 0.3, 0.5).eval()
    x = torch.randn(2, 5, DIM)
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    compiled(x)
    for block in model.stack.blocks:
        block.set_skip_scale(0.9)
    got = compiled(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, model(x), rtol=0, atol=0)
