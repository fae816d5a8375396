"""Memory of training: what autograd keeps, what a whole step costs, and what it will cost.

* :func:`activation_bytes`: bytes the graph of one forward keeps for backward.
* :func:`memory_report`: one real training step (forward, loss, backward, optimizer step),
  broken down into parameters, gradients, optimizer state, kept activations and the peak.
* :func:`plan_memory`: the same report predicted under ``FakeTensorMode``, allocating nothing,
  for any registered model and timm baseline, for GPU sizes on a CPU.
* :func:`largest_batch`: the largest batch whose planned peak fits a memory size.
* :func:`set_memory_budget` (:mod:`~pareprop.memory.budget`): store the blocks that fit a
  budget of activation memory, recompute the rest; :func:`set_engine` with ``"auto"``.

See docs/memory.md for what a prediction leaves out.
"""

from pareprop.memory.budget import MemoryPlan, set_engine, set_memory_budget
from pareprop.memory.measure import memory_report
from pareprop.memory.plan import largest_batch, plan_memory
from pareprop.memory.report import BYTE_FIELDS, MemoryReport
from pareprop.memory.saved import activation_bytes
from pareprop.memory.units import parse_memory

__all__ = [
    "activation_bytes",
    "memory_report",
    "plan_memory",
    "largest_batch",
    "parse_memory",
    "MemoryReport",
    "BYTE_FIELDS",
    "MemoryPlan",
    "set_memory_budget",
    "set_engine",
]
