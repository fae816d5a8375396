"""The model catalog: one road from a model's name to a model to run, measure or plan.

A name is pareprop's (``rev_vit_base_patch16_224``, see :func:`pareprop.list_models`), timm's
(``vit_base_patch16_224``), one of torchvision's video MViTs (``mvit_v1_b``, ``mvit_v2_s``:
:mod:`pareprop.models.torchvision_video`, the baselines of the video models) or 2-D Swins
(``swin_t`` ... ``swin_v2_b``: :mod:`pareprop.models.torchvision_swin`), or
``converted:SOURCE``, a pretrained model ``SOURCE`` converted by :func:`pareprop.convert`
(NOTE [ Converted models by name ]). The catalog
builds it with overrides in an *engine mode*: one of
pareprop's engines (``autograd``, ``reversible``, ``pareprop``) for a model with a
:class:`~pareprop.engine.ReversibleStack`, or a baseline mode for any other model (``plain``:
autograd; ``checkpointed``: timm's ``set_grad_checkpointing()``). A reversible model also runs
``checkpointed``: its blocks under the autograd engine, each in ``torch.utils.checkpoint`` as
timm's are (:func:`pareprop.engine.set_block_checkpointing`), so the reversible engines are
compared with checkpointing on the very same model. It also gives the model's
example inputs, its facts (source, family, depth, whether it is reversible or reads text) and
its logits. The benchmark (:mod:`pareprop.bench`), the memory planner
(:func:`pareprop.plan_memory`), the trainer and the CLI all build their models here, so a plan
of ``name`` is a plan of exactly the model ``create_model(name, **overrides)`` builds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn

from pareprop.convert import converted_model_name, converted_model_names
from pareprop.engine import ENGINES, set_block_checkpointing, stacks_of
from pareprop.engine.stack import REVERSIBLE_ENGINES
from pareprop.models import create_model, is_model, unknown_model_message
from pareprop.models.torchvision_swin import TORCHVISION_SWIN_MODELS, create_torchvision_swin
from pareprop.models.torchvision_video import TORCHVISION_VIDEO_MODELS, create_torchvision_video

__all__ = [
    "BASELINE_ENGINES",
    "ALL_ENGINES",
    "REVERSIBLE_ENGINES",
    "REVERSIBLE_MODEL_ENGINES",
    "ModelFacts",
    "ModelRequest",
    "CONVERTED_PREFIX",
    "CONVERTED_COUPLING",
    "converted_source",
    "is_converted",
    "model_source",
    "model_facts",
    "engines_for",
    "engine_budgets",
    "engine_label",
    "build_model",
    "example_inputs",
    "logits",
    "depth_overrides",
    "model_depth",
]

BASELINE_ENGINES = ("plain", "checkpointed")  # the modes of models without a reversible stack
ALL_ENGINES = tuple(ENGINES) + BASELINE_ENGINES
# The modes of a model with a reversible stack: the engines, and its blocks checkpointed.
REVERSIBLE_MODEL_ENGINES = tuple(ENGINES) + ("checkpointed",)


# NOTE [ Converted models by name ]
# ``converted:swin_tiny_patch4_window7_224`` names timm's (or torchvision's) model converted
# by pareprop.convert, so one plan or benchmark compares it with its source by name
# (``pareprop plan --models converted:X X --engines reversible checkpointed``). The catalog
# builds ``create_model(converted_model_name(X), source=X, ...)`` at the reversible coupling
# (0, 1) unless a ``coupling`` override says otherwise: at (1, 0) every block is stored, which
# is plain fine-tuning's memory, not what converting buys. No precision guard is attached
# (``tolerance=None``): a plan has no values to measure, and the coupling planned is the one
# given. ``img_size`` and ``depth`` go to the source's constructor. ``pareprop plan --coupling``
# (plan_sweep's ``coupling``) gives the override to the names is_converted() knows, and to no
# other model, whose constructor would refuse the keyword.

CONVERTED_PREFIX = "converted:"
CONVERTED_COUPLING = (0.0, 1.0)  # a converted:SOURCE name's (alpha, beta) unless overridden


def converted_source(name: str) -> Optional[str]:
    """The source of a ``converted:SOURCE`` name, or None for other names."""
    return name[len(CONVERTED_PREFIX):] if name.startswith(CONVERTED_PREFIX) else None


def is_converted(name: str) -> bool:
    """Whether ``name`` builds a converted model, whose coupling an override ``coupling``
    sets: ``converted:SOURCE``, or a registered converted model (``converted_vit``...)."""
    return converted_source(name) is not None or name in converted_model_names()


def model_source(name: str) -> str:
    """``"pareprop"``, ``"torchvision"`` (its video MViTs and 2-D Swins), ``"converted"``
    (``converted:SOURCE``) or ``"timm"``: who knows ``name``.

    Raises:
        ValueError: none knows it; the message names pareprop's close matches.
    """
    source = converted_source(name)
    if source is not None:
        converted_model_name(source, name)  # raises, naming the families pareprop converts
        return "converted"
    if is_model(name):
        return "pareprop"
    if name in TORCHVISION_VIDEO_MODELS or name in TORCHVISION_SWIN_MODELS:
        return "torchvision"
    if timm.is_model(name):
        return "timm"
    raise ValueError(unknown_model_message(name) + "; timm model names are accepted too")


@dataclass(frozen=True)
class ModelFacts:
    """What a name's default model is, read off a build on the meta device."""

    name: str
    source: str  # "pareprop" or "timm"
    family: str  # the model's class: RevViT, RevMViTv2, VisionTransformer...
    reversible: bool  # holds a ReversibleStack: runs the engines, else the baseline modes
    text: bool  # takes (input_ids, attention_mask); its input_size is (seq_len,)
    cfg: Any  # the pareprop config dataclass, or None
    input_size: Optional[Tuple[int, ...]]
    depth: Optional[int]  # blocks in total (see model_depth)


_FACTS: Dict[str, ModelFacts] = {}


def model_facts(name: str) -> ModelFacts:
    """The facts of model ``name`` with its default config (cached per name)."""
    if name in _FACTS:
        return _FACTS[name]
    source = model_source(name)
    build = {"pareprop": _default_pareprop, "torchvision": _create_torchvision,
             "converted": _default_converted}.get(source, _default_timm)
    try:
        with _meta_device():
            model = build(name)
    except Exception:  # some initialisers call .item(); build for real then
        model = build(name)
    pcfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    input_size = pcfg.get("input_size")
    facts = ModelFacts(
        name=name,
        source=source,
        family=type(model).__name__,
        reversible=bool(stacks_of(model)),
        text=input_size is not None and len(input_size) == 1,
        cfg=getattr(model, "cfg", None),
        input_size=tuple(input_size) if input_size is not None else None,
        depth=model_depth(model),
    )
    _FACTS[name] = facts
    del model
    return facts


@contextlib.contextmanager
def _meta_device() -> Iterator[None]:
    # Building on the meta device inspects a base-size model without allocating it.
    with torch.device("meta"):
        yield


def _default_pareprop(name: str) -> nn.Module:
    return create_model(name)


def _default_converted(name: str) -> nn.Module:
    return _create_converted(name, {"num_classes": 2})


def _create_converted(name: str, kwargs: Dict[str, Any]) -> nn.Module:
    source = converted_source(name)
    kwargs = {"coupling": CONVERTED_COUPLING, "tolerance": None, **kwargs, "source": source}
    return create_model(converted_model_name(source, f"converted:{source}"), **kwargs)


def _default_timm(name: str) -> nn.Module:
    # A small head: the facts do not depend on it, and a 1000-class head of a large model
    # would be built for real where the meta device cannot be used.
    return timm.create_model(name, pretrained=False, num_classes=2)


def engines_for(name: str, engines: Sequence[str]) -> List[str]:
    """The engine modes of ``engines`` that apply to model ``name``, in the given order."""
    valid = REVERSIBLE_MODEL_ENGINES if model_facts(name).reversible else BASELINE_ENGINES
    return [e for e in engines if e in valid]


def engine_budgets(engines: Sequence[str], budgets: Sequence[Any]) -> List[Tuple[str, Any]]:
    """``(engine, memory budget)`` pairs to run: each reversible engine once per budget
    (``None``: no budget); autograd and the baselines have no blocks to choose and run once."""
    out: List[Tuple[str, Any]] = []
    for engine in engines:
        if engine in REVERSIBLE_ENGINES:
            out += [(engine, None if b is None else float(b)) for b in dict.fromkeys(budgets)]
        else:
            out.append((engine, None))
    return out


def engine_label(record: Dict[str, Any]) -> str:
    """The engine of a record as tables and plots show it: ``reversible``; under a memory
    budget (``pareprop bench --memory-budgets``) ``reversible@0.5``; with the non-reversible
    blocks checkpointed (``--grad-checkpointing``) ``reversible+ckpt``; with chunked branches
    (``chunk_bytes``) ``reversible_chunked``, as ``benchmarks/gpu_sweep.py`` names them."""
    budget = record.get("memory_budget")
    engine = record["engine"]
    if record.get("chunk_bytes") is not None:
        engine += "_chunked"
    label = engine if budget is None else f"{engine}@{budget:g}"
    return label + "+ckpt" if record.get("grad_checkpointing") else label


@dataclass
class ModelRequest:
    """A model by name, with what to change about it.

    ``None`` keeps the model's own value: ``create_model(model, **overrides)`` (or timm's
    ``create_model``) is what is built, changed only by the fields given.
    """

    model: str
    engine: str  # an engine or "checkpointed" (reversible models), or a baseline mode
    num_classes: Optional[int] = None
    img_size: Optional[int] = None
    depth: Optional[int] = None  # blocks in total; staged models change their deepest stage
    seq_len: Optional[int] = None  # text models' example inputs
    seed: int = 0  # example inputs of models without example_inputs()
    grad_checkpointing: bool = False  # reversible models: checkpoint their other blocks
    overrides: Dict[str, Any] = field(default_factory=dict)  # any other config field


def build_model(request: ModelRequest, facts: Optional[ModelFacts] = None) -> nn.Module:
    """Build ``request.model`` with its overrides, in its engine or baseline mode."""
    facts = facts if facts is not None else model_facts(request.model)
    if is_converted(request.model):
        # img_size and depth are the source's; a registered converted model (converted_vit)
        # takes them as the source's keywords too.
        kwargs = _source_kwargs(request)
        kwargs["engine"] = "autograd" if request.engine == "checkpointed" else request.engine
        try:
            model = (_create_converted(request.model, kwargs) if facts.source == "converted"
                     else create_model(request.model, **kwargs))
        except (TypeError, ValueError) as err:  # torchvision's sources take no depth
            if request.depth is not None and "argument 'depth'" in str(err):
                raise ValueError(
                    f"depth override unsupported: the source of {request.model!r} takes no "
                    "depth argument; give no depth for it (--depth, --depths)"
                ) from err
            raise
    elif facts.source == "pareprop":
        model = create_model(request.model, **_pareprop_kwargs(request, facts))
    elif facts.source == "torchvision":
        model = _create_torchvision(request.model, **_torchvision_kwargs(request))
    else:
        try:
            model = timm.create_model(request.model, pretrained=False, **_source_kwargs(request))
        except TypeError as err:
            if request.depth is not None and "depth" in str(err):
                raise ValueError(
                    f"depth override unsupported: timm model {request.model!r} takes no depth "
                    "argument; omit --depths for it"
                ) from err
            raise
    if request.engine == "checkpointed":
        # timm's blocks; or a reversible model's blocks, and its other blocks (transitions)
        # where it has any (a model of the model contract has set_grad_checkpointing).
        if facts.reversible:
            set_block_checkpointing(model, True)
        if not facts.reversible or hasattr(model, "set_grad_checkpointing"):
            model.set_grad_checkpointing(True)
    if request.grad_checkpointing:
        if not facts.reversible:
            raise ValueError(
                f"grad checkpointing here is for the blocks of reversible models that are not "
                f"reversible; {request.model!r} is a baseline: use its engine 'checkpointed'"
            )
        model.set_grad_checkpointing(True)
    return model


def _pareprop_kwargs(request: ModelRequest, facts: ModelFacts) -> Dict[str, Any]:
    kwargs = _with_num_classes(request)
    names = {f.name for f in dataclasses.fields(facts.cfg)} if facts.cfg is not None else set()
    if facts.reversible:  # "checkpointed": autograd, with the blocks checkpointed by build_model
        kwargs["engine"] = "autograd" if request.engine == "checkpointed" else request.engine
    if request.img_size is not None and "img_size" in names:
        kwargs["img_size"] = request.img_size
    if facts.cfg is not None:
        kwargs.update(depth_overrides(facts.cfg, request.depth))
    return kwargs


def _create_torchvision(name: str, **kwargs: Any) -> nn.Module:
    # torchvision's baselines: its video MViTs, its 2-D Swins (which take no num_frames).
    if name in TORCHVISION_SWIN_MODELS:
        if "num_frames" in kwargs:
            raise ValueError(f"torchvision's {name!r} takes images: num_classes and img_size, "
                             "not num_frames")
        return create_torchvision_swin(name, **kwargs)
    return create_torchvision_video(name, **kwargs)


def _torchvision_kwargs(request: ModelRequest) -> Dict[str, Any]:
    kwargs = _with_num_classes(request)
    if request.depth is not None:
        raise ValueError(f"depth override unsupported: torchvision's {request.model!r} takes "
                         "no depth argument; omit --depths for it")
    if request.img_size is not None:
        kwargs["img_size"] = request.img_size
    unknown = set(kwargs) - {"num_classes", "num_frames", "img_size"}
    if unknown:
        raise ValueError(f"torchvision's {request.model!r} takes num_classes, num_frames and "
                         f"img_size, got {', '.join(sorted(unknown))}")
    return kwargs


def _source_kwargs(request: ModelRequest) -> Dict[str, Any]:
    # timm's keywords (a timm model's, or a converted model's source's).
    kwargs = _with_num_classes(request)
    for key in ("img_size", "depth"):
        if getattr(request, key) is not None:
            kwargs[key] = getattr(request, key)
    return kwargs


def _with_num_classes(request: ModelRequest) -> Dict[str, Any]:
    # A num_classes among the overrides wins over the request's (as --model-overrides does).
    kwargs: Dict[str, Any] = {}
    if request.num_classes is not None:
        kwargs["num_classes"] = request.num_classes
    kwargs.update(request.overrides)
    return kwargs


def example_inputs(
    model: nn.Module,
    request: ModelRequest,
    batch_size: int,
    device: Any = "cpu",
    facts: Optional[ModelFacts] = None,
) -> Tuple[torch.Tensor, ...]:
    """A batch for ``model`` (built from ``request``): its own ``example_inputs`` where it has
    them (pareprop's models; ``seq_len`` for text), else random images of its input size."""
    device = torch.device(device)
    example = getattr(model, "example_inputs", None)
    if example is not None:
        kwargs: Dict[str, Any] = {}
        if request.seq_len is not None and "seq_len" in inspect.signature(example).parameters:
            kwargs["seq_len"] = request.seq_len
        inputs = tuple(example(batch_size, device=device, **kwargs))
        if request.seq_len is not None and not inputs[0].is_floating_point() and not kwargs:
            inputs = _fit_seq_len(inputs, request.seq_len)
        return inputs
    facts = facts if facts is not None else model_facts(request.model)
    size = request.img_size or (facts.input_size[-1] if facts.input_size else 224)
    chans = facts.input_size[0] if facts.input_size else 3
    gen = torch.Generator().manual_seed(request.seed)
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


def logits(out: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor, ``out["logits"]`` or ``out[0]``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    return out[0]


def depth_overrides(cfg: Any, depth: Optional[int]) -> Dict[str, Any]:
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
    if "transition_blocks" in names and "depth" in names:  # Rev-MViT: stage starts by index
        ends = [*cfg.transition_blocks, cfg.depth]
        lengths = [b - a for a, b in zip([0, *cfg.transition_blocks], ends)]
        deepest = max(range(len(lengths)), key=lambda i: lengths[i])
        # A stage keeps one reversible block (after its transition, if it has one).
        least = cfg.depth - lengths[deepest] + (1 if deepest == 0 else 2)
        lengths[deepest] += depth - cfg.depth
        if depth < least:
            raise ValueError(
                f"expected a depth of at least {least} for transition_blocks "
                f"{tuple(cfg.transition_blocks)} (depth {cfg.depth}), got {depth}"
            )
        starts = tuple(sum(lengths[:i]) for i in range(1, len(lengths)))
        return {"depth": depth, "transition_blocks": starts}
    if "depth" in names:
        return {"depth": depth}
    raise ValueError(f"model config {type(cfg).__name__} has no depth field; omit --depths")


def model_depth(model: nn.Module) -> Optional[int]:
    """Blocks in total: the config's ``depths`` summed or ``depth``, else the model's
    ``blocks`` or its stages' (timm's models); ``None`` where none of these exists."""
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
