"""Fine-tuning from published weights: the initial weights with a fresh head, and AdamW with
layer-wise learning-rate decay through timm's optimizer factory.

Layer decay scales block ``i``'s learning rate by ``layer_decay ** (L - i)`` (the head and the
final norm by 1, the stem by the smallest factor), the usual recipe for fine-tuning a
pretrained transformer. The layer of every parameter comes from the model's
``group_matcher`` (every pareprop family has one); timm's schedulers apply the factors
(``lr_scale`` in each parameter group), so they work with ``pareprop train``'s cosine schedule.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from timm.models._hub import download_cached_file
from timm.optim import create_optimizer_v2

from pareprop.pretrained import PUBLISHED, LoadReport, PretrainedError, load_pretrained

__all__ = ["load_initial_weights", "create_finetune_optimizer"]


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
