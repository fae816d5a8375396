"""Building a benchmarked model by name (pareprop's registry or timm's) and its inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn

from pareprop.bench.fields import BASELINE_ENGINES
from pareprop.engine import ENGINES, ReversibleStack
from pareprop.models import create_model, is_model

__all__ = ["engines_for"]


def _model_source(name: str) -> str:
    """``"pareprop"`` or ``"timm"``; ``ValueError`` for a name neither registry knows."""
    if is_model(name):
        return "pareprop"
    import timm

    if timm.is_model(name):
        return "timm"
    from pareprop.models._registry import _unknown_model_message

    raise ValueError(_unknown_model_message(name) + "; timm model names are accepted too")


@dataclass
class _ModelInfo:
    source: str  # "pareprop" or "timm"
    reversible: bool
    text: bool  # takes (input_ids, attention_mask); its input_size is (seq_len,)
    cfg: Any  # the pareprop config dataclass, or None
    input_size: Tuple[int, ...] | None


_INFO_CACHE: Dict[str, _ModelInfo] = {}


@contextlib.contextmanager
def _meta_device() -> Iterator[None]:
    # Building on the meta device inspects a base-size model without allocating it.
    with torch.device("meta"):
        yield


def _model_info(name: str) -> _ModelInfo:
    if name in _INFO_CACHE:
        return _INFO_CACHE[name]
    source = _model_source(name)
    build = _build_pareprop if source == "pareprop" else _build_timm_default
    try:
        with _meta_device():
            model = build(name)
    except Exception:  # some initialisers call .item(); build for real then
        model = build(name)
    reversible = any(isinstance(m, ReversibleStack) for m in model.modules())
    pcfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    input_size = pcfg.get("input_size")
    text = input_size is not None and len(input_size) == 1
    info = _ModelInfo(source, reversible, text, getattr(model, "cfg", None), input_size)
    _INFO_CACHE[name] = info
    del model
    return info


def _build_pareprop(name: str, **overrides: Any) -> nn.Module:
    return create_model(name, **overrides)


def _build_timm_default(name: str) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=2)


def engines_for(name: str, engines: Sequence[str]) -> List[str]:
    """The engines of ``engines`` that apply to model ``name``, in the given order."""
    valid = ENGINES if _model_info(name).reversible else BASELINE_ENGINES
    return [e for e in engines if e in valid]


def _depth_overrides(cfg: Any, depth: int | None) -> Dict[str, Any]:
    """Config overrides that make a pareprop model ``depth`` blocks deep in total."""
    if depth is None:
        return {}
    names = {f.name for f in dataclasses.fields(cfg)}
    if "depths" in names:  # Swin-like: stage depths; the deepest stage absorbs the change
        depths = list(cfg.depths)
        deepest = max(range(len(depths)), key=lambda i: depths[i])
        depths[deepest] += depth - sum(depths)
        if depths[deepest] < 1:
            raise ValueError(
                f"expected a depth of at least {sum(cfg.depths) - cfg.depths[deepest] + 1} "
                f"for stage depths {tuple(cfg.depths)}, got {depth}"
            )
        return {"depths": tuple(depths)}
    if "last_block_indexes" in names and "depth" in names:  # MViT-like: stage ends by index
        ends = list(cfg.last_block_indexes)
        closed = ends[-1] == cfg.depth - 1  # else blocks after the last index form a stage
        if not closed:
            ends.append(cfg.depth - 1)
        lengths = [ends[0] + 1] + [b - a for a, b in zip(ends, ends[1:])]
        deepest = max(range(len(lengths)), key=lambda i: lengths[i])
        shallowest_total = cfg.depth - lengths[deepest] + 1
        lengths[deepest] += depth - cfg.depth
        if lengths[deepest] < 1:
            raise ValueError(
                f"expected a depth of at least {shallowest_total}"
                f" for last_block_indexes {tuple(cfg.last_block_indexes)} (depth {cfg.depth}), "
                f"got {depth}"
            )
        ends = [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]
        return {"depth": depth, "last_block_indexes": tuple(ends if closed else ends[:-1])}
    if "depth" in names:
        return {"depth": depth}
    raise ValueError(f"model config {type(cfg).__name__} has no depth field; omit --depths")



def _build(job: Any, info: _ModelInfo) -> nn.Module:
    # job: a _Job (pareprop.bench.measure) or anything with the same attributes.
    if info.source == "pareprop":
        overrides: Dict[str, Any] = {"num_classes": job.num_classes, **job.model_overrides}
        names = {f.name for f in dataclasses.fields(info.cfg)} if info.cfg is not None else set()
        if info.reversible:
            overrides["engine"] = job.engine
        if job.img_size is not None and "img_size" in names:
            overrides["img_size"] = job.img_size
        if info.cfg is not None:
            overrides.update(_depth_overrides(info.cfg, job.depth))
        model = create_model(job.model, **overrides)
    else:
        import timm

        kwargs: Dict[str, Any] = {"num_classes": job.num_classes, **job.model_overrides}
        if job.img_size is not None:
            kwargs["img_size"] = job.img_size
        if job.depth is not None:
            kwargs["depth"] = job.depth
        try:
            model = timm.create_model(job.model, pretrained=False, **kwargs)
        except TypeError as err:
            if job.depth is not None and "depth" in str(err):
                raise ValueError(
                    f"depth override unsupported: timm model {job.model!r} takes no depth "
                    "argument; omit --depths for it"
                ) from err
            raise
    if job.engine == "checkpointed":
        model.set_grad_checkpointing(True)
    if getattr(job, "grad_checkpointing", False):
        if not info.reversible:
            raise ValueError(
                f"grad checkpointing here is for the blocks of reversible models that are not "
                f"reversible; {job.model!r} is a baseline: use its engine 'checkpointed'"
            )
        model.set_grad_checkpointing(True)
    return model


def _make_inputs(
    model: nn.Module, job: Any, info: _ModelInfo, device: torch.device, batch_size: int
) -> Tuple[torch.Tensor, ...]:
    example = getattr(model, "example_inputs", None)
    if example is not None:
        kwargs: Dict[str, Any] = {}
        if job.seq_len is not None and "seq_len" in inspect.signature(example).parameters:
            kwargs["seq_len"] = job.seq_len
        inputs = tuple(example(batch_size, device=device, **kwargs))
        if job.seq_len is not None and not inputs[0].is_floating_point() and not kwargs:
            inputs = _fit_seq_len(inputs, job.seq_len)
        return inputs
    size = job.img_size or (info.input_size[-1] if info.input_size else 224)
    chans = info.input_size[0] if info.input_size else 3
    gen = torch.Generator().manual_seed(job.seed)
    return (torch.randn(batch_size, chans, size, size, generator=gen).to(device),)


def _fit_seq_len(inputs: Tuple[torch.Tensor, ...], seq_len: int) -> Tuple[torch.Tensor, ...]:
    # Text models whose example_inputs has no seq_len: cut (or tile) every (B, T) input to T.
    out = []
    for t in inputs:
        if t.dim() >= 2:
            reps = math.ceil(seq_len / t.shape[1])
            t = t.repeat(1, reps, *([1] * (t.dim() - 2)))[:, :seq_len]
        out.append(t)
    return tuple(out)


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    return out[0]


def _side(size: Any) -> int:
    return int(size[-1]) if isinstance(size, (tuple, list)) else int(size)


def _model_depth(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        if getattr(cfg, "depths", None) is not None:
            return int(sum(cfg.depths))
        if getattr(cfg, "depth", None) is not None:
            return int(cfg.depth)
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return len(blocks)
    depths = [len(s.blocks) for s in getattr(model, "stages", getattr(model, "layers", []))
              if isinstance(getattr(s, "blocks", None), (nn.ModuleList, nn.Sequential))]
    return sum(depths) if depths else None
