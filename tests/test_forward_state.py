"""State of the forward that recomputation must see again, or refuse to guess: each module's
train/eval flag, and the keyword tensors of a stack. Float64 parity with plain autograd."""

import pytest
import torch

import pareprop
from pareprop.testing import relative_error

TOL = 1e-10
ENGINES = ("reversible", "pareprop")


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _grads(model, x, step):
    """Input and parameter gradients of one seeded ``step(model, x) -> loss``."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        step(model, x).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    grads["input"] = x.grad
    return grads


def _worst(grads, reference):
    return max(relative_error(grads[k], reference[k]) for k in reference)


def _rev_vit(**overrides):
    torch.manual_seed(0)
    cfg = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=3, num_heads=2,
               num_classes=3, drop_path_rate=0.3)
    cfg.update(overrides)
    return pareprop.create_model("rev_vit_tiny_patch4_32", **cfg).double()


def _train_then_eval(model, x):
    # The forward runs in training mode (drop-path draws), the backward after model.eval(),
    # as a validation pass squeezed between forward and backward would leave it.
    model.train()
    out = model(x)
    model.eval()
    return (out * torch.arange(out.numel()).reshape(out.shape).cos()).sum()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("overrides", [{}, {"proj_drop_rate": 0.2, "attn_drop_rate": 0.1}])
def test_train_flags_of_forward_are_replayed_in_backward(engine, overrides):
    model = _rev_vit(**overrides)
    x = torch.randn(2, 1, 8, 8)
    reference = _grads(pareprop.set_engine(model, "autograd"), x, _train_then_eval)
    grads = _grads(pareprop.set_engine(model, engine), x, _train_then_eval)
    assert _worst(grads, reference) < TOL
    assert not any(m.training for m in model.modules()), "the caller's eval mode is kept"


@pytest.mark.parametrize("engine", ENGINES)
def test_eval_forward_then_train_mode_backward(engine):
    # The other way round: a frozen-dropout block (eval submodule) inside a training model,
    # switched to train before backward.
    model = _rev_vit(proj_drop_rate=0.2)
    x = torch.randn(2, 1, 8, 8)

    def step(m, inp):
        m.train()
        m.stack.blocks[1].eval()
        out = m(inp)
        m.train()
        return out.square().sum()

    reference = _grads(pareprop.set_engine(model, "autograd"), x, step)
    grads = _grads(pareprop.set_engine(model, engine), x, step)
    assert _worst(grads, reference) < TOL
    assert all(m.training for m in model.modules())


def _text_model():
    torch.manual_seed(0)
    return pareprop.create_model(
        "rev_roberta_small", vocab_size=50, max_position_embeddings=16, example_seq_len=12,
        embed_dim=16, depth=3, num_heads=2, mlp_dim=32, num_classes=3, drop_path_rate=0.0,
    ).double()


@pytest.mark.parametrize("engine", ENGINES)
def test_keyword_tensor_refilled_between_forward_and_backward_is_refused(engine):
    model = _text_model()
    ids = torch.randint(2, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.bool)  # .bool() of it is the very same tensor

    def two_forwards(m, _):
        mask.fill_(True)
        mask[1, 8:] = False
        first = m(ids, mask)
        mask.fill_(True)  # a reused buffer, refilled for the next batch
        mask[2, :3] = False
        second = m(ids, mask)
        return (first.square().sum() + second.square().sum())

    model.train()
    reference = _grads(pareprop.set_engine(model, "autograd"), torch.zeros(1), two_forwards)
    pareprop.set_engine(model, engine)
    # Right or refused: today's code returned a gradient 8e-3 off (relative).
    with pytest.raises(RuntimeError, match="keyword input 'attn_mask'.*modified in place"):
        _grads(model, torch.zeros(1), two_forwards)
    # Unchanged keyword tensors still give autograd's gradients.

    def two_masks(m, _):
        a = torch.ones(3, 12, dtype=torch.bool)
        a[1, 8:] = False
        b = torch.ones(3, 12, dtype=torch.bool)
        b[2, :3] = False
        return m(ids, a).square().sum() + m(ids, b).square().sum()

    reference = _grads(pareprop.set_engine(model, "autograd"), torch.zeros(1), two_masks)
    grads = _grads(pareprop.set_engine(model, engine), torch.zeros(1), two_masks)
    assert _worst(grads, reference) < TOL
