"""CUDA graphs of a stack on the CPU (see tests/test_cuda_graphs.py): what changes after capture
is refused, naming what changed, since a replay would not see it: a keyword's value, a backend
flag, a replaced buffer, the inputs' requires_grad, a skip scale set to 0, and FSDP2 sharding
(issue 39 item 5: each test here failed with a one-line mutant of the code it checks).

A replay runs the captured kernels, not the host code that chose them. The eager stand-in
(``graphs._EagerStandIn``) runs the host code again at each replay, so a check that the host
code makes anyway (the engines refuse beta = 0 in a recomputed block) would pass through it
even where the graphed path forgot it. :class:`KernelReplay` replays what a graph would: the
operators recorded at capture (below autograd, with a dispatch mode), on the same tensors,
without the Python that issued them.
"""

import types

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pareprop
from pareprop.distributed import fsdp
from pareprop.engine import graphs, replay
from pareprop.engine.testing import relative_error

DIM = 8
TOL = 1e-10

pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _storage(t):
    return t.untyped_storage().data_ptr()


class KernelReplay:
    """A CUDA graph's stand-in that replays no host code: capture records every operator the
    step runs; a replay runs those operators again on the same tensors and writes each new
    result where the captured one lives (a view or an in-place result is already there), as a
    graph's kernels write into the captured memory."""

    def branch_rng(self, seeds):
        return replay._CpuBranchRng(seeds)

    def capture(self, fn, states):
        recorder = _Recorder()
        with recorder:
            fn()
        ops = recorder.ops

        def run_kernels():
            for func, args, kwargs, out in ops:
                fresh = func(*args, **kwargs)
                for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                    if isinstance(old, torch.Tensor) and _storage(new) != _storage(old):
                        old.copy_(new)

        return types.SimpleNamespace(replay=run_kernels)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "backend_for", lambda device: graphs._EagerStandIn())


@pytest.fixture
def kernels_only(monkeypatch):
    monkeypatch.setattr(graphs, "backend_for", lambda device: KernelReplay())


class Keyed(pareprop.ReversibleBlock):
    """F scaled by a keyword ``scale`` (a Python number) and shifted by a buffer; G plain."""

    def __init__(self):
        super().__init__()
        self.f_lin = nn.Linear(DIM, DIM)
        self.g_lin = nn.Linear(DIM, DIM)
        self.register_buffer("offset", torch.zeros(DIM))

    def f(self, x, scale=1.0, **kwargs):
        return torch.tanh(self.f_lin(x)) * scale + self.offset

    def g(self, x, **kwargs):
        return torch.tanh(self.g_lin(x))


def _stack(engine="reversible", depth=3):
    torch.manual_seed(0)
    return pareprop.ReversibleStack([Keyed() for _ in range(depth)], engine=engine)


def _inputs(requires_grad=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, DIM, generator=g).requires_grad_(requires_grad) for _ in range(2)]


def _step(stack, x1, x2, **kwargs):
    y1, y2 = stack(x1, x2, **kwargs)
    (y1 * y2).sum().backward()
    return y1.detach(), y2.detach()


def _captured(engine="reversible", requires_grad=True, **kwargs):
    stack = _stack(engine)
    stack.set_engine(engine, cuda_graphs=True)
    for step in range(graphs.WARMUP_STEPS + 1):
        _step(stack, *_inputs(requires_grad, seed=step), **kwargs)
    assert stack.cuda_graph_status.startswith("captured")
    return stack


def _refused(stack, what, *inputs, **kwargs):
    with pytest.raises(ValueError, match=f"captured as CUDA graphs.*{what}.*capture anew"):
        stack(*(inputs or _inputs()), **kwargs)


def test_a_changed_keyword_value_is_refused(stand_in):
    stack = _captured(scale=2.0)
    _refused(stack, r"keyword arguments", scale=3.0)
    _step(stack, *_inputs(), scale=2.0)  # as captured: replays


def test_a_changed_backend_flag_is_refused(stand_in, monkeypatch):
    stack = _captured()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark)
    _refused(stack, r"backend flags")


def test_a_replaced_buffer_is_refused(stand_in):
    stack = _captured()
    stack.blocks[1].offset = torch.ones(DIM)  # a new tensor: the capture reads the old one
    _refused(stack, r"buffers \(replaced\)")


@pytest.mark.parametrize("captured_with", [False, True])
def test_a_change_in_the_inputs_requires_grad_is_refused(stand_in, captured_with):
    # Captured without input gradients, a replay would give none to inputs that now want them
    # (and the other way round, compute ones nobody asked for).
    stack = _captured(requires_grad=captured_with)
    _refused(stack, r"requires_grad", *_inputs(requires_grad=not captured_with))


def test_the_kernel_replay_stand_in_matches_eager_autograd(kernels_only):
    reference = _stack("autograd")
    for engine in ("reversible", "pareprop"):
        graphed = _stack(engine)
        graphed.set_engine(engine, cuda_graphs=True)
        for step in range(graphs.WARMUP_STEPS + 3):
            got, want = [], []
            for stack, into in ((graphed, got), (reference, want)):
                stack.zero_grad(set_to_none=True)
                x1, x2 = _inputs(seed=10 + step)
                into.extend([*_step(stack, x1, x2), x1.grad, x2.grad])
                into.extend(p.grad for p in stack.parameters())
            assert max(relative_error(a, b) for a, b in zip(got, want)) < TOL, (engine, step)
        assert graphed.cuda_graph_status.startswith("captured")


@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_a_skip_scale_set_to_0_after_capture_is_refused(kernels_only, engine):
    # The reversible engines divide by beta; a recomputed block at beta = 0 is refused in
    # forward. A replay runs no forward host code, so the stack checks before replaying.
    stack = _stack(engine)
    for block in stack.blocks:
        block.set_skip_scale(0.5)
    stack.set_engine(engine, cuda_graphs=True)
    for step in range(graphs.WARMUP_STEPS + 1):
        _step(stack, *_inputs(seed=step))
    assert stack.cuda_graph_status.startswith("captured")
    stack.blocks[1].set_skip_scale(0.0)  # in place: the buffer stays, its value changes
    with pytest.raises(ValueError, match="block 1 .*skip scale beta = 0"):
        stack(*_inputs())


def _sharded_as_shard_leaves_it(stack):
    stack.sharding = fsdp._BlockSharding(list(stack.blocks), reshard_after_forward=True)
    return stack


def test_cuda_graphs_on_an_fsdp2_sharded_stack_are_refused(stand_in):
    # The state pareprop.distributed.fsdp.shard leaves a stack in (tests/test_fsdp_models.py
    # shards a model for real in two processes and checks the same refusals).
    stack = _sharded_as_shard_leaves_it(_stack())
    with pytest.raises(ValueError, match="cannot capture an FSDP2-sharded stack.*Use DDP"):
        stack.set_engine("reversible", cuda_graphs=True)
    stack = _stack()
    stack.set_engine("reversible", cuda_graphs=True)
    _sharded_as_shard_leaves_it(stack)  # sharded after the switch: refused at the next step
    with pytest.raises(ValueError, match="cannot capture an FSDP2-sharded stack"):
        stack(*_inputs())

