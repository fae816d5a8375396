"""CUDA graphs of a stack on the CPU (see tests/test_cuda_graphs.py): what must reach a replay or
outlive it. A keyword tensor refilled in place reaches the next replay; gradients that
``torch.autograd.grad`` hands back are the caller's, untouched by the next replay (issue 39
item 5: each test here failed with a one-line mutant of the replay)."""

import pytest
import torch

import pareprop
from pareprop.engine import graphs
from pareprop.engine.testing import relative_error
from test_cuda_graphs_refusals import DIM, TOL, _inputs, _stack

pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "backend_for", lambda device: graphs._EagerStandIn())


class Shifted(pareprop.ReversibleBlock):
    """F shifted by a keyword tensor ``shift`` (a constant the caller keeps and refills)."""

    def __init__(self):
        super().__init__()
        self.f_lin = torch.nn.Linear(DIM, DIM)
        self.g_lin = torch.nn.Linear(DIM, DIM)

    def f(self, x, shift=None, **kwargs):
        return torch.tanh(self.f_lin(x)) + shift

    def g(self, x, **kwargs):
        return torch.tanh(self.g_lin(x))


def test_a_keyword_tensor_refilled_in_place_reaches_the_replay():
    torch.manual_seed(0)
    graphed = pareprop.ReversibleStack([Shifted() for _ in range(2)], engine="reversible")
    reference = pareprop.ReversibleStack([Shifted() for _ in range(2)], engine="autograd")
    reference.load_state_dict(graphed.state_dict())
    graphed.set_engine("reversible", cuda_graphs=True)
    shift = torch.zeros(DIM)  # one tensor, as a model keeps a mask
    for step in range(graphs.WARMUP_STEPS + 3):
        shift.fill_(float(step))  # the same tensor, new values
        x1, x2 = _inputs(seed=step)
        got, want = [], []
        for stack, into in ((graphed, got), (reference, want)):
            a, b = x1.detach().requires_grad_(), x2.detach().requires_grad_()
            y1, y2 = stack(a, b, shift=shift)
            (y1 * y2).sum().backward()
            into.extend([y1, y2, a.grad, b.grad])
        assert max(relative_error(a, b) for a, b in zip(got, want)) < TOL, step
    assert graphed.cuda_graph_status.startswith("captured")


def test_gradients_from_autograd_grad_survive_the_next_replay():
    graphed, reference = _stack(), _stack("autograd")
    graphed.set_engine("reversible", cuda_graphs=True)
    for step in range(graphs.WARMUP_STEPS + 1):  # warm up, then capture
        y1, y2 = graphed(*_inputs(seed=step))
        (y1 * y2).sum().backward()
    assert graphed.cuda_graph_status.startswith("captured")
    grads = []
    for step in range(2):  # two replays; the first's gradients are read after the second
        y1, y2 = graphed(*_inputs(seed=10 + step))
        grads.append(torch.autograd.grad((y1 * y2).sum(), list(graphed.parameters())))
    y1, y2 = reference(*_inputs(seed=10))
    want = torch.autograd.grad((y1 * y2).sum(), list(reference.parameters()))
    assert max(relative_error(a, b) for a, b in zip(grads[0], want)) < TOL
