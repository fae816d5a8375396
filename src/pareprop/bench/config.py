"""What a sweep measures: :class:`BenchConfig` and the default sweep of ``pareprop bench``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Sequence

import torch

from pareprop.bench.fields import ALL_ENGINES, AMP_MODES
from pareprop.catalog import model_facts, model_source
from pareprop.devices import device_here
from pareprop.engine import ENGINES
from pareprop.engine.chunk_cost import parse_chunking

__all__ = ["BenchConfig", "default_config"]


@dataclass
class BenchConfig:
    """What to sweep and how to measure it.

    Attributes:
        models: registry names (pareprop's, then timm's).
        engines: any of :data:`ALL_ENGINES`; each model runs those that apply to it.
        memory_budgets: fractions of a memory budget between 0 (every block recomputed) and 1
            (every block stored) for the reversible engines, each chosen on the benchmarked
            batch by :func:`pareprop.set_memory_budget` (FLOP cost); ``None`` runs the engine as
            it is. Other engines run once, without a budget.
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
        plan: record ``planned_peak_bytes``, :func:`pareprop.plan_memory`'s prediction of the
            same step (a few seconds per configuration on a CPU, nothing allocated).
        isolate: run every configuration in a fresh subprocess; ``None`` does so only on a CPU
            where the peak RSS cannot be reset (see NOTE [ Measuring memory on the CPU ]).
        stop_after_oom: skip larger batch sizes of a model/engine/depth after an out-of-memory.
        lr: AdamW learning rate (the value does not change the cost).
        seed: seed of parameters, inputs and the gradient check.
        compile: run every reversible model's F and G compiled
            (:func:`pareprop.compile_blocks`, regional ``torch.compile``); compilation happens
            in the warm-up steps, so at least one is required. Baselines without reversible
            blocks are refused (compile them with ``torch.compile`` yourself).
        chunk_bytes: the reversible engines rebuild and differentiate each block's branches
            in chunks whose graphs save at most this many bytes (``pareprop.set_chunking``;
            ``None``: whole branches); planned peaks are planned so too.
        chunked_variant: also run engine ``reversible`` with chunked branches of this size
            (records with ``chunk_bytes`` set, labelled ``reversible_chunked``) beside the
            whole-branch one; ``None``: no such variant. Ignored when ``chunk_bytes`` already
            chunks every reversible engine.
        interleave: time the engines of each (model, depth, seq_len, batch) group again
            together, round robin, and replace their step times with those medians (see
            NOTE [ Interleaved timing ] in pareprop/bench/sweep.py).
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
    memory_budgets: Sequence[float | None] = (None,)
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
    plan: bool = True
    isolate: bool | None = None
    stop_after_oom: bool = True
    lr: float = 1e-4
    seed: int = 0
    compile: bool = False
    grad_checkpointing: bool = False
    chunk_bytes: int | str | None = None
    chunked_variant: int | str | None = None
    interleave: bool = True
    progress: bool = True
    threads: int | None = None
    time_budget_s: float | None = None
    model_overrides: Dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not self.models:
            raise ValueError("expected at least one model, got none")
        for name in self.models:
            model_source(name)  # raises for unknown names
        bad = [e for e in self.engines if e not in ALL_ENGINES]
        if bad or not self.engines:
            raise ValueError(f"expected engines among {', '.join(ALL_ENGINES)}, got {bad or []}")
        for what, values in (("batch size", self.batch_sizes), ("depth", self.depths)):
            for v in values:
                if v is not None and (not isinstance(v, int) or v < 1):
                    raise ValueError(f"expected every {what} to be a positive integer, got {v!r}")
        if not self.memory_budgets:
            raise ValueError("expected at least one memory budget (or None), got none")
        for v in self.memory_budgets:
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not 0.0 <= v <= 1.0):
                raise ValueError(
                    "expected every memory budget to be a fraction from 0 (every block "
                    f"recomputed) to 1 (every block stored), got {v!r}"
                )
        if not self.batch_sizes:
            raise ValueError("expected at least one batch size, got none")
        for v in self.seq_lens:
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"expected every seq_len to be a positive integer, got {v!r}")
        if self.img_size is not None and self.img_size < 1:
            raise ValueError(f"expected a positive img_size, got {self.img_size}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"expected amp among {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.time_budget_s is not None and not (
            isinstance(self.time_budget_s, (int, float)) and 0 <= self.time_budget_s < math.inf
        ):
            raise ValueError(
                f"expected a time budget of 0 (none) or more seconds, got {self.time_budget_s}"
            )
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(
                f"expected warmup >= 0 and iters >= 1, got warmup={self.warmup} iters={self.iters}"
            )
        for size in (self.chunk_bytes, self.chunked_variant):
            if size is not None:
                parse_chunking(max_bytes=size)  # a bad size is refused here
        if self.grad_checkpointing:
            plain = [m for m in self.models if not model_facts(m).reversible]
            if plain:
                raise ValueError(
                    "--grad-checkpointing checkpoints the non-reversible blocks of reversible "
                    f"models; {', '.join(plain)} is a baseline: use its engine 'checkpointed'"
                )
        if self.compile:
            plain = [m for m in self.models if not model_facts(m).reversible]
            if plain:
                raise ValueError(
                    f"--compile compiles reversible blocks (pareprop.compile_blocks); "
                    f"{', '.join(plain)} has none"
                )
            if self.warmup < 1:
                raise ValueError(
                    "--compile needs at least one warm-up step (compilation happens there), "
                    f"got warmup={self.warmup}"
                )
        device_here(self.resolved_device(), flag="device")  # a name torch accepts, and here

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"


def default_config() -> BenchConfig:
    """The small CPU sweep behind ``pareprop bench`` with no options.

    A Rev-ViT-Ti stack (dim 192, 3 heads) at depths 4, 12 and 24 on 128x128 inputs (64 patch
    tokens) at batches 4 and 16, with the three engines and the competitor, the same blocks
    checkpointed (``checkpointed``: autograd with each block in ``torch.utils.checkpoint``, as
    timm's ``set_grad_checkpointing()``), on one CPU thread (steadier on a shared machine). At
    batch 16 the activations autograd keeps outweigh parameters, gradients and AdamW state
    (1.7x at depth 24), as they do when a model does not fit a GPU, so the whole step's peak
    shows what reversibility saves; reversible and checkpointing each cost about one extra
    forward. Engine ``reversible`` also runs with chunked branches of at most 1 MiB saved per
    chunk (``reversible_chunked``, :func:`pareprop.set_chunking`), today's other memory lever:
    it caps a block's transient, which sets the peak at large batches. Each batch's engines
    are timed again together, round robin (``timing: "interleaved"``), so their time ratios
    hold on a busy machine.
    """
    return BenchConfig(
        models=("rev_vit_tiny_patch16_224",),
        engines=(*ENGINES, "checkpointed"),
        batch_sizes=(4, 16),
        depths=(4, 12, 24),
        img_size=128,
        device="cpu",
        warmup=1,
        iters=3,
        threads=1,
        chunked_variant="1MiB",
    )
