"""torch.compile for reversible blocks: compiled F and G under every engine.

:func:`compile_blocks` compiles each :class:`~pareprop.engine.ReversibleBlock`'s ``f`` and ``g``
in place, so every engine runs the compiled code in forward and in recomputation alike
(the engines call ``block.f`` and ``block.g``, nothing else). See docs/compile.md.
"""

from __future__ import annotations

import types
from typing import Any, Dict, List

import torch
import torch.nn as nn

from pareprop.engine.block import ReversibleBlock

__all__ = ["compile_blocks", "uncompile_blocks", "compiled_blocks"]

_BRANCHES = ("f", "g")
_MARK = "_pareprop_compiled"
# cache entries per F or G code object: a stage shape x grad mode x autocast state each
_RECOMPILE_LIMIT = 32

# NOTE [ Regional compilation of F and G ]
# The unit compiled is a block's F or G, not the model: torch's regional compilation recipe.
# Blocks of one class run the same code object, and with inlined nn.Modules (the default since
# torch 2.5) their parameters are graph inputs rather than guarded constants, so every block of
# one class and shape reuses one compiled graph; compile time does not grow with depth
# (tests/test_compile.py counts the compiled frames; benchmarks/compile.py times it).
# fullgraph=True makes a graph break inside F or G an error instead of a silent slowdown.
# dynamic=False by default: each stage's shape gets its own static graph (automatic dynamic
# shapes hit inductor errors on MViTv2's pooling), so hierarchical models need a few cache
# entries per code object; compile_blocks raises Dynamo's recompile_limit (a process-wide
# setting) to 32 (stage shapes x grad mode x autocast state).
# The compiled callables are instance attributes that shadow the class's ``f`` and ``g``, so
# uncompile_blocks only has to delete them, and state_dict keys do not change.
#
# NOTE [ Compiled randomness in recomputation ]
# The engines replay dropout and drop-path by restoring the global generator state before each
# F and G (NOTE [ Exact replay of randomness ] in engine/replay.py). Inductor's own random kernels
# draw their seeds from the global generator too, but not as eager does, so a compiled F would
# not draw eager's masks. compile_blocks therefore passes inductor's ``fallback_random=True``
# (scoped to these compiles through ``options``), so compiled dropout calls the same aten
# random ops as eager: recomputation replays forward's masks, and a compiled model draws
# exactly what the eager one draws from the same seed (tested against eager, every engine).
# Pass ``options={"fallback_random": False}`` to opt out.


def _check_torch() -> None:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 5):
        raise RuntimeError(
            f"pareprop.compile_blocks needs torch >= 2.5 (nn.Module inlining makes blocks share "
            f"compiled code), found torch {torch.__version__}"
        )


def _blocks(model: nn.Module) -> List[ReversibleBlock]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if isinstance(m, ReversibleBlock)]


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile every reversible block's ``f`` and ``g`` inside ``model``, in place.

    Args:
        model: a module holding :class:`~pareprop.engine.ReversibleBlock` instances (a
            pareprop model, a :class:`~pareprop.engine.ReversibleStack`, or one block).
        **compile_kwargs: passed to :func:`torch.compile` (``mode``, ``dynamic``, ``backend``,
            ``options``...). ``fullgraph`` defaults to True, ``dynamic`` to False and
            inductor's ``fallback_random`` to True; see NOTE [ Compiled randomness in
            recomputation ].

    Returns:
        ``model``, whose blocks now run compiled F and G under every engine.

    Raises:
        RuntimeError: torch older than 2.5.
        ValueError: ``model`` holds no reversible block.
    """
    _check_torch()
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} holds no ReversibleBlock; compile_blocks compiles their f "
            "and g (use torch.compile for other modules)"
        )
    kwargs: Dict[str, Any] = {"fullgraph": True, "dynamic": False, **compile_kwargs}
    if kwargs.get("backend", "inductor") == "inductor":
        kwargs["options"] = {"fallback_random": True, **(kwargs.get("options") or {})}
    if torch._dynamo.config.recompile_limit < _RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = _RECOMPILE_LIMIT
    # One torch.compile per block class and branch, bound to each block: every torch.compile
    # call makes its own inductor backend, and Dynamo's cache entries are guarded on the
    # backend, so compiling each block separately would recompile the same graph per block.
    shared: Dict[Any, Any] = {}
    for block in blocks:
        uncompile_blocks(block)
        for name in _BRANCHES:
            key = (type(block), name)
            if key not in shared:
                shared[key] = torch.compile(getattr(type(block), name), **kwargs)
            object.__setattr__(block, name, types.MethodType(shared[key], block))
        object.__setattr__(block, _MARK, True)
    return model


def uncompile_blocks(model: nn.Module) -> nn.Module:
    """Undo :func:`compile_blocks`: every block runs its class's eager ``f`` and ``g`` again."""
    for block in _blocks(model):
        if block.__dict__.pop(_MARK, False):
            for name in _BRANCHES:
                block.__dict__.pop(name, None)
    return model


def compiled_blocks(model: nn.Module) -> List[str]:
    """Names (as in ``named_modules``) of the blocks inside ``model`` that run compiled."""
    return [
        name for name, m in model.named_modules()
        if isinstance(m, ReversibleBlock) and m.__dict__.get(_MARK, False)
    ]
