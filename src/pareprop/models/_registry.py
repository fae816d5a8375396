"""One registry of named models, shared by ``create_model``, the CLI and timm.

A model family registers one-line factories with :func:`register_model`. Each factory takes
config overrides as keyword arguments. Registration also adds the factory to timm's registry,
so ``timm.create_model("rev_vit_small_patch16_224")`` works after ``import pareprop``.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from typing import Any, Callable, Dict, List, Optional

import torch.nn as nn

__all__ = ["register_model", "create_model", "list_models", "is_model", "model_spec"]

_MODEL_FACTORIES: Dict[str, Callable[..., nn.Module]] = {}

# Keywords timm's create_model passes to every factory; they describe pretrained weights, of
# which pareprop ships none.
_TIMM_KEYWORDS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register ``fn`` under its own name in pareprop's registry and in timm's."""
    name = fn.__name__
    if name in _MODEL_FACTORIES:
        raise ValueError(f"model {name!r} is registered twice")

    @functools.wraps(fn)
    def factory(pretrained: bool = False, **overrides: Any) -> nn.Module:
        for key in _TIMM_KEYWORDS:
            overrides.pop(key, None)
        if pretrained:
            raise ValueError(
                f"pareprop ships no pretrained weights for {name!r}; "
                "create it with pretrained=False and train it, or load a pareprop checkpoint"
            )
        model = fn(**overrides)
        # Enough to rebuild the model later: create_model(model.model_name, **model.model_kwargs).
        model.model_name = name
        model.model_kwargs = dict(overrides)
        return model

    _MODEL_FACTORIES[name] = factory
    try:
        from timm.models import register_model as timm_register_model
    except ImportError:  # timm is a declared dependency, but the core works without it
        return factory
    from timm.models import is_model as timm_is_model

    if not timm_is_model(name):
        timm_register_model(factory)
    return factory


def list_models(pattern: Optional[str] = None) -> List[str]:
    """Sorted names of the registered models, optionally filtered by a glob ``pattern``."""
    names = sorted(_MODEL_FACTORIES)
    return [n for n in names if pattern is None or fnmatch.fnmatch(n, pattern)]


def is_model(name: str) -> bool:
    return name in _MODEL_FACTORIES


def _unknown_model_message(name: str) -> str:
    close = difflib.get_close_matches(name, list(_MODEL_FACTORIES), n=5, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (
        f"unknown model {name!r}{hint} "
        f"(pareprop.list_models() lists all {len(_MODEL_FACTORIES)} names)"
    )


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build a registered model; any config field can be overridden by keyword.

    Example:
        ``create_model("rev_vit_small_patch16_224", depth=4, num_classes=10, engine="pareprop")``
    """
    if name not in _MODEL_FACTORIES:
        raise ValueError(_unknown_model_message(name))
    return _MODEL_FACTORIES[name](**overrides)


def model_spec(model: nn.Module) -> Dict[str, Any]:
    """``{"name": ..., "kwargs": ...}`` for a model made by :func:`create_model`."""
    name = getattr(model, "model_name", None)
    if name is None or name not in _MODEL_FACTORIES:
        raise ValueError("model was not created by pareprop.create_model, so it has no spec")
    return {"name": name, "kwargs": dict(getattr(model, "model_kwargs", {}))}
