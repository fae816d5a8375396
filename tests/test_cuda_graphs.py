"""CUDA graphs of a stack's step (``pareprop.set_engine(model, engine, cuda_graphs=True)``) on
the CPU.

The capture and replay code runs here through its stand-in, ``graphs._EagerStandIn``: capturing
runs the step once and each replay runs it again, writing into the captured tensors, with the
branches' random streams on the CPU generator (NOTE [ Randomness in CUDA graphs ]). So the
static buffers, the copies in and out, gradients reaching ``.grad`` (accumulation included),
the random streams, the warm-up, the checks at every call and the refusals are tested in
float64 against plain autograd. What only a device shows (capture itself, the CUDA generator
states, two streams in one graph) is in tests/test_cuda_graphs_gpu.py. A step on the meta
device shows that no engine makes a data-dependent host decision (``.item()``, ``bool()``,
``.cpu()``), which a capture could not replay.
"""

import copy

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop.engine import graphs, replay
from pareprop.engine.testing import relative_error
from pareprop.models.vit import RevViTBlock

TOL = 1e-10
NO_DROP = dict(attn_drop_rate=0.0, proj_drop_rate=0.0, drop_path_rate=0.0)
DROP = dict(attn_drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.3)

pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "backend_for", lambda device: graphs._EagerStandIn())


def _vit(engine="autograd", drop=NO_DROP, depth=3):
    torch.manual_seed(0)
    return pareprop.create_model("rev_vit_tiny_patch4_32", img_size=8, embed_dim=16, depth=depth,
                                 num_heads=2, num_classes=3, engine=engine, **drop)


def _swin(engine="autograd", drop=NO_DROP):
    torch.manual_seed(0)
    return pareprop.create_model("rev_swin_tiny_32", embed_dim=8, depths=(2, 2), num_heads=(1, 2),
                                 window=4, patch_size=2, img_size=16, num_classes=3,
                                 engine=engine, **drop)


FAMILIES = {"vit": (_vit, (3, 8, 8)), "swin": (_swin, (3, 16, 16))}


def _stacks(model):
    return [m for m in model.modules() if isinstance(m, pareprop.ReversibleStack)]


def _steps(models, shape, steps=5, batch=2, seed=0):
    """Train ``models`` side by side, the same data and seeds each step (SGD with momentum
    between steps), and yield each step's (outputs, parameter gradients) per model."""
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in models]
    data = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(batch, *shape, generator=data)
        got = []
        for model, opt in zip(models, opts):
            torch.manual_seed(100 + step)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            out.pow(2).sum().backward()
            got.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
            opt.step()
        yield got


def _worst(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    errors = {"output": relative_error(out_a, out_b)}
    errors.update({n: relative_error(grads_a[n], grads_b[n]) for n in grads_b})
    return max(errors.items(), key=lambda item: item[1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_graphed_steps_match_eager_autograd(stand_in, family, engine):
    make, shape = FAMILIES[family]
    reference, graphed = make(), make(engine)
    pareprop.set_engine(graphed, engine, cuda_graphs=True)
    for step, (ref, got) in enumerate(_steps([reference, graphed], shape)):
        name, err = _worst(got, ref)
        assert err < TOL, f"step {step}: {name} off by {err:.3e}"
    assert all(s.cuda_graph_status.startswith("captured") for s in _stacks(graphed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_graphed_dropout_matches_graphed_autograd(stand_in, family, engine):
    # Under graphs every engine draws from the branches' streams, seeded alike at capture, so
    # the reversible engines must match graphed autograd exactly with dropout on: a
    # recomputation drawing other masks than forward would be far off.
    make, shape = FAMILIES[family]
    reference, graphed = make("autograd", DROP), make(engine, DROP)
    pareprop.set_engine(reference, "autograd", cuda_graphs=True)
    pareprop.set_engine(graphed, engine, cuda_graphs=True)
    for step, (ref, got) in enumerate(_steps([reference, graphed], shape)):
        name, err = _worst(got, ref)
        assert err < TOL, f"step {step}: {name} off by {err:.3e}"


def test_replays_draw_new_masks(stand_in):
    model = _vit("reversible", DROP)
    pareprop.set_engine(model, "reversible", cuda_graphs=True)
    x = torch.randn(2, 3, 8, 8)
    outs = []
    for _ in range(graphs.WARMUP_STEPS + 3):
        out = model(x)
        out.sum().backward()
        outs.append(out.detach())
    assert model.stack.cuda_graph_status.startswith("captured")
    assert relative_error(outs[-1], outs[-2]) > 1e-3  # same input and weights, new masks


def test_a_recomputation_drawing_other_masks_is_caught(stand_in, monkeypatch):
    # Negative control of the dropout test: recomputation drawing from the forward streams
    # (advanced by forward) instead of the backward ones gets other masks, and the test sees it.
    monkeypatch.setattr(replay._CpuBranchRng, "recompute",
                        lambda self, i, b: self._use(self.forward_states, (i, b)))
    reference, graphed = _vit("autograd", DROP), _vit("reversible", DROP)
    pareprop.set_engine(reference, "autograd", cuda_graphs=True)
    pareprop.set_engine(graphed, "reversible", cuda_graphs=True)
    worst = max(_worst(got, ref)[1] for ref, got in _steps([reference, graphed], (3, 8, 8)))
    assert worst > 1e-3


@pytest.mark.parametrize("reset", [True, False])
def test_a_forward_without_backward_leaves_the_streams_in_step(stand_in, monkeypatch, reset):
    # A forward replay whose backward never runs (a skipped step) advances the forward streams
    # only; the backward streams catch up before the next forward replay (step_begin). Without
    # that (reset=False, the negative control) recomputation draws other masks from then on.
    if not reset:
        monkeypatch.setattr(replay._CpuBranchRng, "step_begin", lambda self: None)
    reference, graphed = _vit("autograd", DROP), _vit("reversible", DROP)
    for model, engine in ((reference, "autograd"), (graphed, "reversible")):
        pareprop.set_engine(model, engine, cuda_graphs=True)
    worst = 0.0
    for step, (ref, got) in enumerate(_steps([reference, graphed], (3, 8, 8), steps=6)):
        worst = max(worst, _worst(got, ref)[1])
        if step == graphs.WARMUP_STEPS:  # captured: one forward each, never differentiated
            for model in (reference, graphed):
                model(torch.randn(2, 3, 8, 8))
    assert (worst < TOL) if reset else (worst > 1e-3)


def test_gradients_accumulate_over_micro_batches(stand_in):
    reference, graphed = _vit(), _vit("pareprop")
    pareprop.set_engine(graphed, "pareprop", cuda_graphs=True)
    for step in range(graphs.WARMUP_STEPS + 3):
        for model in (reference, graphed):
            model.zero_grad(set_to_none=True)
            for micro in range(3):
                x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(10 * step
                                                                                    + micro))
                model(x).pow(2).sum().backward()
        for (name, a), b in zip(graphed.named_parameters(), reference.parameters()):
            assert relative_error(a.grad, b.grad) < TOL, f"step {step}: {name}"


def test_stored_blocks_and_input_gradients(stand_in):
    torch.manual_seed(0)
    stack = pareprop.ReversibleStack(
        [RevViTBlock(16, 2) for _ in range(4)], engine="reversible")
    reference = copy.deepcopy(stack).set_engine("autograd")
    stack.store_blocks([0, 2])
    stack.set_engine("reversible", cuda_graphs=True)
    for _ in range(graphs.WARMUP_STEPS + 3):
        x = torch.randn(2, 5, 16)
        grads = []
        for model in (reference, stack):
            a, b = x.clone().requires_grad_(), (2 * x).requires_grad_()
            y1, y2 = model(a, b)
            (y1 * y2).sum().backward()
            grads.append([a.grad, b.grad] + [p.grad for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        assert max(relative_error(g, r) for g, r in zip(grads[1], grads[0])) < TOL
    assert stack.cuda_graph_status.startswith("captured")


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_no_engine_makes_a_host_decision_on_data(engine, monkeypatch):
    # On the meta device every tensor op runs without data, and .item(), bool(), .tolist() or
    # .cpu() raise: an eager step and graphed (stand-in) steps of each engine pass.
    monkeypatch.setattr(graphs, "backend_for", lambda device: graphs._EagerStandIn())
    with torch.device("meta"):
        model = _vit(engine, DROP, depth=2)
        x = torch.randn(2, 3, 8, 8)
    pareprop.set_engine(model, engine, cuda_graphs=True)
    for _ in range(graphs.WARMUP_STEPS + 2):
        model(x).sum().backward()
    assert model.stack.cuda_graph_status.startswith("captured")
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


def test_the_meta_check_catches_a_host_sync():
    class Syncing(pareprop.ReversibleBlock):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def f(self, x, **kwargs):
            return self.lin(x) * (2.0 if x.sum().item() > 0 else 1.0)

        def g(self, x, **kwargs):
            return self.lin(x)

    with torch.device("meta"):
        stack = pareprop.ReversibleStack([Syncing()], engine="reversible")
        x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="meta"):
        stack(x, x)


# ---------------------------------------------------------------------------------------------
# What is refused, and what starts a capture anew


def test_cpu_tensors_are_refused():
    model = _vit()
    pareprop.set_engine(model, "reversible", cuda_graphs=True)
    with pytest.raises(ValueError, match="captures a stack's work as CUDA graphs.*on cpu"):
        model(torch.randn(2, 3, 8, 8))


def test_options_a_capture_cannot_run_are_refused(stand_in):
    model = _vit()
    pareprop.set_chunking(model, chunks=2)
    with pytest.raises(ValueError, match=r"stack stack .*cannot capture chunked.*set_chunking"):
        pareprop.set_engine(model, "reversible", cuda_graphs=True)
    assert not model.stack.cuda_graphs  # checked before any stack changed
    pareprop.set_chunking(model)
    pareprop.set_engine(model, "reversible", cuda_graphs=True)
    pareprop.set_chunking(model, chunks=2)  # after the switch: refused at the next step
    with pytest.raises(ValueError, match="chunked branches"):
        model(torch.randn(2, 3, 8, 8))
    pareprop.set_chunking(model)

    pareprop.engine.debug_reconstruction(model)
    with pytest.raises(ValueError, match=r"debug_reconstruction.*\.item\(\)"):
        model(torch.randn(2, 3, 8, 8))
    pareprop.engine.debug_reconstruction(model, None)

    with pytest.raises(ValueError, match="fallback=True"):
        pareprop.set_engine(model, "pareprop", fallback=True)
    with pytest.raises(ValueError, match="fallback=True"):
        pareprop.set_engine(_vit(), "pareprop", fallback=True, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be"):
        pareprop.set_engine(model, "pareprop", cuda_graphs="yes")

    checkpointed = pareprop.engine.set_block_checkpointing(_vit())
    with pytest.raises(ValueError, match="set_block_checkpointing.*get_rng_state"):
        pareprop.set_engine(checkpointed, "autograd", cuda_graphs=True)


def _captured(engine="reversible", drop=NO_DROP):
    model = _vit(engine, drop)
    pareprop.set_engine(model, engine, cuda_graphs=True)
    for _ in range(graphs.WARMUP_STEPS + 1):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert model.stack.cuda_graph_status == "captured (inputs (2, 4, 16))"
    return model


def _new_weight(m):
    fc1 = m.stack.blocks[1].mlp.fc1
    fc1.weight = nn.Parameter(fc1.weight.detach().clone())


@pytest.mark.parametrize("change, named", [
    (lambda m: torch.randn(3, 3, 8, 8), "inputs' shapes"),
    (lambda m: m.stack.blocks[0].attn.train(False) and None, "training flags"),
    (_new_weight, "parameters"),
    (lambda m: m.stack.blocks[0].mlp.fc1.weight.requires_grad_(False).shape and None,
     "parameters"),
])
def test_a_changed_step_is_refused_after_capture(stand_in, change, named):
    model = _captured()
    x = change(model)
    with pytest.raises(ValueError, match=f"captured as CUDA graphs.*{named}.*capture anew"):
        model(torch.randn(2, 3, 8, 8) if x is None else x)
    pareprop.set_engine(model, "reversible")  # set again: warms up and captures anew
    assert model.stack.cuda_graph_status.startswith("warming up (0 of")
    model(torch.randn(2, 3, 8, 8) if x is None else x).sum().backward()


def test_a_changed_rate_or_autocast_state_is_refused(stand_in):
    model = _captured("autograd", DROP)
    dropout = next(m for m in model.stack.modules() if isinstance(m, nn.Dropout))
    dropout.p = 0.5
    with pytest.raises(ValueError, match="dropout or drop-path rates"):
        model(torch.randn(2, 3, 8, 8))
    dropout.p = 0.1
    h = torch.randn(2, 4, 16, requires_grad=True)  # the stack's own input
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="autocast state"):
            model.stack(h, h)


def test_forward_twice_before_backward_and_backward_twice_are_refused(stand_in):
    model = _captured()
    loss = model(torch.randn(2, 3, 8, 8)).sum()
    with pytest.raises(RuntimeError, match="second training forward.*before the backward"):
        model(torch.randn(2, 3, 8, 8))
    del loss  # its graph is gone: nothing waits for the replay
    loss = model(torch.randn(2, 3, 8, 8)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()
    loss = model(torch.randn(2, 3, 8, 8)).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


def test_a_parameter_changed_before_backward_is_refused(stand_in):
    model = _captured()
    loss = model(torch.randn(2, 3, 8, 8)).sum()
    with torch.no_grad():
        model.stack.blocks[2].mlp.fc2.bias.add_(1.0)
    with pytest.raises(RuntimeError, match="'blocks.2.mlp.fc2.bias' was modified in place"):
        loss.backward()


def test_eval_no_grad_and_copies_run_eagerly(stand_in):
    model = _captured("pareprop")
    eager = copy.deepcopy(model)
    assert eager.stack.cuda_graphs and eager.stack.cuda_graph_status.startswith("warming up")
    x = torch.randn(4, 3, 8, 8)  # another batch size: eval and no_grad never replay
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    pareprop.set_engine(eager, "autograd", cuda_graphs=False)
    eager.eval()
    assert relative_error(out, eager(x).detach()) < TOL
    assert model.stack.cuda_graph_status.startswith("captured")
    assert "cuda_graphs=True" in repr(model.stack) and not eager.stack.cuda_graphs


def test_warm_up_starts_again_when_the_step_changes(stand_in):
    model = _vit()
    pareprop.set_engine(model, "reversible", cuda_graphs=True)
    model(torch.randn(3, 3, 8, 8)).sum().backward()
    assert model.stack.cuda_graph_status == f"warming up (1 of {graphs.WARMUP_STEPS} eager steps)"
    for _ in range(graphs.WARMUP_STEPS):  # another batch size: counted from the start
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert model.stack.cuda_graph_status.startswith("warming up")
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert model.stack.cuda_graph_status == "captured (inputs (2, 4, 16))"


def test_store_blocks_and_moves_capture_anew(stand_in):
    model = _captured()
    model.stack.store_blocks([1])
    assert model.stack.cuda_graph_status.startswith("warming up")
    model = _captured()
    model.float()
    assert model.stack.cuda_graph_status.startswith("warming up")


def test_the_fallback_does_not_measure_under_graphs(stand_in):
    model = _vit("pareprop")
    pareprop.set_engine(model, "pareprop", cuda_graphs=True)
    (state, why), = pareprop.schedule_reasons(model).values()
    assert state == "pareprop" and "CUDA graphs" in why
    assert pareprop.chosen_schedule(model) == "pareprop"


def test_auto_engine_measures_eagerly_then_captures(stand_in):
    model = _vit("reversible")
    pareprop.set_engine(model, "reversible", cuda_graphs=True)
    pareprop.set_engine(model, "auto", memory_budget=1.0, example_inputs=torch.randn(2, 3, 8, 8))
    assert model.stack.cuda_graphs and model.stack.cuda_graph_status.startswith("warming up")
    pareprop.set_engine(model, "reversible", cuda_graphs=False)
    assert model.stack.cuda_graph_status == "off"


# ---------------------------------------------------------------------------------------------
# The CUDA side's bookkeeping, with torch's CUDA objects faked: what runs only on a device is
# at least called as intended (names, order, restores) before a device session spends its time.


class _FakeState:
    def __init__(self, seed=0, offset=0):
        self.seed, self.offset = seed, offset


class _FakeGenerator:
    """The graph-safe surface of a CUDA generator: a pointer to a state."""

    def __init__(self, state=None):
        self.state = state if state is not None else _FakeState()

    def clone_state(self):
        return _FakeGenerator(_FakeState(self.state.seed, self.state.offset))

    def manual_seed(self, seed):
        self.state.seed, self.state.offset = seed, 0
        return self

    def graphsafe_get_state(self):
        return _FakeGenerator(self.state)

    def graphsafe_set_state(self, other):
        self.state = other.state

    def get_offset(self):
        return self.state.offset

    def set_offset(self, offset):
        self.state.offset = offset


def test_cuda_branch_streams_switch_and_restore_the_default_generator(monkeypatch):
    default = _FakeGenerator()
    original = default.state
    monkeypatch.setattr(torch.cuda, "default_generators", (default,), raising=False)
    rng = replay._CudaBranchRng(torch.device("cuda", 0), {(0, "f"): 7, (0, "g"): 8})
    assert [g.state.seed for g in rng.states("forward")] == [7, 8]
    assert [g.state.seed for g in rng.states("backward")] == [7, 8]
    assert {id(g.state) for g in rng.states("forward")}.isdisjoint(
        id(g.state) for g in rng.states("backward"))  # two states per branch, one seed
    with rng.forward(0, "g"):
        assert default.state is rng.forward_states[0, "g"].state
    assert default.state is original
    with rng.recompute(0, "f"):
        assert default.state is rng.backward_states[0, "f"].state
    assert default.state is original
    rng.forward_states[0, "f"].set_offset(12)  # what a forward replay advanced it by
    rng.step_begin()
    assert rng.backward_states[0, "f"].get_offset() == 12


def test_cuda_capture_registers_the_streams_first(monkeypatch):
    events = []

    class FakeGraph:
        def register_generator_state(self, state):
            events.append(("register", state))

    class FakeCapture:
        def __init__(self, graph, pool=None):
            events.append(("capture", pool))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append(("end",))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(graphs, "_side_stream", lambda device: events.append(("side",)))
    backend = graphs._CudaGraphs(torch.device("cuda", 0))
    backend.capture(lambda: events.append(("run",)), ["s1"])
    assert events == [("register", "s1"), ("side",), ("capture", "pool"), ("run",), ("end",)]


def test_this_torch_has_the_graph_api_the_cuda_side_calls():
    missing = [f"{o.__name__}.{n}" for o, n in graphs._GRAPH_API if not hasattr(o, n)]
    assert not missing
    for name in ("graph", "graph_pool_handle", "default_generators"):
        assert hasattr(torch.cuda, name)


def test_the_memory_dial_measures_eagerly_then_graphs_are_on(stand_in):
    # engine="auto" measures blocks with eager steps: graphs are off while it does, and on
    # again afterwards, as asked (or as the stacks had them).
    model = _vit("reversible")
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    pareprop.set_engine(model, "reversible", cuda_graphs=True)
    pareprop.set_engine(model, "auto", memory_budget=0.5, example_inputs=(x,))
    assert model.memory_plan is not None
    assert all(s.cuda_graphs and s.cuda_graph_status.startswith("warming up")
               for s in _stacks(model))
    pareprop.set_engine(model, "auto", memory_budget=0.5, example_inputs=(x,), cuda_graphs=False)
    assert not any(s.cuda_graphs for s in _stacks(model))


# ---------------------------------------------------------------------------------------------
# The CUDA backend's own capture code on the CPU (torch.cuda's graph objects faked, a replay
# runs the step again as the stand-in's does): compiled F and G, and DDP, under graphs.


class _FakeCudaGraph:
    def register_generator_state(self, state):
        pass


class _FakeCapture:  # torch.cuda.graph(graph, pool=...)
    def __init__(self, graph, pool=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class _CudaCodeOnTheCpu(graphs._CudaGraphs):
    def branch_rng(self, seeds):
        return replay._CpuBranchRng(seeds)

    def capture(self, fn, states):
        graph = super().capture(fn, states)
        graph.replay = fn
        return graph


@pytest.fixture
def cuda_code_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeCudaGraph)
    monkeypatch.setattr(torch.cuda, "graph", _FakeCapture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(graphs, "_side_stream", lambda device: None)
    monkeypatch.setattr(graphs, "backend_for", _CudaCodeOnTheCpu)


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_every_graphed_branch_call_sees_one_weight_cache_state(cuda_code_on_the_cpu, engine,
                                                                monkeypatch):
    # NOTE [ Autocast's weight cache under CUDA graphs ]: the capture turns the cache off, so
    # warm-up forwards and recomputations (on this thread, on the CPU) must run with it off
    # too, or compiled F and G, guarded on it, compile again inside the capture.
    seen = []
    for name in ("f", "g"):
        real = getattr(RevViTBlock, name)

        def spy(self, x, *args, real=real, **kwargs):
            seen.append(torch.is_autocast_cache_enabled())
            return real(self, x, *args, **kwargs)

        monkeypatch.setattr(RevViTBlock, name, spy)
    model = _vit(engine)
    pareprop.set_engine(model, engine, cuda_graphs=True)
    for _ in range(graphs.WARMUP_STEPS + 2):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        assert torch.is_autocast_cache_enabled()  # the caller's state, given back
    assert model.stack.cuda_graph_status.startswith("captured")
    assert seen and set(seen) == {False}, str(seen)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5),
                    reason="compile_blocks needs torch >= 2.5")
@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_compiled_blocks_compile_nothing_in_the_capture(cuda_code_on_the_cpu, engine):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    reference, graphed = _vit(), pareprop.compile_blocks(_vit(engine), backend="eager")
    pareprop.set_engine(graphed, engine, cuda_graphs=True)
    compiled = []
    for step, (ref, got) in enumerate(_steps([reference, graphed], (3, 8, 8))):
        name, err = _worst(got, ref)
        assert err < TOL, f"step {step}: {name} off by {err:.3e}"
        compiled.append(counters["stats"]["unique_graphs"])
    assert graphed.stack.cuda_graph_status.startswith("captured")
    # compiled in warm-up (forward, and recomputation's graphs), then never again
    assert compiled[0] > 0 and compiled[graphs.WARMUP_STEPS - 1:] == [compiled[0]] * (
        len(compiled) - graphs.WARMUP_STEPS + 1), compiled
    torch._dynamo.reset()


class _CaptureWatch(graphs._EagerStandIn):
    """The stand-in, noting every node that ``torch.autograd.grad`` is asked for a gradient
    at while a capture runs."""

    def __init__(self, asked):
        self.asked = asked

    def capture(self, fn, states):
        real = torch.autograd.grad

        def watched(outputs, inputs, *args, **kwargs):
            inputs = [inputs] if isinstance(inputs, torch.Tensor) else inputs
            self.asked.extend(torch.autograd.graph.get_gradient_edge(t).node for t in inputs)
            return real(outputs, inputs, *args, **kwargs)

        torch.autograd.grad = watched
        try:
            return super().capture(fn, states)
        finally:
            torch.autograd.grad = real


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_ddp_replays_and_its_reducer_nodes_stay_out_of_the_capture(engine, tmp_path,
                                                                   monkeypatch):
    # NOTE [ Parameter aliases in a capture ]: DDP's reducer holds each parameter's
    # AccumulateGrad node, made on the default stream; autograd.grad inside a capture must not
    # end at one. And the gradients of every replay reach DDP's reduction, as eager ones do.
    import torch.distributed as tdist

    from pareprop.distributed import wrap_ddp

    asked = []
    monkeypatch.setattr(graphs, "backend_for", lambda device: _CaptureWatch(asked))
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                             world_size=1)
    try:
        reference, model = _vit(), _vit(engine)
        pareprop.set_engine(model, engine, cuda_graphs=True)
        net = wrap_ddp(model)
        reduced = []

        def count(state, bucket):
            reduced.append(len(bucket.parameters()))
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        net.register_comm_hook(None, count)
        held = [torch.autograd.graph.get_gradient_edge(p).node for p in model.parameters()]
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (reference, model)]
        for step in range(graphs.WARMUP_STEPS + 3):
            x = torch.randn(2, 3, 8, 8)
            reduced.clear()
            for run, opt in ((reference, opts[0]), (net, opts[1])):
                opt.zero_grad(set_to_none=True)
                run(x).pow(2).sum().backward()
            assert sum(reduced) == len(held), f"step {step}: DDP reduced {reduced}"
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                assert relative_error(p.grad, r.grad) < TOL, f"step {step}: {name}"
            for opt in opts:
                opt.step()
        assert model.stack.cuda_graph_status.startswith("captured")
        met = sum(node is h for node in asked for h in held)
        assert asked and not met, f"autograd.grad in the capture met {met} of DDP's nodes"
    finally:
        tdist.destroy_process_group()
