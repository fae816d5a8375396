"""``pareprop.budget``: the memory dial's short name; it lives in :mod:`pareprop.memory.budget`.

The dial measures blocks with the memory counters, and the memory planner plans steps under a
budget, so both sit in one package, :mod:`pareprop.memory`; this module keeps the name that
``pareprop train --memory-budget``, checkpoints and users' code import.
"""

from pareprop.memory.budget import (
    BlockCost,
    MemoryPlan,
    apply_stored_blocks,
    parse_budget,
    set_engine,
    set_memory_budget,
    stored_blocks,
)

__all__ = [
    "MemoryPlan",
    "BlockCost",
    "set_memory_budget",
    "set_engine",
    "parse_budget",
    "stored_blocks",
    "apply_stored_blocks",
]
