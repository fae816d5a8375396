"""``memory_report``: the memory of one real training step, broken down.

NOTE [ Counting a real step's peak ]
    On CUDA the peak is the caching allocator's own count: ``torch.cuda.max_memory_allocated``
    after ``reset_peak_memory_stats``, taken relative to what was allocated before the step
    plus the bytes of the model, optimizer state and inputs, so tensors of other work on the
    device do not count. The CPU allocator keeps no peak, and the profiler's CPU memory events
    attribute allocations to operators rather than giving a time line we could sum; so on the
    CPU torch's ``MemTracker`` (a ``TorchDispatchMode`` that sees every storage an operator
    creates, and its release through a weak reference) counts the real tensors. That is the
    same counter :func:`pareprop.plan_memory` uses under ``FakeTensorMode``; what the CPU test
    of the two checks is that the fake trace allocates and frees what the real step does.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from pareprop.engine import ReversibleStack, set_block_checkpointing, set_engine
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

__all__ = ["memory_report", "apply_engine"]


def apply_engine(model: nn.Module, engine: Optional[str]) -> None:
    """Put ``model`` on ``engine``: a reversible engine, ``plain`` or ``checkpointed`` (timm's
    ``set_grad_checkpointing()``; for a model with reversible stacks, the autograd engine with
    each block checkpointed, :func:`pareprop.engine.set_block_checkpointing`)."""
    if engine is None or engine == "plain":
        return
    stacks = any(isinstance(m, ReversibleStack) for m in model.modules())
    if engine == "checkpointed":
        if stacks:
            set_engine(model, "autograd")
            set_block_checkpointing(model, True)
        if hasattr(model, "set_grad_checkpointing"):  # timm's blocks, or the transitions
            model.set_grad_checkpointing(True)
        elif not stacks:
            raise ValueError(f"engine 'checkpointed' needs set_grad_checkpointing(); "
                             f"{type(model).__name__} has none")
        return
    set_block_checkpointing(model, False)
    set_engine(model, engine)


# NOTE [ Only the step's peak ]
#     After every operator, ``MemTracker._update_peak_stats`` walks every module it has seen to
#     keep per-module peaks (operators x modules: about half of a ViT-B plan's time). We need
#     the step's peak alone, so our subclass keeps just the global one, as the base class does
#     at the end of that method. Should a later torch drop that method, the base class's
#     (slower, same result) runs instead.
def _step_tracker():
    # torch.distributed's private tools: loaded by the first report, not at ``import pareprop``.
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class _StepPeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]

    if not hasattr(MemTracker, "_update_peak_stats"):
        return MemTracker()
    return _StepPeakTracker()


def tracked_peak(model: nn.Module, inputs: Sequence[torch.Tensor], optimizer: Any,
                 dtype: Optional[torch.dtype]) -> tuple:
    """Run the step under torch's ``MemTracker``; (counts, peak bytes)."""
    tracker = _step_tracker()
    tracker.track_external(model, *inputs)
    if optimizer is not None:
        tracker.track_external(optimizer)
    with tracker:
        counts = run_step(model, inputs, optimizer, dtype)
    peak = sum(tracker._peak_mem.values())
    return counts, int(peak)


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
