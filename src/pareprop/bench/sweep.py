"""The sweep: every configuration of a :class:`BenchConfig`, one record each."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from tqdm.auto import tqdm

from pareprop.bench import stop
from pareprop.bench.config import BenchConfig
from pareprop.bench.cpu_memory import _can_reset_rss
from pareprop.bench.fields import BASELINE_ENGINES, REVERSIBLE_ENGINES
from pareprop.bench.isolate import _measure_subprocess
from pareprop.bench.measure import _empty_record, _Job, measure
from pareprop.catalog import REVERSIBLE_MODEL_ENGINES, engine_budgets, engines_for, model_facts

__all__ = ["run_bench"]


def sweep_jobs(config: BenchConfig) -> List[_Job]:
    device = config.resolved_device()
    jobs = []
    for name in config.models:
        engines = engines_for(name, config.engines)
        if not engines:
            valid = (REVERSIBLE_MODEL_ENGINES if model_facts(name).reversible
                     else BASELINE_ENGINES)
            raise ValueError(
                f"expected an engine that applies to {name!r} ({', '.join(valid)}), "
                f"got {', '.join(config.engines)}"
            )
        # Sequence lengths only multiply the configurations of text models.
        seq_lens = config.seq_lens if model_facts(name).text else (None,)
        for depth in config.depths:
            for engine, budget in engine_budgets(engines, config.memory_budgets):
                for seq_len in seq_lens:
                    for bs in sorted(config.batch_sizes):
                        jobs.append(
                            _Job(
                                model=name, engine=engine, memory_budget=budget,
                                batch_size=bs, depth=depth,
                                seq_len=seq_len, device=device, amp=config.amp,
                                img_size=config.img_size, warmup=config.warmup,
                                iters=config.iters, num_classes=config.num_classes,
                                grad_check=config.grad_check, activation=config.activation,
                                plan=config.plan, compile=config.compile,
                                grad_checkpointing=config.grad_checkpointing,
                                chunk_bytes=(config.chunk_bytes
                                             if engine in REVERSIBLE_ENGINES else None),
                                lr=config.lr, seed=config.seed, threads=config.threads,
                                model_overrides=dict(config.model_overrides),
                            )
                        )
    return jobs


def run_bench(
    config: BenchConfig, on_record: Callable[[Dict[str, Any]], None] | None = None
) -> List[Dict[str, Any]]:
    """Run the sweep; one record (see :data:`RECORD_FIELDS`) per configuration.

    Args:
        config: what to sweep.
        on_record: called with each record as soon as it is measured.

    Returns:
        The records, in sweep order (model, depth, engine, seq_len, batch size).
    """
    config.validate()
    jobs = sweep_jobs(config)
    device = torch.device(config.resolved_device())
    isolate = config.isolate
    if isolate is None:
        isolate = device.type == "cpu" and not _can_reset_rss()
    checked: Dict[Tuple, float | None] = {}
    failed: set = set()
    records = []
    started = time.monotonic()
    bar = _progress(len(jobs), config.progress)
    try:
        for job in jobs:
            stop.check()  # NOTE [ Stopping on a signal ] in pareprop/bench/stop.py
            key = (job.model, job.engine, job.memory_budget, job.depth, job.seq_len)
            bar.set_description(f"{job.model} {job.engine} d={job.depth} bs={job.batch_size}")
            record = _empty_record(job)
            if key in failed:
                record["status"] = "oom"  # not run: a smaller batch already ran out of memory
            elif config.time_budget_s and time.monotonic() - started > config.time_budget_s:
                record["status"] = f"skipped: time budget of {config.time_budget_s:g} s spent"
            else:
                job.grad_check = config.grad_check and key not in checked
                record = _measure_subprocess(job) if isolate else measure(job)
                if record["status"] == "oom" and config.stop_after_oom:
                    failed.add(key)
                if job.grad_check and record["status"] == "ok":
                    checked[key] = record["grad_rel_err"]
                elif key in checked and record["status"] == "ok":
                    record["grad_rel_err"] = checked[key]
            records.append(record)
            if on_record is not None:
                on_record(record)
            bar.update(1)
    except KeyboardInterrupt:
        # Interrupted (Ctrl-C, or SIGTERM from `timeout` via the CLI): keep what was measured.
        if config.progress:
            print("\ninterrupted: returning the configurations measured so far", file=sys.stderr)
    finally:
        bar.close()
    return records


def _progress(total: int, enabled: bool):
    return tqdm(total=total, disable=not enabled, unit="config", dynamic_ncols=True,
                file=sys.stderr)
