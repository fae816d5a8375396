"""``plan_memory``: the memory of a training step predicted without allocating it.

NOTE [ Planning under FakeTensorMode ]
    The model is built on the meta device (no parameter is allocated), its tensors are then
    made fake (``to_empty`` under ``FakeTensorMode``: shapes, dtypes and storages without
    data), and the same training step as :func:`pareprop.memory_report` runs on fake inputs
    while torch's ``MemTracker`` counts every storage created and released. The step traced is
    therefore the real one: the engine's autograd Function, its recomputation in backward,
    PaReprop's two live graphs, autocast's casts, AdamW's temporaries.

    Written here because torch has no one-call planner: the meta build (with ``linspace`` on the
    CPU: ``fake_modes.cpu_linspace``), the optimizer state of a later step, the breakdown and
    the largest-batch search. The trace runs on fake *CPU* tensors even when ``device="cuda"``
    is planned (fake CUDA tensors would need a CUDA runtime for RNG state, streams and
    autocast); for CUDA the optimizer uses CUDA's default multi-tensor (``foreach``) path. What
    a prediction leaves out is listed in docs/memory.md: the CUDA context and kernel workspaces
    (cuBLAS, cuDNN), allocator rounding and fragmentation (the caching allocator reserves more
    than it allocates), the differences between CPU and CUDA autocast (CUDA runs softmax and
    layer norm in float32 under autocast) and attention kernels, and the extra lifetime that
    ``record_stream`` gives PaReprop's tensors on the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from pareprop.catalog import (
    ALL_ENGINES,
    REVERSIBLE_ENGINES,
    ModelFacts,
    ModelRequest,
    build_model,
    engines_for,
    example_inputs,
    is_converted,
    model_facts,
    model_source,
)
from pareprop.engine import apply_chunking
from pareprop.engine.chunk_cost import Chunking, parse_chunking, tracing_distinct_chunks
from pareprop.memory.budget import set_memory_budget
from pareprop.memory.detection import is_detector_name, plan_detector
from pareprop.memory.fake_modes import cpu_linspace, planning_values
from pareprop.memory.measure import apply_engine, tracked_peak
from pareprop.memory.report import MemoryReport
from pareprop.memory.step import (
    FLOOR_MAPS,
    amp_dtype,
    amp_label,
    create_optimizer_state,
    make_optimizer,
)

__all__ = ["plan_memory", "largest_batch", "plan_chunking", "MAX_BATCH"]

MAX_BATCH = 2**20  # the largest-batch search stops here

# NOTE [ Choosing the chunk size ]
#     ``chunk_bytes="auto"`` plans the step with whole branches, then with chunks of these
#     fractions of one stream of the largest stack (its bytes come from the whole-branch plan's
#     floor), and keeps the chunking with the lowest planned peak. A smaller chunk never plans
#     more, but past some size the peak is set by the streams and gradients, not by the chunk,
#     and smaller chunks only cost time; so among the plans within AUTO_CHUNK_TOLERANCE of the
#     lowest peak the largest chunk wins (whole branches first). Expressed in bytes, the choice
#     carries over to other batch sizes: a chunk of that size holds the same samples or tokens.
#     ``largest_batch`` does not choose at every batch it tries: NOTE [ The largest batch with
#     chunk_bytes="auto" ].
AUTO_CHUNK_FRACTIONS = (2.0, 0.5, 1 / 8, 1 / 32)
AUTO_CHUNK_TOLERANCE = 0.01


# NOTE [ The precision guard in a plan ]
#     A converted model's precision guard (pareprop/convert/precision_guard.py) measures the
#     rebuild error of each block on the training batch: values a fake tensor does not have.
#     What it stores is planned without running it: at beta = 0 every block (the coupling
#     cannot be inverted; the model stores them itself, guard or not), at beta > 0 none, which
#     is what the guard stores while rebuilding is exact enough (the drift report says where it
#     is; a stored block adds one block's activations to the plan's peak). So a converted model
#     is planned without a guard (``tolerance=None``), whatever tolerance it was asked for.


def _fake_model(request: ModelRequest, fake_mode: Any) -> Tuple[nn.Module, ModelFacts]:
    facts = model_facts(request.model)
    if is_converted(request.model):  # NOTE [ The precision guard in a plan ]
        request = dataclasses.replace(request, overrides={**request.overrides,
                                                          "tolerance": None})
    with torch.device("meta"), cpu_linspace():
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
        name: a pareprop model (``rev_vit_base_patch16_224``...), a timm model
            (``vit_base_patch16_224``...) or a detector ``ARCH:BACKBONE``
            (``maskrcnn:detectron2:vitdet_b``: :func:`pareprop.memory.detection.plan_detector`,
            whose keywords ``img_size``, ``gt_per_image``... pass through ``overrides``).
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
            size (bytes, ``"256MiB"`` or a ``Chunking`` by bytes:
            ``pareprop.set_chunking(model, max_bytes=...)``), or
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
    if is_detector_name(name):
        if memory_budget is not None:
            raise ValueError(f"memory_budget is not planned for detectors ({name!r}); plan "
                             "the reversible engines without it, or engine 'checkpointed'")
        return plan_detector(name, batch_size, engine, amp=amp, optimizer=optimizer,
                             device=device, chunk_bytes=chunk_bytes,
                             grad_checkpointing=grad_checkpointing, **overrides)
    # torch's private fake-tensor module: loaded by the first plan, not at ``import pareprop``.
    from torch._subclasses.fake_tensor import FakeTensorMode

    _check(name, batch_size, engine, device)
    if chunk_bytes is not None and engine not in REVERSIBLE_ENGINES:
        raise ValueError(
            f"chunk_bytes chunks the branches of a reversible engine's backward; engine "
            f"{engine!r} has none (use reversible or pareprop, or chunk_bytes=None)"
        )
    chunking = plan_chunking(chunk_bytes)
    if chunking == "auto":
        return _plan_auto_chunks(
            name, batch_size, engine, amp=amp, optimizer=optimizer, device=device,
            memory_budget=memory_budget, grad_checkpointing=grad_checkpointing, **overrides)
    if memory_budget is not None and engine not in REVERSIBLE_ENGINES:
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
        apply_chunking(model, chunking)
        # Each chunked branch traces only its distinct chunks: the same peak, in a fraction of
        # the time (NOTE [ Planning a chunked branch from its distinct chunks ]).
        with planning_values(), tracing_distinct_chunks():
            counts, peak = tracked_peak(model, inputs, opt, dtype)
    return MemoryReport(**counts, peak=peak, model=name, engine=engine, batch_size=batch_size,
                        amp=amp_label(dtype), device=str(device), method="tracked_fake",
                        grad_checkpointing=request.grad_checkpointing,
                        chunk_bytes=None if chunking is None else chunking.max_bytes,
                        coupling=_coupling_built(model, name))


def _coupling_built(model: nn.Module, name: str) -> Optional[Tuple[float, float]]:
    """The coupling the model was built at, read from it rather than from the catalog's
    default (a converted model keeps it as ``model.coupling``); None for other models."""
    coupling = getattr(model, "coupling", None) if is_converted(name) else None
    return None if coupling is None else (float(coupling[0]), float(coupling[1]))


def plan_chunking(chunk_bytes: Any) -> Union[Chunking, str, None]:
    """A plan's ``chunk_bytes`` parsed once, where it enters (NOTE [ Chunk sizes are parsed at
    the edge ] in engine/stack.py): ``None`` (whole branches), ``"auto"``, or a
    :class:`Chunking` by bytes from bytes, ``"256MiB"`` or a :class:`Chunking` by bytes."""
    if isinstance(chunk_bytes, Chunking):
        if chunk_bytes.max_bytes is None:
            raise ValueError(f"expected a chunk size in bytes or 'auto', got {chunk_bytes!r}")
        return chunk_bytes
    if isinstance(chunk_bytes, str) and chunk_bytes.strip().lower() == "auto":
        return "auto"
    return parse_chunking(max_bytes=chunk_bytes)


def _by_bytes(size: Optional[int]) -> Optional[Chunking]:
    """One of :func:`_auto_sizes` as a chunking (None: whole branches)."""
    return None if size is None else Chunking(max_bytes=size)


def _plan_auto_chunks(name: str, batch_size: int, engine: str, **kwargs: Any) -> MemoryReport:
    """The plan of the chunk size with the lowest peak (NOTE [ Choosing the chunk size ])."""
    whole = plan_memory(name, batch_size, engine, **kwargs)
    plans = [whole]  # largest chunk first: whole branches, then smaller and smaller chunks
    for size in _auto_sizes(_stream_bytes(whole))[1:]:
        plans.append(plan_memory(name, batch_size, engine, chunk_bytes=_by_bytes(size),
                                 **kwargs))
    return plans[_auto_choice([p.peak for p in plans])]


def _stream_bytes(whole: MemoryReport) -> int:
    """One stream map of the largest stack, from a plan's floor (0: no reversible stack)."""
    fixed = whole.parameters + whole.gradients + whole.optimizer_state + whole.inputs
    return (whole.floor - fixed) // FLOOR_MAPS if whole.floor else 0


def _auto_sizes(stream: int) -> List[Optional[int]]:
    """The chunk sizes "auto" plans, largest first (``None``: whole branches)."""
    if stream <= 0:
        return [None]
    return [None] + [max(1, int(stream * fraction)) for fraction in AUTO_CHUNK_FRACTIONS]


def _auto_choice(peaks: Sequence[int]) -> int:
    """Index of the largest chunk (earliest) whose peak is within the tolerance of the lowest."""
    lowest = min(peaks)
    return next(i for i, p in enumerate(peaks) if p <= lowest * (1 + AUTO_CHUNK_TOLERANCE))


def _store_for_budget(model: nn.Module, inputs: Tuple[torch.Tensor, ...], budget: Any,
                      engine: str, dtype: Optional[torch.dtype]) -> None:
    autocast = (torch.autocast("cpu", dtype=dtype) if dtype is not None
                else torch.autocast("cpu", enabled=False))
    with autocast, planning_values():
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
            ``chunk_bytes``...). With ``chunk_bytes="auto"`` the chunking is chosen at a
            probe batch and at the answer, and the search in between keeps it (NOTE [ The
            largest batch with chunk_bytes="auto" ]).

    Returns:
        ``(largest batch, or 0 when batch 1 does not fit; every report planned, by batch)``.
    """
    if memory_bytes <= 0:
        raise ValueError(f"expected a positive memory size, got {memory_bytes}")
    if plan_kwargs.get("chunk_bytes") is not None:
        plan_kwargs["chunk_bytes"] = plan_chunking(plan_kwargs["chunk_bytes"])  # parsed once
    if plan_kwargs.get("chunk_bytes") == "auto":
        kwargs = {k: v for k, v in plan_kwargs.items() if k != "chunk_bytes"}
        return _largest_batch_auto(name, engine, memory_bytes, max(1, int(start)), **kwargs)
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


# NOTE [ The largest batch with chunk_bytes="auto" ]
#     "auto" plans five chunkings of a batch (NOTE [ Choosing the chunk size ]), and a plan's
#     time is its number of chunk graphs traced, so a search that chose the chunking afresh at
#     every batch it tried would take many minutes at ViT-B's 80 GiB batches (BENCHMARKS.md,
#     "Measurements behind the design"). Two facts make most of those plans unnecessary:
#
#     * The candidates are fractions of one stream map, which is proportional to the batch, so
#       with the fraction held, every branch has the same number of chunks at every batch and
#       each holds the same share of it: the step is the same step scaled, and its peak is
#       close to affine in the batch (parameters, gradients and optimizer state do not grow).
#       The search holds the fraction: a chord through two plans (or through the fixed part and
#       one plan) lands within a few samples of the answer, and a plan there and at the next
#       batch closes the bracket, at the same cost per plan whatever the batch.
#     * A smaller chunk never plans more, and the peak as a function of the chunk size is a
#       maximum of moments each growing with the chunk, so convex: the line through the last
#       two chunk sizes planned, carried to the smallest candidate, is a lower bound on every
#       smaller candidate's peak. Once the choice among the plans made so far is within the
#       tolerance of that bound, smaller chunks cannot change it and are not planned
#       (``_choose_auto``). At large batches, where the chunk is a small part of the peak,
#       that usually spares the smallest, slowest candidate.
#
#     So: the fraction is guessed at a probe batch (the largest whose floor fits, above the
#     answer), the search holds it, and the choice is made at the answer. Where that choice
#     differs, the search runs again from there with the new fraction (each fraction at most
#     once). The guess plans from the smallest chunk up, while each is within the tolerance of
#     the lowest peak so far (``_guess_auto``): at 80 GiB two plans, where choosing there as
#     at the answer took four or five (whole branches first); it need not be the choice, which
#     is made, exactly, where it counts. The answer ``lo`` is exact in the sense of the
#     per-batch search at ``lo`` (its own choice among the chunkings, planned) and for the
#     chosen fraction at ``lo + 1``; the other fractions are not planned at ``lo + 1``, where
#     a choice other than ``lo``'s would need peaks within a sample's growth of the
#     tolerance's edge.
def _largest_batch_auto(name: str, engine: str, memory_bytes: int, first: int,
                        **kwargs: Any) -> Tuple[int, List[MemoryReport]]:
    base = plan_memory(name, first, engine, **kwargs)
    stream = _stream_bytes(base)
    if stream <= 0:  # no reversible stack: "auto" is whole branches at every batch
        return largest_batch(name, engine, memory_bytes, start=first, **kwargs)
    plans: Dict[Tuple[int, int], MemoryReport] = {(first, 0): base}  # (batch, candidate)
    chosen: Dict[int, int] = {}  # batch -> the candidate "auto" chose there

    def plan(bs: int, i: int) -> MemoryReport:
        if (bs, i) not in plans:
            size = _auto_sizes(stream * bs // first)[i]  # streams grow with the batch exactly
            plans[(bs, i)] = plan_memory(name, bs, engine, chunk_bytes=_by_bytes(size), **kwargs)
        return plans[(bs, i)]

    def choose(bs: int) -> int:
        chosen[bs] = _choose_auto(_auto_sizes(stream * bs // first), lambda i: plan(bs, i).peak)
        return chosen[bs]

    fixed = base.parameters + base.gradients + base.optimizer_state
    per_sample = (base.floor - fixed) / first
    probe = int(min(max((memory_bytes - fixed) / per_sample, 1), MAX_BATCH))
    i = chosen[probe] = _guess_auto(len(_auto_sizes(stream)), lambda j: plan(probe, j).peak)
    found: Dict[int, int] = {}  # candidate searched -> the largest batch it fits
    while i not in found:
        known = {bs: r.peak for (bs, j), r in plans.items() if j == i}
        found[i], _ = _chord_search(lambda bs, i=i: plan(bs, i).peak, memory_bytes, known, fixed)
        lo = found[i]
        i = choose(max(lo, 1))
    if i != list(found)[-1] and (lo == 0 or plan(lo, i).peak > memory_bytes):
        lo = found[i]  # the choice at lo came back to a fraction searched before (not seen)
    reports: Dict[int, MemoryReport] = {}
    for (bs, j), r in plans.items():
        if chosen.get(bs, j) == j:
            reports[bs] = r
    return lo, [reports[b] for b in sorted(reports)]


def _guess_auto(count: int, peak: Callable[[int], int]) -> int:
    """The candidate to search with, from the smallest chunk up: the next larger one is
    planned only while each so far is within the tolerance of the lowest peak seen (NOTE
    [ The largest batch with chunk_bytes="auto" ]). A guess: the choice is made exactly at
    the answer, and the search runs again where it differs."""
    best = count - 1
    lowest = peak(best)
    for j in range(count - 2, -1, -1):
        p = peak(j)
        if p > lowest * (1 + AUTO_CHUNK_TOLERANCE):
            break
        best, lowest = j, min(lowest, p)
    return best


def _choose_auto(sizes: Sequence[Optional[int]], peak: Callable[[int], int]) -> int:
    """The candidate "auto" chooses among ``sizes`` (largest first), planning the smaller
    ones only while they could change the choice (NOTE [ The largest batch with
    chunk_bytes="auto" ])."""
    peaks: List[int] = []
    for i in range(len(sizes)):
        peaks.append(peak(i))
        if i >= 2 and i + 1 < len(sizes):
            (ca, pa), (cb, pb) = (sizes[i - 1], peaks[i - 1]), (sizes[i], peaks[i])
            if pa < pb:  # a smaller chunk planned more: no bound, plan them all
                continue
            bound = pb - (pa - pb) * (cb - sizes[-1]) / (ca - cb)
            best = _auto_choice(peaks)
            if peaks[best] <= min(bound, min(peaks)) * (1 + AUTO_CHUNK_TOLERANCE):
                return best
    return _auto_choice(peaks)


def _chord_search(peak: Callable[[int], int], memory_bytes: int, known: Dict[int, int],
                  intercept: int, tries: int = 12) -> Tuple[int, Optional[int]]:
    """``(lo, hi)``: ``lo`` fits (0: batch 1 does not), ``hi = lo + 1`` does not (``None``:
    MAX_BATCH fits). ``known``: batch -> peak already planned; ``intercept``: the peak's part
    that does not grow with the batch. Each batch tried is where the chord through the bracket
    (or the line through the last two points, the first through ``intercept`` at batch 0)
    meets ``memory_bytes``; bisection finishes what ``tries`` leave."""
    known = dict(known)

    def bracket() -> Tuple[int, Optional[int]]:
        lo = max((b for b, p in known.items() if p <= memory_bytes), default=0)
        hi = min((b for b, p in known.items() if p > memory_bytes and b > lo), default=None)
        return lo, hi

    def at(b: int) -> int:
        if b not in known:
            known[b] = peak(b)
        return known[b]

    width = None  # the bracket's width before the last step
    stalls = 0  # steps in a row that did not halve the bracket
    for _ in range(tries):
        lo, hi = bracket()
        if (hi is not None and hi - lo <= 1) or lo >= MAX_BATCH:
            break
        p_lo = known[lo] if lo else intercept
        # Chords that twice in a row did not halve the bracket meet a peak that is not affine
        # there (a jump between two batches): they would close in one batch a plan, so bisect
        # once. Once is usual: the first chord from a far bracket lands a batch or two short
        # of the answer, and the next closes it.
        stalls = stalls + 1 if hi is not None and width is not None and hi - lo > width / 2 else 0
        halve = stalls >= 2
        width = None if hi is None else hi - lo
        if halve:
            guess = (lo + hi) / 2
        elif hi is not None:
            slope = (known[hi] - p_lo) / (hi - lo)
            guess = lo + (memory_bytes - p_lo) / slope if slope > 0 else (lo + hi) / 2
        else:
            (b0, p0), (b1, p1) = ([(0, intercept)] + sorted(known.items()))[-2:]
            slope = (p1 - p0) / (b1 - b0)
            guess = b1 + (memory_bytes - p1) / slope if slope > 0 else 2 * b1
            guess = min(guess, 16 * b1)
        upper = MAX_BATCH if hi is None else hi - 1
        at(int(max(lo + 1, min(guess, upper))))
    lo, hi = bracket()
    while hi is None and lo < MAX_BATCH:  # not bracketed: double until it is
        at(min(2 * max(lo, 1), MAX_BATCH))
        lo, hi = bracket()
    while hi is not None and hi - lo > 1:
        at((lo + hi) // 2)
        lo, hi = bracket()
    return lo, hi
