"""timm's pretrained weights of a source, loaded into the model converted from it.

``pareprop train --convert-from NAME`` and ``pareprop eval`` start a converted model from
timm's pretrained weights of its source (timm's download cache; timm drops a head of another
class count and adapts the input size). A model of another library's source (torchvision's
video MViT) loads them through its own ``load_source_pretrained``. What cannot load says why in
one line: no weights, offline, or model arguments the weights do not fit.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import timm
import torch
import torch.nn as nn

from pareprop.models.published import PretrainedError

__all__ = ["load_timm_pretrained"]


# Keywords of the converted_vit factory that are not timm's.
_CONVERT_KEYWORDS = ("source", "pretrained_file", "engine", "coupling", "tolerance")


def load_timm_pretrained(model: nn.Module, source: str) -> None:
    """Load timm's pretrained weights of ``source`` into the converted ``model`` (timm's
    download cache; timm drops a head of another class count and adapts the input size), or,
    for a model of another library's source, its own ``load_source_pretrained(source)``.

    Raises:
        PretrainedError: timm has no pretrained weights for ``source``, or they cannot be
            fetched (offline), or they do not fit the model its ``model_kwargs`` build (NOTE
            [ Model arguments against pretrained weights ]): the message names the arguments,
            ``--pretrained-file`` and ``--from-scratch``.
    """
    own_loader = getattr(model, "load_source_pretrained", None)
    if own_loader is not None:  # a source of another library (torchvision's video MViT)
        own_loader(source)
        return
    cfg = timm.models.get_pretrained_cfg(source)
    offline = "pass a local copy of the timm weights with --pretrained-file PATH, or start " \
        "from random weights with --from-scratch"
    if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
        raise PretrainedError(f"--convert-from {source}: timm has no pretrained weights for it; "
                              + offline)
    kwargs = {k: v for k, v in getattr(model, "model_kwargs", {}).items()
              if k not in _CONVERT_KEYWORDS}
    kwargs["num_classes"] = model.num_classes
    try:
        vit = timm.create_model(source, pretrained=True, **kwargs)
    except TypeError as e:
        raise _misfit(source, kwargs, _unexpected_keywords(e, kwargs), e) from None
    except RuntimeError as e:
        if _LOAD_ERROR in str(e):
            raise _misfit(source, kwargs, _layout_changers(source, kwargs, e), e) from None
        raise _unfetched(source, e, offline) from None
    except OSError as e:  # no network, no cache, a damaged download
        raise _unfetched(source, e, offline) from None
    model.load_state_dict(vit.state_dict())


# NOTE [ Model arguments against pretrained weights ]
# --model-arg reaches timm.create_model(source, pretrained=True, **kwargs), and timm's weights
# are those of its own configuration. An argument timm's class does not take (a field of the
# model config that pareprop's converted factory applies itself, e.g. converted_mvitv2's
# depths) is a TypeError naming it; one that changes the layout (embed_dim, depth at timm's own
# class count) is torch's RuntimeError "Error(s) in loading state_dict ...", raised by timm's
# load_pretrained, which names tensors, not arguments. To name the arguments, the model is
# built on the meta device with each argument alone (or, where it does not build alone, as
# embed_dim=16 does beside ViT-Ti's 3 heads, with all arguments but it) to see which named
# tensors it changes, and the fewest arguments that change them all are named, largest share
# first: an argument timm adapts to (img_size: timm resamples pos_embed) also changes
# pos_embed, but beside embed_dim, which changes every tensor, it explains nothing more. A
# different depth at another class count loads the first blocks and is no error: timm only
# warns (its load is not strict when it drops the head).

_LOAD_ERROR = "Error(s) in loading state_dict"


def _unfetched(source: str, err: Exception, offline: str) -> PretrainedError:
    first = (str(err).splitlines() or [type(err).__name__])[0]
    return PretrainedError(
        f"--convert-from {source}: cannot fetch timm's pretrained weights "
        f"({type(err).__name__}: {first}); offline, {offline}"
    )


def _misfit(source: str, kwargs: Dict[str, Any], names: List[str],
            err: Exception) -> PretrainedError:
    given = " ".join(f"--model-arg {k}={kwargs[k]}" for k in names)
    detail = _load_summary(str(err)) if _LOAD_ERROR in str(err) else str(err).strip()
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    return PretrainedError(
        f"--convert-from {source}: timm's pretrained weights of {source} do not fit the model "
        f"built with {given} ({detail}); drop "
        f"{', '.join(names)} from --model-arg to start from them, or pass weights of this "
        "configuration with --pretrained-file PATH, or start from random weights with "
        "--from-scratch"
    )


def _load_summary(text: str) -> str:
    """torch's load_state_dict error (a line per kind, every tensor listed) in a few words."""
    shapes = re.findall(r"size mismatch for ([\w.]+): copying a param with shape "
                        r"torch.Size\(\[([\d, ]*)\]\) from checkpoint, the shape in current "
                        r"model is torch.Size\(\[([\d, ]*)\]\)", text)
    parts = []
    for kind, said in (("Unexpected", "the weights have {n} tensors the model lacks ({k}...)"),
                       ("Missing", "the model has {n} tensors the weights lack ({k}...)")):
        found = re.search(kind + r' key\(s\) in state_dict: (.*)', text)
        if found:
            keys = re.findall(r'"([\w.]+)"', found.group(1))
            parts.append(said.format(n=len(keys), k=keys[0] if keys else ""))
    if shapes:
        key, there, here = shapes[0]
        parts.append(f"{len(shapes)} tensors have other shapes ({key}: ({there}) in the "
                     f"weights, ({here}) here...)")
    return "; ".join(parts) or text.strip().splitlines()[0]


def _user_keys(kwargs: Dict[str, Any]) -> List[str]:
    return [k for k in kwargs if k != "num_classes"]  # the class count is the trainer's


def _unexpected_keywords(err: TypeError, kwargs: Dict[str, Any]) -> List[str]:
    named = re.findall(r"unexpected keyword argument '(\w+)'", str(err))
    return [k for k in _user_keys(kwargs) if k in named] or _user_keys(kwargs)


def _layout_changers(source: str, kwargs: Dict[str, Any], err: RuntimeError) -> List[str]:
    """The fewest arguments that change every tensor the load error names (greedy, largest
    share first; NOTE [ Model arguments against pretrained weights ])."""
    text = str(err)
    named = set(re.findall(r"size mismatch for ([\w.]+):", text))
    named |= set(re.findall(r'"([\w.]+)"', text))  # missing and unexpected keys
    classes = {"num_classes": kwargs["num_classes"]}
    base, whole = _layout(source, classes), _layout(source, kwargs)
    changes = {}
    for k in _user_keys(kwargs):
        alone = _layout(source, {**classes, k: kwargs[k]})
        if alone is not None and base is not None:  # what k changes by itself
            changes[k] = {t for t in named if base.get(t) != alone.get(t)}
            continue
        rest = _layout(source, {j: v for j, v in kwargs.items() if j != k})
        if rest is not None and whole is not None:  # what k changes beside the others
            changes[k] = {t for t in named if rest.get(t) != whole.get(t)}
        else:
            changes[k] = set(named)
    left, found = set(named), []
    while left:
        k = max(changes, key=lambda j: len(changes[j] & left), default=None)
        if k is None or not changes[k] & left:
            break
        found.append(k)
        left -= changes.pop(k)
    return found or _user_keys(kwargs)


def _layout(source: str, kwargs: Dict[str, Any]) -> Optional[Dict[str, Tuple[int, ...]]]:
    """Each tensor's shape in timm's ``source`` built with ``kwargs`` (None: it does not
    build); on the meta device, so a large model costs no memory."""
    for device in ("meta", "cpu"):  # some initialisers call .item(): build for real then
        try:
            with torch.device(device):
                net = timm.create_model(source, pretrained=False, **kwargs)
        except Exception:  # noqa: BLE001 - any failure: not buildable with these alone
            continue
        return {k: tuple(v.shape) for k, v in net.state_dict().items()}
    return None
