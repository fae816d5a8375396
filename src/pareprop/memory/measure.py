"""``memory_report``: the memory of one real training step, broken down.

NOTE [ Counting a real step's peak ]
    On CUDA the peak is the caching allocator's own count: ``torch.cuda.max_memory_allocated``
    after ``reset_peak_memory_stats``, taken relative to what was allocated before the step
    plus the bytes of the model, optimizer state and inputs, so tensors of other work on the
    device do not count. The CPU allocator keeps no peak, and the profiler's CPU memory events
    attribute allocations to operators rather than giving a time line we could sum; so on the
    CPU :class:`StepPeakTracker` (a ``TorchDispatchMode`` that sees every storage an operator
    creates, and its release through a weak reference; NOTE [ Counting storages ]) counts the
    real tensors. That is the same counter :func:`pareprop.plan_memory` uses under
    ``FakeTensorMode``; what the CPU test of the two checks is that the fake trace allocates
    and frees what the real step does.
"""

from __future__ import annotations

import gc
import weakref
from functools import partial
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from pareprop.engine import set_block_checkpointing, set_stack_engine, stacks_of
from pareprop.engine.chunk_cost import measuring
from pareprop.memory.report import MemoryReport
from pareprop.memory.step import (
    amp_dtype,
    amp_label,
    create_optimizer_state,
    make_optimizer,
    run_step,
    state_tensors,
    unique_bytes,
)

__all__ = ["memory_report", "apply_engine", "StepPeakTracker"]


def apply_engine(model: nn.Module, engine: Optional[str]) -> None:
    """Put ``model`` on ``engine``: a reversible engine, ``plain`` or ``checkpointed`` (timm's
    ``set_grad_checkpointing()``; for a model with reversible stacks, the autograd engine with
    each block checkpointed, :func:`pareprop.engine.set_block_checkpointing`)."""
    if engine is None or engine == "plain":
        return
    stacks = bool(stacks_of(model))
    if engine == "checkpointed":
        if stacks:
            set_stack_engine(model, "autograd")
            set_block_checkpointing(model, True)
        if hasattr(model, "set_grad_checkpointing"):  # timm's blocks, or the transitions
            model.set_grad_checkpointing(True)
        elif not stacks:
            raise ValueError(f"engine 'checkpointed' needs set_grad_checkpointing(); "
                             f"{type(model).__name__} has none")
        return
    set_block_checkpointing(model, False)
    set_stack_engine(model, engine)


# NOTE [ Counting storages ]
#     A step's peak on the CPU (real tensors, ``memory_report``) and in a plan (fake tensors,
#     ``plan_memory``) is counted by :class:`StepPeakTracker`, a ``TorchDispatchMode`` that
#     sees every operator's outputs: each storage is counted once, from the first operator
#     that returns it, until it is freed (a weak reference's callback). What exists before
#     the step (parameters, their gradients, buffers, optimizer state, inputs) is counted from
#     the start. torch's ``MemTracker`` does the same but also keeps per-module statistics
#     through ``ModTracker``: hooks on every module call, and gradient hooks on the inputs and
#     outputs of each, whose closures hold the inputs' autograd nodes while the nodes hold the
#     hooks, a cycle through C++ that no collector frees. That bookkeeping costs a large share
#     of a plan's time, and its hooks keep alive, for the rest of the step, the graphs built to
#     measure a chunk's cost (NOTE [ Measuring a chunk's graph ] in engine/chunk_cost.py),
#     which are never differentiated, so plans in chunks would count more than the step holds.
#     This tracker counts within a fraction of a percent of the CPU allocator's own events
#     (``torch.profiler`` with ``profile_memory``, summed in time order; nothing hooked;
#     tests/test_step_tracker.py); the figures are in BENCHMARKS.md ("Measurements behind the
#     design"). Steps without chunks count the same either way.
#     ``UntypedStorage.resize_`` bypasses the dispatcher, so it is wrapped while the tracker
#     runs, as ``MemTracker`` does. What is made while a chunk's cost is measured (a step
#     of training after the first does not measure) is left out, and counted from the
#     measurement's end if it outlives it (NOTE [ Chunk costs while planning ] in
#     engine/chunk_cost.py).
class StepPeakTracker(TorchDispatchMode):
    """The current and peak bytes of every storage alive during a step (NOTE [ Counting
    storages ]). ``track_external`` what exists before the step, then run it inside
    ``with tracker:``; ``peak`` is the most bytes alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: Dict[int, list] = {}  # id(storage) -> [weak reference, bytes counted]
        self._aside: Dict[int, list] = {}  # made while a chunk's cost was measured
        self._orig_resize = None

    def track_external(self, *objects: Any) -> None:
        """Count what exists before the step: modules (parameters, their gradients,
        buffers), optimizers (their state) and tensors (or sequences of them)."""
        for obj in objects:
            if isinstance(obj, torch.Tensor):
                self.track(obj)
            elif isinstance(obj, nn.Module):
                for p in obj.parameters():
                    self.track(p)
                    if p.grad is not None:
                        self.track(p.grad)
                for b in obj.buffers():
                    self.track(b)
            elif isinstance(obj, torch.optim.Optimizer):
                for t in state_tensors(obj):
                    self.track(t)
            elif isinstance(obj, (tuple, list)):
                self.track_external(*obj)
            elif obj is not None:
                raise TypeError(f"expected modules, optimizers or tensors to track, got "
                                f"{type(obj).__name__}")
        self.peak = max(self.peak, self.current)

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage unless it is counted; follow a change of its size. While a
        chunk's cost is measured, a new storage is set aside, and counted only if it outlives
        the measurement (NOTE [ Chunk costs while planning ] in engine/chunk_cost.py)."""
        st = t.untyped_storage()
        key = id(st)
        entry = self._sizes.get(key)
        if entry is None:
            if measuring():
                if key not in self._aside:
                    self._aside[key] = [weakref.ref(st, partial(self._dropped, key)), st.nbytes()]
                return
            size = st.nbytes()
            self._sizes[key] = [weakref.ref(st, partial(self._freed, key)), size]
            self.current += size
        elif entry[1] != st.nbytes():
            self.current += st.nbytes() - entry[1]
            entry[1] = st.nbytes()

    def _freed(self, key: int, ref: Any) -> None:
        entry = self._sizes.get(key)
        if entry is not None and entry[0] is ref:
            del self._sizes[key]
            self.current -= entry[1]

    def _dropped(self, key: int, ref: Any) -> None:
        entry = self._aside.get(key)
        if entry is not None and entry[0] is ref:
            del self._aside[key]

    def _count_aside(self) -> None:
        """Count what a measurement made and left alive, from now on."""
        for key, (ref, _) in list(self._aside.items()):
            st = ref()
            del self._aside[key]
            if st is not None and key not in self._sizes:
                self._sizes[key] = [weakref.ref(st, partial(self._freed, key)), st.nbytes()]
                self.current += st.nbytes()

    def _outputs(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.track(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._outputs(item)

    def _new_peak(self) -> None:
        """Called when the step reaches a new peak (a hook for tools that describe it)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._aside and not measuring():
            self._count_aside()
        self._outputs(out)
        if self.current > self.peak:
            self.peak = self.current
            self._new_peak()
        return out

    def __enter__(self) -> "StepPeakTracker":
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            entry = self._sizes.get(id(st))
            if entry is not None and entry[1] != st.nbytes():
                self.current += st.nbytes() - entry[1]
                entry[1] = st.nbytes()
                self.peak = max(self.peak, self.current)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        if self._aside and not measuring():
            self._count_aside()
            self.peak = max(self.peak, self.current)
        super().__exit__(*exc)


# NOTE [ A count that does not depend on the collector ]
#     A storage that the step leaves in a reference cycle is freed when Python's cyclic
#     collector next runs, and when that is depends on everything the process allocated
#     before: the same plan made after other plans, or alone, could count it for a different
#     stretch of the step, and plans would move from run to run (BENCHMARKS.md,
#     "Measurements behind the design"). The steps planned here leave no such cycle (NOTE
#     [ Measuring a chunk's graph ] in chunk_cost.py); so that none can come back unseen, the
#     counted step runs with the collector off: a storage is freed when its last
#     reference goes, and a plan is a function of its inputs. The steps planned here leave no
#     storage to the collector (tests/test_memory.py lets it run every few allocations and
#     finds the same plan), so nothing is counted longer than the step keeps it.
def _step_tracker() -> StepPeakTracker:
    return StepPeakTracker()


def tracked_peak(model: nn.Module, inputs: Sequence[torch.Tensor], optimizer: Any,
                 dtype: Optional[torch.dtype]) -> tuple:
    """Run the step under :class:`StepPeakTracker`, without the cyclic garbage collector
    (NOTE [ A count that does not depend on the collector ]); (counts, peak bytes)."""
    tracker = _step_tracker()
    tracker.track_external(model, *inputs)
    if optimizer is not None:
        tracker.track_external(optimizer)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with tracker:
            counts = run_step(model, inputs, optimizer, dtype)
    finally:
        if collecting:
            gc.enable()
    return counts, int(tracker.peak)


def memory_report(
    model: nn.Module,
    inputs: Any,
    engine: Optional[str] = None,
    optimizer: str = "adamw",
    amp: Any = None,
) -> MemoryReport:
    """Measure one full training step (forward, loss, backward, optimizer step) on real tensors.

    The optimizer's state is created first (as after a first step), so the step measured is
    what every step of training costs. The model's parameters are changed by that step.

    Args:
        model: a model in training mode, on its device (its outputs, or their first element
            or ``"logits"``, are the logits of a cross-entropy loss).
        inputs: a tensor or a tuple of tensors for ``model(*inputs)``.
        engine: ``autograd``, ``reversible``, ``pareprop``, ``plain`` or ``checkpointed``
            (see :func:`apply_engine`); ``None`` keeps the model's.
        optimizer: ``adamw`` (default), ``adam``, ``sgd`` (momentum) or ``none``.
        amp: ``None``/``"none"``, ``"bf16"``, ``"fp16"`` or a dtype: autocast of the forward.

    Returns:
        A :class:`MemoryReport`.

    Example:
        ``print(pareprop.memory_report(model, images, engine="reversible").table())``
    """
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ValueError(f"expected a tensor or a tuple of tensors as inputs, got {inputs!r:.80}")
    dtype = amp_dtype(amp)
    apply_engine(model, engine)
    model.train()
    opt = make_optimizer(model, optimizer)
    create_optimizer_state(model, opt)
    device = inputs[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        counts = run_step(model, inputs, opt, dtype)
        torch.cuda.synchronize(device)
        resident = (unique_bytes(list(model.parameters()) + list(model.buffers()))
                    + unique_bytes(state_tensors(opt)) + unique_bytes(inputs))
        peak = torch.cuda.max_memory_allocated(device) - before + resident
        method = "cuda_max_allocated"
    else:
        counts, peak = tracked_peak(model, inputs, opt, dtype)
        method = "tracked_real"
    return MemoryReport(
        **counts, peak=int(peak), engine=engine or "", batch_size=int(inputs[0].shape[0]),
        amp=amp_label(dtype), device=str(device), method=method,
        model=getattr(model, "default_cfg", {}).get("architecture", type(model).__name__)
        if isinstance(getattr(model, "default_cfg", None), dict) else type(model).__name__,
    )
