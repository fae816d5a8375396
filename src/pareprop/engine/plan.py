"""What a stack's forward leaves for its backward: the plan of one step.

:class:`_Plan` holds everything backward needs besides the saved outputs: the blocks, their
parameters as forward saw them, the captured state (:mod:`pareprop.engine.replay`), each
block's record and, for stored blocks, the graphs forward built (:class:`_Rebuilt`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from pareprop.engine.block import ReversibleBlock
from pareprop.engine.chunk_cost import Chunking
from pareprop.engine.fallback import PaRepropFallback
from pareprop.engine.replay import (
    _AutocastState,
    _BackendState,
    _KeywordVersions,
    _ModeState,
    _RngState,
)
from pareprop.engine.sharding import BlockSharding

Tensor = torch.Tensor


@dataclass
class _BlockRecord:
    """What forward leaves for one block's recomputation (and for the debug check)."""

    # None for a stored block, which is not recomputed, and in a captured step, whose branches
    # draw from their own streams (NOTE [ Randomness in CUDA graphs ] in replay.py).
    f_rng: Optional[_RngState]
    g_rng: Optional[_RngState]
    inputs: Optional[Tuple[Tensor, Tensor]] = None
    modes: Optional[_ModeState] = None


@dataclass
class _Plan:
    """Everything a stack's backward needs besides the saved outputs."""

    blocks: Sequence[ReversibleBlock]
    engine: str
    kwargs: Dict[str, Any]
    # Per block: (index into the Function's parameter inputs, parameter) of trainable params.
    block_params: List[List[Tuple[int, Tensor]]]
    # Per block: every parameter as (owning module, attribute, tensor, version) at forward.
    block_locations: List[List["_ParamLocation"]]
    num_params: int
    device: torch.device
    autocast: _AutocastState
    backends: _BackendState
    keywords: "_KeywordVersions"
    # Per block: True when the block keeps its graph from forward (NOTE [ Stored blocks ] in
    # rebuild.py).
    stored: Sequence[bool]
    # Per block: its skip scale at forward as (buffer, version), None for beta = 1 (NOTE
    # [ Skip scale of the coupling ] in block.py).
    betas: Sequence[Optional[Tuple[Tensor, int]]] = ()
    debug_tolerance: Optional[float] = None
    records: List[_BlockRecord] = field(default_factory=list)
    # Per block: the graphs a stored block built in forward, until backward consumes them.
    graphs: List[Optional["_Rebuilt"]] = field(default_factory=list)
    # Called around each stored block's forward (pareprop.memory.budget measures blocks with it).
    probe: Optional[Callable[[int, Tensor], contextlib.AbstractContextManager]] = None
    reconstruction_errors: List[Tuple[float, float]] = field(default_factory=list)
    # FSDP2: gathers each block around its forward and recomputation and hands its parameter
    # gradients to FSDP; None when the stack is not sharded (NOTE [ FSDP2 and reversible blocks ]
    # in distributed/fsdp.py). A sharded stack's block_params are filled in forward, per block.
    sharding: Optional[BlockSharding] = None
    # Chunked backward of the recomputed blocks (NOTE [ Chunked backward ] in chunked.py); None:
    # whole branches.
    chunking: Optional[Chunking] = None
    # (block, branch, input shape, dtype, autocast) -> (fixed, per-unit) saved bytes of a chunk.
    chunk_costs: Dict[Any, Tuple[float, float]] = field(default_factory=dict)
    # A chunked stack's outputs, held here (not saved in the Function) until backward takes
    # them, and their versions at forward.
    outputs: Optional[List[Tensor]] = None
    output_versions: Tuple[int, ...] = ()
    # Under "pareprop": the stack's choice between PaReprop and Reprop (engine/fallback.py).
    fallback: Optional[PaRepropFallback] = None
    # In a step captured as CUDA graphs: the branches' random streams (_CudaBranchRng, or its
    # CPU stand-in), which forward and recomputation draw from; None outside one.
    graph_rng: Optional[Any] = None


@dataclass
class _ParamLocation:
    module: nn.Module
    name: str
    tensor: Tensor
    version: int


@dataclass
class _Rebuilt:
    """Block l's local graphs, G(Y1) and F(X2), and its reconstructed inputs."""

    y1: Tensor  # the block's first output, input of G: a leaf (or a leaf's view, if stored)
    g_out: Optional[Tensor]  # None when chunked: grads() rebuilds G chunk by chunk
    x2: Tensor  # the reconstructed second input, input of F: likewise
    f_out: Optional[Tensor]  # likewise
    x1: Optional[Tensor]  # reconstructed first input (no graph); None where nobody needs it


def _plan_beta(plan: _Plan, index: int) -> Optional[Tensor]:
    if not plan.betas or plan.betas[index] is None:
        return None
    beta, version = plan.betas[index]
    if beta._version != version:
        raise RuntimeError(
            f"the skip scale of block {index} ({type(plan.blocks[index]).__name__}) changed "
            "between forward and backward; change it between steps, after backward"
        )
    return beta


def _block_params(
    block: nn.Module, params: Optional[List[Tensor]] = None, slots: Optional[Dict[int, int]] = None
) -> Tuple[List[Tuple[int, Tensor]], List[_ParamLocation]]:
    """A block's trainable parameters as (slot in ``params``, tensor), appending new ones to
    ``params``, and every parameter's location. Without ``params`` the slots are the block's own."""
    params = [] if params is None else params
    slots = {} if slots is None else slots
    owned: Dict[int, Tuple[int, Tensor]] = {}
    locations = []
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            locations.append(_ParamLocation(module, name, p, p._version))
            if not p.requires_grad or id(p) in owned:
                continue
            if id(p) not in slots:
                slots[id(p)] = len(params)
                params.append(p)
            owned[id(p)] = (slots[id(p)], p)
    return list(owned.values()), locations
