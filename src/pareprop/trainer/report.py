"""What a run tells: its messages (on process 0, to stderr) and its ``metrics.jsonl``.

One line of ``metrics.jsonl`` per epoch (``type: epoch``), per evaluation of a checkpoint
(``type: eval``) and per run (``type: summary``); :data:`TIMING_KEYS` are the fields that
measure the machine rather than the run.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Dict

import torch

# Fields of a metrics record that measure the machine, not the run; exact resume compares the rest.
TIMING_KEYS = ("time_s", "samples_per_s", "peak_mem_mb")


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
        where = f"interrupted in epoch {self.epoch + 1} after {self.step} step(s)"
        if not self.last_checkpoint:
            return f"{where}; no checkpoint was written yet"
        return (
            f"{where}; the last checkpoint is {self.last_checkpoint!r}: "
            # --workers is not restored (it is the machine's), but augmentation's random draws
            # are dealt out per worker (NOTE [ Reproducible clips ] in pareprop/video.py): the
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
