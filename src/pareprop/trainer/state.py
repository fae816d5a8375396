"""A run's training state: what a checkpoint saves beside the weights, and resuming it.

NOTE [ Exact resume ]
    A run stopped after epoch k and resumed produces the same numbers as one that was not
    stopped, because everything a step depends on is either a function of ``(seed, epoch)`` or
    saved: the data order comes from a sampler seeded with ``(seed, epoch)``; the model,
    optimizer, scheduler and gradient scaler states are saved; and the RNG states (python,
    numpy, torch CPU and CUDA, per process) are saved after the epoch's evaluation, which is
    exactly where the next epoch starts drawing random crops, dropout and drop-path masks. The
    run's options are saved too and restored on resume, its directory included (NOTE
    [ Resumed configuration ] and NOTE [ Run directories ] in pareprop/trainer/rundir.py).

NOTE [ Sharded checkpoints ]
    With ``--fsdp`` each process holds a shard of every parameter and of its optimizer state.
    A checkpoint is still the single-process layout (model.safetensors + model.json + state.pt),
    so ``pareprop.load_model`` reads it on one process: every process gathers each parameter
    with ``full_tensor()`` (a collective, so all take part) and the optimizer state with
    ``get_optimizer_state_dict(full_state_dict=True)``, keyed by parameter names; process 0
    writes. Resuming builds and shards the model from the whole weights, and
    ``set_optimizer_state_dict`` cuts each process's shard of the whole optimizer state back
    out: copies, no arithmetic, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Tuple

import torch

from pareprop import checkpoint as ckpt_lib
from pareprop import distributed as dist_lib


class TrainState:
    """Saving the training state after an epoch, and loading it to resume (NOTE [ Exact
    resume ]).

    Part of :class:`~pareprop.trainer.Trainer`; reads and restores its ``optimizer``,
    ``scheduler``, ``scaler``, ``coupling``, ``epoch``, ``step``, ``best`` and
    ``last_checkpoint``.
    """

    # The validation metric that picks the ``best`` checkpoint (higher is better).
    BEST_KEY = "val_acc"

    def _load_train_state(self, ck: ckpt_lib.Checkpoint) -> None:
        st = ck.train_state
        if st is None:
            raise ckpt_lib.CheckpointError(
                f"{ck.path!r} holds weights only, no training state to resume from; "
                "evaluate it with --eval-only or start a new run"
            )
        self._load_optimizer_state(ck)
        self.epoch, self.step = int(st["epoch"]), int(st["step"])
        self.saved_epoch = self.epoch
        self._load_schedule(st["scheduler"])
        self.scaler.load_state_dict(st["scaler"])
        if self.coupling is not None and "coupling" in st:
            self.coupling.load_state_dict(st["coupling"])
        self.best = dict(st["best"])
        self.last_checkpoint = ck.path
        saved_workers = json.loads(st.get("config") or "{}").get("workers", self.cfg.workers)
        if saved_workers != self.cfg.workers:
            self._log(
                f"note: checkpoint saved by a run with --workers {saved_workers}, resuming with "
                f"{self.cfg.workers}: augmentation draws will differ from an uninterrupted run"
            )
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
        key = self.BEST_KEY  # val_acc, or a detection run's bbox_AP
        is_best = metrics[key] > self.best[key]
        if is_best:
            self.best = {key: metrics[key], "epoch": self.epoch}
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
            self.saved_epoch = self.epoch  # with last_checkpoint, for an interruption's message
        dist_lib.barrier(self.dist)
        self.saved_epoch = self.epoch

