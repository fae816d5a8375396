"""What a benchmark record holds, and the engine and autocast names a sweep accepts."""

from __future__ import annotations

from pareprop.catalog import ALL_ENGINES, BASELINE_ENGINES, REVERSIBLE_ENGINES, engine_label
from pareprop.memory.step import AMP_MODES

__all__ = [
    "BASELINE_ENGINES",
    "ALL_ENGINES",
    "AMP_MODES",
    "REVERSIBLE_ENGINES",
    "RECORD_FIELDS",
    "engine_label",
]

# The engine modes are the catalog's (pareprop.catalog) and the autocast names the step's
# (pareprop.memory.step); offered here beside what a record holds.

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
    # The caching allocator's out-of-memory retries (free the cache, allocate again) during the
    # timed steps; CUDA only.
    "alloc_retries",
    "planned_peak_bytes",
    "activation_bytes",
    "stored_blocks",
    "compiled",
    "grad_checkpointing",
    "chunk_bytes",
    # pareprop.chosen_schedule after the timed steps: "pareprop" for engine pareprop (benchmarks
    # run it with the fallback to Reprop off, so the engine column is one schedule), None for
    # models without a pareprop stack.
    "schedule",
    "grad_rel_err",
    # How the step times were measured: "interleaved" (the group's engines round robin, one
    # timed step each in turn, medians; see NOTE [ Interleaved timing ] in bench/sweep.py), or
    # "sequential (why)" where this configuration's own steps are the times.
    "timing",
    # The median of this configuration's own timed steps (before interleaving replaced it).
    "step_ms_sequential",
    "status",
)

