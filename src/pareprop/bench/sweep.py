"""The sweep: every configuration of a :class:`BenchConfig`, one record each."""

from __future__ import annotations

import statistics
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
from pareprop.bench.measure import _empty_record, _is_oom, _Job, measure, time_interleaved
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
        variants = []
        for engine, budget in engine_budgets(engines, config.memory_budgets):
            chunk = config.chunk_bytes if engine in REVERSIBLE_ENGINES else None
            variants.append((engine, budget, chunk))
            if engine == "reversible" and chunk is None and config.chunked_variant is not None:
                variants.append((engine, budget, config.chunked_variant))  # reversible_chunked
        for depth in config.depths:
            for seq_len in seq_lens:
                # A group (model, depth, seq_len, batch) runs together, so its engines can be
                # timed again round robin after their own measurements
                # (NOTE [ Interleaved timing ] below).
                for bs in sorted(config.batch_sizes):
                    for engine, budget, chunk in variants:
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
                                chunk_bytes=chunk,
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
        The records, in sweep order (model, depth, seq_len, batch size, engine); each
        group's records are passed to ``on_record`` once its interleaved timing is done.
    """
    config.validate()
    jobs = sweep_jobs(config)
    device = torch.device(config.resolved_device())
    isolate = config.isolate
    if isolate is None:
        isolate = device.type == "cpu" and not _can_reset_rss()
    checked: Dict[Tuple, float | None] = {}
    failed: set = set()
    records: List[Dict[str, Any]] = []
    pending: List[Tuple[_Job, Dict[str, Any]]] = []  # the group being measured
    started = time.monotonic()
    bar = _progress(len(jobs), config.progress)

    def budget_spent() -> bool:
        return bool(config.time_budget_s) and time.monotonic() - started > config.time_budget_s

    def flush(timed: bool) -> None:
        if not pending:
            return
        if timed:
            _interleave(pending, config, isolate, budget_spent())
        else:
            _mark_sequential(pending, "interrupted")
        group = list(pending)
        pending.clear()
        for _, record in group:
            records.append(record)
            if on_record is not None:
                on_record(record)

    try:
        for job in jobs:
            if pending and _group(pending[0][0]) != _group(job):
                flush(timed=True)
            stop.check()  # NOTE [ Stopping on a signal ] in pareprop/bench/stop.py
            key = (job.model, job.engine, job.memory_budget, job.chunk_bytes, job.depth,
                   job.seq_len)
            bar.set_description(f"{job.model} {job.engine} d={job.depth} bs={job.batch_size}")
            record = _empty_record(job)
            if key in failed:
                record["status"] = "oom"  # not run: a smaller batch already ran out of memory
            elif budget_spent():
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
            pending.append((job, record))
            bar.update(1)
        flush(timed=True)
    except KeyboardInterrupt:
        # Interrupted (Ctrl-C, or SIGTERM from `timeout` via the CLI): keep what was measured.
        flush(timed=False)
        if config.progress:
            print("\ninterrupted: returning the configurations measured so far", file=sys.stderr)
    finally:
        bar.close()
    return records


def _group(job: _Job) -> Tuple:
    return (job.model, job.depth, job.seq_len, job.batch_size)


# NOTE [ Interleaved timing ]
#     Each configuration is measured alone (measure): its peak and activation bytes are its
#     own, with no other model alive. Its step times, though, are a few steps at one moment,
#     and on a shared machine a burst of load during one engine's steps and not another's
#     made ratios noise (checkpointed/autograd 2.89x at one size and 0.55x at another in one
#     run). So once a group (model, depth, seq_len, batch) is measured, its engines that ran
#     are built again together (same seed, same inputs and targets) and timed round robin:
#     one step of each in turn, `iters` rounds, medians (as benchmarks/_steps.py does). A
#     burst then lands on every engine alike. The round-robin medians replace the step-time
#     fields (the configuration's own median stays in step_ms_sequential) and the record says
#     `timing: "interleaved"`; where the group cannot be timed together the record keeps its
#     own times and says why: "sequential (single engine)", "(isolated)" (each configuration
#     in its own process), "(peak not resettable)" (a CPU whose peak RSS cannot be reset: the
#     models alive together would raise the peak every later configuration is measured
#     against), "(out of memory)" (the group's models do not fit at once), "(time budget
#     spent)", "(interrupted)", "(error: ...)".
def _interleave(pending: List[Tuple[_Job, Dict[str, Any]]], config: BenchConfig, isolate: bool,
                budget_spent: bool) -> None:
    ran = [(job, r) for job, r in pending if r["status"] == "ok"]
    for _, r in ran:
        r["step_ms_sequential"] = r["step_ms_median"]
    device = torch.device(config.resolved_device())
    why = None
    if not config.interleave:
        why = "not asked"
    elif len(ran) < 2:
        why = "single engine"
    elif isolate:
        why = "isolated"
    elif device.type == "cpu" and not _can_reset_rss():
        why = "peak not resettable"
    elif budget_spent:
        why = "time budget spent"
    if why is not None:
        _mark_sequential(ran, why)
        return
    try:
        times = time_interleaved([job for job, _ in ran])
    except Exception as err:  # noqa: BLE001 - the sequential times stand, marked
        why = "out of memory" if _is_oom(err) else f"error: {type(err).__name__}: {err}"
        _mark_sequential(ran, why)
        return
    for (job, r), ms in zip(ran, times):
        median = statistics.median(ms)
        r.update(step_ms_median=median, step_ms_min=min(ms), step_ms_max=max(ms),
                 samples_per_s=job.batch_size * 1e3 / median, timing="interleaved")
        if r.get("tokens_per_s") is not None and r.get("seq_len"):
            r["tokens_per_s"] = job.batch_size * r["seq_len"] * 1e3 / median


def _mark_sequential(pending: List[Tuple[_Job, Dict[str, Any]]], why: str) -> None:
    for _, r in pending:
        if r["status"] == "ok" and r.get("timing") is None:
            r["timing"] = f"sequential ({why})"
            if r.get("step_ms_sequential") is None:
                r["step_ms_sequential"] = r["step_ms_median"]


def _progress(total: int, enabled: bool):
    return tqdm(total=total, disable=not enabled, unit="config", dynamic_ncols=True,
                file=sys.stderr)
