"""pareprop: reversible and parallel-reversible (PaReprop) backpropagation for transformers."""

from pareprop.checkpoint import CheckpointError, load_model
from pareprop.convert import (
    CouplingSchedule,
    GuardReport,
    PrecisionGuard,
    convert,
    coupling_of,
    set_coupling,
)
from pareprop.engine import (
    ENGINES,
    ReversibleBlock,
    ReversibleStack,
    chosen_schedule,
    debug_reconstruction,
    schedule_reasons,
    set_chunking,
)
from pareprop.engine.compile import compile_blocks, compiled_blocks, uncompile_blocks
from pareprop.memory import (
    MemoryReport,
    activation_bytes,
    largest_batch,
    memory_report,
    plan_memory,
)
from pareprop.memory.budget import MemoryPlan, set_engine, set_memory_budget
from pareprop.memory.drift import DriftReport, drift_report
from pareprop.models import create_model, is_model, list_models, model_spec, register_model
from pareprop.pretrained import PretrainedError, load_pretrained

# Detectors: imported so that plan_memory and largest_batch know their names (NOTE [ Detectors
# reach the planner by registration ] in memory/detection.py).
from pareprop import detection  # noqa: E402,F401  isort: skip

__version__ = "0.1.0"

__all__ = [
    "ENGINES",
    "ReversibleBlock",
    "ReversibleStack",
    "set_engine",
    "chosen_schedule",
    "schedule_reasons",
    "set_chunking",
    "compile_blocks",
    "uncompile_blocks",
    "compiled_blocks",
    "debug_reconstruction",
    "activation_bytes",
    "set_memory_budget",
    "MemoryPlan",
    "memory_report",
    "plan_memory",
    "largest_batch",
    "MemoryReport",
    "drift_report",
    "DriftReport",
    "create_model",
    "is_model",
    "list_models",
    "model_spec",
    "register_model",
    "load_model",
    "convert",
    "set_coupling",
    "coupling_of",
    "CouplingSchedule",
    "PrecisionGuard",
    "GuardReport",
    "CheckpointError",
    "load_pretrained",
    "PretrainedError",
]
