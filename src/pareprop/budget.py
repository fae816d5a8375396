"""``pareprop.budget``: the memory dial's short name; it lives in :mod:`pareprop.memory.budget`.

The dial measures blocks with the memory counters, and the memory planner plans steps under a
budget, so both sit in one package, :mod:`pareprop.memory`; this module keeps the name that
``pareprop train --memory-budget``, checkpoints and users' code import. Its
:func:`set_engine` (``pareprop.set_engine``) adds the CUDA graphs switch to the dial's.
"""

from typing import Any, Optional

import torch.nn as nn

from pareprop.engine import ReversibleStack
from pareprop.engine import set_engine as _engine_set_engine
from pareprop.memory.budget import (
    BlockCost,
    Budget,
    MemoryPlan,
    apply_stored_blocks,
    parse_budget,
    set_memory_budget,
    stored_blocks,
)
from pareprop.memory.budget import set_engine as _budget_set_engine


def set_engine(
    module: nn.Module,
    name: str,
    memory_budget: Optional[Budget] = None,
    example_inputs: Any = None,
    fallback: Optional[bool] = None,
    cuda_graphs: Optional[bool] = None,
) -> nn.Module:
    """Switch every :class:`ReversibleStack` inside ``module`` to engine ``name``, or let a
    memory budget choose (``"auto"``): :func:`pareprop.memory.budget.set_engine`, whose
    ``memory_budget``, ``example_inputs`` and ``fallback`` these are.

    ``cuda_graphs=True`` captures each stack's training forward and backward as CUDA graphs
    after a few eager steps and replays them, for small batches where the host, issuing
    kernels, sets the pace (NOTE [ CUDA graphs of a stack ] in pareprop/engine/graphs.py;
    docs/compile.md). CUDA only; chunking, FSDP2 sharding, checkpointed blocks,
    debug_reconstruction and ``fallback=True`` are refused. False runs eagerly; None (the
    default) keeps each stack's setting. Under ``"auto"`` the budget measures the blocks eagerly
    first. Its speed is not measured yet (benchmarks/small_batch.py --graphs).
    """
    if name != "auto":
        if memory_budget is not None:
            raise ValueError(f"memory_budget= goes with engine='auto', not {name!r}")
        return _engine_set_engine(module, name, fallback, cuda_graphs)
    # The dial measures blocks with eager steps: graphs off while it does, then as asked.
    graphs = [m for m in module.modules() if isinstance(m, ReversibleStack) and m.cuda_graphs]
    keep = cuda_graphs if cuda_graphs is not None else bool(graphs)
    for m in graphs:
        m.set_engine(m.engine, cuda_graphs=False)
    module = _budget_set_engine(module, name, memory_budget, example_inputs, fallback)
    if keep:
        for m in module.modules():
            if isinstance(m, ReversibleStack):
                m.set_engine(m.engine, cuda_graphs=True)
    return module


__all__ = [
    "MemoryPlan",
    "BlockCost",
    "set_memory_budget",
    "set_engine",
    "parse_budget",
    "stored_blocks",
    "apply_stored_blocks",
]
