"""Published reversible weights, loaded exactly as published, without running code from a file.

``pareprop.load_pretrained(model, path)`` reads a PySlowFast file (``{"model_state": ...}``),
an mmpretrain file (``backbone.*`` keys, bare or under ``"state_dict"``), a ``.safetensors``
file or a pareprop checkpoint, recognises which from its keys, maps the keys and shapes onto
the model (the family's ``checkpoint_filter_fn``) and copies them in. The file reading, the
mapping rules and ``create_model(name, pretrained=True)`` live in the models layer
(:mod:`pareprop.models.published`); this module adds pareprop checkpoint directories, which
are verified by :func:`pareprop.checkpoint.load_checkpoint`.
"""

from __future__ import annotations

import os

import torch.nn as nn

from pareprop.checkpoint import META, WEIGHTS, CheckpointError, load_checkpoint
from pareprop.convert import coupling_of
from pareprop.convert.weights import check_saved_coupling
from pareprop.models.published import (
    PUBLISHED,
    LoadReport,
    PathLike,
    PretrainedError,
    PublishedWeights,
    detect_layout,
    load_state,
    load_weights_file,
    read_weights,
)

__all__ = [
    "PUBLISHED",
    "PublishedWeights",
    "PretrainedError",
    "LoadReport",
    "load_pretrained",
    "read_weights",
    "detect_layout",
]


def _is_converted(model: nn.Module) -> bool:
    return any(hasattr(m, "set_alpha") for m in model.modules())


def load_pretrained(model: nn.Module, path: PathLike, strict: bool = True) -> LoadReport:
    """Load published or pareprop weights from ``path`` into ``model``, detecting the layout.

    A classifier of another class count (or a model without one) leaves the file's head out:
    the model keeps its fresh head, and a warning says so (timm's behaviour). Any other
    missing, unexpected or misshapen tensor is an error that names it.

    Args:
        model: a Rev-ViT or Rev-MViT (published layouts), or any pareprop model of any
            family (its own state dicts, ``model.safetensors`` files and checkpoints). Size
            overrides (depth, width) load files of the same sizes.
        path: a ``.pyth``/``.pth``/``.pt`` file or a ``.safetensors`` file (told apart by
            content, not name), a pareprop checkpoint directory or a file in one, or a run
            directory (its ``last`` checkpoint).
        strict: False tolerates missing and unexpected tensors (misshapen ones still fail).

    A converted model's weights saved at another coupling than the model's are refused (NOTE
    [ The coupling travels with the weights ] in pareprop/convert/weights.py).

    Raises:
        PretrainedError: unreadable, unsafe, foreign or non-fitting file.
    """
    path = os.fspath(path)
    if _is_converted(model):  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(path, coupling_of(model))
    in_checkpoint = os.path.basename(path) in (META, WEIGHTS) and os.path.isfile(
        os.path.join(os.path.dirname(path) or ".", META))
    if os.path.isdir(path) or in_checkpoint:  # verified by its checksums
        try:
            state = load_checkpoint(path, train_state=False).state_dict
        except CheckpointError as e:
            raise PretrainedError(str(e)) from None
        return load_state(model, dict(state), "pareprop", path, strict)
    return load_weights_file(model, path, strict)
