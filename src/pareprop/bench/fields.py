"""What a benchmark record holds, and the engine and autocast names a sweep accepts."""

from __future__ import annotations

from pareprop.engine import ENGINES

__all__ = ["BASELINE_ENGINES", "ALL_ENGINES", "AMP_MODES", "REVERSIBLE_ENGINES", "RECORD_FIELDS"]

BASELINE_ENGINES = ("plain", "checkpointed")
ALL_ENGINES = tuple(ENGINES) + BASELINE_ENGINES
AMP_MODES = ("none", "bf16", "fp16")
REVERSIBLE_ENGINES = ("reversible", "pareprop")

# One record per (model, engine, batch_size, depth, seq_len, device). Order is the CSV column order.
RECORD_FIELDS = (
    "model",
    "engine",
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
    "grad_rel_err",
    "status",
)
