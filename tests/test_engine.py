"""The three engines against plain autograd, in float64 on the CPU."""

import weakref

import pytest
import torch
import torch.nn as nn
from timm.layers import DropPath

import pareprop
from pareprop.engine import backward, lanes, replay
from pareprop.engine.testing import engine_errors, relative_error, worst_error

TOL = 1e-10
DIM = 8


class MixerBlock(pareprop.ReversibleBlock):
    """A small transformer-like block: F and G both normalise, project and drop."""

    def __init__(self, dim=DIM, drop=0.25, drop_path=0.3):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.drop = nn.Dropout(drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(drop),
                                 nn.Linear(2 * dim, dim))

    def f(self, x, scale=None, **kwargs):
        out = self.drop_path(self.drop(self.attn(self.norm1(x))))
        return out if scale is None else out * scale

    def g(self, x, **kwargs):
        return self.drop_path(self.mlp(self.norm2(x)))


class Model(nn.Module):
    def __init__(self, depth, engine="reversible", **block_kwargs):
        super().__init__()
        self.stack = pareprop.ReversibleStack(
            [MixerBlock(**block_kwargs) for _ in range(depth)], engine=engine
        )

    def forward(self, x, **kwargs):
        y1, y2 = self.stack(x, x, **kwargs)
        return torch.cat([y1, y2], dim=-1)


pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


def _assert_agree(report, tol=TOL):
    engine, key, err = worst_error(report)
    assert err < tol, f"{engine} disagrees with autograd on {key}: relative error {err:.3e}"


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_engines_match_autograd_with_dropout_and_drop_path(depth):
    model = Model(depth)
    report = engine_errors(model, torch.randn(3, 5, DIM), engines=("reversible", "pareprop"))
    # Every parameter of every block was compared.
    assert all(len(errs) == 2 + len(list(model.parameters())) for errs in report.values())
    _assert_agree(report)


def test_comparison_fails_when_replay_is_broken(monkeypatch):
    # If recomputation drew fresh dropout masks, the gradients would be wrong: check that the
    # comparison used everywhere notices.
    monkeypatch.setattr(replay._RngState, "restore", lambda self, device: None)
    report = engine_errors(Model(3), torch.randn(3, 5, DIM), engines=("reversible",))
    assert worst_error(report)[2] > 1e-3


def test_stack_keyword_inputs_reach_f_in_recomputation():
    model = Model(3)
    scale = torch.rand(1, 5, 1) + 0.5
    report = engine_errors(model, torch.randn(2, 5, DIM), scale=scale)
    _assert_agree(report)
    # ... and they matter: without them the outputs differ.
    model.eval()
    x = torch.randn(2, 5, DIM)
    assert relative_error(model(x, scale=scale), model(x)) > 1e-3


def test_gradcheck_through_inputs_and_parameters():
    stack = pareprop.ReversibleStack([MixerBlock(dim=4, drop=0.0, drop_path=0.0)
                                      for _ in range(3)])
    names = [n for n, _ in stack.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in stack.parameters())
    x1 = torch.randn(2, 3, 4, requires_grad=True)
    x2 = torch.randn(2, 3, 4, requires_grad=True)

    def run(x1, x2, *params):
        return torch.func.functional_call(stack, dict(zip(names, params)), (x1, x2))

    for name in ("reversible", "pareprop"):
        stack.set_engine(name)
        assert torch.autograd.gradcheck(run, (x1, x2, *params), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_backward_phases_are_named_in_profiles(engine):
    from torch.profiler import ProfilerActivity, profile

    model = Model(3, engine=engine)
    loss = model(torch.randn(2, 3, DIM)).sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("pareprop::recover") == 3 and calls.get("pareprop::grads") == 3


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_global_rng_after_a_step_equals_autograd(name):
    def step(engine):
        torch.manual_seed(1)
        model = Model(3, engine=engine)
        model(torch.randn(2, 4, DIM)).sum().backward()
        return torch.get_rng_state()

    assert torch.equal(step(name), step("autograd"))


def test_activation_memory_does_not_grow_with_depth():
    x = torch.randn(4, 16, DIM)

    def kept(depth, name):
        return pareprop.activation_bytes(Model(depth, engine=name), x)

    for name in ("reversible", "pareprop"):
        assert kept(16, name) <= 1.1 * kept(2, name)
        # What is kept is the stack's two outputs (and the concatenation needs none).
        assert kept(16, name) == 2 * x.numel() * x.element_size()
    ratio = kept(16, "autograd") / kept(2, "autograd")
    assert 6.0 < ratio < 9.0, f"autograd should keep ~8x more for 8x the depth, kept {ratio:.2f}x"


def test_activation_bytes_counts_a_storage_once_and_skips_parameters():
    w = nn.Parameter(torch.randn(10, 10))
    x = torch.randn(4, 10, requires_grad=True)
    # x @ w saves x and w; x * x saves x twice: only x counts, once.
    assert pareprop.activation_bytes(lambda: (x @ w + x * x).sum()) == x.numel() * 8


def test_pareprop_schedule_overlaps_recover_and_grads(monkeypatch):
    events, alive = [], []
    recover, grads = backward._recover, backward._grads

    def logged_recover(plan, index, *args):
        rebuilt = recover(plan, index, *args)
        alive.append(weakref.ref(rebuilt))
        events.append(("recover", index))
        return rebuilt

    def logged_grads(plan, index, *args):
        live = sum(ref() is not None for ref in alive)
        assert live <= 2, f"{live} rebuilt graphs alive during grads({index})"
        events.append(("grads", index))
        return grads(plan, index, *args)

    monkeypatch.setattr(backward, "_recover", logged_recover)
    monkeypatch.setattr(backward, "_grads", logged_grads)
    Model(4, engine="pareprop")(torch.randn(2, 3, DIM)).sum().backward()
    assert events == [
        ("recover", 3), ("recover", 2), ("grads", 3), ("recover", 1), ("grads", 2),
        ("recover", 0), ("grads", 1), ("grads", 0),
    ]
    events.clear()
    Model(3, engine="reversible")(torch.randn(2, 3, DIM)).sum().backward()
    assert events == [("recover", 2), ("grads", 2), ("recover", 1), ("grads", 1),
                      ("recover", 0), ("grads", 0)]


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_parameters_get_gradients_when_input_needs_none(name):
    x = torch.randn(2, 3, DIM)  # does not require grad
    grads = {}
    for engine in ("autograd", name):
        torch.manual_seed(0)
        model = Model(3, engine=engine, drop=0.0, drop_path=0.0)
        model(x).pow(2).sum().backward()
        grads[engine] = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads[name])
    assert max(relative_error(a, b) for a, b in zip(grads[name], grads["autograd"])) < TOL


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_autograd_grad_returns_parameter_gradients(name):
    # Parameters are inputs of the engine's Function, so autograd.grad sees them.
    torch.manual_seed(0)
    model = Model(2, engine=name, drop=0.0, drop_path=0.0)
    x = torch.randn(2, 3, DIM)
    params = list(model.parameters())
    got = torch.autograd.grad(model(x).sum(), params)
    model.stack.set_engine("autograd")
    want = torch.autograd.grad(model(x).sum(), params)
    assert max(relative_error(a, b) for a, b in zip(got, want)) < TOL
    assert all(p.grad is None for p in params)  # autograd.grad accumulates nothing


def test_shared_and_frozen_parameters():
    shared = MixerBlock(drop=0.0, drop_path=0.0)
    other = MixerBlock(drop=0.0, drop_path=0.0)
    other.attn.weight.requires_grad_(False)
    grads = {}
    for engine in ("autograd", "reversible", "pareprop"):
        stack = pareprop.ReversibleStack([shared, other, shared], engine=engine)
        stack.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        x = torch.randn(2, 3, DIM)
        y1, y2 = stack(x, x)
        (y1 * y2).sum().backward()
        grads[engine] = [p.grad for p in stack.parameters()]
    assert other.attn.weight.grad is None
    for engine in ("reversible", "pareprop"):
        assert max(relative_error(a, b) for a, b in zip(grads[engine], grads["autograd"])) < TOL


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_second_backward_raises_unless_graph_retained(name):
    model = Model(2, engine=name)
    loss = model(torch.randn(2, 3, DIM, requires_grad=True)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_retained_graph_allows_a_second_exact_backward(name):
    grads = {}
    for engine in ("autograd", name):
        torch.manual_seed(0)
        model = Model(2, engine=engine)
        loss = model(torch.randn(2, 3, DIM)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads[engine] = [p.grad for p in model.parameters()]
    assert max(relative_error(a, b) for a, b in zip(grads[name], grads["autograd"])) < TOL


def test_double_backward_is_refused():
    model = Model(2, engine="reversible")
    x = torch.randn(2, 3, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match="do not support double backward"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def test_eval_and_no_grad_run_plain_forward():
    model = Model(3, engine="pareprop")
    x = torch.randn(2, 3, DIM, requires_grad=True)
    with torch.no_grad():
        assert not model(x).requires_grad
    model.eval()
    out = model(x)
    assert "ReversibleFunction" not in type(out.grad_fn.next_functions[0][0]).__name__
    model.train()
    y1, _ = model.stack(x, x)
    assert "ReversibleFunction" in type(y1.grad_fn).__name__


def test_unknown_engine_lists_the_valid_ones():
    with pytest.raises(ValueError, match="autograd, reversible, pareprop"):
        Model(1, engine="fast")
    with pytest.raises(ValueError, match="expected one of"):
        pareprop.set_engine(Model(1), "checkpoint")


def test_streams_of_different_shapes_are_rejected():
    stack = Model(1).stack
    with pytest.raises(ValueError, match=r"same shape, got \(2, 3, 8\) and \(2, 4, 8\)"):
        stack(torch.randn(2, 3, DIM), torch.randn(2, 4, DIM))


def test_keyword_input_that_requires_grad_is_rejected():
    with pytest.raises(ValueError, match="'scale' requires grad"):
        Model(1)(torch.randn(1, 2, DIM), scale=torch.ones(1, requires_grad=True))


def test_batchnorm_is_rejected_by_the_reversible_engines():
    class NormBlock(MixerBlock):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def f(self, x, **kwargs):
            return self.bn(x)

    pareprop.ReversibleStack([NormBlock()], engine="autograd")  # fine: nothing recomputed
    with pytest.raises(ValueError, match=r"running statistics of blocks\.0\.bn"):
        pareprop.ReversibleStack([NormBlock()], engine="reversible")


def test_in_place_change_of_the_input_is_rejected():
    class InPlaceBlock(MixerBlock):
        def g(self, x, **kwargs):
            return x.mul_(2)

    stack = pareprop.ReversibleStack([InPlaceBlock()], engine="reversible")
    x = torch.randn(2, 3, DIM)
    with pytest.raises(RuntimeError, match=r"InPlaceBlock\.g modified its input in place"):
        stack(x, x.clone().requires_grad_())


def test_empty_stack_and_wrong_block_type_are_rejected():
    with pytest.raises(ValueError, match="at least one block"):
        pareprop.ReversibleStack([])
    with pytest.raises(TypeError, match="ReversibleBlock"):
        pareprop.ReversibleStack([nn.Linear(2, 2)])


def test_streams_are_not_created_at_construction():
    Model(2, engine="pareprop")
    assert lanes._SIDE_STREAMS == {}


def test_autocast_state_is_replayed_in_recomputation():
    seen = []

    class Spy(MixerBlock):
        def f(self, x, **kwargs):
            seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                         torch.get_autocast_dtype("cpu")))
            return super().f(x)

    stack = pareprop.ReversibleStack([Spy(drop=0.0, drop_path=0.0).float()],
                                     engine="reversible")
    x = torch.randn(2, 3, DIM, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = stack(x, x.clone().requires_grad_())
    # The streams stay float32 while F and G compute in bfloat16.
    assert y1.dtype == y2.dtype == torch.float32
    (y1.sum() + y2.sum()).backward()
    assert seen == [(False, True, torch.bfloat16), (True, True, torch.bfloat16)]


def test_parameter_changed_before_backward_is_refused():
    model = Model(2, engine="reversible")
    loss = model(torch.randn(2, 3, DIM)).sum()
    with torch.no_grad():
        model.stack.blocks[1].attn.weight.add_(1.0)  # an optimizer step before backward
    with pytest.raises(RuntimeError, match="'weight' of block 1 .* modified in place"):
        loss.backward()


def test_attention_dropout_is_replayed_exactly():
    # Attention dropout goes through nn.functional.dropout (see pareprop.layers.attend), whose
    # masks depend only on the generator state the engines replay.
    from pareprop.layers import Attention

    class AttentionBlock(MixerBlock):
        def __init__(self):
            super().__init__()
            self.attn = Attention(DIM, num_heads=2, attn_drop=0.3)

        def f(self, x, **kwargs):
            return self.attn(self.norm1(x))

    stack = pareprop.ReversibleStack([AttentionBlock() for _ in range(3)])
    report = engine_errors(stack, (torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)))
    _assert_agree(report)


class FlagRecordingBlock(MixerBlock):
    """Records the SDPA switch and cuDNN benchmark flag seen by each call of F."""

    seen = []

    def f(self, x, **kwargs):
        FlagRecordingBlock.seen.append(
            (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cudnn.benchmark)
        )
        return super().f(x, **kwargs)


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_backend_flags_of_forward_are_replayed_in_recomputation(name):
    FlagRecordingBlock.seen.clear()
    stack = pareprop.ReversibleStack([FlagRecordingBlock(), FlagRecordingBlock()], engine=name)
    x = torch.randn(2, 3, DIM)
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cudnn.benchmark)
    torch.backends.cuda.enable_flash_sdp(not before[0])
    with torch.backends.cudnn.flags(enabled=True, benchmark=not before[1]):
        y1, y2 = stack(x, x)
    torch.backends.cuda.enable_flash_sdp(before[0])
    (y1 * y2).sum().backward()
    flipped = (not before[0], not before[1])
    assert FlagRecordingBlock.seen == [flipped] * 4  # 2 in forward, 2 in recomputation
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cudnn.benchmark) == before
