"""One configuration: build the model, time full training steps, record memory.

:func:`measure` never raises for a failed configuration; it returns a record (see
:data:`~pareprop.bench.fields.RECORD_FIELDS`) whose ``status`` says what happened.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pareprop import catalog
from pareprop.bench import stop
from pareprop.bench.cpu_memory import _can_reset_rss, _free_memory, _reset_rss_peak, _rss_peak_bytes
from pareprop.bench.fields import RECORD_FIELDS, REVERSIBLE_ENGINES
from pareprop.bench.gradcheck import grad_rel_err
from pareprop.catalog import ModelRequest, build_model, example_inputs, model_depth, model_facts
from pareprop.engine import apply_chunking, chosen_schedule, stacks_of
from pareprop.engine.chunk_cost import parse_chunking
from pareprop.engine.compile import compile_blocks
from pareprop.memory import activation_bytes, plan_memory, set_memory_budget

__all__ = ["measure", "time_interleaved"]


@dataclass
class _Job:
    model: str
    engine: str
    batch_size: int
    depth: int | None
    seq_len: int | None
    device: str
    amp: str
    img_size: int | None
    warmup: int
    iters: int
    num_classes: int
    grad_check: bool
    activation: bool
    lr: float
    seed: int
    threads: int | None
    model_overrides: Dict[str, Any]
    plan: bool = False  # also plan_memory's prediction of this step (planned_peak_bytes)
    memory_budget: float | None = None  # a fraction: set_memory_budget on this batch first
    compile: bool = False  # pareprop.compile_blocks before the warm-up steps
    grad_checkpointing: bool = False  # model.set_grad_checkpointing() (reversible models)
    chunk_bytes: int | str | None = None  # pareprop.set_chunking(max_bytes=...) (reversible)

    def __post_init__(self) -> None:
        # Parsed once, as the job is made (here or in its isolated process, which gets the
        # fields as JSON); ``chunk_bytes`` stays as given, the form the record keeps (NOTE
        # [ Chunk sizes are parsed at the edge ] in engine/stack.py).
        self.chunking = parse_chunking(max_bytes=self.chunk_bytes)

    def request(self) -> ModelRequest:
        """The model this configuration measures, as the catalog builds it."""
        return ModelRequest(
            model=self.model, engine=self.engine, num_classes=self.num_classes,
            img_size=self.img_size, depth=self.depth, seq_len=self.seq_len, seed=self.seed,
            grad_checkpointing=self.grad_checkpointing, overrides=dict(self.model_overrides),
        )



def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )



def _autocast(device: torch.device, amp: str):
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _dtype_label(amp: str) -> str:
    return {"none": "float32", "bf16": "bfloat16-amp", "fp16": "float16-amp"}[amp]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(job: _Job) -> Dict[str, Any]:
    """Measure one configuration in this process and return its record.

    Never raises for a failed configuration: an out-of-memory gives ``status="oom"``, any other
    exception ``status="error: <type>: <message>"``.
    """
    device = torch.device(job.device)
    record = _empty_record(job)
    result: Dict[str, Any] = {}
    with _frozen_gc(), _num_threads(job.threads):
        _free_memory(device)
        try:
            _measure_into(job, device, result)
            record.update(result)
            record["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - the sweep records every failure, goes on
            record.update({k: v for k, v in result.items() if k in _KNOWN_EARLY})
            record["status"] = "oom" if _is_oom(err) else f"error: {type(err).__name__}: {err}"
        # Tensors of this configuration (held by its frames, or an exception's) go now.
        _free_memory(device)
    return record


@contextlib.contextmanager
def _num_threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    # A full collection walks every object of torch, timm and the caller (a second or more
    # with many modules imported); freezing what exists now leaves it only our new objects.
    # Nested use (run_bench -> measure) keeps the outer freeze.
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# Fields known before the first step, kept in the record of a configuration that failed later.
_KNOWN_EARLY = ("params", "depth", "img_size", "seq_len")


def _empty_record(job: _Job) -> Dict[str, Any]:
    record: Dict[str, Any] = dict.fromkeys(RECORD_FIELDS)
    record.update(
        model=job.model,
        engine=job.engine,
        memory_budget=job.memory_budget,
        batch_size=job.batch_size,
        depth=job.depth,
        seq_len=job.seq_len,
        device=job.device,
        dtype=_dtype_label(job.amp),
        img_size=job.img_size,
        compiled=job.compile,
        grad_checkpointing=job.grad_checkpointing,
        chunk_bytes=job.chunk_bytes,
    )
    return record


def _measure_into(job: _Job, device: torch.device, out: Dict[str, Any]) -> None:
    cpu_reset = device.type == "cpu" and _can_reset_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        mem_before = torch.cuda.memory_allocated(device)
    else:
        if cpu_reset:
            _reset_rss_peak()
        mem_before = _rss_peak_bytes()

    model, inputs, step = _setup(job, device, out)
    text = not inputs[0].is_floating_point()

    for _ in range(job.warmup):
        stop.check()
        step()
    _sync(device)
    retries_before = _alloc_retries(device)
    times = []
    for _ in range(job.iters):
        stop.check()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)

    out["schedule"] = chosen_schedule(model)
    optimizer = step.optimizer
    if device.type == "cuda":
        out["alloc_retries"] = _alloc_retries(device) - retries_before
        out["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device) - mem_before)
        out["peak_mem_kind"] = "cuda_max_allocated"
        # What the caching allocator held from the device at most (allocated + its cache).
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    else:
        out["peak_mem_bytes"] = int(_rss_peak_bytes() - mem_before)
        out["peak_mem_kind"] = "cpu_rss_growth"
    median = statistics.median(times)
    out.update(
        step_ms_median=median,
        step_ms_min=min(times),
        step_ms_max=max(times),
        samples_per_s=job.batch_size * 1e3 / median,
    )
    if text:
        out["tokens_per_s"] = job.batch_size * out["seq_len"] * 1e3 / median
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()  # AdamW's moments are not needed for the checks below

    stop.check()
    if job.activation:
        try:
            out["activation_bytes"] = _activation_bytes(model, inputs, device, job.amp)
        except Exception as err:  # noqa: BLE001 - the step ran; only this extra forward failed
            if not _is_oom(err):
                raise
            out["activation_bytes"] = None  # the step fitted, its graph plus a second did not
    if job.plan:
        stop.check()
        out["planned_peak_bytes"] = _planned_peak(job, device)
    if job.grad_check and job.engine in REVERSIBLE_ENGINES:
        small = tuple(t[: min(2, job.batch_size)] for t in inputs)
        out["grad_rel_err"] = grad_rel_err(model, small, job.engine, seed=job.seed)



def _setup(job: _Job, device: torch.device, out: Dict[str, Any]):
    """Build the configuration's model (seeded), its inputs and one training step; ``out``
    gets the fields known before the first step. Returns ``(model, inputs, step)``; the
    step's optimizer is ``step.optimizer``."""
    facts = model_facts(job.model)
    request = job.request()
    torch.manual_seed(job.seed)
    model = build_model(request, facts).to(device).train()
    apply_chunking(model, job.chunking)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["depth"] = job.depth if job.depth is not None else model_depth(model)
    inputs = example_inputs(model, request, job.batch_size, device, facts)
    text = not inputs[0].is_floating_point()
    if facts.source == "pareprop" and model.cfg is not None and hasattr(model.cfg, "img_size"):
        out["img_size"] = _side(model.cfg.img_size)
    elif not text:
        out["img_size"] = int(inputs[0].shape[-1])
    if text:
        out["seq_len"] = int(inputs[0].shape[1])
        out["img_size"] = None
    if job.memory_budget is not None:
        out["stored_blocks"] = _apply_budget(model, inputs, job, device)
    if job.compile:  # after the budget, which measures the blocks eagerly
        compile_blocks(model)
    _force_schedule(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    scaler = None
    if job.amp == "fp16" and device.type == "cuda":
        scaler = _grad_scaler()

    with torch.no_grad():
        logits = catalog.logits(model(*inputs))
    torch.manual_seed(job.seed)  # the same targets for every engine of a batch
    target = torch.randint(0, logits.shape[-1], logits.shape[:-1], device=device)
    del logits

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device, job.amp):
            logits = catalog.logits(model(*inputs))
        loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return model, inputs, step


# The clock of the interleaved timing (tests inject their own).
_clock = time.perf_counter


def _make_step(job: _Job, device: torch.device):
    """One configuration's training step, ready to time (its model held by the closure)."""
    return _setup(job, device, {})[2]


def time_interleaved(jobs: Sequence[_Job]) -> List[List[float]]:
    """Step milliseconds of several configurations, timed round robin.

    Builds every job's model (each seeded as :func:`measure` seeds it, so the same weights,
    inputs and targets), runs the warm-up steps, then ``iters`` rounds of one timed step per
    job in turn, so a burst of load on a shared machine falls on every engine alike. All the
    models are alive at once: this measures time only, never memory. Raises what a step
    raises (an out-of-memory included).

    Returns:
        Per job, its timed steps in milliseconds.
    """
    device = torch.device(jobs[0].device)
    steps: List[Any] = []
    times: List[List[float]] = [[] for _ in jobs]
    with _frozen_gc(), _num_threads(jobs[0].threads):
        _free_memory(device)
        try:
            for job in jobs:
                stop.check()
                steps.append(_make_step(job, device))
            for _ in range(max(job.warmup for job in jobs)):
                for step in steps:
                    stop.check()
                    step()
            for _ in range(max(job.iters for job in jobs)):
                for step, out in zip(steps, times):
                    stop.check()
                    _sync(device)
                    t0 = _clock()
                    step()
                    _sync(device)
                    out.append((_clock() - t0) * 1e3)
        finally:
            steps.clear()
            _free_memory(device)
    return times


def _force_schedule(model: nn.Module) -> None:
    """Engine "pareprop" runs PaReprop itself: a record's engine is one schedule, and the
    fallback's choice is what the pareprop and reversible records of a batch compare."""
    for _, m in stacks_of(model):
        m.set_engine(m.engine, fallback=False)


def _alloc_retries(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _apply_budget(
    model: nn.Module, inputs: Tuple[torch.Tensor, ...], job: _Job, device: torch.device
) -> int:
    """Store the blocks a memory budget chooses for this batch; return how many."""
    # FLOP cost: repeatable, so every engine and rerun of a sweep stores the same blocks.
    with _autocast(device, job.amp):
        plan = set_memory_budget(model, job.memory_budget, inputs, engine=job.engine,
                                 cost="flops", repeats=1)
    return plan.num_stored


def _side(size: Any) -> int:
    return int(size[-1]) if isinstance(size, (tuple, list)) else int(size)


def _grad_scaler():
    amp_scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if amp_scaler is not None:
        return amp_scaler("cuda")
    return torch.cuda.amp.GradScaler()  # torch < 2.3


def _activation_bytes(
    model: nn.Module, inputs: Tuple[torch.Tensor, ...], device: torch.device, amp: str
) -> int:
    def forward(*args: torch.Tensor) -> torch.Tensor:
        with _autocast(device, amp):
            return catalog.logits(model(*args))

    return int(activation_bytes(forward, *inputs))


def _planned_peak(job: _Job, device: torch.device) -> int | None:
    """plan_memory's peak for this configuration, or None where it cannot be planned.

    A planner failure never fails the measurement: the record just has no prediction.
    """
    try:
        report = plan_memory(
            job.model, job.batch_size, job.engine, amp=job.amp, device=device.type,
            num_classes=job.num_classes, img_size=job.img_size, depth=job.depth,
            seq_len=job.seq_len, seed=job.seed, memory_budget=job.memory_budget,
            grad_checkpointing=job.grad_checkpointing, chunk_bytes=job.chunking,
            **job.model_overrides,
        )
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return int(report.peak)
