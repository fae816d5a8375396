"""Fine-tuning a converted timm ViT in the trainer: ``pareprop train --convert-from NAME``.

The trainer keeps only a few hooks (its config fields, one schedule step per optimizer step,
the schedule's state in checkpoints); what they mean lives here. A run with ``convert_from``
builds ``create_model("converted_vit", source=NAME, ...)`` (pareprop.models.converted_vit), so
checkpoints record the source, and the coupling the model was saved at, like any model.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from pareprop.coupling import SCHEDULES, CouplingSchedule

__all__ = ["CONVERTED_MODEL", "apply_convert_options", "make_coupling_schedule"]

CONVERTED_MODEL = "converted_vit"


def apply_convert_options(cfg: Any) -> None:
    """Check the fine-tuning fields of a TrainConfig and, with ``convert_from``, point the run at
    the converted model (called before the config fills in a preset for its model)."""
    if cfg.coupling_schedule not in SCHEDULES:
        raise ValueError(
            f"expected --coupling-schedule one of {', '.join(SCHEDULES)}, got "
            f"{cfg.coupling_schedule!r}"
        )
    if cfg.coupling_steps is not None and int(cfg.coupling_steps) < 1:
        raise ValueError(f"expected --coupling-steps >= 1 (or unset), got {cfg.coupling_steps}")
    if cfg.convert_from is None:
        if cfg.pretrained_file is not None:
            raise ValueError("--pretrained-file goes with --convert-from NAME (a timm ViT)")
        return
    if cfg.memory_budget is not None:
        raise ValueError(
            "--memory-budget with --convert-from is not supported: the precision guard chooses "
            "the stored blocks of a converted model while its skip scale is small (docs/convert.md)"
        )
    import timm

    if not timm.is_model(cfg.convert_from):
        raise ValueError(f"--convert-from {cfg.convert_from!r} is not a timm model name")
    kwargs = dict(cfg.model_kwargs or {})
    kwargs["source"] = cfg.convert_from
    if cfg.pretrained_file is not None:
        kwargs["pretrained_file"] = cfg.pretrained_file
    cfg.model, cfg.model_kwargs = CONVERTED_MODEL, kwargs


def make_coupling_schedule(cfg: Any, model: nn.Module,
                           steps_per_epoch: int) -> Optional[CouplingSchedule]:
    """The schedule the trainer steps after each optimizer step, or None for other models.
    ``coupling_steps`` unset: one epoch."""
    if getattr(model, "model_name", None) != CONVERTED_MODEL:
        return None
    steps = cfg.coupling_steps if cfg.coupling_steps is not None else steps_per_epoch
    # A run from a checkpoint keeps the coupling the model was saved at (model.json): resuming
    # loads the schedule's state, and --eval-only evaluates the model as it was trained.
    return CouplingSchedule(model, cfg.coupling_schedule, steps, apply=cfg.resume is None)
