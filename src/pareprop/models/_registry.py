"""One registry of named models, shared by ``create_model``, the CLI and timm.

A model family registers one-line factories with :func:`register_model`. Each factory takes
config overrides as keyword arguments. Registration of an image model also adds the factory
to timm's registry, so ``timm.create_model("rev_vit_small_patch16_224")`` works after
``import pareprop``; the text encoders stay in pareprop's registry only (timm is an image-model
library and its tooling feeds every model it lists images).

# NOTE [ device and dtype at build time ]
# timm's factory passes ``device=`` and ``dtype=`` to every model (``create_model(name,
# device="meta")`` builds a model that allocates nothing). They say where to build, not what to
# build, so they are taken off the overrides here and never reach, or are stored in, a config:
# the model is built under ``torch.device(device)`` (every parameter and buffer is created
# there, no copy from the CPU) and then cast to ``dtype``.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from pareprop.engine import engine_of
from pareprop.models._features import StageFeatureNet
from pareprop.models.published import load_published, published_cfg

__all__ = ["register_model", "create_model", "list_models", "is_model", "model_spec",
           "unknown_model_message"]

_MODEL_FACTORIES: Dict[str, Callable[..., nn.Module]] = {}

# Keywords timm's create_model passes to every factory: where pretrained weights come from
# (pareprop.models.published.load_published). pretrained_cfg_overlay is applied to the model's
# pretrained_cfg (mean/std overrides reach timm's resolve_data_config; "file" is a local copy
# of the published weights).
_TIMM_KEYWORDS = ("pretrained_cfg", "cache_dir")


def register_model(
    fn: Optional[Callable[..., nn.Module]] = None, *, timm: bool = True
) -> Any:
    """Register ``fn`` under its own name in pareprop's registry and, with ``timm=True`` (image
    models), in timm's. Usable bare (``@register_model``) or as ``@register_model(timm=False)``.
    """
    if fn is None:
        return functools.partial(register_model, timm=timm)
    name = fn.__name__
    if name in _MODEL_FACTORIES:
        raise ValueError(f"model {name!r} is registered twice")

    @functools.wraps(fn)
    def factory(
        pretrained: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        features_only: bool = False,
        out_indices: Any = None,
        **overrides: Any,
    ) -> nn.Module:
        timm_kw = {key: overrides.pop(key, None) for key in _TIMM_KEYWORDS}
        overlay = overrides.pop("pretrained_cfg_overlay", None) or {}
        if not isinstance(overlay, dict):
            raise ValueError(f"expected pretrained_cfg_overlay to be a dict, got {overlay!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"expected a floating torch.dtype for dtype, got {dtype!r}")
        if device is None:
            model = fn(**overrides)
        else:
            with torch.device(device):
                model = fn(**overrides)
        if isinstance(getattr(model, "pretrained_cfg", None), dict):
            model.pretrained_cfg.update(published_cfg(name))
        if overlay:
            model.pretrained_cfg.update(overlay)  # default_cfg is the same dict
        if pretrained:
            load_published(model, name, **timm_kw)
        if dtype is not None:
            model.to(dtype=dtype)
        # Enough to rebuild the model later: create_model(model.model_name, **model.model_kwargs).
        model.model_name = name
        model.model_kwargs = dict(overrides)
        model._created_engine = engine_of(model)  # model_spec records a later change
        if features_only:
            return _feature_net(model, out_indices)
        if out_indices is not None:
            raise ValueError("out_indices is for features_only=True models")
        return model

    _MODEL_FACTORIES[name] = factory
    if not timm:
        return factory
    try:
        from timm.models import register_model as timm_register_model
    except ImportError:  # timm is a declared dependency, but the core works without it
        return factory
    from timm.models import is_model as timm_is_model

    if not timm_is_model(name):
        timm_register_model(factory)
    return factory


def _feature_net(model: nn.Module, out_indices: Any) -> nn.Module:
    """timm's ``FeatureGetterNet`` over the model's ``forward_intermediates``: a list of NCHW
    stage maps, ``feature_info`` describing them (all stages when ``out_indices`` is None)."""
    # The image and video families list their stage maps in feature_info (timm's contract); the text
    # encoder has none. Asked of the model, not of its class, so the registry stays below the
    # families that register themselves in it.
    if getattr(model, "feature_info", None) is None:
        raise ValueError(
            f"features_only=True needs an image or video model (Rev-ViT, Rev-MViT, Rev-MViTv2, "
            f"Rev-Swin, Rev-MViT-B 16x4), "
            f"got {type(model).__name__}"
        )
    n = len(model.feature_info)
    return StageFeatureNet(model, out_indices=n if out_indices is None else out_indices)


def list_models(pattern: Optional[str] = None) -> List[str]:
    """Sorted names of the registered models, optionally filtered by a glob ``pattern``."""
    names = sorted(_MODEL_FACTORIES)
    return [n for n in names if pattern is None or fnmatch.fnmatch(n, pattern)]


def is_model(name: str) -> bool:
    return name in _MODEL_FACTORIES


def unknown_model_message(name: str) -> str:
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
        raise ValueError(unknown_model_message(name))
    return _MODEL_FACTORIES[name](**overrides)


def model_spec(model: nn.Module) -> Dict[str, Any]:
    """``{"name": ..., "kwargs": ...}`` for a model made by :func:`create_model`."""
    name = getattr(model, "model_name", None)
    if name is None or name not in _MODEL_FACTORIES:
        raise ValueError("model was not created by pareprop.create_model, so it has no spec")
    kwargs = dict(getattr(model, "model_kwargs", {}))
    # An engine set after creation (set_engine) is part of the model as it runs now.
    engine = engine_of(model)
    if engine is not None and engine != getattr(model, "_created_engine", engine):
        kwargs["engine"] = engine
    return {"name": name, "kwargs": kwargs}

