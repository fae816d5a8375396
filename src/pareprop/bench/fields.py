"""What a benchmark record holds, and the engine and autocast names a sweep accepts."""

from __future__ import annotations

from typing import Any, Dict

from pareprop.engine import ENGINES

__all__ = [
    "BASELINE_ENGINES",
    "ALL_ENGINES",
    "AMP_MODES",
    "REVERSIBLE_ENGINES",
    "RECORD_FIELDS",
    "engine_label",
]

BASELINE_ENGINES = ("plain", "checkpointed")
ALL_ENGINES = tuple(ENGINES) + BASELINE_ENGINES
AMP_MODES = ("none", "bf16", "fp16")
REVERSIBLE_ENGINES = ("reversible", "pareprop")

# One record per (model, engine, memory_budget, batch_size, depth, seq_len, device).
# Order is the CSV column order.
RECORD_FIELDS = (
    "model",
    "engine",
    "memory_budget",
    "batch_size",
    "depth",
    "seq_len",
    "device",
    "dtype",
    "img_size",
    "params",
    "step_ms_median",
    "step_ms_min",
    "step_ms_max",
    "samples_per_s",
    "tokens_per_s",
    "peak_mem_bytes",
    "peak_mem_kind",
    "peak_reserved_bytes",
    "planned_peak_bytes",
    "activation_bytes",
    "stored_blocks",
    "compiled",
    "grad_checkpointing",
    "grad_rel_err",
    "status",
)


def engine_label(record: Dict[str, Any]) -> str:
    """The engine of a record as tables and plots show it: ``reversible``; under a memory
    budget (``pareprop bench --memory-budgets``) ``reversible@0.5``; with the non-reversible
    blocks checkpointed (``--grad-checkpointing``) ``reversible+ckpt``."""
    budget = record.get("memory_budget")
    label = record["engine"] if budget is None else f"{record['engine']}@{budget:g}"
    return label + "+ckpt" if record.get("grad_checkpointing") else label
