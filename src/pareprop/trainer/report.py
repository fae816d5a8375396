"""What a run tells: its messages (on process 0, to stderr), its ``metrics.jsonl`` and, with
``--tensorboard``, its scalars for TensorBoard.

One line of ``metrics.jsonl`` per epoch (``type: epoch``), per evaluation of a checkpoint
(``type: eval``) and per run (``type: summary``); :data:`TIMING_KEYS` are the fields that
measure the machine rather than the run.

NOTE [ TensorBoard ]
    ``--tensorboard`` writes, as timm's and torchvision's reference scripts do, with
    ``torch.utils.tensorboard.SummaryWriter`` into ``OUT/tensorboard`` (``tensorboard --logdir
    OUT``), every scalar against the optimizer step: ``train/loss`` (the epoch's running mean),
    ``train/lr``, ``train/samples_per_s`` and ``train/peak_mem_mb`` every ``--log-interval``
    steps, and each epoch's record (``epoch/train_loss``, ``epoch/train_acc``,
    ``epoch/val_loss``, ``epoch/val_acc``, ``epoch/lr``, ``epoch/samples_per_s``,
    ``epoch/peak_mem_mb``) at its last step. A resumed run purges what its directory's files
    hold past the checkpoint it resumes from (``purge_step``): the part of the run that was lost.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Dict, Optional

import torch

from pareprop.convert.coupling import coupling_of
from pareprop.trainer.config import MISSING_TENSORBOARD

# Fields of a metrics record that measure the machine, not the run; exact resume compares the rest.
TIMING_KEYS = ("time_s", "samples_per_s", "peak_mem_mb")
# The fields of an epoch's record written for TensorBoard (NOTE [ TensorBoard ]).
EPOCH_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "samples_per_s",
                 "peak_mem_mb")


def peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Peak resident set of the process (kilobytes on Linux): the CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RunReport:
    """The trainer's messages and metrics records.

    Part of :class:`~pareprop.trainer.Trainer`; reads its ``dist``, ``cfg``, ``model``,
    ``device``, ``epoch``, ``step``, ``best`` and ``last_checkpoint``.
    """

    _scalars: Optional[Any] = None  # the SummaryWriter of --tensorboard, on process 0

    def _open_scalars(self) -> None:
        """With ``--tensorboard``, open ``OUT/tensorboard`` (NOTE [ TensorBoard ])."""
        if not self.cfg.tensorboard or self.dist.rank != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: pareprop[tensorboard]
        except ImportError:
            raise ValueError(MISSING_TENSORBOARD) from None
        # Resumed: what the files hold past the checkpoint's step was lost with the run.
        self._scalars = SummaryWriter(os.path.join(self.cfg.out, "tensorboard"),
                                      purge_step=self.step + 1 if self.step else None)

    def _write_scalars(self, group: str, values: Dict[str, float]) -> None:
        if self._scalars is not None:
            for name, value in values.items():
                self._scalars.add_scalar(f"{group}/{name}", value, self.step)

    def _close_scalars(self) -> None:
        if self._scalars is not None:
            self._scalars.close()
            self._scalars = None

    def _coupling_record(self) -> Dict[str, Any]:
        """A converted model's (or detector backbone's) coupling at the epoch's end and its
        precision guard's last report (NOTE [ The precision guard ]): which blocks it stores
        and why, in the log and in ``metrics.jsonl`` (``coupling``, ``guard_stored``,
        ``guard_report``)."""
        if self.coupling is None:
            return {}
        record: Dict[str, Any] = {"coupling": list(coupling_of(self.model))}
        guard = getattr(self.model, "precision_guard", None)
        report = guard.report if guard is not None else None
        if report is not None:
            record["guard_stored"] = list(report.stored)
            record["guard_report"] = str(report)
            self._log(f"precision guard: {report}")
        return record

    def _log(self, msg: str) -> None:
        if self.dist.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def _kept(self) -> str:
        if self.last_checkpoint:
            return f"the last good checkpoint {self.last_checkpoint!r} is kept"
        return "no checkpoint was written yet"

    def _append_metrics(self, record: Dict[str, Any]) -> None:
        if self.dist.rank != 0:
            return
        os.makedirs(self.cfg.out, exist_ok=True)
        with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _interrupted(self) -> str:
        if self.saved_epoch < self.epoch:  # stopped between an epoch's end and its checkpoint
            where = (f"interrupted after epoch {self.epoch} ({self.step} step(s)), before its "
                     "checkpoint was written")
        else:
            where = f"interrupted in epoch {self.epoch + 1} after {self.step} step(s)"
        if not self.last_checkpoint:
            return f"{where}; no checkpoint was written yet"
        return (
            f"{where}; the last checkpoint is {self.last_checkpoint!r}: "
            # --workers is not restored (it is the machine's), but augmentation's random draws
            # are dealt out per worker (NOTE [ Reproducible clips ] in pareprop/data/video.py): the
            # same number continues exactly.
            f"continue with: pareprop train --resume {self.cfg.out} --workers {self.cfg.workers}"
        )

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
            "peak_mem_mb": peak_mem_mb(self.device),
            "out": self.cfg.out,
        }
