"""The storage counter of plans and CPU reports (NOTE [ Counting storages ] in memory/measure.py)
and the floor a plan reports (NOTE [ The floor of a reversible step ] in memory/step.py)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from pareprop.engine import chunk_cost, recompute
from pareprop.engine import chunked as engine_chunked
from pareprop.memory import measure, plan_memory
from pareprop.memory.step import create_optimizer_state, make_optimizer, run_step
from test_memory import FAMILIES, _real

SLOW = pytest.mark.slow


def test_it_counts_each_storage_once_until_freed():
    tracker = measure.StepPeakTracker()
    kept = torch.zeros(250)  # 1000 bytes before the step
    tracker.track_external(kept, [kept.view(25, 10)])  # a view: the same storage
    assert tracker.current == tracker.peak == 1000
    with tracker:
        a = kept + 1  # 1000 new bytes
        b = a.view(10, 25)  # no new storage
        c, d = torch.ones(50, dtype=torch.float64).split(25)  # one storage of 400 bytes
        assert tracker.current == 2400
        del a, c
        assert tracker.current == 2400  # b and d keep their storages
        del b
        assert tracker.current == 1400
        d.untyped_storage().resize_(800)  # outside the dispatcher, followed
        assert tracker.current == 1800
        del d
        e = torch.empty(100, dtype=torch.uint8)
        assert tracker.current == 1100
    assert tracker.peak == 2400
    assert torch.UntypedStorage.resize_ is tracker._orig_resize  # put back
    del e
    with pytest.raises(TypeError, match="modules, optimizers or tensors"):
        tracker.track_external("weights")


def _memtracker_peak(name, batch, chunk_bytes, **kw):
    """The plan's peak counted by torch's MemTracker, as plans counted before (step peak only)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class StepPeak(MemTracker):
        def _update_peak_stats(self, peak_state):
            for dev, snap in self._curr_mem_snap.items():
                self._peak_mem[dev] = max(self._peak_mem.get(dev, 0), snap[_TOTAL_KEY])

        @property
        def peak(self):
            return sum(self._peak_mem.values())

    made = measure._step_tracker
    measure._step_tracker = StepPeak
    try:
        return plan_memory(name, batch, "reversible", chunk_bytes=chunk_bytes, **kw).peak
    finally:
        measure._step_tracker = made


@pytest.mark.parametrize("name", ["rev_vit_tiny_patch4_32",
                                  pytest.param("rev_swin_tiny_32", marks=SLOW),
                                  pytest.param("rev_mvitv2_tiny_32", marks=SLOW)])
def test_it_counts_what_memtracker_counts_but_what_memtracker_s_hooks_keep(name, monkeypatch):
    # Whole branches: the same peak to the byte. In chunks, where each plan measures its
    # chunks' costs (no sharing here), MemTracker's module hooks keep the measured graphs for
    # the rest of the step (NOTE [ Counting storages ]): it counts more, never less.
    monkeypatch.setattr(chunk_cost, "planned_cost", lambda module, key, measure: measure())
    for module in (engine_chunked, recompute):
        monkeypatch.setattr(module, "planned_cost", chunk_cost.planned_cost)
    kw = dict(device="cpu", num_classes=10, grad_checkpointing=name != "rev_vit_tiny_patch4_32",
              **FAMILIES[name])
    whole = plan_memory(name, 6, "reversible", **kw).peak
    assert whole == _memtracker_peak(name, 6, None, **kw)
    chunked = plan_memory(name, 6, "reversible", chunk_bytes=16 * 2**10, **kw).peak
    assert chunked < _memtracker_peak(name, 6, 16 * 2**10, **kw)


def _allocator_peak(step, path):
    """The most bytes the CPU allocator held at once above what it held before ``step()``:
    its allocation and free events (torch.profiler, profile_memory), summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    events = sorted((e["ts"], e["args"]["Bytes"]) for e in trace if e.get("name") == "[memory]")
    assert len(events) > 1000  # every allocation of the step
    current = peak = 0
    for _, change in events:
        current += change
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("name", ["rev_swin_tiny_32",
                                  pytest.param("rev_mvitv2_tiny_32", marks=SLOW)])
def test_a_real_chunked_step_counts_what_the_cpu_allocator_holds(name, tmp_path):
    # The counter against the allocator's own events, with no hook installed: within 1% (the
    # allocator also holds kernels' scratch memory, which no operator returns, and events of
    # one microsecond have no order). MemTracker counted 2-3% more on these steps.
    real = _real(name, "reversible", 6, chunk_bytes=16 * 2**10, grad_checkpointing=True,
                 **dict(FAMILIES[name]))
    torch.manual_seed(0)
    from pareprop.catalog import ModelRequest, build_model, example_inputs
    from pareprop.engine import set_chunking

    request = ModelRequest(model=name, engine="reversible", num_classes=10,
                           grad_checkpointing=True)
    request.overrides = dict(FAMILIES[name])
    model = build_model(request)
    set_chunking(model, max_bytes=16 * 2**10)
    inputs = example_inputs(model, request, 6)
    measure.apply_engine(model, "reversible")
    model.train()
    opt = make_optimizer(model, "adamw")
    create_optimizer_state(model, opt)
    resident = real.parameters + real.optimizer_state + real.inputs
    step = lambda: run_step(model, inputs, opt, None)  # noqa: E731
    allocated = resident + _allocator_peak(step, tmp_path / "trace.json")
    assert real.peak == pytest.approx(allocated, rel=0.01)


@pytest.mark.slow
def test_a_plan_does_not_depend_on_the_collector(monkeypatch):
    # NOTE [ A count that does not depend on the collector ]: the counted step runs with the
    # collector off; with it on and running every 20 allocations, the same plan.
    kw = dict(device="cpu", num_classes=10, chunk_bytes=16 * 2**10, grad_checkpointing=True,
              **FAMILIES["rev_swin_tiny_32"])
    was = gc.isenabled()
    plan = plan_memory("rev_swin_tiny_32", 6, "reversible", **kw)
    assert gc.isenabled() == was  # put back as found
    monkeypatch.setattr(measure.gc, "disable", lambda: None)
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()  # only the step's own objects are scanned: frequent collections stay cheap
    gc.set_threshold(20, 1, 1)
    try:
        collected = plan_memory("rev_swin_tiny_32", 6, "reversible", **kw)
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
    assert collected.to_dict() == plan.to_dict()


def test_the_floor_is_under_the_peak_where_everything_chunks():
    # Rev-ViT in chunks, its head chunked too: a block's backward holds six stream maps (NOTE
    # [ The floor of a reversible step ]); with eight counted the floor was above the peak.
    plan = plan_memory("rev_vit_tiny_patch4_32", 64, "reversible", device="cpu",
                       num_classes=10, chunk_bytes=16 * 2**10, amp="bf16")
    fixed = plan.parameters + plan.gradients + plan.optimizer_state + plan.inputs
    stream = (plan.floor - fixed) // 6
    assert stream == 64 * 64 * 192 * 4  # one float32 stream map of the stack
    assert plan.floor <= plan.peak < fixed + 8 * stream
