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
``create_model("converted_vit", source=NAME, ...)`` (pareprop.convert.vit), so
checkpoints record the source, and the coupling the model was saved at, like any model.
It starts from timm's pretrained weights of the source
(:func:`pareprop.convert.timm_pretrained.load_timm_pretrained`, timm's download), or from
``--pretrained-file``, a local copy of them; offline without that file it refuses. Random
weights only when asked for by name: ``--from-scratch``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
from timm.models._hub import download_cached_file
from timm.optim import create_optimizer_v2

from pareprop.convert import (
    SCHEDULES,
    CouplingSchedule,
    converted_model_name,
    converted_model_names,
)
from pareprop.convert.weights import saved_coupling
from pareprop.pretrained import PUBLISHED, LoadReport, PretrainedError, load_pretrained

__all__ = [
    "apply_convert_options",
    "check_start_coupling",
    "detects_converted",
    "make_coupling_schedule",
    "start_coupling",
    "load_initial_weights",
    "create_finetune_optimizer",
]

DEFAULT_MODEL = "rev_vit_tiny_patch4_32"  # TrainConfig.model's default
# Detector backbone prefixes built at the coupling (1, 0) with a precision guard.
CONVERTED_BACKBONES = ("converted:", "detectron2:")


def apply_convert_options(cfg: Any) -> None:
    """Check the fine-tuning fields of a TrainConfig and, with ``convert_from``, point the run at
    the converted model (called before the config fills in a preset for its model)."""
    _check_start_options(cfg)
    if not _check_coupling_arguments(cfg):
        return  # a detector on a converted backbone: the schedule moves the backbone's coupling
    if cfg.convert_from is None:
        _check_nothing_converted(cfg)
        return  # --pretrained(-file) then starts a registered model (load_initial_weights)
    _check_convert_from(cfg)
    cfg.model, cfg.model_kwargs = converted_model_name(cfg.convert_from), _convert_kwargs(cfg)


def _check_start_options(cfg: Any) -> None:
    """The schedule's options and the starting point: one of --pretrained, --pretrained-file
    and --from-scratch, and no --model-arg engine= against --engine."""
    if cfg.coupling_schedule not in SCHEDULES:
        raise ValueError(
            f"expected --coupling-schedule one of {', '.join(SCHEDULES)}, got "
            f"{cfg.coupling_schedule!r}"
        )
    if cfg.coupling_steps is not None and int(cfg.coupling_steps) < 1:
        raise ValueError(f"expected --coupling-steps >= 1 (or unset), got {cfg.coupling_steps}")
    if cfg.pretrained and cfg.pretrained_file is not None:
        raise ValueError(
            f"--pretrained (the published weights) and --pretrained-file {cfg.pretrained_file} "
            "name two starting points: give one"
        )
    if cfg.from_scratch and (cfg.pretrained or cfg.pretrained_file is not None):
        start = "--pretrained" if cfg.pretrained else f"--pretrained-file {cfg.pretrained_file}"
        raise ValueError(f"--from-scratch and {start} contradict each other: give one")
    engine = (cfg.model_kwargs or {}).get("engine")
    if engine is not None and engine != cfg.engine and cfg.resume is None:
        # The trainer builds the model with --engine: a model argument would be overridden.
        raise ValueError(
            f"--model-arg engine={engine} and --engine {cfg.engine} contradict each other: "
            f"give --engine {engine}"
        )


def _check_coupling_arguments(cfg: Any) -> bool:
    """Refuse a coupling given as a model argument (the schedule sets it); False for a detector
    on a converted backbone, which the rest of the conversion options do not concern."""
    converts = cfg.convert_from is not None or cfg.model in converted_model_names()
    if detects_converted(cfg):
        # A detector on a converted backbone: the schedule moves the backbone's coupling.
        coupling = ((cfg.model_kwargs or {}).get("backbone_args") or {}).get("coupling")
        if coupling is not None and cfg.resume is None:
            raise ValueError(
                f"--model-arg backbone_args with coupling={coupling} would be overridden: the "
                "coupling schedule sets the backbone's coupling from the first step; choose it "
                "with --coupling-schedule (reversible: (0, 1) throughout) and --coupling-steps"
            )
        return False
    if converts and "coupling" in (cfg.model_kwargs or {}) and cfg.resume is None:
        raise ValueError(
            f"--model-arg coupling={cfg.model_kwargs['coupling']} would be overridden: the "
            "coupling schedule sets the coupling from the first step; choose it with "
            "--coupling-schedule (reversible: (0, 1) throughout) and --coupling-steps"
        )
    return True


def _check_nothing_converted(cfg: Any) -> None:
    """--coupling-steps without a converted model: refused, in the task's words."""
    # A resumed run restores --convert-from from its checkpoint, and the run's own
    # comparison (equal accepted, different refused) judges --coupling-steps then.
    if cfg.coupling_steps is not None and cfg.resume is None and \
            getattr(cfg, "task", None) == "detection":
        raise ValueError(
            f"--coupling-steps {cfg.coupling_steps} moves a converted backbone's coupling and "
            f"{cfg.model} converts nothing: name the backbone converted:SOURCE or "
            "detectron2:NAME, or drop --coupling-steps"
        )
    if cfg.coupling_steps is not None and cfg.resume is None:
        raise ValueError(
            f"--coupling-steps {cfg.coupling_steps} moves a converted ViT's coupling and "
            "this run converts nothing: add --convert-from NAME, or drop --coupling-steps"
        )


def _check_convert_from(cfg: Any) -> None:
    """What --convert-from cannot be combined with."""
    if cfg.pretrained:
        raise ValueError(
            "--pretrained downloads a published reversible model's weights; with --convert-from "
            "the timm weights are timm's own download, or a local copy as --pretrained-file"
        )
    converted = converted_model_name(cfg.convert_from)
    if cfg.model not in (DEFAULT_MODEL, converted):
        raise ValueError(
            f"--model {cfg.model} and --convert-from {cfg.convert_from} name two models: "
            f"--convert-from builds {converted}; give one"
        )
    if cfg.memory_budget is not None:
        raise ValueError(
            "--memory-budget with --convert-from is not supported: the precision guard chooses "
            "the stored blocks of a converted model while its skip scale is small (docs/convert.md)"
        )


def _convert_kwargs(cfg: Any) -> Dict[str, Any]:
    """The converted model's arguments: --model-arg, the source, the starting weight file."""
    kwargs = dict(cfg.model_kwargs or {})
    # --model-arg pretrained=false asks for random initialisation by name, as --from-scratch.
    pretrained = kwargs.pop("pretrained", None)
    if pretrained is not None:
        if not isinstance(pretrained, bool):
            raise ValueError(f"expected --model-arg pretrained=true or false, got {pretrained!r}")
        if pretrained and cfg.from_scratch:
            raise ValueError(
                "--model-arg pretrained=true and --from-scratch contradict each other: give one"
            )
        if not pretrained and cfg.pretrained_file is not None:
            raise ValueError(
                f"--model-arg pretrained=false and --pretrained-file {cfg.pretrained_file} "
                "contradict each other: give one"
            )
        cfg.from_scratch = cfg.from_scratch or not pretrained
    kwargs["source"] = cfg.convert_from
    if cfg.pretrained_file is not None and cfg.resume is None:
        check_start_coupling(cfg, cfg.pretrained_file)
    # A pareprop checkpoint directory is loaded by load_initial_weights once the model is
    # built (load_pretrained reads it, verified); a file is the source's, read by its family.
    if cfg.pretrained_file is not None and not os.path.isdir(cfg.pretrained_file):
        kwargs["pretrained_file"] = cfg.pretrained_file
    return kwargs




def detects_converted(cfg: Any) -> bool:
    """Whether ``cfg`` trains a detector whose backbone is converted (``converted:SOURCE``,
    ``detectron2:NAME``): its coupling moves along the schedule as a converted classifier's."""
    if getattr(cfg, "task", None) != "detection" or ":" not in str(cfg.model):
        return False
    backbone = str(cfg.model).split(":", 1)[1]
    return backbone.startswith(CONVERTED_BACKBONES)


def start_coupling(cfg: Any) -> Tuple[float, float]:
    """The coupling a new run's schedule starts at: (0, 1) for ``reversible``, else (1, 0)."""
    return (0.0, 1.0) if cfg.coupling_schedule == "reversible" else (1.0, 0.0)


def check_start_coupling(cfg: Any, path: str) -> None:
    """Refuse initial weights saved at another coupling than the run starts at (NOTE [ The
    coupling travels with the weights ] in pareprop/convert/weights.py), in the run's words."""
    saved, start = saved_coupling(path), start_coupling(cfg)
    if saved is None or saved == start:
        return
    other = "; or start at (0, 1) with --coupling-schedule reversible" \
        if saved == (0.0, 1.0) else ""
    raise ValueError(
        f"--pretrained-file {path} holds weights trained at coupling (alpha, beta) = {saved}, "
        f"and --coupling-schedule {cfg.coupling_schedule} starts at {start}, where they "
        f"compute another function: continue their run with --resume{other}"
    )


def make_coupling_schedule(cfg: Any, model: nn.Module,
                           steps_per_epoch: int) -> Optional[CouplingSchedule]:
    """The schedule the trainer steps after each optimizer step, or None for other models.
    ``coupling_steps`` unset: one epoch."""
    if getattr(model, "model_name", None) not in converted_model_names() and not (
            getattr(model, "pareprop_spec", None) is not None
            and getattr(model, "precision_guard", None) is not None):
        return None  # neither a converted classifier nor a detector on a converted backbone
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
