"""The one entry point, :func:`convert`: the families it knows, what every conversion checks of
its source, and the source's names in the converted model's state dict."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar

import torch.nn as nn

from pareprop.convert.precision_guard import PrecisionGuard
from pareprop.engine import ENGINES

__all__ = [
    "NamedSource", "UnsupportedModelError", "build_source", "convert", "converted_model_name",
    "converted_model_names", "converter_for", "converts", "keep_source_names",
    "refuse_grad_checkpointing", "refuse_hooks", "register_source_names", "set_clip_data",
]


class UnsupportedModelError(ValueError):
    """The model cannot be converted exactly; the message says why."""


# The source classes each family converts, mapped to the converted model's class; each family
# module registers its own (``@converts(VisionTransformer)``).
_CONVERTERS: Dict[type, Type[nn.Module]] = {}


def converts(*sources: type) -> Callable[[Type[nn.Module]], Type[nn.Module]]:
    """Class decorator: the converted model class built as ``cls(source, engine=...)`` from a
    source of one of these classes."""

    def register(cls: Type[nn.Module]) -> Type[nn.Module]:
        for source in sources:
            _CONVERTERS[source] = cls
        return cls

    return register


def converter_for(model: nn.Module) -> Type[nn.Module]:
    """The converted class for ``model``'s class or its nearest registered base (whose own
    check then says whether the subclass is safe), or :class:`UnsupportedModelError`."""
    for cls in type(model).__mro__:
        if cls in _CONVERTERS:
            return _CONVERTERS[cls]
    known = ", ".join(sorted({f"{c.__module__.split('.')[0]} {c.__name__}" for c in _CONVERTERS}))
    raise UnsupportedModelError(
        f"pareprop.convert does not know {type(model).__name__}; it converts {known}"
    )


def convert(
    model: nn.Module,
    engine: str = "reversible",
    tolerance: Optional[float] = 1e-3,
    guard_every: int = 100,
) -> nn.Module:
    """Rewire a pretrained model into a dual-residual reversible model, exactly.

    The result shares ``model``'s parameters (copy it first to keep the original apart), keeps
    the source's parameter names in its state dict, and starts at (alpha, beta) = (1, 0): its
    logits equal ``model``'s to the bit in float32. Move the coupling with
    :func:`pareprop.set_coupling` or :class:`pareprop.CouplingSchedule` (docs/convert.md).

    Args:
        model: a model of a family pareprop converts (timm's ``VisionTransformer`` with
            pre-norm two-branch blocks, ...). Anything else raises
            :class:`UnsupportedModelError` with the reason.
        engine: the backward engine of the stacks.
        tolerance: the precision guard's tolerance on rebuilt inputs (see
            :class:`pareprop.PrecisionGuard`); None attaches no guard (then only beta = 0 is
            stored, and a small beta can give wrong gradients).
        guard_every: the guard measures again after this many training steps.
    """
    if engine not in ENGINES:
        raise ValueError(f"expected engine in {ENGINES}, got {engine!r}")
    converted = converter_for(model)(model, engine=engine).train(model.training)
    if tolerance is not None:
        PrecisionGuard(converted, tolerance=tolerance, every=guard_every)
    return converted


# NOTE [ Model arguments of a source ]
# A converted model's keywords beyond its own (source, engine, coupling, ...) go to the source's
# library: timm's create_model, torchvision's constructors. An argument the source does not take
# is their TypeError, a value it cannot build with anything from an assertion to a RuntimeError
# deep inside a layer. Either is the user's input, not a bug: :func:`build_source` says which
# arguments, in one line (``pareprop train`` and ``eval`` print it and exit 2), as a registered
# model refuses a field its config lacks.

_BUILD_ERRORS = (TypeError, ValueError, AssertionError, RuntimeError, ZeroDivisionError,
                 IndexError, KeyError)

M = TypeVar("M", bound=nn.Module)


def build_source(build: Callable[[], M], what: str, kwargs: Dict[str, Any]) -> M:
    """``build()``: the source ``what`` (e.g. "timm's vit_small_patch16_224") from the model
    arguments ``kwargs``; whatever it raises for them becomes a one-line ValueError naming them
    (NOTE [ Model arguments of a source ])."""
    try:
        return build()
    except _BUILD_ERRORS as e:
        first = (str(e).strip().splitlines() or [""])[0] or type(e).__name__
        named = re.findall(r"unexpected keyword argument '(\w+)'", first)
        if named:
            raise ValueError(
                f"{what} takes no model argument {named[0]!r} ({first}); drop it, or give one "
                "its constructor takes"
            ) from None
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "its defaults"
        raise ValueError(f"cannot build {what} with {given}: {first}") from None


def set_clip_data(model: nn.Module, frame_stride: Optional[int] = None,
                  mean: Optional[Sequence[float]] = None,
                  std: Optional[Sequence[float]] = None) -> None:
    """Overrides of a converted video model's data config (``frame_stride``, ``mean``,
    ``std``; None keeps the weights'), into its ``pretrained_cfg``, where the one video data
    config reads them (NOTE [ One video data config ] in pareprop/video.py), as a registered
    video model takes them. Checked here, when the model is built, not when its clips are
    first drawn."""
    cfg = model.pretrained_cfg
    if frame_stride is not None:
        if isinstance(frame_stride, bool) or not isinstance(frame_stride, int) or frame_stride < 1:
            raise ValueError(
                f"expected frame_stride an int >= 1 (clips take every frame_stride-th frame at "
                f"30 fps), got {frame_stride!r}"
            )
        cfg["frame_stride"] = frame_stride
    channels = int(cfg["input_size"][0])
    for name, values in (("mean", mean), ("std", std)):
        if values is None:
            continue
        ok = isinstance(values, (tuple, list)) and len(values) == channels and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not ok or (name == "std" and min(values) <= 0):
            raise ValueError(f"expected {name} with one number per channel ({channels})"
                             f"{', each > 0' if name == 'std' else ''}, got {values!r}")
        cfg[name] = tuple(float(v) for v in values)


# NOTE [ Sources by name ]
# ``pareprop train --convert-from NAME`` (and create_model("converted_...", source=NAME))
# builds the source by its library's name. Each family registers its named converted model
# with the source names it takes (timm's by module, torchvision's by name), so one lookup
# says which converted model a source name makes.


@dataclass(frozen=True)
class NamedSource:
    model_name: str  # the registered converted model ("converted_vit", ...)
    library: str  # the source's library, for messages ("timm", "torchvision")
    accepts: Callable[[str], bool]  # whether a source name belongs to this family
    examples: str  # a few source names, for messages


_NAMED_SOURCES: List[NamedSource] = []


def register_source_names(model_name: str, library: str, accepts: Callable[[str], bool],
                          examples: str) -> None:
    """Declare that the registered model ``model_name`` converts the sources ``accepts``."""
    _NAMED_SOURCES.append(NamedSource(model_name, library, accepts, examples))


def converted_model_names() -> Tuple[str, ...]:
    """Every registered converted model's name."""
    return tuple(dict.fromkeys(s.model_name for s in _NAMED_SOURCES))


def converted_model_name(source: str, asked: Optional[str] = None) -> str:
    """The registered converted model that builds the source named ``source``; ``asked``: how
    the command named it, for the message (default ``--convert-from SOURCE``; plan and eval
    say ``converted:SOURCE``)."""
    for named in _NAMED_SOURCES:
        if named.accepts(source):
            return named.model_name
    known = "; ".join(f"{s.library} {s.examples} ({s.model_name})" for s in _NAMED_SOURCES)
    asked = asked or f"--convert-from {source!r}"
    raise ValueError(f"{asked} names no model pareprop converts: {known}")


def _hooks(module: nn.Module) -> List[str]:
    """The kinds of module hooks registered on ``module`` itself."""
    kinds = (("forward", "_forward_hooks"), ("forward pre", "_forward_pre_hooks"),
             ("backward", "_backward_hooks"), ("backward pre", "_backward_pre_hooks"))
    return [kind for kind, attr in kinds if getattr(module, attr, None)]


def refuse_hooks(modules: Iterable[Tuple[str, nn.Module]], runs: str) -> None:
    """Refuse hooks on modules whose own ``forward`` the converted model never calls.

    ``modules``: (name, module) pairs; ``runs``: which submodules do run, for the message.
    """
    for name, module in modules:
        kinds = _hooks(module)
        if kinds:
            raise UnsupportedModelError(
                f"{name} has {', '.join(kinds)} hook(s): the converted model calls the "
                "blocks' branches, never this module's forward, so they would not run. Remove "
                "them (handle.remove()) before converting, or register them on the block's "
                f"submodules ({runs}), which do run"
            )


def refuse_grad_checkpointing(model: nn.Module) -> None:
    if getattr(model, "grad_checkpointing", False) or any(
            getattr(m, "grad_checkpointing", False) for m in model.modules()):
        raise UnsupportedModelError(
            "the model has gradient checkpointing on; turn it off "
            "(set_grad_checkpointing(False)): the reversible engines replace it"
        )


# NOTE [ The source's names in the state dict ]
# A converted model keeps the blocks of a stage in a reversible stack (``stack.blocks.3``) so
# that every engine, the memory dial and FSDP find them; the source calls them ``blocks.3``.
# Two state-dict hooks translate, so the source's checkpoints load with load_state_dict and
# state_dict() loads into the source. Inside a block the names are the source's already: a
# converted block holds the source's own modules under the source's attributes.


class _SourceNames:
    """The two state-dict hooks of :func:`keep_source_names`, as objects of a module-level
    class, not closures: a converted model pickles (``torch.save(model)``, ``pickle.dumps``,
    spawned workers) and deep-copies with them."""

    def __init__(self, renames: Sequence[Tuple[str, str]]):
        self.to_source = [(re.compile(r"(^|\.)" + re.escape(ours)), theirs)
                          for ours, theirs in renames]
        self.to_ours = [(re.compile(r"(^|\.)" + re.escape(theirs)), ours)
                        for ours, theirs in renames]

    @staticmethod
    def rename(key: str, prefix: str, rules) -> str:
        rest = key[len(prefix):]
        for pattern, repl in rules:
            rest, n = pattern.subn(r"\g<1>" + repl, rest, count=1)  # names: no backslashes
            if n:
                break
        return prefix + rest

    def save(self, module, state_dict, prefix, local_metadata):
        for key in list(state_dict):  # every key moves to the end, so the order is kept
            value = state_dict.pop(key)
            state_dict[self.rename(key, prefix, self.to_source)
                       if key.startswith(prefix) else key] = value
        return state_dict

    def load(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
             error_msgs):
        for key in list(state_dict):
            value = state_dict.pop(key)
            ours = not key.startswith(prefix) or any(
                p.search(key[len(prefix):]) for p, _ in self.to_source)  # ours already
            state_dict[key if ours else self.rename(key, prefix, self.to_ours)] = value


def keep_source_names(model: nn.Module, renames: Sequence[Tuple[str, str]]) -> None:
    """Give ``model``'s state dict the source's names: each (ours, source's) pair of dotted
    name parts is swapped wherever ``ours`` starts a name or follows a dot, on save and back on
    load."""
    names = _SourceNames(renames)
    model._register_state_dict_hook(names.save)
    model._register_load_state_dict_pre_hook(names.load)
