"""The forward coupling, shared by every engine: Y1 = beta X1 + F(X2), Y2 = beta X2 + G(Y1).

Every call of F and G (in forward and in recomputation) goes through :func:`_call_checked`,
which refuses a branch that modifies its input in place or changes its shape.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from pareprop.chunking import Chunk
from pareprop.engine.block import ReversibleBlock, _skip, skip_scale
from pareprop.engine.plan import _BlockRecord
from pareprop.engine.replay import _ModeState, _RngState

Tensor = torch.Tensor


def _call_checked(
    block: ReversibleBlock,
    name: str,
    x: Tensor,
    kwargs: Dict[str, Any],
    chunk: Optional[Chunk] = None,
) -> Tensor:
    """``block.f(x)`` or ``block.g(x)`` (``f_chunk`` / ``g_chunk`` with a chunk), checked."""
    call = getattr(block, name) if chunk is None else functools.partial(
        getattr(block, f"{name}_chunk"), chunk=chunk)
    # Traced (whole-model torch.compile) or inference-mode tensors: they have no _version.
    if torch.compiler.is_compiling() or x.is_inference():
        return call(x, **kwargs)
    version = x._version
    out = call(x, **kwargs)
    if x._version != version:
        raise RuntimeError(
            f"{type(block).__name__}.{name} modified its input in place; a reversible block "
            "must leave its input unchanged (use out-of-place ops, e.g. inplace=False)"
        )
    if out.shape != x.shape:
        raise RuntimeError(
            f"{type(block).__name__}.{name} must return a tensor of its input's shape "
            f"{tuple(x.shape)}, got {tuple(out.shape)}"
        )
    return out


def _drawing(rng: Optional[Any], index: int, branch: str) -> contextlib.AbstractContextManager:
    """Where F or G of block ``index`` draws its random numbers in forward: from the global
    generators, or, in a captured step, from the branch's own stream (NOTE [ Randomness in
    CUDA graphs ] in replay.py)."""
    return contextlib.nullcontext() if rng is None else rng.forward(index, branch)


def _couple(
    block: ReversibleBlock,
    x1: Tensor,
    x2: Tensor,
    kwargs: Dict[str, Any],
    records: Optional[List[_BlockRecord]] = None,
    keep_inputs: bool = False,
    rng: Optional[Any] = None,
    index: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Y1 = beta X1 + F(X2), Y2 = beta X2 + G(Y1). With ``records`` (the reversible engines),
    each block's record for recomputation is appended, and ``index`` is its length. ``rng``:
    the per-branch streams of a captured step, None outside one."""
    beta = skip_scale(block)
    index = len(records) if records is not None else index
    if records is None or rng is not None:
        with _drawing(rng, index, "f"):
            y1 = _skip(beta, x1) + _call_checked(block, "f", x2, kwargs)
        with _drawing(rng, index, "g"):
            y2 = _skip(beta, x2) + _call_checked(block, "g", y1, kwargs)
        if records is not None:  # recomputation draws from the same streams: nothing to keep
            inputs = (x1.clone(), x2.clone()) if keep_inputs else None
            records.append(_BlockRecord(None, None, inputs, _ModeState.capture(block, index)))
        return y1, y2
    f_rng = _RngState.capture(x2.device)
    y1 = _skip(beta, x1) + _call_checked(block, "f", x2, kwargs)
    g_rng = _RngState.capture(x2.device)
    y2 = _skip(beta, x2) + _call_checked(block, "g", y1, kwargs)
    inputs = (x1.clone(), x2.clone()) if keep_inputs else None
    records.append(_BlockRecord(f_rng, g_rng, inputs, _ModeState.capture(block, len(records))))
    return y1, y2
