"""Mixed precision: stream dtypes, drift_report, and the reconstruction debug switch."""

import math
import warnings

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop.memory.drift import drift_report

SMALL = {
    "rev_vit_tiny_patch4_32": dict(depth=2, embed_dim=32, num_heads=2, img_size=16),
    "rev_mvitv2_tiny_32": dict(embed_dim=16, img_size=16),
    "rev_mvit_base": dict(embed_dim=16, img_size=32, depth=4, transition_blocks=(2,)),
    "rev_swin_tiny_32": dict(embed_dim=16, img_size=16, depths=(1, 2), num_heads=(2, 2)),
    "rev_roberta_small": dict(embed_dim=32, depth=2, num_heads=2, mlp_dim=64, vocab_size=50,
                              max_position_embeddings=20, example_seq_len=8),
}


def _small(name):
    torch.manual_seed(0)
    return pareprop.create_model(name, num_classes=5, **SMALL[name])


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_streams_stay_float32_while_f_and_g_compute_in_bf16(name, engine):
    model = _small(name)
    pareprop.set_engine(model, engine)
    streams, computed = [], []

    def spy(fn):
        def wrapped(x, **kwargs):
            out = fn(x, **kwargs)
            streams.append(x.dtype)  # F and G read a stream ...
            computed.append(out.dtype)  # ... and compute in low precision
            return out
        return wrapped

    for module in model.modules():
        if isinstance(module, pareprop.ReversibleStack):
            module.register_forward_hook(lambda m, args, out: streams.extend(t.dtype for t in out))
            for block in module.blocks:
                block.f, block.g = spy(block.f), spy(block.g)
    inputs = model.example_inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*inputs)
    assert streams and set(streams) == {torch.float32}
    assert torch.bfloat16 in computed
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def _vit(depth):
    torch.manual_seed(0)
    return pareprop.create_model("rev_vit_tiny_patch4_32", depth=depth, embed_dim=32,
                                 num_heads=2, img_size=16, num_classes=5, drop_path_rate=0.1)


def test_drift_report_is_at_rounding_level_in_float64():
    model = _vit(3).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    report = drift_report(model, x, amp_dtype=None, reference_dtype=torch.float64)
    assert len(report.blocks) == 3
    for engine in ("reversible", "pareprop"):
        assert len(report.reconstruction[engine]) == 3
        assert max(report.reconstruction[engine]) < 1e-12
        assert max(report.block_grad_error[engine]) < 1e-12
    assert report.grad_error["autograd"] == 0.0


def test_drift_report_in_bf16_is_larger_finite_and_per_block():
    model = _vit(3)
    x = torch.randn(2, 3, 16, 16)
    report = drift_report(model, x, amp_dtype=torch.bfloat16)
    for engine in pareprop.ENGINES:
        errs = report.block_grad_error[engine]
        assert len(errs) == 3 and all(math.isfinite(e) for e in errs)
        assert 1e-5 < report.grad_error[engine] < 1.0
    for engine in ("reversible", "pareprop"):
        assert all(math.isfinite(e) and e > 1e-9 for e in report.reconstruction[engine])
    assert set(report.to_dict()) >= {"blocks", "reconstruction", "grad_error"}
    # The model is left as found.
    assert all(p.grad is None for p in model.parameters())
    stacks = [m for m in model.modules() if isinstance(m, pareprop.ReversibleStack)]
    assert all(s.engine == "reversible" for s in stacks)


def test_drift_report_plot_writes_a_png(tmp_path):
    report = drift_report(_vit(2), torch.randn(2, 3, 16, 16))
    path = tmp_path / "drift.png"
    report.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drift_report_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        drift_report(_vit(1), torch.randn(1, 3, 16, 16), engines=("fast",))
    with pytest.raises(ValueError, match="no ReversibleStack"):
        drift_report(nn.Linear(2, 2), torch.randn(1, 2))


class Drifting(pareprop.ReversibleBlock):
    """F reads hidden state that changes between calls, so it cannot be inverted."""

    def __init__(self, drifting):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drifting = drifting
        self.calls = 0

    def f(self, x, **kwargs):
        self.calls += 1
        return self.proj(x) + (self.calls if self.drifting else 0.0)

    def g(self, x, **kwargs):
        return torch.tanh(x)


@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_debug_switch_warns_naming_the_block_that_does_not_invert(engine):
    stack = pareprop.ReversibleStack([Drifting(False), Drifting(True), Drifting(False)], engine)
    x = torch.randn(2, 4)
    pareprop.debug_reconstruction(stack, tolerance=1e-4)
    with pytest.warns(RuntimeWarning) as caught:
        sum(t.sum() for t in stack(x, x.clone().requires_grad_())).backward()
    # The culprit warns first; block 0 then inherits its error and warns too.
    messages = [str(w.message) for w in caught]
    assert messages[0].startswith("block 1 (Drifting)") and messages[1].startswith("block 0")
    # Backward runs last to first, so the first block to warn is the culprit; the blocks
    # before it inherit its error.
    errors = stack.last_reconstruction_errors
    assert max(errors[2]) < 1e-6 and errors[1][0] > 1e-2 and errors[1][1] < 1e-6
    # The switch lasts one step: the next one keeps nothing and warns about nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sum(t.sum() for t in stack(x, x.clone().requires_grad_())).backward()


def test_debug_switch_is_silent_for_invertible_blocks():
    stack = pareprop.ReversibleStack([Drifting(False) for _ in range(3)])
    x = torch.randn(2, 4)
    stack.debug_reconstruction(1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sum(t.sum() for t in stack(x, x.clone().requires_grad_())).backward()
    assert len(stack.last_reconstruction_errors) == 3
