"""The training loop behind ``pareprop train``.

One :class:`TrainConfig` holds every choice of a run (the CLI, a YAML/JSON file and the tests
all fill it); :func:`train` runs it and returns a summary. The loop is ordinary supervised
training (AdamW, cosine schedule with warm-up, label smoothing, gradient clipping, autocast);
what is particular to pareprop is only that the model's engine is picked by name, and that a
run can be resumed exactly.

NOTE [ Exact resume ]
    A run stopped after epoch k and resumed produces the same numbers as one that was not
    stopped, because everything a step depends on is either a function of ``(seed, epoch)`` or
    saved: the data order comes from a sampler seeded with ``(seed, epoch)``; the model,
    optimizer, scheduler and gradient scaler states are saved; and the RNG states (python,
    numpy, torch CPU and CUDA, per process) are saved after the epoch's evaluation, which is
    exactly where the next epoch starts drawing random crops, dropout and drop-path masks. The
    run's options are saved too and restored on resume, its directory included (NOTE
    [ Resumed configuration ] and NOTE [ Run directories ] in pareprop/rundir.py).

NOTE [ Sharded checkpoints ]
    With ``--fsdp`` each process holds a shard of every parameter and of its optimizer state.
    A checkpoint is still the single-process layout (model.safetensors + model.json + state.pt),
    so ``pareprop.load_model`` reads it on one process: every process gathers each parameter
    with ``full_tensor()`` (a collective, so all take part) and the optimizer state with
    ``get_optimizer_state_dict(full_state_dict=True)``, keyed by parameter names; process 0
    writes. Resuming builds and shards the model from the whole weights, and
    ``set_optimizer_state_dict`` cuts each process's shard of the whole optimizer state back
    out: copies, no arithmetic, so a resumed run equals an uninterrupted one.

NOTE [ Batch size ]
    ``batch_size`` is the global number of samples per optimizer step. Each of ``world_size``
    processes feeds ``batch_size / (world_size * grad_accum)`` samples per micro-batch. Because
    the distributed sampler deals sample ``i`` of the epoch's order to process ``i % world``, a
    step covers the same samples whatever the number of processes and micro-batches, so a run
    changes neither its learning rate nor its results when it is spread out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from pareprop import checkpoint as ckpt_lib
from pareprop import distributed as dist_lib
from pareprop import rundir
from pareprop.budget import parse_budget, set_memory_budget
from pareprop.checkpoint import atomic_write
from pareprop.chunking import parse_chunking
from pareprop.compile import compile_blocks
from pareprop.data import build_datasets, epoch_sampler, model_data_config
from pareprop.engine import ENGINES, set_chunking
from pareprop.finetune import (
    apply_convert_options,
    create_finetune_optimizer,
    load_initial_weights,
    load_timm_pretrained,
    make_coupling_schedule,
)
from pareprop.fsdp import fsdp_available
from pareprop.models import create_model

__all__ = [
    "TrainConfig", "Trainer", "train", "NonFiniteLossError", "TrainingInterrupted", "param_groups"
]

AMP_MODES = ("none", "bf16", "fp16")
# Model settings used when a run names no model kwargs. The default model at digits scale:
# 8x8 grey input, 2x2 patches (16 tokens), width 64, 4 reversible blocks (0.2M parameters) reaches
# >= 95% validation accuracy in a few minutes on a 2-core CPU (docs/training.md has the command).
PRESETS: Dict[Tuple[str, str], Dict[str, Any]] = {
    ("rev_vit_tiny_patch4_32", "digits"): dict(
        img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=4, num_heads=4
    ),
}
# Fields of a metrics record that measure the machine, not the run; exact resume compares the rest.
TIMING_KEYS = ("time_s", "samples_per_s", "peak_mem_mb")


@dataclass
class TrainConfig:
    """Everything a training run depends on; defaults train the digits model in minutes."""

    model: str = "rev_vit_tiny_patch4_32"
    model_kwargs: Optional[Dict[str, Any]] = None  # None: PRESETS[(model, dataset)] or {}
    engine: str = "reversible"
    # Activation memory for the reversible engines: bytes ("12GiB") or a fraction 0..1 between
    # every block recomputed and every block stored (pareprop.set_memory_budget).
    memory_budget: Optional[Union[str, float]] = None
    # Compile every block's F and G with torch.compile (pareprop.compile_blocks).
    compile: bool = False
    # Run the blocks that are not reversible (MViTv2 transitions, Swin merging and fusion)
    # under activation checkpointing (model.set_grad_checkpointing()).
    grad_checkpointing: bool = False
    # Rebuild and differentiate the reversible blocks' branches in chunks whose graphs save at
    # most this many bytes ("256MiB"; pareprop.set_chunking); None: whole branches.
    chunk_bytes: Optional[Union[str, int]] = None
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = False
    augment: bool = True
    epochs: int = 40
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.1
    clip_grad: Optional[float] = 1.0
    grad_accum: int = 1
    amp: str = "none"
    seed: int = 0
    out: str = "runs/train"
    # A new run refuses an --out that holds anything; this deletes the previous run's files.
    overwrite: bool = False
    resume: Optional[str] = None
    eval_only: bool = False
    workers: int = 0
    device: str = "auto"
    stop_after_epochs: Optional[int] = None
    max_steps: Optional[int] = None
    progress: bool = True
    # Under torchrun: shard parameters, gradients and optimizer state with FSDP2
    # (pareprop.distributed.shard) instead of replicating them with DDP.
    fsdp: bool = False
    # Fine-tuning (pareprop.finetune). From published weights: pretrained (the model's published
    # file) or pretrained_file (a local one), with a fresh head when the class counts differ.
    # From a timm ViT converted to a reversible coupling: convert_from, from timm's pretrained
    # weights (its download) or pretrained_file (a local copy of them). layer_decay scales
    # block i's learning rate by layer_decay ** (L - i) (timm's optimizer factory).
    pretrained: bool = False
    layer_decay: Optional[float] = None
    convert_from: Optional[str] = None
    pretrained_file: Optional[str] = None
    # With convert_from: start from random weights instead of timm's pretrained ones.
    from_scratch: bool = False
    coupling_schedule: str = "cosine"
    coupling_steps: Optional[int] = None  # None: one epoch

    def __post_init__(self) -> None:
        apply_convert_options(self)
        if self.amp not in AMP_MODES:
            raise ValueError(f"expected --amp one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        for name in ("epochs", "batch_size", "grad_accum"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "stop_after_epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"expected {name} >= 1 (or unset), got {value}")
        if self.fsdp and self.amp == "fp16":
            raise ValueError(
                "--fsdp with --amp fp16 is not supported: the fp16 gradient scaler is not "
                "checked against sharded gradients; use --amp bf16 (it needs no scaler)"
            )
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)  # refuse a bad budget before anything runs
        if self.chunk_bytes is not None:
            if str(self.chunk_bytes).strip().lower() == "auto":
                raise ValueError(
                    "--chunk-bytes auto is a planning choice: run pareprop plan --chunk-bytes auto "
                    "and give train the chunk size it reports (e.g. --chunk-bytes 256MiB)"
                )
            parse_chunking(max_bytes=self.chunk_bytes)  # a bad size is refused here
            if self.engine == "autograd" and self.resume is None:
                raise ValueError(
                    f"--chunk-bytes {self.chunk_bytes} chunks the recomputation of the "
                    f"reversible engines, and --engine {self.engine} recomputes nothing: use "
                    "--engine reversible or pareprop, or drop --chunk-bytes"
                )
        if self.workers < 0:
            raise ValueError(f"expected workers >= 0, got {self.workers}")
        if self.model_kwargs is None:
            self.model_kwargs = dict(PRESETS.get((self.model, self.dataset), {}))
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"expected a positive learning rate, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"expected weight_decay >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ValueError(f"expected warmup_epochs >= 0, got {self.warmup_epochs}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"expected label_smoothing in [0, 1], got {self.label_smoothing}")
        if self.clip_grad == 0:
            self.clip_grad = None  # documented: 0 disables clipping
        if self.clip_grad is not None and not (
            math.isfinite(self.clip_grad) and self.clip_grad > 0
        ):
            raise ValueError(f"expected clip_grad > 0 (or 0 for none), got {self.clip_grad}")

    @classmethod
    def fields(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> TrainConfig:
        """Build from a mapping (a config file), checking each value against its field's type.

        YAML gives strings for some numbers (``1e-3`` without a dot) and a file may say
        ``augment: "false"``; both must not slip through as a string.
        """
        unknown = sorted(set(d) - set(cls.fields()))
        if unknown:
            raise ValueError(
                f"unknown training option(s) {', '.join(unknown)}; valid: {', '.join(cls.fields())}"
            )
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        return cls(**{k: _coerce(k, v, types[k]) for k, v in d.items()})


def _coerce(name: str, value: Any, type_name: str) -> Any:
    """``value`` as the type named ``type_name`` (``int``, ``Optional[float]``, ...)."""
    optional = type_name.startswith("Optional[")
    base = type_name[len("Optional[") : -1] if optional else type_name
    if value is None:
        if optional:
            return None
        raise ValueError(f"expected a value for {name}, got null")
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected {name} true or false, got {value!r}")
    if base in ("int", "float"):
        if not isinstance(value, bool):
            try:
                number = float(value)
                if base == "float":
                    return number
                if number.is_integer():
                    return int(number)
            except (TypeError, ValueError):
                pass
        kind = "an integer" if base == "int" else "a number"
        raise ValueError(f"expected {name} to be {kind}, got {value!r}")
    if base == "str":
        if isinstance(value, str):
            return value
        raise ValueError(f"expected {name} to be a string, got {value!r}")
    if base.startswith("Dict") and not isinstance(value, dict):
        raise ValueError(f"expected {name} to be a mapping (KEY: VALUE, ...), got {value!r}")
    return value


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the run stopped before the optimizer step."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; the message says where its last checkpoint is."""


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on the model's ``no_weight_decay()`` names (position
    embeddings, relative position tables) nor on norms and biases (any 0-D or 1-D tensor)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Peak resident set of the process (kilobytes on Linux): the CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"expected --device auto, cpu, cuda or cuda:N, got {name!r}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"expected --device cpu or auto on a machine without CUDA, got {name!r}"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


class Trainer:
    """Builds the model, data, optimizer and schedule of a :class:`TrainConfig` and runs them.

    Args:
        cfg: the run.
        dist: the process group view (``pareprop.distributed.init()``); one process if omitted.
        given: the options set explicitly (the CLI passes the flags and file keys it got); a
            resumed run restores the others from its checkpoint. ``None``: the options that
            differ from :class:`TrainConfig`'s defaults.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        dist: Optional[dist_lib.DistInfo] = None,
        given: Optional[Iterable[str]] = None,
    ):
        self.dist = dist or dist_lib.DistInfo()
        self.cfg, self.resume = self._open_run(cfg, given)
        self._setup_device()
        self.model = self._build_model()  # the bare model; self.net is what the loop calls
        self._setup_engine(self.model)
        self._setup_data()
        self._setup_processes()
        self._setup_optimizer()
        self.epoch, self.step = 0, 0
        self.best = {"val_acc": -1.0, "epoch": 0}
        self.step_losses: List[float] = []
        self.last_checkpoint: Optional[str] = None
        self._lock: Optional[rundir.RunLock] = None
        if self.resume is not None and not self.cfg.eval_only:
            self._load_train_state(self.resume)

    # ------------------------------------------------------------------ set-up
    def _open_run(
        self, cfg: TrainConfig, given: Optional[Iterable[str]]
    ) -> Tuple[TrainConfig, Optional[ckpt_lib.Checkpoint]]:
        """The run's configuration, and its checkpoint when resuming (NOTE [ Resumed
        configuration ] in pareprop/rundir.py); refuses an output directory a new run may not
        write into (NOTE [ Run directories ])."""
        given = _given_fields(cfg) if given is None else set(given)
        # Where the resumed checkpoint's run lives, and whether this run continues there.
        self._source_run: Optional[str] = None
        self._in_place = False
        if cfg.resume is None:
            if cfg.eval_only:
                raise ValueError("--eval-only needs a checkpoint to evaluate: pass --resume PATH")
            self._check_new_run_dir(cfg)
            return cfg, None
        ck = ckpt_lib.load_checkpoint(cfg.resume, train_state=not cfg.eval_only)
        run_dir = self._source_run = rundir.run_dir_of(ck.path)
        saved = rundir.saved_config(ck.meta, ck.train_state, run_dir)
        if saved is not None:
            merged, changes = rundir.restore_config(
                dataclasses.asdict(cfg), saved, given, TrainConfig.fields()
            )
            cfg = TrainConfig.from_dict(merged)
            for change in changes:
                self._log(f"resume: {change} (changed for this run)")
        if cfg.eval_only:
            if "out" not in given and run_dir is not None:
                cfg.out = run_dir
            return cfg, ck
        if "out" in given and not (run_dir and os.path.realpath(cfg.out) == run_dir):
            # Continued in a new directory: the rules of a new run.
            self._check_new_run_dir(cfg)
            self._log(f"resume: continuing {ck.path} in the new run directory {cfg.out}")
        elif run_dir is None:
            raise rundir.RunDirError(
                f"{ck.path!r} is not inside a run directory (RUN/checkpoints/NAME), so there is "
                "no run to continue in place: pass --out DIR to continue it in a new directory"
            )
        else:
            cfg.out = saved["out"] if saved and _is_dir(saved.get("out"), run_dir) else run_dir
            _check_is_last(ck, cfg.out)
            self._in_place = True
        if cfg.epochs < ck.epoch:
            raise rundir.RunDirError(
                f"--epochs {cfg.epochs} is fewer than the {ck.epoch} epoch(s) {ck.path!r} has "
                f"done: nothing to train. Pass --epochs above {ck.epoch} to train longer, or "
                "--eval-only to evaluate it"
            )
        return cfg, ck

    def _check_new_run_dir(self, cfg: TrainConfig) -> None:
        self._on_first_process(lambda: rundir.check_new_run_dir(cfg.out, cfg.overwrite), cfg.out)

    def _on_first_process(self, action: Callable[[], None], out: str) -> None:
        """Run ``action`` on process 0; if it refuses the run directory, every process fails."""
        error: Optional[Exception] = None
        if self.dist.rank == 0:
            try:
                action()
            except rundir.RunDirError as e:
                error = e
        failed = dist_lib.all_reduce(torch.tensor([float(error is not None)]), self.dist, "max")
        if error is not None:
            raise error
        if failed.item() > 0:
            raise rundir.RunDirError(f"process 0 refused the run directory {out!r}")

    def _setup_device(self) -> None:
        """The device, the engine name, autocast, and what --fsdp needs."""
        cfg = self.cfg
        self.device = _resolve_device(cfg.device, self.dist.local_rank)
        if cfg.engine not in ENGINES:
            raise ValueError(f"expected --engine one of {', '.join(ENGINES)}, got {cfg.engine!r}")
        if cfg.amp == "fp16" and self.device.type != "cuda":
            raise ValueError(
                "--amp fp16 needs a CUDA device (its gradient scaler guards fp16's narrow range); "
                "use --amp bf16 on the CPU"
            )
        if cfg.fsdp:
            _check_fsdp(self.dist)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)

    def _build_model(self) -> nn.Module:
        """The data sets and the model: from the checkpoint's spec (and weights) when resuming,
        else from the config, with as many classes as the data has."""
        cfg, resume = self.cfg, self.resume
        if resume is not None:
            name, kwargs = resume.meta["model"]["name"], dict(resume.meta["model"]["kwargs"])
        else:
            name, kwargs = cfg.model, dict(cfg.model_kwargs)
        kwargs["engine"] = cfg.engine
        torch.manual_seed(cfg.seed)
        model = create_model(name, **kwargs)
        input_size = tuple(model.pretrained_cfg["input_size"])
        self.data = build_datasets(
            cfg.dataset, input_size, cfg.data_dir, cfg.download, cfg.seed, cfg.augment,
            self._data_config(model, input_size),
        )
        asked = (cfg.model_kwargs or {}).get("num_classes")
        if resume is None and asked is not None and asked != self.data.num_classes:
            raise ValueError(
                f"--num-classes {asked} disagrees with the data set {cfg.dataset!r}, which has "
                f"{self.data.num_classes} classes: drop --num-classes (the head follows the "
                "data) or give the data set it was meant for"
            )
        if model.num_classes != self.data.num_classes:
            if resume is not None:
                raise ValueError(
                    f"checkpoint {resume.path!r} has {model.num_classes} classes, data set "
                    f"{cfg.dataset!r} has {self.data.num_classes}"
                )
            kwargs["num_classes"] = self.data.num_classes
            torch.manual_seed(cfg.seed)
            model = create_model(name, **kwargs)
        model = model.to(self.device)
        if resume is not None:
            ckpt_lib.load_weights(model, resume)
        elif cfg.convert_from is None and (cfg.pretrained or cfg.pretrained_file):
            load_initial_weights(model, cfg.pretrained_file, name)
        elif cfg.convert_from is not None and cfg.pretrained_file is None and not cfg.from_scratch:
            load_timm_pretrained(model, cfg.convert_from)
        return model

    def _data_config(self, model: nn.Module, input_size: Tuple[int, ...]) -> Optional[dict]:
        """The data config the run normalises by (NOTE [ One data config ] in
        pareprop/data.py): the checkpoint's when resuming, the model's own when starting from
        pretrained weights, else None (the data set's statistics)."""
        cfg = self.cfg
        if self.resume is not None:
            return self.resume.meta.get("data_config")  # None: saved before it was recorded
        if cfg.pretrained or cfg.pretrained_file or (cfg.convert_from and not cfg.from_scratch):
            return model_data_config(model, input_size)
        return None

    def _setup_engine(self, model: nn.Module) -> None:
        """Memory budget, activation checkpointing and compilation, in that order (the budget
        measures the blocks eagerly)."""
        cfg = self.cfg
        self.memory_plan = None
        if self.resume is None and cfg.memory_budget is not None:
            self.memory_plan = self._apply_memory_budget(model)
        if cfg.grad_checkpointing:
            model.set_grad_checkpointing(True)
        set_chunking(model, max_bytes=cfg.chunk_bytes)
        if cfg.compile:
            compile_blocks(model)
        # Each process draws its own augmentation and dropout; process 0 matches a
        # single-process run of the same seed.
        if self.dist.rank > 0:
            torch.manual_seed(cfg.seed + self.dist.rank)

    def _setup_data(self) -> None:
        """Per-process micro-batches (see NOTE [ Batch size ]) and the validation shard."""
        cfg, world, accum = self.cfg, self.dist.world_size, self.cfg.grad_accum
        if cfg.batch_size % (world * accum):
            raise ValueError(
                f"expected --batch-size divisible by processes x --grad-accum = {world} x {accum}, "
                f"got {cfg.batch_size}"
            )
        self.micro_batch = cfg.batch_size // (world * accum)
        self.sampler = epoch_sampler(
            self.data.train, cfg.seed, num_replicas=world, rank=self.dist.rank
        )
        self.train_loader = DataLoader(
            self.data.train,
            batch_size=self.micro_batch,
            sampler=self.sampler,
            num_workers=cfg.workers,
            pin_memory=self.device.type == "cuda",
            drop_last=False,
        )
        # Validation is split without padding (a distributed sampler would repeat samples).
        val = self.data.val
        shard = Subset(val, range(self.dist.rank, len(val), world)) if world > 1 else val
        self.val_loader = DataLoader(
            shard, batch_size=max(self.micro_batch, 64), num_workers=cfg.workers
        )
        self.micro_per_epoch = len(self.train_loader)
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / accum)
        self.total_steps = self.steps_per_epoch * cfg.epochs

    def _setup_processes(self) -> None:
        """DDP wraps the model; shard() turns the model itself into an FSDP2 module, so then
        self.net is self.model (NOTE [ Sharded checkpoints ] says what saving does)."""
        if self.dist.world_size == 1:
            self.net = self.model
        elif self.cfg.fsdp:
            self.net = dist_lib.shard(self.model)
        else:
            self.net = dist_lib.wrap_ddp(self.model, self.device)

    def _setup_optimizer(self) -> None:
        """AdamW (with --layer-decay: timm's factory, per-layer learning-rate factors), timm's
        cosine schedule per step with linear warm-up, the fp16 scaler."""
        from timm.scheduler import CosineLRScheduler

        cfg = self.cfg
        if cfg.layer_decay is None:
            self.optimizer = torch.optim.AdamW(
                param_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.999)
            )
        else:
            self.optimizer = create_finetune_optimizer(
                self.model, cfg.lr, cfg.weight_decay, cfg.layer_decay, betas=(0.9, 0.999)
            )
        warmup = int(round(cfg.warmup_epochs * self.steps_per_epoch))
        self.scheduler = CosineLRScheduler(
            self.optimizer,
            t_initial=max(1, self.total_steps - warmup),
            lr_min=cfg.lr * 1e-2,
            warmup_t=warmup,
            warmup_lr_init=cfg.lr * 1e-2,
            warmup_prefix=True,
            t_in_epochs=False,
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp == "fp16")
        self.coupling = make_coupling_schedule(cfg, self.model, self.steps_per_epoch)

    def _apply_memory_budget(self, model: nn.Module):
        """Store the blocks that fit ``--memory-budget``, measured on one training batch of the
        run, under the run's autocast. Costs are FLOPs, not timings, so every process and every
        rerun of the same config chooses the same blocks; a resumed run takes the stored blocks
        recorded in its checkpoint instead, so it computes exactly what the first run did."""
        if self.cfg.engine == "autograd":
            raise ValueError(
                "--memory-budget chooses blocks for the reversible engines to store; with "
                "--engine autograd every block is stored already (use reversible or pareprop)"
            )
        parse_budget(self.cfg.memory_budget)  # a clear error before any data is read
        loader = DataLoader(self.data.train, batch_size=self.cfg.batch_size // max(
            1, self.dist.world_size * self.cfg.grad_accum))
        with torch.random.fork_rng(devices=[]):  # augmentation draws: keep the run's RNG
            images = next(iter(loader))[0].to(self.device)
        with self._autocast():
            plan = set_memory_budget(model, self.cfg.memory_budget, images,
                                     engine=self.cfg.engine, cost="flops")
        self._log(str(plan))
        return plan

    # ------------------------------------------------------------------ state
    def _load_train_state(self, ck: ckpt_lib.Checkpoint) -> None:
        st = ck.train_state
        if st is None:
            raise ckpt_lib.CheckpointError(
                f"{ck.path!r} holds weights only, no training state to resume from; "
                "evaluate it with --eval-only or start a new run"
            )
        self._load_optimizer_state(ck)
        self.epoch, self.step = int(st["epoch"]), int(st["step"])
        self._load_schedule(st["scheduler"])
        self.scaler.load_state_dict(st["scaler"])
        if self.coupling is not None and "coupling" in st:
            self.coupling.load_state_dict(st["coupling"])
        self.best = dict(st["best"])
        self.last_checkpoint = ck.path
        rngs = st["rng"]
        if len(rngs) == self.dist.world_size:
            ckpt_lib.set_rng_state(rngs[self.dist.rank])
        else:  # a different number of processes: exactness is impossible, continue sensibly
            self._log(
                f"note: checkpoint saved by {len(rngs)} process(es), resuming with "
                f"{self.dist.world_size}: random draws will differ from an uninterrupted run"
            )
            torch.manual_seed(self.cfg.seed + 7919 * self.epoch + self.dist.rank)

    def _load_optimizer_state(self, ck: ckpt_lib.Checkpoint) -> None:
        st = ck.train_state
        if st.get("optimizer_layout") == "full":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                st["optimizer"],
                options=StateDictOptions(full_state_dict=True),
            )
        elif self.cfg.fsdp:
            raise ckpt_lib.CheckpointError(
                f"{ck.path!r} was saved by a run without --fsdp; its optimizer state is keyed "
                "by parameter order, not names, and cannot be sharded: resume it without --fsdp"
            )
        else:
            self.optimizer.load_state_dict(st["optimizer"])

    def _load_schedule(self, saved: Dict[str, Any]) -> None:
        """The saved schedule, or, when --epochs changed its length, the new one at this step."""
        fresh = self.scheduler.state_dict()
        if all(saved.get(k) == fresh[k] for k in ("t_initial", "warmup_t")):
            self.scheduler.load_state_dict(saved)
            return
        self._log(
            f"resume: the cosine schedule now spans {self.cfg.epochs} epochs; the learning rate "
            f"from step {self.step} on follows it, not the original schedule"
        )
        self.scheduler.step_update(num_updates=self.step)

    def _optimizer_state(self) -> Tuple[Dict[str, Any], str]:
        """The optimizer state and its layout: ``"local"`` (``optimizer.state_dict()``) or,
        for a sharded model, ``"full"``: gathered whole and keyed by parameter names, on
        process 0 (a collective; the other processes get an empty dict)."""
        if not self.cfg.fsdp:
            return self.optimizer.state_dict(), "local"
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options), "full"

    def _train_state(self) -> Dict[str, Any]:
        optimizer, layout = self._optimizer_state()
        return {
            "optimizer": optimizer,
            "optimizer_layout": layout,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            **({"coupling": self.coupling.state_dict()} if self.coupling is not None else {}),
            "epoch": self.epoch,
            "step": self.step,
            "best": dict(self.best),
            "rng": dist_lib.gather_objects(ckpt_lib.rng_state(), self.dist),
            "config": json.dumps(dataclasses.asdict(self.cfg), default=str),
        }

    def save(self, metrics: Dict[str, Any]) -> None:
        """Checkpoint after an epoch on process 0 (all processes take part in gathering RNG)."""
        is_best = metrics["val_acc"] > self.best["val_acc"]
        if is_best:
            self.best = {"val_acc": metrics["val_acc"], "epoch": self.epoch}
        state = self._train_state()
        # A sharded model's weights are gathered by every process (collectives), written by 0.
        weights = dist_lib.full_state_dict(self.model) if self.cfg.fsdp else None
        if self.dist.rank == 0:
            tags = ("last", "best") if is_best else ("last",)
            self.last_checkpoint = ckpt_lib.save_checkpoint(
                self.cfg.out,
                self.model,
                epoch=self.epoch,
                step=self.step,
                metrics=metrics,
                train_state=state,
                tags=tags,
                # The run's options travel with it: --resume and --eval-only restore them.
                extra={"config": json.loads(json.dumps(dataclasses.asdict(self.cfg), default=str)),
                       # pareprop eval validates as training did (NOTE [ One data config ]).
                       "data_config": self.data.data_config},
                state_dict=weights,
            )
        dist_lib.barrier(self.dist)

    # ------------------------------------------------------------------ loop
    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _log(self, msg: str) -> None:
        if self.dist.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def _kept(self) -> str:
        if self.last_checkpoint:
            return f"the last good checkpoint {self.last_checkpoint!r} is kept"
        return "no checkpoint was written yet"

    def _check_finite(self, value: torch.Tensor, what: str = "loss") -> None:
        ok = torch.isfinite(value.detach()).to(torch.float32).reshape(1)
        ok = dist_lib.all_reduce(ok, self.dist, op="min")
        if ok.item() < 1:
            raise NonFiniteLossError(
                f"{what} is {value.item()} at epoch {self.epoch + 1}, step {self.step + 1}: "
                f"stopped before the optimizer step; {self._kept()}. Lower --lr, raise "
                f"--warmup-epochs, keep --clip-grad, or train with --amp none/bf16 instead of fp16"
            )

    def _forward_backward(
        self, i: int, x: torch.Tensor, y: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, bool]:
        """Micro-batch ``i``: forward, loss and backward; (loss, logits, ends a step)."""
        accum = self.cfg.grad_accum
        in_group = min(accum, self.micro_per_epoch - (i // accum) * accum)
        last_micro = (i + 1) % accum == 0 or i + 1 == self.micro_per_epoch
        # Micro-batches before the last one of a step only accumulate locally.
        sync = nullcontext() if last_micro else dist_lib.no_sync(self.net)
        with sync:
            with self._autocast():
                logits = self.net(x)
                loss = F.cross_entropy(
                    logits.float(), y, label_smoothing=self.cfg.label_smoothing
                )
            self._check_finite(loss)
            self.scaler.scale(loss / in_group).backward()
        return loss, logits, last_micro

    def _optimizer_step(self) -> None:
        """Clip, step, and advance the schedule by one optimizer step."""
        cfg = self.cfg
        if cfg.clip_grad is not None and cfg.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
            if cfg.fsdp:  # the norm of sharded gradients is a (replicated) DTensor
                norm = norm.full_tensor()
            # With fp16 the scaler skips a step whose gradients overflowed; otherwise a
            # non-finite gradient (finite loss) would turn every weight into NaN.
            if not self.scaler.is_enabled():
                self._check_finite(norm, "the gradient norm")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.scheduler.step_update(num_updates=self.step)
        if self.coupling is not None:
            self.coupling.step()

    def train_epoch(self) -> Dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        self.net.train()
        self.sampler.set_epoch(self.epoch)
        sums = torch.zeros(3, dtype=torch.float64)  # loss * n, correct, n
        t0, seen = time.perf_counter(), 0
        bar = tqdm(
            self.train_loader,
            desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
            disable=not cfg.progress or self.dist.rank != 0,
            dynamic_ncols=True,
            leave=True,
        )
        self.optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(bar):
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            loss, logits, last_micro = self._forward_backward(i, x, y)
            n = y.shape[0]
            sums += torch.tensor(
                [loss.item() * n, (logits.argmax(-1) == y).sum().item(), n],
                dtype=torch.float64,
            )
            seen += n
            if not last_micro:
                continue
            self._optimizer_step()
            self.step_losses.append(loss.item())
            rate = seen * self.dist.world_size / (time.perf_counter() - t0)
            bar.set_postfix(
                loss=f"{sums[0].item() / sums[2].item():.4f}",
                lr=f"{self.optimizer.param_groups[0]['lr']:.2e}",
                samples_s=f"{rate:.0f}",
                mem_mb=f"{_peak_mem_mb(self.device):.0f}",
                refresh=False,
            )
        bar.close()
        sums = dist_lib.all_reduce(sums, self.dist)
        elapsed = time.perf_counter() - t0
        return {
            "train_loss": sums[0].item() / max(sums[2].item(), 1),
            "train_acc": sums[1].item() / max(sums[2].item(), 1),
            "lr": self.optimizer.param_groups[0]["lr"],
            "time_s": elapsed,
            "samples_per_s": sums[2].item() / elapsed,
        }

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Loss (plain cross-entropy) and accuracy on the validation set, over all processes."""
        self.net.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        batches = list(self.val_loader) if self.cfg.fsdp else self.val_loader
        if self.cfg.fsdp:
            # Every forward of a sharded model all-gathers, so every process must run the same
            # number of them: one whose shard has fewer batches runs extra, uncounted ones.
            most = dist_lib.all_reduce(torch.tensor([float(len(batches))]), self.dist, "max")
            for _ in range(int(most.item()) - len(batches)):
                with self._autocast():
                    self.model(batches[0][0][:1].to(self.device))
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                logits = self.model(x)  # the bare model: DDP needs no sync in evaluation
            loss = F.cross_entropy(logits.float(), y, reduction="sum")
            sums += torch.tensor(
                [loss.item(), (logits.argmax(-1) == y).sum().item(), y.shape[0]],
                dtype=torch.float64,
            )
        sums = dist_lib.all_reduce(sums, self.dist)
        return {
            "val_loss": sums[0].item() / sums[2].item(),
            "val_acc": sums[1].item() / sums[2].item(),
        }

    def _append_metrics(self, record: Dict[str, Any]) -> None:
        if self.dist.rank != 0:
            return
        os.makedirs(self.cfg.out, exist_ok=True)
        with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ run
    def _claim_run_dir(self) -> None:
        """Lock the run directory and make it this run's (NOTE [ Run directories ]): a new one
        checked again under the lock (and cleared with --overwrite), a resumed one given the
        metrics of the epochs its checkpoint holds; then write config.json."""
        cfg, ck = self.cfg, self.resume

        def claim() -> None:
            self._lock = rundir.RunLock(cfg.out).acquire()
            if self._source_run is not None and self._in_place:
                _check_is_last(ck, cfg.out)
            else:
                rundir.check_new_run_dir(cfg.out, cfg.overwrite)
                removed = rundir.clear_run_dir(cfg.out) if cfg.overwrite else []
                if removed:
                    self._log(f"--overwrite: deleted {', '.join(removed)} of {cfg.out}")
            if ck is not None:
                rundir.continue_metrics(
                    os.path.join(self._source_run or "", "metrics.jsonl"),
                    os.path.join(cfg.out, "metrics.jsonl"),
                    ck.epoch,
                    ck.meta.get("metrics") or None,
                )
            _write_json(os.path.join(cfg.out, "config.json"), dataclasses.asdict(cfg))

        self._on_first_process(claim, cfg.out)

    def _release_run_dir(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _interrupted(self) -> str:
        where = f"interrupted in epoch {self.epoch + 1} after {self.step} step(s)"
        if not self.last_checkpoint:
            return f"{where}; no checkpoint was written yet"
        return (
            f"{where}; the last checkpoint is {self.last_checkpoint!r}: "
            f"continue with: pareprop train --resume {self.cfg.out}"
        )

    def fit(self) -> Dict[str, Any]:
        """Train from the current epoch to ``cfg.epochs`` (or evaluate only); return a summary.

        Raises:
            TrainingInterrupted: on Ctrl-C (SIGINT), saying where the last checkpoint is.
        """
        cfg = self.cfg
        if cfg.eval_only:
            return self._evaluate_checkpoint()
        try:
            # Claimed even when nothing is left to train: a run killed after its last save
            # gets that epoch's metrics line back (NOTE [ Run directories ]).
            self._claim_run_dir()
            if self.resume is not None and self.epoch >= cfg.epochs:
                self._log(
                    f"{cfg.out}: the run has done all its {cfg.epochs} epochs, nothing to "
                    f"train; pass --epochs above {cfg.epochs} to train longer"
                )
                return self._summary(self.epoch, time.perf_counter(), {})
            return self._train_epochs()
        except KeyboardInterrupt:
            raise TrainingInterrupted(self._interrupted()) from None
        finally:
            self._release_run_dir()

    def _evaluate_checkpoint(self) -> Dict[str, Any]:
        metrics = {"type": "eval", "epoch": self.resume.epoch, **self.evaluate()}
        self._append_metrics(metrics)
        self._log(
            f"eval {self.resume.path}: val_acc {metrics['val_acc']:.4f}, "
            f"val_loss {metrics['val_loss']:.4f}"
        )
        return metrics

    def _train_epochs(self) -> Dict[str, Any]:
        cfg = self.cfg
        n_params = sum(p.numel() for p in self.model.parameters())
        self._log(
            f"{self.model.model_name} ({n_params / 1e6:.2f}M params, engine {cfg.engine}) on "
            f"{self.data.name}: {len(self.data.train)} train / {len(self.data.val)} val, "
            f"{self.dist.world_size} process(es) on {self.device}, "
            f"epochs {self.epoch + 1}-{cfg.epochs}, run directory {cfg.out}"
        )
        start, t0, run_epochs = self.epoch, time.perf_counter(), 0
        metrics: Dict[str, Any] = {}
        while self.epoch < cfg.epochs:
            if cfg.stop_after_epochs is not None and run_epochs >= cfg.stop_after_epochs:
                break
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
            metrics = self._run_epoch()
            run_epochs += 1
        summary = self._summary(start, t0, metrics)
        self._append_metrics(summary)
        if metrics:
            self._log(
                f"done: {summary['epochs_run']} epoch(s) in {summary['time_s']:.1f}s; best "
                f"val_acc {self.best['val_acc']:.4f} at epoch {self.best['epoch']}; "
                f"checkpoints in {os.path.join(cfg.out, 'last')} and "
                f"{os.path.join(cfg.out, 'best')}; metrics in "
                f"{os.path.join(cfg.out, 'metrics.jsonl')}"
            )
        return summary

    def _run_epoch(self) -> Dict[str, Any]:
        """One epoch: train, evaluate, checkpoint, record."""
        record = self.train_epoch()
        record.update(self.evaluate())
        self.epoch += 1
        metrics = {"type": "epoch", "epoch": self.epoch, "step": self.step, **record}
        metrics["peak_mem_mb"] = _peak_mem_mb(self.device)
        if not math.isfinite(metrics["val_loss"]):
            # Non-finite weights (a step that overflowed without a non-finite loss) must
            # not become 'last': that would lose the last good checkpoint.
            raise NonFiniteLossError(
                f"validation loss is {metrics['val_loss']} after epoch {self.epoch}: the "
                f"weights are no longer finite and were not saved; {self._kept()}. Lower "
                f"--lr, raise --warmup-epochs or keep --clip-grad"
            )
        self.save(metrics)
        self._append_metrics(metrics)
        self._log(
            f"epoch {self.epoch}: train_loss {metrics['train_loss']:.4f}, val_loss "
            f"{metrics['val_loss']:.4f}, val_acc {metrics['val_acc']:.4f} "
            f"({metrics['samples_per_s']:.0f} samples/s)"
        )
        return metrics

    def _summary(self, start: int, t0: float, metrics: Dict[str, Any]) -> Dict[str, Any]:
        return {
            "type": "summary",
            "model": self.model.model_name,
            "engine": self.cfg.engine,
            "epochs_run": self.epoch - start,
            "epoch": self.epoch,
            "step": self.step,
            "final_val_acc": metrics.get("val_acc"),
            "best_val_acc": self.best["val_acc"],
            "best_epoch": self.best["epoch"],
            "time_s": time.perf_counter() - t0,
            "peak_mem_mb": _peak_mem_mb(self.device),
            "out": self.cfg.out,
        }


def _write_json(path: str, value: Any) -> None:
    """Write ``path`` atomically: a kill leaves the old file or the new one, never half."""
    text = json.dumps(value, indent=2)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def _given_fields(cfg: TrainConfig) -> set:
    """The options of ``cfg`` that differ from the defaults (taken as given explicitly)."""
    default = TrainConfig()
    return {
        name for name in TrainConfig.fields()
        if json.dumps(getattr(cfg, name), sort_keys=True, default=str)
        != json.dumps(getattr(default, name), sort_keys=True, default=str)
    }


def _is_dir(path: Optional[str], run_dir: str) -> bool:
    return isinstance(path, str) and os.path.realpath(path) == run_dir


def _check_is_last(ck: ckpt_lib.Checkpoint, out: str) -> None:
    last = os.path.join(out, "last")
    if os.path.realpath(last) != ck.path:
        raise rundir.RunDirError(
            f"{ck.path!r} is not the last checkpoint of its run ({last} is "
            f"{os.path.realpath(last)!r}): continuing from it in {out!r} would mix two "
            f"histories. Resume {last}, or continue this one in a new directory with --out"
        )


def _check_fsdp(dist: dist_lib.DistInfo) -> None:
    if not dist.active:
        raise ValueError(
            "--fsdp shards the model over the processes of a torchrun job, and this is "
            "one process: start with torchrun --nproc_per_node N ... -m pareprop train "
            "--fsdp, or drop --fsdp"
        )
    if not fsdp_available():
        raise ValueError(
            f"--fsdp needs torch.distributed.fsdp.fully_shard (PyTorch >= 2.6); this is "
            f"torch {torch.__version__}. Upgrade PyTorch, or train with DDP (no --fsdp)"
        )


def train(cfg: TrainConfig, given: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Run ``cfg`` in this process, or in each process of a torchrun job. ``given``: the
    options set explicitly (see :class:`Trainer`)."""
    dist = dist_lib.init(cfg.device)
    try:
        return Trainer(cfg, dist, given).fit()
    finally:
        dist_lib.shutdown(dist)
