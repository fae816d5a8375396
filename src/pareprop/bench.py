"""Throughput and memory of every engine, against the standard models users would otherwise train.

A sweep measures full training steps (forward, cross-entropy loss, backward, AdamW step) for
every combination of model, engine, batch size, depth and sequence length in a
:class:`BenchConfig`, and returns one flat record (a ``dict``) per combination; see
:data:`RECORD_FIELDS`. The CLI (``pareprop bench``) is a thin front end over :func:`run_bench`,
:func:`write_results` and :func:`format_table`.

Models come from two places:

* pareprop's registry (``rev_vit_small_patch16_224``, ``text_encoder_base``, ...). Models that
  contain a :class:`~pareprop.engine.ReversibleStack` run the engines ``autograd``,
  ``reversible`` and ``pareprop``; registry models without one are baselines like timm's.
* timm's registry (``vit_base_patch16_224``, ``mvitv2_base``, ...): the standard baselines,
  which run ``plain`` (autograd) and ``checkpointed`` (timm's ``set_grad_checkpointing()``).

Engines that do not apply to a model are skipped, so one ``--engines`` list serves a mixed sweep.

NOTE [ Measuring memory on the CPU ]
    On a GPU, peak memory is ``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``, per configuration. On the CPU there is no allocator peak, so
    we use the growth of the process's peak resident set size (``ru_maxrss``) during the
    configuration. ``ru_maxrss`` never decreases, so on its own it would only show the largest
    configuration so far. On Linux we reset it before every configuration by writing ``5`` to
    ``/proc/self/clear_refs`` (which sets the peak back to the current RSS), after freeing the
    previous configuration's tensors and returning freed heap to the OS with ``malloc_trim``.
    Where that reset is not possible, every configuration runs in a fresh subprocess
    (``isolate=True``), which is slower (one ``import torch`` each) but measures the same
    thing. The growth includes parameters, gradients, optimizer state and the allocator's
    slack, so it is noisier than ``activation_bytes``, the exact byte count of the tensors
    autograd keeps for backward (parameters excluded), which we report as well.

NOTE [ Why not fork a worker per configuration ]
    Forking is cheap but unsafe: once the parent has run a parallel OpenMP region (any matmul),
    a forked child that computes hangs in the OpenMP runtime. Resetting the peak in-process (or
    a fresh ``spawn``-style subprocess) avoids that.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pareprop.engine import ENGINES, ReversibleStack, set_engine
from pareprop.models import create_model, is_model

__all__ = [
    "BASELINE_ENGINES",
    "ALL_ENGINES",
    "AMP_MODES",
    "RECORD_FIELDS",
    "BenchConfig",
    "run_bench",
    "measure",
    "write_results",
    "format_table",
    "format_ratios",
    "format_summary",
    "ratio_summary",
    "default_config",
]

BASELINE_ENGINES = ("plain", "checkpointed")
ALL_ENGINES = tuple(ENGINES) + BASELINE_ENGINES
AMP_MODES = ("none", "bf16", "fp16")
REVERSIBLE_ENGINES = ("reversible", "pareprop")

# One record per (model, engine, batch_size, depth, seq_len, device). Order is the CSV column order.
RECORD_FIELDS = (
    "model",
    "engine",
    "batch_size",
    "depth",
    "seq_len",
    "device",
    "dtype",
    "img_size",
    "params",
    "step_ms_median",
    "step_ms_min",
    "step_ms_max",
    "samples_per_s",
    "tokens_per_s",
    "peak_mem_bytes",
    "peak_mem_kind",
    "activation_bytes",
    "grad_rel_err",
    "status",
)


@dataclass
class BenchConfig:
    """What to sweep and how to measure it.

    Attributes:
        models: registry names (pareprop's, then timm's).
        engines: any of :data:`ALL_ENGINES`; each model runs those that apply to it.
        batch_sizes: batch sizes, swept in increasing order (a GPU sweep stops growing the
            batch of a model/engine after the first out-of-memory).
        depths: total numbers of blocks; ``None`` keeps the model's own depth. Staged models
            (``depths`` or ``last_block_indexes`` in their config) absorb the change in their
            deepest stage.
        img_size: input side for image models; ``None`` keeps the model's.
        seq_lens: sequence lengths for text models; ``None`` keeps the model's example length.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` picks cuda when available.
        amp: ``"none"``, ``"bf16"`` or ``"fp16"`` autocast for the step (fp16 uses a GradScaler
            on CUDA).
        warmup: untimed steps before timing.
        iters: timed steps.
        num_classes: classifier width of every model (small, so the head does not dominate).
        grad_check: compare reversible engines' gradients against autograd once per model,
            engine and depth (float32, no autocast, batch of at most 2).
        activation: measure ``activation_bytes`` (one extra forward per configuration).
        isolate: run every configuration in a fresh subprocess; ``None`` does so only on a CPU
            where the peak RSS cannot be reset (see NOTE [ Measuring memory on the CPU ]).
        stop_after_oom: skip larger batch sizes of a model/engine/depth after an out-of-memory.
        lr: AdamW learning rate (the value does not change the cost).
        seed: seed of parameters, inputs and the gradient check.
        progress: show a tqdm progress bar over configurations.
        threads: ``torch.set_num_threads`` during each measurement; ``None`` keeps torch's.
            One thread gives steadier CPU timings on a shared machine, where OpenMP threads
            that wait for each other can make two threads slower than one.
        time_budget_s: start no configuration after this many seconds; the rest are recorded
            with status ``skipped: ...``.
        model_overrides: extra config overrides for every model (pareprop config fields or
            timm keyword arguments).
    """

    models: Sequence[str] = ("rev_vit_small_patch16_224",)
    engines: Sequence[str] = ENGINES
    batch_sizes: Sequence[int] = (8,)
    depths: Sequence[int | None] = (None,)
    img_size: int | None = None
    seq_lens: Sequence[int | None] = (None,)
    device: str | None = None
    amp: str = "none"
    warmup: int = 1
    iters: int = 3
    num_classes: int = 10
    grad_check: bool = True
    activation: bool = True
    isolate: bool | None = None
    stop_after_oom: bool = True
    lr: float = 1e-4
    seed: int = 0
    progress: bool = True
    threads: int | None = None
    time_budget_s: float | None = None
    model_overrides: Dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not self.models:
            raise ValueError("expected at least one model, got none")
        for name in self.models:
            _model_source(name)  # raises for unknown names
        bad = [e for e in self.engines if e not in ALL_ENGINES]
        if bad or not self.engines:
            raise ValueError(f"expected engines among {', '.join(ALL_ENGINES)}, got {bad or []}")
        for what, values in (("batch size", self.batch_sizes), ("depth", self.depths)):
            for v in values:
                if v is not None and (not isinstance(v, int) or v < 1):
                    raise ValueError(f"expected every {what} to be a positive integer, got {v!r}")
        if not self.batch_sizes:
            raise ValueError("expected at least one batch size, got none")
        for v in self.seq_lens:
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"expected every seq_len to be a positive integer, got {v!r}")
        if self.img_size is not None and self.img_size < 1:
            raise ValueError(f"expected a positive img_size, got {self.img_size}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"expected amp among {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(
                f"expected warmup >= 0 and iters >= 1, got warmup={self.warmup} iters={self.iters}"
            )
        device = torch.device(self.resolved_device())
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"expected an available device, got {device} but CUDA is not available"
            )

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"


def default_config() -> BenchConfig:
    """The small CPU sweep behind ``pareprop bench`` with no options.

    A Rev-ViT-S-like stack (dim 384, 6 heads) at depths 4, 12 and 24 on 64x64 inputs (16 patch
    tokens) at batch 16, with the three engines, on one CPU thread (steadier on a shared
    machine). It shows the claim in a few minutes on two cores: reversible costs about one
    extra forward, and its activation memory does not grow with depth.
    """
    return BenchConfig(
        models=("rev_vit_small_patch16_224",),
        engines=ENGINES,
        batch_sizes=(16,),
        depths=(4, 12, 24),
        img_size=64,
        device="cpu",
        warmup=1,
        iters=3,
        threads=1,
    )


# ---------------------------------------------------------------------------------------------
# Models and inputs


def _model_source(name: str) -> str:
    """``"pareprop"`` or ``"timm"``; ``ValueError`` for a name neither registry knows."""
    if is_model(name):
        return "pareprop"
    import timm

    if timm.is_model(name):
        return "timm"
    from pareprop.models._registry import _unknown_model_message

    raise ValueError(_unknown_model_message(name) + "; timm model names are accepted too")


@dataclass
class _ModelInfo:
    source: str  # "pareprop" or "timm"
    reversible: bool
    text: bool  # takes (input_ids, attention_mask); its input_size is (seq_len,)
    cfg: Any  # the pareprop config dataclass, or None
    input_size: Tuple[int, ...] | None


_INFO_CACHE: Dict[str, _ModelInfo] = {}


@contextlib.contextmanager
def _meta_device() -> Iterator[None]:
    # Building on the meta device inspects a base-size model without allocating it.
    with torch.device("meta"):
        yield


def _model_info(name: str) -> _ModelInfo:
    if name in _INFO_CACHE:
        return _INFO_CACHE[name]
    source = _model_source(name)
    build = _build_pareprop if source == "pareprop" else _build_timm_default
    try:
        with _meta_device():
            model = build(name)
    except Exception:  # some initialisers call .item(); build for real then
        model = build(name)
    reversible = any(isinstance(m, ReversibleStack) for m in model.modules())
    pcfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    input_size = pcfg.get("input_size")
    text = input_size is not None and len(input_size) == 1
    info = _ModelInfo(source, reversible, text, getattr(model, "cfg", None), input_size)
    _INFO_CACHE[name] = info
    del model
    return info


def _build_pareprop(name: str, **overrides: Any) -> nn.Module:
    return create_model(name, **overrides)


def _build_timm_default(name: str) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=2)


def engines_for(name: str, engines: Sequence[str]) -> List[str]:
    """The engines of ``engines`` that apply to model ``name``, in the given order."""
    valid = ENGINES if _model_info(name).reversible else BASELINE_ENGINES
    return [e for e in engines if e in valid]


def _depth_overrides(cfg: Any, depth: int | None) -> Dict[str, Any]:
    """Config overrides that make a pareprop model ``depth`` blocks deep in total."""
    if depth is None:
        return {}
    names = {f.name for f in dataclasses.fields(cfg)}
    if "depths" in names:  # Swin-like: stage depths; the deepest stage absorbs the change
        depths = list(cfg.depths)
        deepest = max(range(len(depths)), key=lambda i: depths[i])
        depths[deepest] += depth - sum(depths)
        if depths[deepest] < 1:
            raise ValueError(
                f"expected a depth of at least {sum(cfg.depths) - cfg.depths[deepest] + 1} "
                f"for stage depths {tuple(cfg.depths)}, got {depth}"
            )
        return {"depths": tuple(depths)}
    if "last_block_indexes" in names and "depth" in names:  # MViT-like: stage ends by index
        ends = list(cfg.last_block_indexes)
        closed = ends[-1] == cfg.depth - 1  # else blocks after the last index form a stage
        if not closed:
            ends.append(cfg.depth - 1)
        lengths = [ends[0] + 1] + [b - a for a, b in zip(ends, ends[1:])]
        deepest = max(range(len(lengths)), key=lambda i: lengths[i])
        shallowest_total = cfg.depth - lengths[deepest] + 1
        lengths[deepest] += depth - cfg.depth
        if lengths[deepest] < 1:
            raise ValueError(
                f"expected a depth of at least {shallowest_total}"
                f" for last_block_indexes {tuple(cfg.last_block_indexes)} (depth {cfg.depth}), "
                f"got {depth}"
            )
        ends = [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]
        return {"depth": depth, "last_block_indexes": tuple(ends if closed else ends[:-1])}
    if "depth" in names:
        return {"depth": depth}
    raise ValueError(f"model config {type(cfg).__name__} has no depth field; omit --depths")


def _build(job: _Job, info: _ModelInfo) -> nn.Module:
    if info.source == "pareprop":
        overrides: Dict[str, Any] = {"num_classes": job.num_classes, **job.model_overrides}
        names = {f.name for f in dataclasses.fields(info.cfg)} if info.cfg is not None else set()
        if info.reversible:
            overrides["engine"] = job.engine
        if job.img_size is not None and "img_size" in names:
            overrides["img_size"] = job.img_size
        if info.cfg is not None:
            overrides.update(_depth_overrides(info.cfg, job.depth))
        model = create_model(job.model, **overrides)
    else:
        import timm

        kwargs: Dict[str, Any] = {"num_classes": job.num_classes, **job.model_overrides}
        if job.img_size is not None:
            kwargs["img_size"] = job.img_size
        if job.depth is not None:
            kwargs["depth"] = job.depth
        try:
            model = timm.create_model(job.model, pretrained=False, **kwargs)
        except TypeError as err:
            if job.depth is not None and "depth" in str(err):
                raise ValueError(
                    f"depth override unsupported: timm model {job.model!r} takes no depth "
                    "argument; omit --depths for it"
                ) from err
            raise
    if job.engine == "checkpointed":
        model.set_grad_checkpointing(True)
    return model


def _make_inputs(
    model: nn.Module, job: _Job, info: _ModelInfo, device: torch.device, batch_size: int
) -> Tuple[torch.Tensor, ...]:
    example = getattr(model, "example_inputs", None)
    if example is not None:
        kwargs: Dict[str, Any] = {}
        if job.seq_len is not None and "seq_len" in inspect.signature(example).parameters:
            kwargs["seq_len"] = job.seq_len
        inputs = tuple(example(batch_size, device=device, **kwargs))
        if job.seq_len is not None and not inputs[0].is_floating_point() and not kwargs:
            inputs = _fit_seq_len(inputs, job.seq_len)
        return inputs
    size = job.img_size or (info.input_size[-1] if info.input_size else 224)
    chans = info.input_size[0] if info.input_size else 3
    gen = torch.Generator().manual_seed(job.seed)
    return (torch.randn(batch_size, chans, size, size, generator=gen).to(device),)


def _fit_seq_len(inputs: Tuple[torch.Tensor, ...], seq_len: int) -> Tuple[torch.Tensor, ...]:
    # Text models whose example_inputs has no seq_len: cut (or tile) every (B, T) input to T.
    out = []
    for t in inputs:
        if t.dim() >= 2:
            reps = math.ceil(seq_len / t.shape[1])
            t = t.repeat(1, reps, *([1] * (t.dim() - 2)))[:, :seq_len]
        out.append(t)
    return tuple(out)


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    return out[0]


# ---------------------------------------------------------------------------------------------
# One configuration


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


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _reset_rss_peak() -> bool:
    """Set the process's peak RSS back to its current RSS (Linux >= 4.0); False if impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


_CAN_RESET_RSS: bool | None = None


def _can_reset_rss() -> bool:
    global _CAN_RESET_RSS
    if _CAN_RESET_RSS is None:
        _CAN_RESET_RSS = sys.platform.startswith("linux") and _reset_rss_peak()
    return _CAN_RESET_RSS


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
        batch_size=job.batch_size,
        depth=job.depth,
        seq_len=job.seq_len,
        device=job.device,
        dtype=_dtype_label(job.amp),
        img_size=job.img_size,
    )
    return record


def _measure_into(job: _Job, device: torch.device, out: Dict[str, Any]) -> None:
    info = _model_info(job.model)
    cpu_reset = device.type == "cpu" and _can_reset_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        mem_before = torch.cuda.memory_allocated(device)
    else:
        if cpu_reset:
            _reset_rss_peak()
        mem_before = _rss_peak_bytes()

    torch.manual_seed(job.seed)
    model = _build(job, info).to(device).train()
    out["params"] = sum(p.numel() for p in model.parameters())
    out["depth"] = job.depth if job.depth is not None else _model_depth(model)
    inputs = _make_inputs(model, job, info, device, job.batch_size)
    text = not inputs[0].is_floating_point()
    if info.source == "pareprop" and model.cfg is not None and hasattr(model.cfg, "img_size"):
        out["img_size"] = _side(model.cfg.img_size)
    elif not text:
        out["img_size"] = int(inputs[0].shape[-1])
    if text:
        out["seq_len"] = int(inputs[0].shape[1])
        out["img_size"] = None
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    scaler = None
    if job.amp == "fp16" and device.type == "cuda":
        scaler = _grad_scaler()

    with torch.no_grad():
        logits = _logits(model(*inputs))
    target = torch.randint(0, logits.shape[-1], logits.shape[:-1], device=device)
    del logits

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device, job.amp):
            logits = _logits(model(*inputs))
        loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

    for _ in range(job.warmup):
        step()
    times = []
    for _ in range(job.iters):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)

    if device.type == "cuda":
        out["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device) - mem_before)
        out["peak_mem_kind"] = "cuda_max_allocated"
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

    if job.activation:
        try:
            out["activation_bytes"] = _activation_bytes(model, inputs, device, job.amp)
        except Exception as err:  # noqa: BLE001 - the step ran; only this extra forward failed
            if not _is_oom(err):
                raise
            out["activation_bytes"] = None  # the step fitted, its graph plus a second did not
    if job.grad_check and job.engine in REVERSIBLE_ENGINES:
        small = tuple(t[: min(2, job.batch_size)] for t in inputs)
        out["grad_rel_err"] = grad_rel_err(model, small, job.engine, seed=job.seed)


def _side(size: Any) -> int:
    return int(size[-1]) if isinstance(size, (tuple, list)) else int(size)


def _model_depth(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        if getattr(cfg, "depths", None) is not None:
            return int(sum(cfg.depths))
        if getattr(cfg, "depth", None) is not None:
            return int(cfg.depth)
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return len(blocks)
    depths = [len(s.blocks) for s in getattr(model, "stages", getattr(model, "layers", []))
              if isinstance(getattr(s, "blocks", None), (nn.ModuleList, nn.Sequential))]
    return sum(depths) if depths else None


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
            return _logits(model(*args))

    try:
        from pareprop.memory import activation_bytes
    except ImportError:  # the core's memory module is not there yet: count the same way
        return _saved_tensor_bytes(forward, inputs, exclude=list(model.parameters()))
    return int(activation_bytes(forward, *inputs))


def _saved_tensor_bytes(
    fn: Callable[..., Any], args: Sequence[Any], exclude: Sequence[torch.Tensor] = ()
) -> int:
    """Bytes of the storages autograd saves for backward during ``fn(*args)``.

    Storages of ``exclude`` (the parameters) are not counted, nor is any storage twice.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[Tuple[int, str], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[(storage.data_ptr(), str(t.device))] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return int(sum(seen.values()))


def grad_rel_err(
    model: nn.Module, inputs: Tuple[torch.Tensor, ...], engine: str, seed: int = 0
) -> float:
    """Largest relative error of ``engine``'s output and gradients against the autograd engine.

    Uses ``pareprop.testing.engine_errors`` when the core provides it; otherwise runs the two
    engines here with the same seed. The model is left on ``engine``.
    """
    try:
        from pareprop.testing import engine_errors
    except ImportError:
        engine_errors = None
    if engine_errors is not None:
        errors = engine_errors(model, inputs, engines=(engine,), seed=seed)[engine]
        set_engine(model, engine)
        return float(max(errors.values()))

    def run(name: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor | None]]:
        set_engine(model, name)
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=_rng_devices(inputs)):
            torch.manual_seed(seed)
            out = _logits(model(*inputs))
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
            (out * weights.to(out)).sum().backward()
        grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                 for n, p in model.named_parameters()}
        return out.detach(), grads

    ref_out, ref_grads = run("autograd")
    out, grads = run(engine)
    model.zero_grad(set_to_none=True)
    worst = _rel(out, ref_out)
    for name, ref in ref_grads.items():
        got = grads[name]
        if ref is None and got is None:
            continue
        if ref is None or got is None:
            return math.inf
        worst = max(worst, _rel(got, ref))
    return worst


def _rng_devices(inputs: Tuple[torch.Tensor, ...]) -> List[int]:
    return sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.double() - b.double()).norm().item()
    ref = b.double().norm().item()
    return diff / ref if ref > 0 else diff


# ---------------------------------------------------------------------------------------------
# The sweep


def _jobs(config: BenchConfig) -> List[_Job]:
    device = config.resolved_device()
    jobs = []
    for name in config.models:
        engines = engines_for(name, config.engines)
        if not engines:
            valid = ENGINES if _model_info(name).reversible else BASELINE_ENGINES
            raise ValueError(
                f"expected an engine that applies to {name!r} ({', '.join(valid)}), "
                f"got {', '.join(config.engines)}"
            )
        # Sequence lengths only multiply the configurations of text models.
        seq_lens = config.seq_lens if _model_info(name).text else (None,)
        for depth in config.depths:
            for engine in engines:
                for seq_len in seq_lens:
                    for bs in sorted(config.batch_sizes):
                        jobs.append(
                            _Job(
                                model=name, engine=engine, batch_size=bs, depth=depth,
                                seq_len=seq_len, device=device, amp=config.amp,
                                img_size=config.img_size, warmup=config.warmup,
                                iters=config.iters, num_classes=config.num_classes,
                                grad_check=config.grad_check, activation=config.activation,
                                lr=config.lr, seed=config.seed, threads=config.threads,
                                model_overrides=dict(config.model_overrides),
                            )
                        )
    return jobs


def run_bench(
    config: BenchConfig, on_record: Callable[[Dict[str, Any]], None] | None = None
) -> List[Dict[str, Any]]:
    """Run the sweep; one record (see :data:`RECORD_FIELDS`) per configuration.

    Args:
        config: what to sweep.
        on_record: called with each record as soon as it is measured.

    Returns:
        The records, in sweep order (model, depth, engine, seq_len, batch size).
    """
    config.validate()
    jobs = _jobs(config)
    device = torch.device(config.resolved_device())
    isolate = config.isolate
    if isolate is None:
        isolate = device.type == "cpu" and not _can_reset_rss()
    checked: Dict[Tuple, float | None] = {}
    failed: set = set()
    records = []
    started = time.monotonic()
    bar = _progress(len(jobs), config.progress)
    try:
        for job in jobs:
            key = (job.model, job.engine, job.depth, job.seq_len)
            bar.set_description(f"{job.model} {job.engine} d={job.depth} bs={job.batch_size}")
            record = _empty_record(job)
            if key in failed:
                record["status"] = "oom"  # not run: a smaller batch already ran out of memory
            elif config.time_budget_s and time.monotonic() - started > config.time_budget_s:
                record["status"] = f"skipped: time budget of {config.time_budget_s:g} s spent"
            else:
                job.grad_check = config.grad_check and key not in checked
                record = _measure_subprocess(job) if isolate else measure(job)
                if record["status"] == "oom" and config.stop_after_oom:
                    failed.add(key)
                if job.grad_check and record["status"] == "ok":
                    checked[key] = record["grad_rel_err"]
                elif key in checked and record["status"] == "ok":
                    record["grad_rel_err"] = checked[key]
            records.append(record)
            if on_record is not None:
                on_record(record)
            bar.update(1)
    except KeyboardInterrupt:
        # Interrupted (Ctrl-C, or SIGTERM from `timeout` via the CLI): keep what was measured.
        if config.progress:
            print("\ninterrupted: returning the configurations measured so far", file=sys.stderr)
    finally:
        bar.close()
    return records


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="config", dynamic_ncols=True,
                file=sys.stderr)


def _measure_subprocess(job: _Job) -> Dict[str, Any]:
    """Measure ``job`` in a fresh interpreter, so its peak RSS is this configuration's alone."""
    code = (
        "import json, sys; from pareprop import bench; "
        "job = bench._Job(**json.load(sys.stdin)); "
        "print('\\n' + json.dumps(bench.measure(job)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(dataclasses.asdict(job)),
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    record = _empty_record(job)
    killed = proc.returncode in (-9, 137)  # the kernel's OOM killer sends SIGKILL
    tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    record["status"] = "oom" if killed else f"error: worker failed: {tail[0]}"
    return record


def _pythonpath() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([here] + rest)


# ---------------------------------------------------------------------------------------------
# Output


def write_results(records: Sequence[Dict[str, Any]], out_dir: str) -> Dict[str, str]:
    """Write ``results.json``, ``results.csv`` and the plots into ``out_dir``.

    Returns:
        ``{"json": path, "csv": path, "plots": [paths]}``.
    """
    import csv

    from pareprop.plots import plot_results

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as fh:
        json.dump([_jsonable(r) for r in records], fh, indent=1)
    csv_path = os.path.join(out_dir, "results.csv")
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(RECORD_FIELDS), extrasaction="ignore")
        writer.writeheader()
        for r in records:
            writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in RECORD_FIELDS})
    plots = plot_results(records, out_dir)
    return {"json": json_path, "csv": csv_path, "plots": plots}


def _jsonable(record: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # JSON has no inf/nan
        out[k] = v
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(records: Sequence[Dict[str, Any]]) -> str:
    """One line per record: times, throughput, memory, gradient check and status."""
    head = ("model", "engine", "depth", "bs", "seq", "step ms", "min", "max", "samples/s",
            "peak MiB", "act MiB", "grad err", "status")
    rows = [head]
    for r in records:
        rows.append((
            r["model"], r["engine"], _num(r["depth"], "d"), str(r["batch_size"]),
            _num(r["seq_len"], "d"),
            _num(r["step_ms_median"], ".1f"), _num(r["step_ms_min"], ".1f"),
            _num(r["step_ms_max"], ".1f"), _num(r["samples_per_s"], ".1f"),
            _mib(r["peak_mem_bytes"]), _mib(r["activation_bytes"]),
            _num(r["grad_rel_err"], ".1e"), str(r["status"])[:60],
        ))
    return _align(rows)


def _align(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def ratio_summary(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per model, depth, seq_len and batch size: every engine's ratios to its reference.

    The reference is ``autograd`` for reversible models and ``plain`` for baselines. Fields:
    model, depth, batch_size, seq_len, engine, time_ratio (median step time / reference's),
    time_ratio_min (the same with the fastest steps, steadier on a busy machine),
    act_ratio (reference's activation bytes / this engine's), peak_ratio (same for peak
    memory), and for ``pareprop`` the throughput ratio to ``reversible`` (speedup_vs_reversible).
    """
    ok = {(r["model"], r["depth"], r["seq_len"], r["batch_size"], r["engine"]): r
          for r in records if r["status"] == "ok"}
    out = []
    for (model, depth, seq_len, bs, engine), r in ok.items():
        ref_engine = "autograd" if engine in ENGINES else "plain"
        if engine == ref_engine:
            continue
        ref = ok.get((model, depth, seq_len, bs, ref_engine))
        if ref is None:
            continue
        row = dict(model=model, depth=depth, seq_len=seq_len, batch_size=bs, engine=engine,
                   reference=ref_engine,
                   time_ratio=r["step_ms_median"] / ref["step_ms_median"],
                   time_ratio_min=r["step_ms_min"] / ref["step_ms_min"],
                   act_ratio=_div(ref["activation_bytes"], r["activation_bytes"]),
                   peak_ratio=_div(ref["peak_mem_bytes"], r["peak_mem_bytes"]),
                   speedup_vs_reversible=None)
        rev = ok.get((model, depth, seq_len, bs, "reversible"))
        if engine == "pareprop" and rev is not None:
            row["speedup_vs_reversible"] = r["samples_per_s"] / rev["samples_per_s"]
        out.append(row)
    return out


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def format_ratios(records: Sequence[Dict[str, Any]]) -> str:
    """The ratio summary as a table, plus the largest batch that ran per model/engine/depth."""
    rows = [("model", "depth", "bs", "seq", "engine", "time / ref", "(min)", "ref act / act",
             "ref peak / peak", "vs reversible")]
    for s in ratio_summary(records):
        rows.append((
            s["model"], _num(s["depth"], "d"), str(s["batch_size"]), _num(s["seq_len"], "d"),
            f"{s['engine']} / {s['reference']}", f"{s['time_ratio']:.2f}",
            f"{s['time_ratio_min']:.2f}",
            _num(s["act_ratio"], ".1f"), _num(s["peak_ratio"], ".2f"),
            _num(s["speedup_vs_reversible"], ".2f"),
        ))
    parts = []
    if len(rows) > 1:
        parts.append(_align(rows))
    largest: Dict[Tuple, int] = {}
    for r in records:
        if r["status"] == "ok":
            key = (r["model"], r["engine"], r["depth"], r["seq_len"])
            largest[key] = max(largest.get(key, 0), r["batch_size"])
    if len({r["batch_size"] for r in records}) > 1 and largest:
        fit = [("model", "engine", "depth", "seq", "largest batch that ran")]
        fit += [(m, e, _num(d, "d"), _num(s, "d"), str(b)) for (m, e, d, s), b in largest.items()]
        parts.append(_align(fit))
    return "\n\n".join(parts)


def format_summary(
    records: Sequence[Dict[str, Any]], baselines: Dict[str, str] | None = None
) -> str:
    """Best throughput and largest batch per model and engine, and the headline ratios.

    Args:
        records: records of a batch-size sweep.
        baselines: ``{reversible model: its standard baseline}``, e.g.
            ``{"rev_vit_base_patch16_224": "vit_base_patch16_224"}``, for the largest-batch
            ratio. A largest batch that never ran out of memory is a lower bound (``>=``).

    Returns:
        A table, then one line per reversible model with PaReprop/Reprop throughput at each
        one's best batch and the largest batch against the baseline's.
    """
    best: Dict[Tuple[str, str], Dict[str, Any]] = {}
    largest: Dict[Tuple[str, str], int] = {}
    hit_oom: set = set()
    for r in records:
        key = (r["model"], r["engine"])
        if r["status"] == "oom":
            hit_oom.add(key)
        if r["status"] != "ok":
            continue
        largest[key] = max(largest.get(key, 0), r["batch_size"])
        if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = r

    def bound(key: Tuple[str, str]) -> str:
        if key not in largest:
            return "none"
        return ("" if key in hit_oom else ">=") + str(largest[key])

    rows = [("model", "engine", "best samples/s", "at batch", "largest batch", "peak GiB there")]
    for key in dict.fromkeys((r["model"], r["engine"]) for r in records):
        b = best.get(key)
        at_largest = [r for r in records if (r["model"], r["engine"]) == key
                      and r["status"] == "ok" and r["batch_size"] == largest.get(key)]
        peak = at_largest[0]["peak_mem_bytes"] if at_largest else None
        rows.append((key[0], key[1], _num(b and b["samples_per_s"], ".1f"),
                     str(b["batch_size"]) if b else "-", bound(key),
                     "-" if peak is None else f"{peak / 2**30:.1f}"))
    lines = [_align(rows), ""]
    for model in dict.fromkeys(r["model"] for r in records):
        rev, par = best.get((model, "reversible")), best.get((model, "pareprop"))
        if rev is None and par is None:
            continue
        parts = [model + ":"]
        if rev is not None and par is not None:
            ratio = par["samples_per_s"] / rev["samples_per_s"]
            parts.append(f"PaReprop/Reprop best throughput {ratio:.2f}x"
                         f" (bs {par['batch_size']} vs {rev['batch_size']})")
        base = (baselines or {}).get(model)
        ours = max((largest.get((model, e), 0) for e in REVERSIBLE_ENGINES), default=0)
        if base is not None and ours:
            theirs = largest.get((base, "plain"))
            if theirs:
                sign = "" if (base, "plain") in hit_oom else "<="
                parts.append(f"largest batch {ours} vs {base} plain {theirs} "
                             f"({sign}{ours / theirs:.1f}x)")
            elif (base, "plain") in hit_oom:
                parts.append(f"largest batch {ours}; {base} plain fitted no batch of the sweep")
        lines.append(" ".join(parts))
    return "\n".join(lines).rstrip()
