"""Published reversible weights, loaded exactly as published, without running code from a file.

The models-layer half of :mod:`pareprop.pretrained` (which adds pareprop checkpoint
directories on top): ``load_weights_file(model, path)`` reads a PySlowFast file
(``{"model_state": ...}``), an mmpretrain file (``backbone.*`` keys, bare or under
``"state_dict"``), a ``.safetensors`` file or a pareprop checkpoint's ``model.safetensors``,
recognises which from its keys, maps the keys and shapes onto the model (the family's
``checkpoint_filter_fn``, through the model's ``checkpoint_filter``) and copies them in.
``create_model(name, pretrained=True)`` (pareprop's or timm's) goes through timm's
pretrained machinery: the model's ``pretrained_cfg`` holds the publisher's URL, and
``pretrained_cfg_overlay=dict(file=PATH)`` points it at a local copy instead, as for any timm
model.

NOTE [ Loading runs no code ]
A ``.pth``/``.pyth`` file is a pickle, and unpickling may call any function the file names.
Files are read with ``torch.load(weights_only=True)``, whose unpickler builds only tensors,
numbers, strings and plain containers; a file that needs anything else is refused with the
first object it asked for, and is never retried without the restriction. ``.safetensors``
files and pareprop checkpoints hold no code at all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import zipfile
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
from safetensors.torch import load_file
from timm.models import load_pretrained as timm_load_pretrained

__all__ = [
    "PUBLISHED",
    "PublishedWeights",
    "PretrainedError",
    "LoadReport",
    "load_weights_file",
    "load_state",
    "read_weights",
    "read_state",
    "detect_layout",
    "published_cfg",
    "load_published",
    "unwrap_model",
]

_logger = logging.getLogger("pareprop")

PathLike = Union[str, os.PathLike]
StateDict = Dict[str, torch.Tensor]


class PretrainedError(ValueError):
    """A weight file is unreadable, unsafe, or does not fit the model."""


@dataclasses.dataclass(frozen=True)
class PublishedWeights:
    """Where a model's published weights live and what their publisher reports for them.

    The accuracies are the publisher's figures on ``dataset``, not measured by pareprop.
    """

    url: str
    params_m: float
    top1: float
    top5: float
    publisher: str = "PySlowFast (Mangalam et al., CVPR 2022)"
    mmpretrain_url: str = ""
    dataset: str = "ImageNet-1k"


_SLOWFAST = "https://dl.fbaipublicfiles.com/pyslowfast/rev/"
_MMPRETRAIN = "https://download.openmmlab.com/mmclassification/v0/revvit/"

PUBLISHED: Dict[str, PublishedWeights] = {
    "rev_vit_small_patch16_224": PublishedWeights(
        _SLOWFAST + "REV_VIT_S.pyth", 22.4, 79.9, 94.9,
        mmpretrain_url=_MMPRETRAIN + "revvit-small_3rdparty_in1k_20221213-a3a34f5c.pth",
    ),
    "rev_vit_base_patch16_224": PublishedWeights(
        _SLOWFAST + "REV_VIT_B.pyth", 87.3, 81.8, 95.6,
        mmpretrain_url=_MMPRETRAIN + "revvit-base_3rdparty_in1k_20221213-87a7b0a5.pth",
    ),
    "rev_mvit_base": PublishedWeights(_SLOWFAST + "REV_MVIT_B.pyth", 39.7, 82.9, 96.3),
    # 34,963,120 parameters (the publisher's table rounds down to 34.9M).
    "rev_mvit_base_16x4": PublishedWeights(
        _SLOWFAST + "REV_MVIT_B_16x4.pyth", 35.0, 78.4, 93.4,
        dataset="Kinetics-400, 1 spatial crop x 5 clips",
    ),
}


@dataclasses.dataclass
class LoadReport:
    """What :func:`load_pretrained` did."""

    path: str
    layout: str  # "pyslowfast", "mmpretrain" or "pareprop"
    tensors: int  # tensors copied into the model
    dropped_head: bool = False  # the file's classifier did not fit and was left out
    file_classes: Optional[int] = None


# -- reading files --------------------------------------------------------------------------


def _torch_load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types; each is turned into a clear message
        text = str(e)
        if "Weights only load failed" in text or "weights_only" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            what = f" (it asks for {found.group(1)})" if found else ""
            raise PretrainedError(
                f"refusing {path!r}: loading it would run code from the file{what}. pareprop "
                "reads weight files with torch.load(weights_only=True), which admits only "
                "tensors, numbers, strings and plain containers. If you trust the file, "
                "extract its state dict yourself and save it with safetensors or torch.save"
            ) from None
        if isinstance(e, (EOFError, OSError, zipfile.BadZipFile)) or "zip archive" in text:
            raise PretrainedError(
                f"cannot read {path!r}: the file is truncated or corrupted "
                f"({type(e).__name__}: {text.splitlines()[0] if text else 'end of file'}); "
                "download it again"
            ) from None
        raise PretrainedError(
            f"cannot read {path!r}: not a PyTorch weight file ({type(e).__name__}: "
            f"{text.splitlines()[0] if text else ''})"
        ) from None


def _is_safetensors(path: str) -> bool:
    """Whether ``path`` holds safetensors, by its content (an 8-byte header length, then a JSON
    header), whatever its name: a ``.pth`` of safetensors is not read as a pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        size = os.path.getsize(path)
    except OSError:
        return False
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < n <= size - 8


def read_state(path: PathLike) -> StateDict:
    """The state dict in a weight file, read safely (NOTE [ Loading runs no code ]) whatever its
    name says (safetensors or a torch file, by content), taken out of its publisher's container
    (``model_state``, ``state_dict``, timm's and DeiT's ``model``)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise PretrainedError(f"no weight file at {path!r}")
    if os.path.isdir(path):
        raise PretrainedError(
            f"{path!r} is a directory, not a weight file (pareprop.load_pretrained also takes "
            "pareprop checkpoint directories)"
        )
    if _is_safetensors(path):
        try:
            obj: Any = load_file(path, device="cpu")
        except Exception as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise PretrainedError(f"cannot read {path!r} as safetensors: {first}") from None
    else:
        obj = _torch_load(path)
    return _unwrap(obj, path)


def read_weights(path: PathLike, model: Optional[nn.Module] = None) -> Tuple[StateDict, str]:
    """Read a weight file safely (NOTE [ Loading runs no code ]) and take its state dict out of
    the container its publisher used.

    Returns:
        ``(state_dict, layout)`` with layout ``"pyslowfast"``, ``"mmpretrain"`` or
        ``"pareprop"`` (see :func:`detect_layout`).
    """
    state = read_state(path)
    return state, detect_layout(state, os.fspath(path), model)


def _unwrap(obj: Any, path: str) -> StateDict:
    """The state dict inside a PySlowFast (``model_state``), mmpretrain (``state_dict``),
    timm/DeiT (``model``) or bare file."""
    if isinstance(obj, Mapping):
        for key in ("model_state", "state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj:
        raise PretrainedError(
            f"{path!r} holds no state dict (expected a mapping of names to tensors, bare or "
            f"under 'model_state', 'state_dict' or 'model'; got {type(obj).__name__})"
        )
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise PretrainedError(f"{path!r} is not a state dict: entry {bad[0]!r} is not a tensor")
    if all(k.startswith("module.") for k in obj):  # saved from a DataParallel/DDP wrapper
        return {k[len("module."):]: v for k, v in obj.items()}
    return dict(obj)


def detect_layout(
    state: Mapping[str, torch.Tensor], path: str = "the file", model: Optional[nn.Module] = None
) -> str:
    """``"pyslowfast"`` (``rev_backbone.*``), ``"mmpretrain"`` (``backbone.*``) or
    ``"pareprop"``: pareprop's own module names, those of ``model`` when given (every family:
    text models and converted ViTs too), recognised by content, not by the file's name."""
    keys = list(state)
    if any(k.startswith("rev_backbone.") for k in keys):
        return "pyslowfast"
    if any(k.startswith("backbone.") for k in keys):
        return "mmpretrain"
    if model is not None:
        own = set(unwrap_model(model).state_dict())
        if own and sum(k in own for k in keys) * 2 >= len(keys):
            return "pareprop"  # most of its names are the model's: _check_fits says the rest
    if any(k.startswith(("stack.blocks.", "stages.", "layers.")) for k in keys):
        return "pareprop"
    hint = ""
    if any(k.startswith("blocks.") for k in keys) and any("attn.qkv" in k for k in keys):
        hint = (
            "; they look like a timm ViT's: fine-tune it with pareprop train --convert-from "
            "NAME --pretrained-file PATH (pareprop.convert), or load it into "
            "create_model('converted_vit', source=NAME)"
        )
    raise PretrainedError(
        f"{path} is in no layout pareprop knows (PySlowFast 'rev_backbone.*', mmpretrain "
        f"'backbone.*', or pareprop's own names); its first keys are {keys[:4]}{hint}"
    )


# -- loading into a model -------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel (``module``) or ``torch.compile``
    (``_orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _head_rows(state: Mapping[str, torch.Tensor]) -> Optional[int]:
    w = state.get("head.weight")
    return int(w.shape[0]) if w is not None else None


def load_weights_file(model: nn.Module, path: PathLike, strict: bool = True) -> LoadReport:
    """Load a weight file (PySlowFast, mmpretrain, ``.safetensors``, a pareprop
    ``model.safetensors``) into ``model``, detecting the layout; the published layouts are
    mapped by the model's ``checkpoint_filter`` (its family's ``checkpoint_filter_fn``).
    See :func:`pareprop.load_pretrained` for the rules."""
    model = unwrap_model(model)
    state, layout = read_weights(path, model)
    if layout != "pareprop":
        state = model.checkpoint_filter(state)
    return load_state(model, state, layout, os.fspath(path), strict)


def load_state(
    model: nn.Module, state: StateDict, layout: str, path: str, strict: bool = True
) -> LoadReport:
    """Copy an already mapped ``state`` into ``model``: a classifier of another shape is left
    out (with a warning), any other missing, unknown or misshapen tensor is an error."""
    model = unwrap_model(model)
    own = model.state_dict()
    report = LoadReport(path=path, layout=layout, tensors=0, file_classes=_head_rows(state))
    head_keys = [k for k in ("head.weight", "head.bias") if k in state]
    if head_keys and (
        "head.weight" not in own or own["head.weight"].shape != state["head.weight"].shape
    ):
        for k in head_keys:
            del state[k]
        report.dropped_head = True
        _logger.warning(
            "%s: left out the file's %s-class classifier; the model's %d-class head keeps its "
            "fresh initialisation",
            path, report.file_classes, getattr(model, "num_classes", 0),
        )
    _check_fits(model, own, state, path, strict, report.dropped_head)
    model.load_state_dict(state, strict=False)
    report.tensors = len(state)
    return report


def _check_fits(
    model: nn.Module,
    own: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    path: str,
    strict: bool,
    dropped_head: bool,
) -> None:
    name = type(model).__name__
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise PretrainedError(
                f"{path!r} does not fit {name}: tensor {k!r} has shape {tuple(v.shape)} in the "
                f"file but {tuple(own[k].shape)} in the model; create the model with the "
                "file's sizes (e.g. embed_dim, depth, num_heads, img_size)"
            )
    if not strict:
        return
    skip = {"head.weight", "head.bias"} if dropped_head else set()
    missing = [k for k in own if k not in state and k not in skip]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        what = []
        if missing:
            k = missing[0]
            what.append(
                f"{len(missing)} tensor(s) of the model missing from the file, first {k!r} "
                f"(shape {tuple(own[k].shape)} in the model, absent from the file)"
            )
        if unexpected:
            k = unexpected[0]
            what.append(
                f"{len(unexpected)} tensor(s) of the file unknown to the model, first {k!r} "
                f"(shape {tuple(state[k].shape)} in the file, absent from the model)"
            )
        raise PretrainedError(
            f"{path!r} does not fit {name}: " + "; ".join(what)
            + "; is it the weights of another model or depth?"
        )


# -- the timm pretrained path ---------------------------------------------------------------


def published_cfg(name: str) -> Dict[str, Any]:
    """``pretrained_cfg`` entries for a model with published weights (else empty)."""
    pub = PUBLISHED.get(name)
    if pub is None:
        return {}
    return {
        "url": pub.url,
        # timm hands the resolved file (a download or pretrained_cfg_overlay's "file") to
        # model.load_pretrained, which reads it safely and maps the publisher's keys.
        "custom_load": True,
        "license": "apache-2.0",
        "paper_name": "Reversible Vision Transformers (CVPR 2022)",
        "origin_url": "https://github.com/facebookresearch/SlowFast",
    }


def load_published(
    model: nn.Module,
    name: str,
    pretrained_cfg: Any = None,
    pretrained_cfg_overlay: Optional[Dict[str, Any]] = None,
    cache_dir: Any = None,
) -> None:
    """``pretrained=True`` for a registered model: timm's ``load_pretrained`` with the model's
    ``pretrained_cfg`` (updated by ``pretrained_cfg`` when a dict, then by the overlay)."""
    cfg = dict(getattr(model, "pretrained_cfg", {}) or {})
    if isinstance(pretrained_cfg, Mapping):
        cfg.update(pretrained_cfg)
    cfg.update(pretrained_cfg_overlay or {})
    if not (cfg.get("file") or cfg.get("url") or cfg.get("state_dict")):
        raise PretrainedError(
            f"no published weights for {name!r} (published: {', '.join(PUBLISHED)}); pass "
            "pretrained_cfg_overlay=dict(file=PATH) for a local file, or create it with "
            "pretrained=False"
        )
    if cfg.get("state_dict") is not None:
        raise PretrainedError("pretrained_cfg 'state_dict' is not supported; save it to a file")
    cfg["custom_load"] = True
    model.pretrained_cfg = model.default_cfg = cfg
    try:
        timm_load_pretrained(
            model,
            pretrained_cfg=cfg,
            num_classes=getattr(model, "num_classes", 1000),
            in_chans=getattr(model, "in_chans", 3),
            cache_dir=cache_dir,
        )
    except PretrainedError:
        raise
    except OSError as e:  # no network, unreachable host, HTTP errors
        raise PretrainedError(
            f"could not fetch {cfg.get('url')!r} for {name!r}: {e}. Offline, download the file "
            "elsewhere and pass pretrained_cfg_overlay=dict(file=PATH), or call "
            "pareprop.load_pretrained(model, PATH)"
        ) from None
