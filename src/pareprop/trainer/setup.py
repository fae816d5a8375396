"""Setting up a run: device, model and data, engine options, loaders, processes, optimizer.

Each step is one method of :class:`RunSetup`, called in order by the trainer's ``__init__``;
a resumed run builds its model from the checkpoint's spec and weights, and its stored blocks
are the checkpoint's, not measured again.

NOTE [ Batch size ]
    ``batch_size`` is the global number of samples per optimizer step. Each of ``world_size``
    processes feeds ``batch_size / (world_size * grad_accum)`` samples per micro-batch. Because
    the distributed sampler deals sample ``i`` of the epoch's order to process ``i % world``, a
    step covers the same samples whatever the number of processes and micro-batches, so a run
    changes neither its learning rate nor its results when it is spread out.
"""

from __future__ import annotations

import math
import os
import random
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

from pareprop import checkpoint as ckpt_lib
from pareprop import distributed as dist_lib
from pareprop.convert import converted_model_names
from pareprop.convert.timm_pretrained import load_timm_pretrained
from pareprop.data import (
    build_datasets,
    epoch_sampler,
    is_video_model,
    model_data_config,
    video_data_config,
)
from pareprop.distributed.fsdp import fsdp_available
from pareprop.engine import ENGINES, apply_chunking
from pareprop.engine.compile import compile_blocks
from pareprop.memory.budget import parse_budget, set_memory_budget
from pareprop.models import create_model
from pareprop.trainer.finetune import (
    create_finetune_optimizer,
    load_initial_weights,
    make_coupling_schedule,
    start_coupling,
)


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on the ``no_weight_decay()`` names of the model and of
    every module in it (position embeddings, relative position tables; a detector's backbone
    trunk's, prefixed by its path) nor on norms and biases (any 0-D or 1-D tensor)."""
    skip = set()
    for path, module in model.named_modules():
        if callable(getattr(module, "no_weight_decay", None)):
            prefix = f"{path}." if path else ""
            skip.update(prefix + n for n in module.no_weight_decay())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _seed(seed: int) -> None:
    """Seed every generator a step may draw from, all of which a checkpoint saves (NOTE
    [ Exact resume ]): torch's (augmentation, video clips, dropout, drop path), and Python's
    and numpy's, for a data set of the user's that draws from them."""
    import numpy as np  # as pareprop.checkpoint's rng_state: loaded where it is used

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


class RunSetup:
    """The set-up steps of a run, in the order the trainer's ``__init__`` calls them:

    * ``_setup_device``: ``device`` and ``amp_dtype``, refusing an engine, ``--amp`` or
      ``--fsdp`` this machine or process cannot run;
    * ``_build_model``: the bare ``model`` and the ``data`` sets;
    * ``_setup_engine``: the ``memory_plan`` of ``--memory-budget``, activation checkpointing,
      chunking and compilation;
    * ``_setup_data``: ``sampler``, ``train_loader``, ``val_loader``, ``micro_batch``,
      ``micro_per_epoch``, ``steps_per_epoch`` and ``total_steps``;
    * ``_setup_processes``: ``net``, the model the loop calls (under DDP or FSDP2);
    * ``_setup_optimizer``: ``optimizer``, ``scheduler``, ``scaler`` and ``coupling``.

    Part of :class:`~pareprop.trainer.Trainer`; reads its ``dist``, ``cfg`` and ``resume``.
    """

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
        if resume is None and name in converted_model_names() and \
                start_coupling(cfg) != (1.0, 0.0):
            # Built where its schedule starts, so initial weights are checked against that
            # coupling (NOTE [ The coupling travels with the weights ]).
            kwargs["coupling"] = list(start_coupling(cfg))
        _seed(cfg.seed)
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
        elif cfg.convert_from is not None and cfg.pretrained_file is not None and \
                os.path.isdir(cfg.pretrained_file):  # a pareprop checkpoint of a converted run
            load_initial_weights(model, cfg.pretrained_file)
        elif cfg.convert_from is not None and cfg.pretrained_file is None and not cfg.from_scratch:
            load_timm_pretrained(model, cfg.convert_from)
        return model

    def _data_config(self, model: nn.Module, input_size: Tuple[int, ...]) -> Optional[dict]:
        """The data config the run normalises by (NOTE [ One data config ] in
        pareprop/data/config.py): the checkpoint's when resuming, the model's own when starting
        from pretrained weights, else None (the data set's statistics). A video model's is its
        own, always."""
        cfg = self.cfg
        if is_video_model(model):
            return video_data_config(model)
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
        apply_chunking(model, cfg.chunking)
        if cfg.compile:
            compile_blocks(model)
        # Each process draws its own augmentation and dropout; process 0 matches a
        # single-process run of the same seed.
        if self.dist.rank > 0:
            _seed(cfg.seed + self.dist.rank)

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

    def _micro_batch_size(self) -> int:
        """Each process's micro-batch: --batch-size over processes x --grad-accum."""
        cfg, world, accum = self.cfg, self.dist.world_size, self.cfg.grad_accum
        if cfg.batch_size % (world * accum):
            raise ValueError(
                f"expected --batch-size divisible by processes x --grad-accum = {world} x {accum}, "
                f"got {cfg.batch_size}"
            )
        return cfg.batch_size // (world * accum)

    def _setup_data(self) -> None:
        """Per-process micro-batches (see NOTE [ Batch size ]) and the validation shard."""
        cfg, world = self.cfg, self.dist.world_size
        self.micro_batch = self._micro_batch_size()
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
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / cfg.grad_accum)
        self.total_steps = self.steps_per_epoch * cfg.epochs

    def _setup_processes(self) -> None:
        """DDP wraps the model; shard() turns the model itself into an FSDP2 module, so then
        self.net is self.model (NOTE [ Sharded checkpoints ] in state.py: what saving does)."""
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

    def _autocast(self):
        """The run's ``--amp`` autocast on its device (a no-op context without one)."""
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

