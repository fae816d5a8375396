"""Fine-tuning in the trainer: from published weights, and from a converted timm ViT.

Published weights (``pareprop train --pretrained`` / ``--pretrained-file``): the initial
weights with a fresh head (:func:`load_initial_weights`), and AdamW with layer-wise
learning-rate decay through timm's optimizer factory (:func:`create_finetune_optimizer`).
Layer decay scales block ``i``'s learning rate by ``layer_decay ** (L - i)`` (the head by 1,
the stem by the smallest factor); the layer of every parameter comes from the model's
``group_matcher`` (every pareprop family has one), and timm's schedulers apply the factors
(``lr_scale`` in each parameter group), so they work with ``pareprop train``'s cosine schedule.

A converted timm ViT (``pareprop train --convert-from NAME``): the trainer keeps only a few
hooks (its config fields, one schedule step per optimizer step, the schedule's state in
checkpoints); what they mean lives here. A run with ``convert_from`` builds
``create_model("converted_vit", source=NAME, ...)`` (pareprop.models.converted_vit), so
checkpoints record the source, and the coupling the model was saved at, like any model;
``--pretrained-file`` is then the timm weights of the source.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import timm
import torch
import torch.nn as nn
from timm.models._hub import download_cached_file
from timm.optim import create_optimizer_v2

from pareprop.coupling import SCHEDULES, CouplingSchedule
from pareprop.pretrained import PUBLISHED, LoadReport, PretrainedError, load_pretrained

__all__ = [
    "CONVERTED_MODEL",
    "apply_convert_options",
    "make_coupling_schedule",
    "load_initial_weights",
    "create_finetune_optimizer",
]

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
        return  # --pretrained(-file) then starts a registered model (load_initial_weights)
    if cfg.pretrained:
        raise ValueError(
            "--pretrained downloads a published reversible model's weights; with --convert-from "
            "give the timm weights as --pretrained-file (or none: timm's own download)"
        )
    if cfg.memory_budget is not None:
        raise ValueError(
            "--memory-budget with --convert-from is not supported: the precision guard chooses "
            "the stored blocks of a converted model while its skip scale is small (docs/convert.md)"
        )
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


def load_initial_weights(
    model: nn.Module, path: Optional[Union[str, os.PathLike]] = None, name: Optional[str] = None
) -> LoadReport:
    """Load the weights a fine-tuning run starts from into ``model``.

    The file's classifier is left out when the model has another class count (the model keeps
    its fresh head; a warning says so).

    Args:
        model: the model to fine-tune, built with its target ``num_classes``.
        path: a local weight file or pareprop checkpoint; None downloads the published file of
            ``name`` (timm's download cache).
        name: the registry name (default: ``model.model_name``).
    """
    if path is None:
        name = name or getattr(model, "model_name", None)
        if name not in PUBLISHED:
            raise PretrainedError(
                f"no published weights for {name!r} (published: {', '.join(PUBLISHED)}); "
                "pass a local file instead"
            )
        try:
            path = download_cached_file(PUBLISHED[name].url, check_hash=False, progress=True)
        except OSError as e:
            raise PretrainedError(
                f"could not fetch {PUBLISHED[name].url!r}: {e}; offline, download it elsewhere "
                "and pass its path"
            ) from None
    return load_pretrained(model, path)


def create_finetune_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.05,
    layer_decay: Optional[float] = None,
    opt: str = "adamw",
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """timm's ``create_optimizer_v2`` over ``model``: no weight decay on 1-D parameters and the
    model's ``no_weight_decay()``; with ``layer_decay`` (0 < d <= 1), per-layer learning-rate
    factors from the model's ``group_matcher`` (``lr_scale`` of each parameter group).

    Args:
        model: the model.
        lr: peak learning rate (the head's; lower layers get ``lr * lr_scale``).
        weight_decay: decoupled weight decay.
        layer_decay: layer-wise learning-rate decay; None for none.
        opt: timm optimizer name.
        **kwargs: passed to ``create_optimizer_v2`` (betas, eps, ...).
    """
    if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
        raise ValueError(f"expected layer_decay in (0, 1], got {layer_decay}")
    if layer_decay is not None and not hasattr(model, "group_matcher"):
        raise ValueError(
            f"layer_decay needs the model's group_matcher(); {type(model).__name__} has none"
        )
    return create_optimizer_v2(
        model, opt=opt, lr=lr, weight_decay=weight_decay, layer_decay=layer_decay, **kwargs
    )
