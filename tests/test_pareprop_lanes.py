"""PaReprop's lanes on the CPU: which lane each block's steps are queued on, the events each step
waits for, the parameter aliases of recomputed blocks, and the fallback to Reprop driven by an
injected clock. On the CPU both lanes run in program order, but the bookkeeping is the same
code as on a GPU (NOTE [ PaReprop on two CUDA streams ] in engine/backward.py)."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop import engine as engine_module
from pareprop.engine import MAIN_LANE, SIDE_LANE, backward, function
from pareprop.engine import fallback as schedule_module
from pareprop.engine import lanes as lanes_module
from pareprop.engine.lanes import _block_lanes
from pareprop.engine.testing import relative_error

DIM = 6
M, S = MAIN_LANE, SIDE_LANE


class Block(pareprop.ReversibleBlock):
    def __init__(self, dim=DIM, drop=0.2):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(drop)

    def f(self, x, **kwargs):
        return self.drop(self.proj(self.norm1(x)))

    def g(self, x, **kwargs):
        return self.drop(self.mlp(self.norm2(x)))

    def f_split(self, x, **kwargs):  # declared, and None: whole branches, chunked schedule
        return None


class Model(nn.Module):
    def __init__(self, depth, engine="pareprop", drop=0.2):
        super().__init__()
        self.stack = pareprop.ReversibleStack([Block(drop=drop) for _ in range(depth)], engine)

    def forward(self, x):
        return torch.cat(self.stack(x, x), dim=-1)


pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py


@pytest.mark.parametrize("stored, lanes", [
    ((False,) * 5, [M, S, M, S, M]),
    ((False,) * 4, [S, M, S, M]),
    ((True, True, True), [M, M, M]),
    ((False, True, False, False), [S, M, S, M]),
    ((False, False, True, False), [M, S, M, S]),
    ((True, False, False, True), [M, S, M, M]),  # an even run between two stored blocks
    ((False, True, False, True, False, False), [S, M, S, M, S, M]),
])
def test_block_lanes(stored, lanes):
    assert _block_lanes(stored) == lanes


def _runs(stored):
    """(bottom, top) of each run of recomputed blocks."""
    runs, i = [], 0
    while i < len(stored):
        if stored[i]:
            i += 1
            continue
        bottom = i
        while i < len(stored) and not stored[i]:
            i += 1
        runs.append((bottom, i - 1))
    return runs


@pytest.mark.parametrize("depth", range(1, 9))
def test_block_lanes_put_stored_blocks_on_main_and_alternate_around_them(depth):
    for mask in range(2**depth):
        stored = [bool(mask >> i & 1) for i in range(depth)]
        lanes = _block_lanes(stored)
        assert all(lane == MAIN_LANE for lane, s in zip(lanes, stored) if s)
        # Neighbours share a lane, unless both are stored, only once in each run of an even
        # number of recomputed blocks between two stored ones: the fewest possible.
        same = sum(lanes[i] == lanes[i + 1] and not (stored[i] and stored[i + 1])
                   for i in range(depth - 1))
        unavoidable = sum(1 for bottom, top in _runs(stored)
                          if bottom > 0 and top < depth - 1 and (top - bottom) % 2 == 1)
        assert same == unavoidable, (stored, lanes)


def _trace_schedule(monkeypatch, model, x):
    """Runs one step, logging every recover / grads with its lane, every event marked and every
    wait: the events are named after the step queued just before the mark."""
    log = []
    recover, grads = backward._recover, backward._grads

    def logged_recover(plan, index, *args):
        log.append(("recover", index, engine_module.current_lane()))
        return recover(plan, index, *args)

    def logged_grads(plan, index, *args):
        log.append(("grads", index, engine_module.current_lane()))
        return grads(plan, index, *args)

    def mark(self, block_index):
        return log[-1][:2]

    def wait(self, block_index, event, name):
        if event is not None:
            log.append(("wait", block_index, event))

    monkeypatch.setattr(backward, "_recover", logged_recover)
    monkeypatch.setattr(backward, "_grads", logged_grads)
    monkeypatch.setattr(lanes_module._Lanes, "mark", mark)
    monkeypatch.setattr(lanes_module._Lanes, "wait", wait)
    model(x).pow(2).sum().backward()
    return log


@pytest.mark.parametrize("stored", [(), (1,), (1, 2), (0, 3), (2, 3, 4)])
def test_each_step_runs_on_its_blocks_lane_after_the_step_before(monkeypatch, stored):
    depth = 5
    model = Model(depth)
    model.stack.store_blocks(stored)
    lanes = _block_lanes([i in stored for i in range(depth)])
    log = _trace_schedule(monkeypatch, model, torch.randn(2, 3, DIM))
    steps = [e for e in log if e[0] != "wait"]
    assert [(kind, i) for kind, i, _ in steps] == [
        ("recover", 4), ("recover", 3), ("grads", 4), ("recover", 2), ("grads", 3),
        ("recover", 1), ("grads", 2), ("recover", 0), ("grads", 1), ("grads", 0)]
    for _, index, lane in steps:
        assert lane == lanes[index]
    # NOTE [ Tensor lifetimes across streams ]: recover(k) waits for recover(k+1) and for
    # grads(k+2); grads(k) waits for grads(k+1).
    for position, (kind, index, _) in enumerate(log):
        if kind == "wait":
            continue
        waits = set()
        for earlier in reversed(log[:position]):
            if earlier[0] != "wait":
                break
            assert earlier[1] == index  # a step's waits are on its own lane
            waits.add(earlier[2])
        if kind == "recover" and index < depth - 1:
            want = {("recover", index + 1)} | ({("grads", index + 2)} if index + 2 < depth
                                               else set())
        elif kind == "grads" and index < depth - 1:
            want = {("grads", index + 1)}
        else:
            want = set()
        assert waits == want, (kind, index, waits)


def _accumulate_grad_variables(graph_root):
    """The leaves (variables of AccumulateGrad nodes) a graph ends in."""
    seen, found, todo = set(), [], [graph_root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("stored", [(), (1,)])
def test_recomputed_blocks_differentiate_parameter_aliases(monkeypatch, stored):
    # NOTE [ Parameter aliases on the lanes ]: no rebuilt graph may end in a parameter's own
    # AccumulateGrad, which the Function keeps on the main stream.
    model = Model(3, drop=0.0)
    model.stack.store_blocks(stored)
    real = {id(p) for p in model.parameters()}
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    checked = []
    grads = backward._grads

    def checking_grads(plan, index, rebuilt, *args):
        leaves = [v for out in (rebuilt.f_out, rebuilt.g_out)
                  for v in _accumulate_grad_variables(out.grad_fn)]
        params = [v for v in leaves if v.untyped_storage().data_ptr() in storages]
        assert params, "the block's graphs reach no parameter"
        if plan.stored[index]:
            assert all(id(v) in real for v in params)
        else:
            assert not any(id(v) in real for v in params)
        checked.append(index)
        return grads(plan, index, rebuilt, *args)

    monkeypatch.setattr(backward, "_grads", checking_grads)
    x = torch.randn(2, 3, DIM)
    model(x).pow(2).sum().backward()
    assert checked == [2, 1, 0]
    # The modules hold their parameters again, and the gradients are autograd's.
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert {id(p) for p in model.parameters()} == real
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.stack.set_engine("autograd")
    model(x).pow(2).sum().backward()
    assert max(relative_error(a, p.grad) for a, p in zip(got, model.parameters())) < 1e-10


# -- the fallback to Reprop (NOTE [ PaReprop's fallback to Reprop ] in engine/fallback.py) --


class FakeClock:
    """A clock the schedules advance: PaReprop's backward takes ``pareprop_ms``, Reprop's
    ``reversible_ms``; results are ready once ``ready`` is True."""

    def __init__(self, pareprop_ms, reversible_ms, pareprop_retries=0):
        self.now, self.retries, self.ready = 0.0, 0, True
        self.cost = {"pareprop": pareprop_ms, "reversible": reversible_ms}
        self.pareprop_retries = pareprop_retries
        self.ran = []

    def mark(self):
        return self.now

    def elapsed_ms(self, start, end):
        return end - start if self.ready else None

    def alloc_retries(self):
        return self.retries

    def run(self, schedule):
        self.ran.append(schedule)
        self.now += self.cost[schedule]
        if schedule == "pareprop":
            self.retries += self.pareprop_retries


@pytest.fixture
def clock(monkeypatch, request):
    fake = FakeClock(*request.param)
    monkeypatch.setattr(schedule_module, "clock_for", lambda device: fake)
    pareprop_backward = function._backward_pareprop
    in_order = function._backward_in_order

    def timed_pareprop(*args):
        fake.run("pareprop")
        return pareprop_backward(*args)

    def timed_in_order(*args):
        fake.run("reversible")
        return in_order(*args)

    monkeypatch.setattr(function, "_backward_pareprop", timed_pareprop)
    monkeypatch.setattr(function, "_backward_in_order", timed_in_order)
    return fake


def _steps(model, x, n):
    grads = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _reference_grads(model, x):
    reference = copy.deepcopy(model)
    pareprop.set_engine(reference, "autograd")
    reference.zero_grad(set_to_none=True)
    reference(x).pow(2).sum().backward()
    return [p.grad for p in reference.parameters()]


PASSES = 2 * (schedule_module.PaRepropFallback.WARMUP + schedule_module.PaRepropFallback.TRIALS)


@pytest.mark.parametrize("clock", [(10.0, 7.0)], indirect=True)
def test_slower_pareprop_falls_back_to_reprop_once_with_exact_gradients(clock, caplog):
    model = Model(4, drop=0.0)
    pareprop.set_engine(model, "pareprop")
    x = torch.randn(2, 3, DIM)
    reference = _reference_grads(model, x)
    assert pareprop.chosen_schedule(model) == "measuring"
    with caplog.at_level(logging.INFO, logger="pareprop"):
        grads = _steps(model, x, PASSES + 3)
    assert clock.ran == ["pareprop", "reversible"] * (PASSES // 2) + ["reversible"] * 3
    assert pareprop.chosen_schedule(model) == "reversible"
    records = [r for r in caplog.records if r.name == "pareprop"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "stack stack (4 Block blocks)" in message
    assert "PaReprop 10.000 ms, Reprop 7.000 ms" in message
    for step in grads:  # identical whichever schedule ran
        assert max(relative_error(a, b) for a, b in zip(step, reference)) < 1e-10


@pytest.mark.parametrize("clock", [(7.0, 10.0)], indirect=True)
def test_faster_pareprop_is_kept_and_logged_once(clock, caplog):
    model = Model(3, drop=0.0)
    x = torch.randn(2, 3, DIM)
    with caplog.at_level(logging.INFO, logger="pareprop"):
        _steps(model, x, PASSES + 2)
        _steps(model, x, 2)
    assert clock.ran[PASSES:] == ["pareprop"] * 4
    assert pareprop.chosen_schedule(model) == "pareprop"
    records = [r for r in caplog.records if r.name == "pareprop"]
    assert len(records) == 1 and records[0].levelno == logging.INFO


@pytest.mark.parametrize("clock", [(7.0, 10.0, 1)], indirect=True)
def test_allocator_retries_under_pareprop_choose_reprop(clock):
    model = Model(3, drop=0.0)
    _steps(model, torch.randn(2, 3, DIM), PASSES + 1)
    assert pareprop.chosen_schedule(model) == "reversible"
    assert clock.ran[-1] == "reversible"


@pytest.mark.parametrize("clock", [(10.0, 7.0)], indirect=True)
def test_the_choice_waits_for_the_device_without_blocking(clock):
    model = Model(3, drop=0.0)
    x = torch.randn(2, 3, DIM)
    clock.ready = False  # the device has not reached the timed passes' end events
    _steps(model, x, PASSES + 2)
    assert clock.ran[PASSES:] == ["pareprop"] * 2  # PaReprop meanwhile
    assert pareprop.chosen_schedule(model) == "measuring"
    clock.ready = True
    assert pareprop.chosen_schedule(model) == "reversible"  # read without another step
    _steps(model, x, 1)
    assert clock.ran[-1] == "reversible"


@pytest.mark.parametrize("clock", [(10.0, 7.0)], indirect=True)
def test_fallback_off_always_runs_pareprop(clock):
    model = Model(3, drop=0.0)
    pareprop.set_engine(model, "pareprop", fallback=False)
    assert pareprop.chosen_schedule(model) == "pareprop"
    _steps(model, torch.randn(2, 3, DIM), PASSES + 2)
    assert clock.ran == ["pareprop"] * (PASSES + 2)
    assert pareprop.chosen_schedule(model) == "pareprop"
    pareprop.set_engine(model, "pareprop", fallback=True)  # measures again
    assert pareprop.chosen_schedule(model) == "measuring"


@pytest.mark.parametrize("clock", [(10.0, 7.0)], indirect=True)
def test_setting_the_engine_stored_blocks_or_dtype_measures_again(clock):
    model = Model(3, drop=0.0)
    x = torch.randn(2, 3, DIM)
    _steps(model, x, PASSES + 1)
    assert pareprop.chosen_schedule(model) == "reversible"
    model.stack.store_blocks([1])
    assert pareprop.chosen_schedule(model) == "measuring"
    _steps(model, x, PASSES + 1)
    pareprop.set_engine(model, "pareprop")
    assert pareprop.chosen_schedule(model) == "measuring"
    _steps(model, x, PASSES + 1)
    model.float()  # another dtype (or device)
    assert pareprop.chosen_schedule(model) == "measuring"


@pytest.mark.parametrize("clock", [(10.0, 7.0)], indirect=True)
def test_a_model_measuring_can_be_deep_copied(clock):
    model = Model(3, drop=0.0)
    _steps(model, torch.randn(2, 3, DIM), 3)
    twin = copy.deepcopy(model)
    assert twin.stack._fallback.passes == 0 and twin.stack._fallback.enabled


def test_chosen_schedule_on_the_cpu_and_without_pareprop():
    model = Model(2)
    assert pareprop.chosen_schedule(model) == "pareprop"  # program order: nothing to measure
    model(torch.randn(2, 3, DIM)).sum().backward()
    assert pareprop.chosen_schedule(model) == "pareprop"
    pareprop.set_engine(model, "reversible")
    assert pareprop.chosen_schedule(model) is None
    with pytest.raises(TypeError, match="fallback must be True, False or None"):
        pareprop.set_engine(model, "pareprop", fallback="no")
