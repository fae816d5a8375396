"""Training a detector: the set-up, epoch and evaluation of a detection run, which
``DetectionTrainer`` (run.py) puts in place of a classifier's.

Everything else is the classification trainer's, unchanged: the run directory, the optimizer
and its schedule, gradient accumulation and clipping, the fp16 scaler, the non-finite stop
(NOTE [ Reading the device once per log interval ] in loop.py), checkpoints and exact resume
(state.py), TensorBoard and the progress bar (report.py), DDP.

NOTE [ A detection step ]
    torchvision's detectors take a list of images and a list of targets and, in training mode,
    return their losses as a dict (RPN objectness and box regression, RoI classification and
    box regression, masks for Mask R-CNN). The step minimises their plain sum, as torchvision's
    reference scripts do; each loss is summed on the device beside the total and read with it,
    so ``metrics.jsonl`` has ``train_loss`` and ``train_<name>`` for each of them. Validation
    is COCO AP (:mod:`pareprop.evaluate_detection`), and the ``best`` checkpoint is the one of
    the highest ``bbox_AP``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from pareprop import checkpoint as ckpt_lib
from pareprop import distributed as dist_lib
from pareprop.data import epoch_sampler
from pareprop.data.coco import collate_detection
from pareprop.detection import create_detector, detector_from_spec, parse_detector_name
from pareprop.detection.coco_eval import evaluate_detections
from pareprop.detection.visualize import save_predictions
from pareprop.engine import apply_chunking
from pareprop.engine.compile import compile_blocks
from pareprop.evaluate_detection import (
    detection_data_config,
    detection_datasets,
    detection_val_loader,
)
from pareprop.trainer.loop import NonFiniteLossError, TrainLoop
from pareprop.trainer.report import peak_mem_mb
from pareprop.trainer.setup import RunSetup, _seed

__all__ = ["DetectionSetup", "DetectionLoop", "DetectionRun"]

# The square crop a detection run trains at when its model options name no max_size
# (ViTDet's large-scale jitter crop).
DEFAULT_TRAIN_SIZE = 1024
# Images per validation forward: small, as a detector's activations at full size are large.
VAL_BATCH_SIZE = 4


@dataclass
class DetectionData:
    """A detection run's data: what the trainer reads of ``self.data``."""

    name: str
    train: Dataset
    val: Dataset
    num_classes: int  # categories + 1 (background), torchvision's convention
    data_config: Dict[str, Any]  # saved in every checkpoint (pareprop.evaluate_detection)


def _to_device(targets: List[Dict[str, Any]], device: torch.device) -> List[Dict[str, Any]]:
    """Targets as plain tensors on ``device`` (tv_tensors wrappers are for the transforms)."""
    out = []
    for t in targets:
        out.append({k: v.as_subclass(torch.Tensor).to(device, non_blocking=True)
                    if isinstance(v, torch.Tensor) else v for k, v in t.items()})
    return out


class DetectionSetup(RunSetup):
    """The set-up steps that differ for a detector: the model and data, the engine options
    that name the backbone, and the loaders (a list of images per batch)."""

    def _build_model(self) -> nn.Module:
        """The data (the shapes written once on process 0) and the detector: from the
        checkpoint's spec and weights when resuming, else ``create_detector``, with as many
        classes as the data has."""
        cfg, resume = self.cfg, self.resume
        kwargs = dict(cfg.model_kwargs or {})
        if resume is not None:
            config = resume.meta.get("data_config")
        else:
            train_size = int(kwargs.get("max_size", DEFAULT_TRAIN_SIZE))
            config = detection_data_config(cfg.dataset, cfg.data_dir, train_size, VAL_BATCH_SIZE)
        if self.dist.rank == 0:
            detection_datasets(config, cfg.augment)  # writes the shapes if they are missing
        dist_lib.barrier(self.dist)
        train, val = detection_datasets(config, cfg.augment, prepare=False)
        name = config["dataset"] if config["dataset"] == "shapes" else config["root"]
        self.data = DetectionData(name, train, val, len(train.categories) + 1, config)
        _seed(cfg.seed)
        if resume is not None:
            spec = resume.meta["model"]
            if not ckpt_lib.is_detector_spec(spec):
                raise ckpt_lib.CheckpointError(
                    f"{resume.path!r} holds the classifier {spec.get('name')!r}, not a "
                    "detector: resume it without --task detection"
                )
            model = detector_from_spec(spec["detector"], engine=cfg.engine).to(self.device)
            ckpt_lib.load_weights(model, resume)
            return model
        arch, backbone = parse_detector_name(cfg.model)
        asked = kwargs.pop("num_classes", None)
        if asked is not None and asked != self.data.num_classes:
            raise ValueError(
                f"--num-classes {asked} disagrees with {name!r}, which has "
                f"{self.data.num_classes - 1} categories (+1 background): drop --num-classes"
            )
        if cfg.pretrained_file is not None:
            if kwargs.get("pretrained_file", cfg.pretrained_file) != cfg.pretrained_file:
                raise ValueError(
                    f"--pretrained-file {cfg.pretrained_file} and --model-arg pretrained_file="
                    f"{kwargs['pretrained_file']} name two starting points: give one")
            kwargs["pretrained_file"] = cfg.pretrained_file
        model = create_detector(arch, backbone, self.data.num_classes, engine=cfg.engine,
                                **kwargs)
        return model.to(self.device)

    def _setup_engine(self, model: nn.Module) -> None:
        """Activation checkpointing of the backbone, chunking and compilation (the memory
        budget is refused for detectors in TrainConfig)."""
        cfg = self.cfg
        self.memory_plan = None
        if cfg.grad_checkpointing:
            backbone = getattr(model, "backbone", None)
            if not hasattr(backbone, "set_grad_checkpointing"):
                raise ValueError(f"--grad-checkpointing: the backbone of {cfg.model} has no "
                                 "blocks to checkpoint; drop --grad-checkpointing")
            backbone.set_grad_checkpointing(True)
        apply_chunking(model, cfg.chunking)
        if cfg.compile:
            compile_blocks(model)
        if self.dist.rank > 0:
            _seed(cfg.seed + self.dist.rank)

    def _setup_data(self) -> None:
        """As a classifier's (NOTE [ Batch size ] in setup.py), with detection's collate; every
        process validates on the whole set (NOTE [ The same AP in training and evaluation ])."""
        cfg, world = self.cfg, self.dist.world_size
        self.micro_batch = self._micro_batch_size()
        self.sampler = epoch_sampler(self.data.train, cfg.seed, num_replicas=world,
                                     rank=self.dist.rank)
        self.train_loader = DataLoader(
            self.data.train, batch_size=self.micro_batch, sampler=self.sampler,
            num_workers=cfg.workers, pin_memory=self.device.type == "cuda",
            collate_fn=collate_detection,
        )
        self.val_loader = detection_val_loader(
            self.data.val, self.data.data_config["val_batch_size"], cfg.workers
        )
        self.micro_per_epoch = len(self.train_loader)
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / cfg.grad_accum)
        self.total_steps = self.steps_per_epoch * cfg.epochs


class DetectionLoop(TrainLoop):
    """A detection epoch (NOTE [ A detection step ]): the classifier's
    :meth:`~TrainLoop.train_epoch` with a detector's micro-step and record; COCO evaluation."""

    RATE_FORMAT = ".1f"

    def _detection_step(
        self, i: int, images: List[torch.Tensor], targets: List[Dict[str, Any]]
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], bool]:
        """Micro-batch ``i``: forward, the summed loss and backward; (loss, losses, ends a
        step)."""

        def forward() -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
            with self._autocast():
                losses = self.net(images, targets)
            losses = {k: v.float() for k, v in losses.items()}
            return sum(losses.values()), losses

        return self._backward(i, forward)

    def _micro_step(
        self, i: int, batch: Any
    ) -> Tuple[torch.Tensor, int, torch.Tensor, bool]:
        """As a classifier's; the row is loss x n, then each named loss x n, the names those
        of the epoch's first batch."""
        images, targets = batch
        images = [im.as_subclass(torch.Tensor).to(self.device, non_blocking=True)
                  for im in images]
        loss, losses, last_micro = self._detection_step(
            i, images, _to_device(targets, self.device))
        if i == 0:
            self._loss_names = list(losses)
        n = len(images)
        parts = [loss.detach()] + [losses[k].detach() for k in self._loss_names]
        return loss, n, torch.stack(parts).double() * n, last_micro

    def _zero_sums(self) -> torch.Tensor:
        self._loss_names = []
        return torch.zeros(1, dtype=torch.float64, device=self.device)

    def _train_record(self, sums: List[float], count: float) -> Dict[str, Any]:
        record = {"train_loss": sums[0] / count}
        record.update({f"train_{k}": v / count for k, v in zip(self._loss_names, sums[1:])})
        return record

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """COCO AP on the validation set (the bare model, in eval mode, the run's autocast)."""
        self.model.eval()
        return evaluate_detections(self.model, self.val_loader, self.data.val, self.device,
                                   autocast=self.amp_dtype)


class DetectionRun:
    """A detection run's epoch checks and lines (the hooks of the trainer's ``_run_epoch``),
    picture, checkpoint evaluation and summary, in place of the
    :class:`~pareprop.trainer.Trainer`'s (``DetectionTrainer`` in run.py puts them
    first); the ``best`` checkpoint is the one of the highest box AP."""

    BEST_KEY = "bbox_AP"

    def _check_finite(self, metrics: Dict[str, Any]) -> None:
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            # AP does not go NaN with the weights: look at them, so 'last' stays good.
            raise NonFiniteLossError(
                f"the weights are no longer finite after epoch {self.epoch} and were not "
                f"saved; {self._kept()}. Lower --lr, raise --warmup-epochs or keep --clip-grad"
            )

    def _epoch_scalars(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in metrics.items() if k not in ("type", "epoch", "step")}

    def _epoch_line(self, metrics: Dict[str, Any]) -> str:
        aps = ", ".join(f"{k} {metrics[k]:.4f}" for k in ("bbox_AP", "bbox_AP50", "segm_AP")
                        if k in metrics)
        return (f"epoch {self.epoch}: train_loss {metrics['train_loss']:.4f}, {aps} "
                f"({metrics['samples_per_s']:.1f} images/s)")

    def _train_epochs(self) -> Dict[str, Any]:
        summary = super()._train_epochs()
        if summary["epochs_run"] and self.dist.rank == 0:
            self._save_picture()
        return summary

    def _save_picture(self) -> None:
        """OUT/predictions.png: the detector's boxes and masks on validation images."""
        path = os.path.join(self.cfg.out, "predictions.png")
        self.model.eval()
        save_predictions(self.model, self.data.val, path)
        self._log(f"predictions on validation images: {path}")

    def _evaluate_checkpoint(self) -> Dict[str, Any]:
        metrics = {"type": "eval", "epoch": self.resume.epoch, **self.evaluate()}
        self._append_metrics(metrics)
        aps = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.endswith("AP50"))
        self._log(f"eval {self.resume.path}: {aps}")
        return metrics

    def _summary(self, start: int, t0: float, metrics: Dict[str, Any]) -> Dict[str, Any]:
        final = {f"final_{k}": v for k, v in metrics.items()
                 if k.startswith(("bbox_", "segm_"))}
        return {
            "type": "summary",
            "model": self.cfg.model,
            "engine": self.cfg.engine,
            "epochs_run": self.epoch - start,
            "epoch": self.epoch,
            "step": self.step,
            **final,
            "best_bbox_AP": self.best[self.BEST_KEY],
            "best_epoch": self.best["epoch"],
            "time_s": time.perf_counter() - t0,
            "peak_mem_mb": peak_mem_mb(self.device),
            "out": self.cfg.out,
        }
