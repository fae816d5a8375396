"""The trainer: a run's set-up steps in order, then its epochs; and :func:`train`, which runs
one in this process or in each process of a torchrun job.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, Iterable, List, Optional

from pareprop import distributed as dist_lib
from pareprop.checkpoint import is_detector_spec, load_checkpoint
from pareprop.trainer import rundir
from pareprop.trainer.config import TrainConfig
from pareprop.trainer.detection import DetectionLoop, DetectionRun, DetectionSetup
from pareprop.trainer.directory import RunDirectory
from pareprop.trainer.loop import NonFiniteLossError, TrainLoop
from pareprop.trainer.report import EPOCH_SCALARS, RunReport, peak_mem_mb
from pareprop.trainer.setup import RunSetup
from pareprop.trainer.state import TrainState


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; the message says where its last checkpoint is."""


class Trainer(RunReport, RunDirectory, RunSetup, TrainState, TrainLoop):
    """Builds the model, data, optimizer and schedule of a :class:`TrainConfig` and runs them.

    ``__init__`` is the run's set-up, step by step; :meth:`fit` runs its epochs. The steps
    live with their kind, one module each: :class:`RunDirectory` (directory.py) opens the run
    and claims its directory, :class:`RunSetup` (setup.py) builds what it trains,
    :class:`TrainState` (state.py) saves and resumes, :class:`TrainLoop` (loop.py) trains and
    evaluates, :class:`RunReport` (report.py) says and records what happened.

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
        self.saved_epoch = 0  # the epoch of the last checkpoint written (or resumed from)
        self.best = {self.BEST_KEY: -1.0, "epoch": 0}
        self.step_losses: List[float] = []
        self.last_checkpoint: Optional[str] = None
        self._lock: Optional[rundir.RunLock] = None
        if self.resume is not None and not self.cfg.eval_only:
            self._load_train_state(self.resume)

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
            self._open_scalars()
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
            self._close_scalars()
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
        name = getattr(self.model, "model_name", cfg.model)  # a detector: its ARCH:BACKBONE
        self._log(
            f"{name} ({n_params / 1e6:.2f}M params, engine {cfg.engine}) on "
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
                f"{self.BEST_KEY} {self.best[self.BEST_KEY]:.4f} at epoch {self.best['epoch']}; "
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
        metrics["peak_mem_mb"] = peak_mem_mb(self.device)
        metrics.update(self._coupling_record())
        self._check_finite(metrics)
        self.save(metrics)
        self._append_metrics(metrics)
        self._write_scalars("epoch", self._epoch_scalars(metrics))
        self._log(self._epoch_line(metrics))
        return metrics

    def _check_finite(self, metrics: Dict[str, Any]) -> None:
        """Stop before saving weights that are no longer finite."""
        if not math.isfinite(metrics["val_loss"]):
            # Non-finite weights (a step that overflowed without a non-finite loss) must
            # not become 'last': that would lose the last good checkpoint.
            raise NonFiniteLossError(
                f"validation loss is {metrics['val_loss']} after epoch {self.epoch}: the "
                f"weights are no longer finite and were not saved; {self._kept()}. Lower "
                f"--lr, raise --warmup-epochs or keep --clip-grad"
            )

    def _epoch_scalars(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        """The epoch's numbers written to TensorBoard."""
        return {k: metrics[k] for k in EPOCH_SCALARS}

    def _epoch_line(self, metrics: Dict[str, Any]) -> str:
        """The epoch's line in the log."""
        return (
            f"epoch {self.epoch}: train_loss {metrics['train_loss']:.4f}, val_loss "
            f"{metrics['val_loss']:.4f}, val_acc {metrics['val_acc']:.4f} "
            f"({metrics['samples_per_s']:.0f} samples/s)"
        )


class DetectionTrainer(DetectionRun, DetectionSetup, DetectionLoop, Trainer):
    """:class:`Trainer` for ``--task detection`` (pareprop/trainer/detection.py): a detector on
    COCO-format data, validated by COCO AP, its best checkpoint the one of the highest box AP."""


def train(cfg: TrainConfig, given: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Run ``cfg`` in this process, or in each process of a torchrun job. ``given``: the
    options set explicitly (see :class:`Trainer`)."""
    trainer_class = _trainer_class(cfg)
    dist = dist_lib.init(cfg.device)
    try:
        return trainer_class(cfg, dist, given).fit()
    finally:
        dist_lib.shutdown(dist)


def _trainer_class(cfg: TrainConfig) -> type:
    """The trainer of the run's task: the resumed checkpoint's, else the config's."""
    task = cfg.task
    if cfg.resume is not None:
        spec = load_checkpoint(cfg.resume, train_state=False).meta.get("model")
        task = "detection" if is_detector_spec(spec) else "classification"
    return DetectionTrainer if task == "detection" else Trainer
