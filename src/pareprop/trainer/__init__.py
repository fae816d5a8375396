"""The training loop behind ``pareprop train``.

One :class:`TrainConfig` holds every choice of a run (the CLI, a YAML/JSON file and the tests
all fill it); :func:`train` runs it and returns a summary. The loop is ordinary supervised
training (AdamW, cosine schedule with warm-up, label smoothing, gradient clipping, autocast);
what is particular to pareprop is only that the model's engine is picked by name, and that a
run can be resumed exactly.

One job per module, in the order a run meets them:

* :mod:`~pareprop.trainer.config`: :class:`TrainConfig`, its checks, ``PRESETS``.
* :mod:`~pareprop.trainer.report`: the run's messages and ``metrics.jsonl`` records.
* :mod:`~pareprop.trainer.directory`: which run directory a run writes, and claiming it.
* :mod:`~pareprop.trainer.setup`: device, model and data, engine options, loaders, processes,
  optimizer (NOTE [ Batch size ]).
* :mod:`~pareprop.trainer.state`: the training state a checkpoint saves, and resuming it
  (NOTE [ Exact resume ], NOTE [ Sharded checkpoints ]).
* :mod:`~pareprop.trainer.loop`: a micro-batch, an optimizer step, an epoch, an evaluation.
* :mod:`~pareprop.trainer.run`: :class:`Trainer` (the set-up steps in order, then the epochs)
  and :func:`train`.
* :mod:`~pareprop.trainer.detection`: :class:`DetectionTrainer`, the set-up, epoch and
  evaluation of ``--task detection`` (a torchvision detector, COCO AP).
"""

# Importable from here as when this was one module (the CLI, the tests and the docs use
# AMP_MODES, PRESETS and TIMING_KEYS); __all__ keeps the names it had.
# ruff: noqa: F401
from pareprop.trainer.config import AMP_MODES, DETECTION_DEFAULTS, PRESETS, TASKS, TrainConfig
from pareprop.trainer.loop import NonFiniteLossError
from pareprop.trainer.report import TIMING_KEYS
from pareprop.trainer.run import Trainer, TrainingInterrupted, train
from pareprop.trainer.setup import param_groups

__all__ = [
    "TrainConfig", "Trainer", "train", "NonFiniteLossError", "TrainingInterrupted", "param_groups"
]
