"""Throughput and memory of every engine, against the standard models users would otherwise train.

A sweep measures full training steps (forward, cross-entropy loss, backward, AdamW step) for
every combination of model, engine, batch size, depth and sequence length in a
:class:`BenchConfig`, and returns one flat record (a ``dict``) per combination; see
:data:`RECORD_FIELDS`. The CLI (``pareprop bench``) is a thin front end over :func:`run_bench`,
:func:`write_results` and :func:`format_table`.

Models come from two places:

* pareprop's registry (``rev_vit_small_patch16_224``, ``text_encoder_base``, ...). Models that
  contain a :class:`~pareprop.engine.ReversibleStack` run the engines ``autograd``,
  ``reversible`` and ``pareprop``, and ``checkpointed``: the same blocks under autograd, each
  in ``torch.utils.checkpoint`` (the competitor on the very same model); registry models
  without one are baselines like timm's.
* timm's registry (``vit_base_patch16_224``, ``mvitv2_base``, ...): the standard baselines,
  which run ``plain`` (autograd) and ``checkpointed`` (timm's ``set_grad_checkpointing()``).

Engines that do not apply to a model are skipped, so one ``--engines`` list serves a mixed sweep.

Models are built by name, with their inputs, by the catalog (:mod:`pareprop.catalog`), as the
memory planner and the trainer build them. One job per module:

* :mod:`~pareprop.bench.fields`: engine names and the record's fields.
* :mod:`~pareprop.bench.config`: :class:`BenchConfig` and the default sweep.
* :mod:`~pareprop.bench.measure`: one configuration (:func:`measure`).
* :mod:`~pareprop.bench.cpu_memory`: the CPU's peak resident memory, reset per configuration.
* :mod:`~pareprop.bench.gradcheck`: the reversible engines' gradients against autograd.
* :mod:`~pareprop.bench.isolate`: a configuration in a fresh interpreter.
* :mod:`~pareprop.bench.sweep`: the sweep (:func:`run_bench`).
* :mod:`~pareprop.bench.results`: JSON, CSV, plots and the printed tables.
"""

# Private names stay importable from here: the subprocess worker (isolate.py), the CLI and the
# tests reach them as ``bench._Job``, ``bench._is_oom``... as they did when this was one module.
# ruff: noqa: F401
from pareprop.bench.config import BenchConfig, default_config
from pareprop.bench.cpu_memory import _can_reset_rss, _free_memory, _reset_rss_peak, _rss_peak_bytes
from pareprop.bench.fields import (
    ALL_ENGINES,
    AMP_MODES,
    BASELINE_ENGINES,
    RECORD_FIELDS,
    REVERSIBLE_ENGINES,
)
from pareprop.bench.gradcheck import grad_rel_err
from pareprop.bench.isolate import _measure_subprocess
from pareprop.bench.measure import _empty_record, _is_oom, _Job, measure
from pareprop.bench.results import (
    format_headline,
    format_ratios,
    format_summary,
    format_table,
    jsonable,
    ratio_summary,
    write_results,
)
from pareprop.bench.sweep import run_bench, sweep_jobs
from pareprop.catalog import engines_for
from pareprop.engine import set_stack_engine

__all__ = [
    "BASELINE_ENGINES",
    "ALL_ENGINES",
    "AMP_MODES",
    "RECORD_FIELDS",
    "BenchConfig",
    "run_bench",
    "measure",
    "write_results",
    "format_table",
    "format_ratios",
    "format_summary",
    "format_headline",
    "ratio_summary",
    "default_config",
    "engines_for",
    "grad_rel_err",
]
