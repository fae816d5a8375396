"""A source model's weights from a local file, in its publisher's layout, before conversion.

``--pretrained-file`` with ``--convert-from`` (and ``create_model("converted_...",
pretrained_file=...)``) loads the file into the *source* model, through the source library's
own checkpoint filter where it has one (timm's ``checkpoint_filter_fn`` adapts older layouts
and resizes position tables), and only then converts: the filters address the source's
modules by the source's names. A classifier of another class count is left out (the model
keeps its fresh head); every other tensor must fit, and all are checked before any is copied,
so a file that does not fit leaves the model untouched.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from pareprop.models.published import PretrainedError, read_state

__all__ = ["check_saved_coupling", "load_classifier_source_weights", "load_source_weights",
           "load_state", "saved_coupling"]

StateDict = Dict[str, torch.Tensor]


def load_source_weights(
    model: nn.Module,
    path: "str | os.PathLike[str]",
    head: Sequence[str],
    checkpoint_filter: Optional[Callable[[StateDict, nn.Module], StateDict]] = None,
    hint: str = "",
) -> None:
    """Load the weight file at ``path`` into the source ``model`` (not yet converted).

    Args:
        model: the source model (timm's or torchvision's), built with its target class count.
        path: safetensors or a torch file (read with weights_only=True), told apart by content,
            bare or under ``model``/``state_dict``/``model_state``.
        head: the classifier's tensor names, left out when their shapes differ from the model's.
        checkpoint_filter: the source library's filter ``(state, model) -> state``, if any.
        hint: what to check when the file does not fit, for the message.

    Raises:
        PretrainedError: the file is missing, unreadable, unsafe, or does not fit.
    """
    state = read_state(path)
    name = type(model).__name__
    if checkpoint_filter is not None:
        try:
            state = checkpoint_filter(state, model)
        except (RuntimeError, ValueError, KeyError, IndexError, AttributeError,
                AssertionError) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise PretrainedError(f"{os.fspath(path)!r} does not fit {name}: {first}") from None
    load_state(model, state, head, where=repr(os.fspath(path)), hint=hint)


def load_classifier_source_weights(
    model: nn.Module,
    path: "str | os.PathLike[str]",
    checkpoint_filter: Optional[Callable[[StateDict, nn.Module], StateDict]],
    what: str,
    classifier: Optional[str] = None,
) -> None:
    """:func:`load_source_weights` with the head read off ``pretrained_cfg["classifier"]``
    (the source or its conversion: their state dicts have the same names); ``what`` names the
    family in messages ("ViT", "MViTv2", ...). ``classifier``: the head's module name, for a
    source that has no ``pretrained_cfg`` (torchvision's models) and whose head is not
    ``head``."""
    if classifier is None:
        classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier", "head")
    load_source_weights(
        model, path, (f"{classifier}.weight", f"{classifier}.bias"), checkpoint_filter,
        hint=f"is it the weights of another {what} (name the source it was trained as, and "
        "its sizes as --model-arg)?",
    )


def load_state(model: nn.Module, state: StateDict, head: Sequence[str], where: str,
               hint: str = "") -> None:
    """Copy ``state`` into ``model`` once every tensor is checked: the ``head`` tensors of
    another shape are left out, anything else missing, unexpected or misshapen raises
    :class:`PretrainedError` (saying ``where`` the state came from) and copies nothing."""
    name = type(model).__name__
    own = model.state_dict()
    other_head = [k for k in head
                  if k in state and k in own and state[k].shape != own[k].shape]
    state = {k: v for k, v in state.items() if k not in other_head}
    missing = sorted(set(own) - set(state) - set(other_head))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} in the model"
              for k in sorted(state) if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        what = [f"{len(v)} {label}, first {v[0]}" for label, v in
                (("missing", missing), ("unexpected", unexpected), ("misshapen", shapes)) if v]
        raise PretrainedError(
            f"{where} does not fit {name}: {'; '.join(what)}" + (f"; {hint}" if hint else "")
        )
    model.load_state_dict(state, strict=False)


# NOTE [ The coupling travels with the weights ]
# A converted model's weights are trained at a coupling (alpha, beta): at another, the same
# tensors compute another function (a model fine-tuned to (0, 1) and loaded at (1, 0) is a
# different network, no longer the one trained). A pareprop checkpoint records the coupling in
# model.json and, for a weight file copied out of it alone, in its safetensors header
# ("coupling"). Loading such a file into a converted model at another coupling is refused,
# naming both: build the model at the file's coupling (``coupling=[alpha, beta]``, ``pareprop
# eval --model-arg``; ``pareprop.load_model`` rebuilds it so), or continue the file's run with
# ``pareprop train --resume``. A file that records none (a source's own weights, a checkpoint
# of another model) is the source's network, at (1, 0), and is not checked.


def saved_coupling(path: "str | os.PathLike[str]") -> Optional[Tuple[float, float]]:
    """The coupling recorded in the safetensors header of the weight file at ``path`` (or of
    ``model.safetensors`` in the checkpoint directory, or the run directory's ``last``), or
    None when it records none."""
    path = os.fspath(path)
    files = ([os.path.join(path, "model.safetensors"),
              os.path.join(path, "last", "model.safetensors")] if os.path.isdir(path) else [path])
    for file in files:
        if not os.path.isfile(file):
            continue
        try:
            from safetensors import safe_open

            with safe_open(file, "pt") as f:
                text = (f.metadata() or {}).get("coupling")
        except Exception:  # noqa: BLE001 - not a safetensors file: records nothing
            return None
        if text is None:
            return None
        try:
            alpha, beta = (float(v) for v in json.loads(text))
        except (TypeError, ValueError):
            return None
        return (alpha, beta) if math.isfinite(alpha) and math.isfinite(beta) else None
    return None


def check_saved_coupling(path: "str | os.PathLike[str]", coupling: Tuple[float, float]) -> None:
    """Refuse the weights at ``path`` for a model at ``coupling`` when they were saved at
    another (NOTE [ The coupling travels with the weights ]).

    Raises:
        PretrainedError: naming both couplings and what to do.
    """
    saved = saved_coupling(path)
    now = tuple(float(c) for c in coupling)
    if saved is not None and saved != now:
        raise PretrainedError(
            f"{os.fspath(path)!r} holds weights saved at coupling (alpha, beta) = {saved}, and "
            f"the model is at {now}, where they compute another function: build it at the "
            f"file's coupling (coupling=[{saved[0]}, {saved[1]}]), or continue their run with "
            "pareprop train --resume"
        )
