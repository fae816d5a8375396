"""``plan_memory``: the memory of a training step predicted without allocating it.

NOTE [ Planning under FakeTensorMode ]
    The model is built on the meta device (no parameter is allocated), its tensors are then
    made fake (``to_empty`` under ``FakeTensorMode``: shapes, dtypes and storages without
    data), and the same training step as :func:`pareprop.memory_report` runs on fake inputs
    while torch's ``MemTracker`` counts every storage created and released. The step traced is
    therefore the real one: the engine's autograd Function, its recomputation in backward,
    PaReprop's two live graphs, autocast's casts, AdamW's temporaries.

    Written here because torch has no one-call planner: the meta build (with ``linspace`` on
    the CPU, see ``_cpu_linspace``), the optimizer state of a later step, the breakdown and the
    largest-batch search. The trace runs on fake *CPU* tensors even when ``device="cuda"`` is
    planned (fake CUDA tensors would need a CUDA runtime for RNG state, streams and autocast);
    for CUDA the optimizer uses CUDA's default multi-tensor (``foreach``) path. What a
    prediction leaves out is listed in docs/memory.md: the CUDA context and kernel
    workspaces (cuBLAS, cuDNN), allocator rounding and fragmentation (the caching allocator
    reserves more than it allocates), the differences between CPU and CUDA autocast (CUDA runs
    softmax and layer norm in float32 under autocast) and attention kernels, and the extra
    lifetime that ``record_stream`` gives PaReprop's tensors on the GPU.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from pareprop.catalog import (
    ALL_ENGINES,
    ModelFacts,
    ModelRequest,
    build_model,
    engines_for,
    example_inputs,
    model_facts,
    model_source,
)
from pareprop.engine import set_chunking
from pareprop.memory.budget import set_memory_budget
from pareprop.memory.measure import apply_engine, tracked_peak
from pareprop.memory.report import MemoryReport
from pareprop.memory.step import amp_dtype, amp_label, create_optimizer_state, make_optimizer
from pareprop.memory.units import parse_memory

__all__ = ["plan_memory", "largest_batch", "MAX_BATCH"]

MAX_BATCH = 2**20  # the largest-batch search stops here

# NOTE [ Choosing the chunk size ]
#     ``chunk_bytes="auto"`` plans the step with whole branches, then with chunks of these
#     fractions of one stream of the largest stack (its bytes come from the whole-branch plan's
#     floor), and keeps the chunking with the lowest planned peak. A smaller chunk never plans
#     more, but past some size the peak is set by the streams and gradients, not by the chunk,
#     and smaller chunks only cost time; so among the plans within AUTO_CHUNK_TOLERANCE of the
#     lowest peak the largest chunk wins (whole branches first). Expressed in bytes, the choice
#     carries over to other batch sizes: a chunk of that size holds the same samples or tokens.
AUTO_CHUNK_FRACTIONS = (2.0, 0.5, 1 / 8, 1 / 32)
AUTO_CHUNK_TOLERANCE = 0.01


class _cpu_linspace(TorchFunctionMode):
    # Some builders turn ``torch.linspace(...)`` into Python floats (drop-path rates); on the
    # meta device that has no data. A linspace of a few numbers is made on the CPU instead.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.linspace:
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


# NOTE [ Value checks of text models under FakeTensorMode ]
#     Fake tensors have no values, so a model that validates its token ids
#     (``int(ids.min())``) or looks at its padding mask (``bool(mask.all())``) cannot run on
#     them. While planning, those reductions of integer and boolean tensors (no ``dim``) answer
#     as for valid ids and a mask without padding: ``min``/``max`` give 0, ``all`` True, ``any``
#     False (no invalid entry). Text steps are planned without padding, which is also the most
#     memory a batch of that length can take.
_VALUE_ANSWERS = {torch.Tensor.min: 0, torch.Tensor.max: 0, torch.Tensor.all: True,
                  torch.Tensor.any: False}


class _planning_values(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _VALUE_ANSWERS and len(args) == 1 and not kwargs
                and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point()
                and type(args[0]).__name__ == "FakeTensor"):
            return _VALUE_ANSWERS[func]
        return func(*args, **kwargs)


def _fake_model(request: ModelRequest, fake_mode: Any) -> Tuple[nn.Module, ModelFacts]:
    facts = model_facts(request.model)
    with torch.device("meta"), _cpu_linspace():
        model = build_model(request, facts)
    with fake_mode:
        model.to_empty(device="cpu")
    return model, facts


def _check(name: str, batch_size: Any, engine: str, device: str) -> None:
    model_source(name)  # unknown names raise, naming the close ones
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"expected a positive integer batch size, got {batch_size!r}")
    if not engines_for(name, [engine]):
        if engine not in ALL_ENGINES:
            raise ValueError(f"expected engine among {', '.join(ALL_ENGINES)}, got {engine!r}")
        valid = ", ".join(engines_for(name, ALL_ENGINES))
        raise ValueError(f"engine {engine!r} does not apply to {name!r} (its engines: {valid})")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"expected device cpu or cuda, got {device!r}")


def plan_memory(
    name: str,
    batch_size: int,
    engine: str,
    amp: Any = None,
    optimizer: str = "adamw",
    device: str = "cuda",
    memory_budget: Any = None,
    grad_checkpointing: bool = False,
    chunk_bytes: Any = None,
    **overrides: Any,
) -> MemoryReport:
    """Predict :func:`pareprop.memory_report` of one training step, allocating nothing.

    Args:
        name: a pareprop model (``rev_vit_base_patch16_224``...) or a timm model
            (``vit_base_patch16_224``...).
        batch_size: samples per step.
        engine: ``autograd``, ``reversible``, ``pareprop`` (reversible models); ``plain`` or
            ``checkpointed`` (timm's ``set_grad_checkpointing()``) for the others.
        amp: ``None``/``"none"``, ``"bf16"``, ``"fp16"``.
        optimizer: ``adamw``, ``adam``, ``sgd`` or ``none``.
        device: the device planned for (``cuda`` or ``cpu``); see NOTE [ Planning under
            FakeTensorMode ] for what differs.
        memory_budget: for ``reversible`` and ``pareprop``, a memory budget as
            :func:`pareprop.set_memory_budget` takes it (a fraction from 0 to 1, or bytes of
            activations); the blocks it stores are chosen on the fake batch by FLOP cost,
            as ``pareprop train --memory-budget`` chooses them.
        grad_checkpointing: reversible models only: their blocks that are not reversible run
            under activation checkpointing (``model.set_grad_checkpointing()``; for timm's
            models that is engine ``checkpointed``).
        chunk_bytes: for ``reversible`` and ``pareprop``: ``None`` (whole branches), a chunk
            size (bytes or ``"256MiB"``: ``pareprop.set_chunking(model, max_bytes=...)``), or
            ``"auto"``: the chunk size whose plan has the lowest peak (NOTE [ Choosing the
            chunk size ]); the report's ``chunk_bytes`` says which.
        **overrides: ``img_size``, ``depth`` (total blocks; staged models change their deepest
            stage), ``seq_len`` (text), ``num_classes``, ``seed``, and any model config field;
            what is not given is the model's own (the model planned is the one
            ``create_model(name, **overrides)`` builds).

    Returns:
        A :class:`MemoryReport` with ``method="tracked_fake"``.

    Example:
        ``pareprop.plan_memory("rev_vit_large_patch16_224", 256, "reversible", amp="bf16")``
    """
    # torch's private fake-tensor module: loaded by the first plan, not at ``import pareprop``.
    from torch._subclasses.fake_tensor import FakeTensorMode

    _check(name, batch_size, engine, device)
    if chunk_bytes is not None and engine not in ("reversible", "pareprop"):
        raise ValueError(
            f"chunk_bytes chunks the branches of a reversible engine's backward; engine "
            f"{engine!r} has none (use reversible or pareprop, or chunk_bytes=None)"
        )
    if isinstance(chunk_bytes, str) and chunk_bytes.strip().lower() == "auto":
        return _plan_auto_chunks(
            name, batch_size, engine, amp=amp, optimizer=optimizer, device=device,
            memory_budget=memory_budget, grad_checkpointing=grad_checkpointing, **overrides)
    size = None if chunk_bytes is None else parse_memory(chunk_bytes)
    if memory_budget is not None and engine not in ("reversible", "pareprop"):
        raise ValueError(
            f"a memory budget chooses stored blocks of a reversible engine; engine {engine!r} "
            "has none to choose (use reversible or pareprop, or no budget)"
        )
    dtype = amp_dtype(amp)
    request = ModelRequest(model=name, engine=engine, grad_checkpointing=bool(grad_checkpointing))
    for key in ("num_classes", "img_size", "depth", "seq_len", "seed"):
        if key in overrides:
            setattr(request, key, overrides.pop(key))
    request.overrides = overrides
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, facts = _fake_model(request, fake_mode)
    if engine == "checkpointed":
        apply_engine(model, engine)
    with fake_mode:
        model.train()
        inputs = example_inputs(model, request, batch_size, "cpu", facts)
        foreach = True if torch.device(device).type == "cuda" else None
        opt = make_optimizer(model, optimizer, foreach=foreach)
        create_optimizer_state(model, opt)
        if memory_budget is not None:
            _store_for_budget(model, inputs, memory_budget, engine, dtype)
        set_chunking(model, max_bytes=size)
        with _planning_values():
            counts, peak = tracked_peak(model, inputs, opt, dtype)
    return MemoryReport(**counts, peak=peak, model=name, engine=engine, batch_size=batch_size,
                        amp=amp_label(dtype), device=str(device), method="tracked_fake",
                        grad_checkpointing=request.grad_checkpointing, chunk_bytes=size)


def _plan_auto_chunks(name: str, batch_size: int, engine: str, **kwargs: Any) -> MemoryReport:
    """The plan of the chunk size with the lowest peak (NOTE [ Choosing the chunk size ])."""
    whole = plan_memory(name, batch_size, engine, **kwargs)
    fixed = whole.parameters + whole.gradients + whole.optimizer_state + whole.inputs
    stream = (whole.floor - fixed) // 8 if whole.floor else 0
    plans = [whole]  # largest chunk first: whole branches, then smaller and smaller chunks
    if stream > 0:
        for fraction in AUTO_CHUNK_FRACTIONS:
            size = max(1, int(stream * fraction))
            plans.append(plan_memory(name, batch_size, engine, chunk_bytes=size, **kwargs))
    lowest = min(p.peak for p in plans)
    return next(p for p in plans if p.peak <= lowest * (1 + AUTO_CHUNK_TOLERANCE))


def _store_for_budget(model: nn.Module, inputs: Tuple[torch.Tensor, ...], budget: Any,
                      engine: str, dtype: Optional[torch.dtype]) -> None:
    autocast = (torch.autocast("cpu", dtype=dtype) if dtype is not None
                else torch.autocast("cpu", enabled=False))
    with autocast, _planning_values():
        set_memory_budget(model, budget, inputs, engine=engine, cost="flops", repeats=1)


def largest_batch(
    name: str,
    engine: str,
    memory_bytes: int,
    start: int = 1,
    **plan_kwargs: Any,
) -> Tuple[int, List[MemoryReport]]:
    """The largest batch whose planned peak fits in ``memory_bytes``.

    A step's peak grows almost linearly with the batch, so each next batch tried is where the
    line through the last two plans meets ``memory_bytes`` (secant steps, a handful of plans),
    and bisection finishes the bracket: the answer is exact either way.

    Args:
        name, engine: as for :func:`plan_memory`.
        memory_bytes: the memory to fit in.
        start: the first batch tried.
        **plan_kwargs: passed to :func:`plan_memory` (``amp``, ``device``, ``img_size``,
            ``chunk_bytes``: with ``"auto"`` every batch tried gets its own best chunking...).

    Returns:
        ``(largest batch, or 0 when batch 1 does not fit; every report planned, by batch)``.
    """
    if memory_bytes <= 0:
        raise ValueError(f"expected a positive memory size, got {memory_bytes}")
    reports: Dict[int, MemoryReport] = {}

    def peak(bs: int) -> int:
        if bs not in reports:
            reports[bs] = plan_memory(name, bs, engine, **plan_kwargs)
        return reports[bs].peak

    def fits(bs: int) -> bool:
        return peak(bs) <= memory_bytes

    def done() -> List[MemoryReport]:
        return [reports[b] for b in sorted(reports)]

    first = max(1, int(start))
    if not fits(first):
        if first == 1:
            return 0, done()
        lo, hi = 0, first
    else:
        lo, hi = _secant(peak, memory_bytes, first)
    while hi is not None and hi - lo > 1:  # lo fits (0: nothing does), hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, done()


def _secant(peak: Any, memory_bytes: int, first: int, tries: int = 8) -> Tuple[int, Optional[int]]:
    """``(lo, hi)``: ``lo`` fits, ``hi`` does not (``None``: MAX_BATCH fits). Each new batch
    is where the line through the last two plans crosses ``memory_bytes``, kept strictly
    inside what is known; the peak is nearly linear in the batch, so a few plans close the
    bracket, and bisection finishes whatever they leave."""
    lo, hi = first, None
    points = [(first, peak(first))]
    guess = min(2 * first, MAX_BATCH)
    for _ in range(tries):
        if guess <= lo:
            guess = lo + 1
        if hi is not None and guess >= hi:
            guess = hi - 1
        if guess <= lo or guess > MAX_BATCH:
            break
        p = peak(guess)
        points.append((guess, p))
        lo, hi = (guess, hi) if p <= memory_bytes else (lo, guess)
        if hi is not None and hi - lo <= 1:
            break
        (b0, p0), (b1, p1) = points[-2], points[-1]
        slope = (p1 - p0) / (b1 - b0) if b1 != b0 else 0.0
        if slope <= 0:  # flat so far: grow geometrically until the peak moves
            guess = min(2 * max(b0, b1), MAX_BATCH)
        else:
            # At small batches fixed costs hide the per-sample slope, and a plan of a huge
            # batch is slow: grow at most 16-fold per step.
            guess = min(int(b1 + (memory_bytes - p1) // slope), 16 * max(b0, b1))
    if hi is None and lo >= MAX_BATCH:
        return MAX_BATCH, None
    if hi is None:
        # Not bracketed within the tries: double until it is (the old search).
        b = lo
        while b < MAX_BATCH:
            b = min(2 * b, MAX_BATCH)
            if peak(b) > memory_bytes:
                return lo, b
            lo = b
        return MAX_BATCH, None
    return lo, hi
