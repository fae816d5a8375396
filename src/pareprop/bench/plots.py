"""Plots of benchmark records (see :mod:`pareprop.bench`): one line per engine.

One figure per question a sweep can answer, per model, written as PNG with matplotlib's Agg
backend (no display needed). A figure is written only when the sweep has the axis it needs,
so no line is a single point:

* ``memory_vs_depth_<model>.png`` (two depths or more): the peak of the whole step, measured
  (solid) and planned by :func:`pareprop.plan_memory` (dashed), and the activation memory,
  against depth.
* ``memory_vs_batch_<model>.png`` (two batch sizes or more): the same against batch size, at
  the deepest depth.
* ``time_<model>.png``: with two batch sizes or more, samples per second against batch size,
  one panel per depth; otherwise the step time of each engine, grouped by depth.

Configurations that did not finish (``status`` other than ``ok``) are left out of the lines;
an engine whose largest batch ran out of memory shows where its line stops. Engines under a
memory budget (``pareprop bench --memory-budgets``) are lines of their own (``reversible@0.5``).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from pareprop.catalog import engine_label

__all__ = [
    "plot_results",
    "plot_throughput",
    "plot_step_time",
    "plot_memory",
    "plot_drift",
    "plot_plan",
]

_MIB = 2**20
_MAX_PANELS = 4


def _pyplot() -> Any:
    # matplotlib is heavy and only a plot needs it: loaded by the first plot, not when the
    # benchmark or the planner that write plots at the end are imported. Agg draws PNGs
    # without a display; the backend must be chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _engines(records: Sequence[Dict[str, Any]]) -> List[str]:
    return list(dict.fromkeys(engine_label(r) for r in records))


def _ok(records: Sequence[Dict[str, Any]], engine: str) -> List[Dict[str, Any]]:
    return [r for r in records if engine_label(r) == engine and r["status"] == "ok"]


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_throughput(records: Sequence[Dict[str, Any]], path: str, title: str = "") -> str:
    """Samples per second against batch size, one line per engine, one panel per depth.

    Args:
        records: records of one model.
        path: PNG file to write.
        title: figure title.

    Returns:
        ``path``.
    """
    panels = list(dict.fromkeys((r["depth"], r["seq_len"]) for r in records))
    if len(panels) > _MAX_PANELS:  # keep the figure readable: first, last and evenly between
        step = (len(panels) - 1) / (_MAX_PANELS - 1)
        panels = [panels[round(i * step)] for i in range(_MAX_PANELS)]
    fig, axes = _pyplot().subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (depth, seq_len) in zip(axes[0], panels):
        for engine in _engines(records):
            pts = sorted((r["batch_size"], r["samples_per_s"]) for r in _ok(records, engine)
                         if r["depth"] == depth and r["seq_len"] == seq_len)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=engine)
        label = f"depth {depth}" + (f", seq {seq_len}" if seq_len is not None else "")
        ax.set_title(label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("samples / s")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(title)
    return _save(fig, path)


def plot_step_time(records: Sequence[Dict[str, Any]], path: str, title: str = "") -> str:
    """Median step time (ms) of each engine, bars grouped by depth, min-max as error bars.

    Returns:
        ``path``.
    """
    batch, seq_len = _common_batch(records)
    chosen = [r for r in records if r["batch_size"] == batch and r["seq_len"] == seq_len]
    depths = sorted({r["depth"] for r in chosen if r["depth"] is not None}) or [None]
    engines = _engines(chosen)
    width = 0.8 / max(len(engines), 1)
    fig, ax = _pyplot().subplots(figsize=(max(5.0, 1.2 * len(depths) * len(engines)), 3.8))
    for i, engine in enumerate(engines):
        xs, ys, lo, hi = [], [], [], []
        for j, depth in enumerate(depths):
            r = next((r for r in _ok(chosen, engine) if r["depth"] == depth), None)
            if r is None:
                continue
            xs.append(j + (i - (len(engines) - 1) / 2) * width)
            ys.append(r["step_ms_median"])
            lo.append(r["step_ms_median"] - r["step_ms_min"])
            hi.append(r["step_ms_max"] - r["step_ms_median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=engine)
    ax.set_xticks(range(len(depths)), [f"depth {d}" if d is not None else "" for d in depths])
    ax.set_ylabel("step time (ms, median; bars: min-max)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    seq = f", seq {seq_len}" if seq_len is not None else ""
    fig.suptitle(f"{title} (batch {batch}{seq})", fontsize=10)
    return _save(fig, path)


def _common_batch(records: Sequence[Dict[str, Any]]):
    # The batch (and sequence length) most records share; among equals the largest, where
    # activations weigh most.
    counts = Counter((r["batch_size"], r["seq_len"]) for r in records)
    return max(counts, key=lambda k: (counts[k], k[0], k[1] or 0))


def plot_memory(
    records: Sequence[Dict[str, Any]], path: str, title: str = "", against: str = "depth"
) -> str:
    """Peak of the step and activation memory (MiB) against ``depth`` or ``batch_size``.

    The peak is drawn as measured (``peak_mem_bytes``, solid) and as planned
    (``planned_peak_bytes``, dashed, the allocator-level count of the same step). Against depth
    the batch size most records share is used; against batch size the deepest depth.

    Returns:
        ``path``.
    """
    if against == "depth":
        batch, seq_len = _common_batch(records)
        chosen = [r for r in records if r["batch_size"] == batch and r["seq_len"] == seq_len]
        fixed = f"batch {batch}" + (f", seq {seq_len}" if seq_len is not None else "")
        xlabel = "depth (blocks)"
    elif against == "batch_size":
        depth = max((r["depth"] for r in records if r["depth"] is not None), default=None)
        chosen = [r for r in records if r["depth"] == depth]
        fixed = f"depth {depth}"
        xlabel = "batch size"
    else:
        raise ValueError(f"expected against='depth' or 'batch_size', got {against!r}")
    fig, axes = _pyplot().subplots(1, 2, figsize=(10, 3.8), squeeze=False)
    peak_ax, act_ax = axes[0]
    for engine in _engines(chosen):
        mine = _ok(chosen, engine)
        line = _line(peak_ax, mine, against, "peak_mem_bytes", "-", engine)
        color = None if line is None else line.get_color()
        _line(peak_ax, mine, against, "planned_peak_bytes", "--", None, color)
        _line(act_ax, mine, against, "activation_bytes", "-", engine, color)
    kinds = {r["peak_mem_kind"] for r in chosen if r["peak_mem_kind"]}
    note = f" [{', '.join(sorted(kinds))}]" if kinds else ""
    peak_ax.set_title(f"peak of the step (MiB): measured{note}, planned dashed", fontsize=9)
    act_ax.set_title("activation memory kept for backward (MiB)", fontsize=9)
    for ax in (peak_ax, act_ax):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MiB")
        ax.grid(True, alpha=0.3)
        if against == "batch_size":
            ax.set_xscale("log", base=2)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"{title} ({fixed})", fontsize=10)
    return _save(fig, path)


def _line(ax: Any, records: Sequence[Dict[str, Any]], x: str, y: str, style: str,
          label: Optional[str], color: Optional[str] = None) -> Any:
    pts = sorted((r[x], r[y] / _MIB) for r in records if r[x] is not None and r[y] is not None)
    if len(pts) < 2:
        return None
    return ax.plot(*zip(*pts), style, marker="o", markersize=4, label=label, color=color)[0]


def plot_results(records: Sequence[Dict[str, Any]], out_dir: str) -> List[str]:
    """Write the figures each model's records can draw (see the module docstring) into
    ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        title = f"{model} on {mine[0]['device']}, {mine[0]['dtype']}"
        name = _safe(model)
        batches = {r["batch_size"] for r in mine}
        if len({r["depth"] for r in mine}) > 1:
            paths.append(plot_memory(mine, os.path.join(out_dir, f"memory_vs_depth_{name}.png"),
                                     title, against="depth"))
        if len(batches) > 1:
            paths.append(plot_memory(mine, os.path.join(out_dir, f"memory_vs_batch_{name}.png"),
                                     title, against="batch_size"))
            paths.append(plot_throughput(mine, os.path.join(out_dir, f"time_{name}.png"), title))
        else:
            paths.append(plot_step_time(mine, os.path.join(out_dir, f"time_{name}.png"), title))
    return paths


def plot_drift(rows: Sequence[Dict[str, Any]], out_dir: str) -> List[str]:
    """Gradient error under autocast against depth, one line per engine, one figure per model.

    Args:
        rows: ``pareprop bench --drift`` rows (a ``DriftReport.to_dict()`` plus model, depth).
        out_dir: where ``drift_<model>.png`` goes.

    Returns:
        The paths written.
    """
    paths = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["depth"])
        fig, ax = _pyplot().subplots(figsize=(5.5, 3.8))
        for engine in dict.fromkeys(e for r in mine for e in r["grad_error"]):
            pts = [(r["depth"], r["grad_error"][engine]) for r in mine if engine in r["grad_error"]]
            ax.plot(*zip(*pts), marker="o", label=engine)
        ax.set_yscale("log")
        ax.set_xlabel("depth (blocks)")
        ax.set_ylabel(f"gradient error vs {mine[0]['reference_dtype']}")
        ax.set_title(f"{model}, autocast {mine[0]['amp_dtype']}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"drift_{_safe(model)}.png")
        fig.savefig(path, dpi=100)
        _pyplot().close(fig)
        paths.append(path)
    return paths


def plot_plan(plan: Dict[str, Any], path: str) -> str:
    """Planned peak memory (GiB) against batch size, one line per model and engine.

    Args:
        plan: what :func:`pareprop.memory.sweep.plan_sweep` returns.
        path: PNG file to write. The memory to fit in, when given, is a dashed line.

    Returns:
        ``path``.
    """
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    keys = list(dict.fromkeys((r["model"], engine_label(r)) for r in plan["records"]))
    for model, engine in keys:
        pts = sorted((r["batch_size"], r["peak"] / 2**30) for r in plan["records"]
                     if (r["model"], engine_label(r)) == (model, engine))
        style = "--" if engine in ("plain", "checkpointed") else "-"
        ax.plot(*zip(*pts), style, marker="o" if len(pts) > 1 else "s", markersize=3,
                label=f"{model} {engine}" if len(keys) > 1 else engine)
    if plan.get("memory_bytes"):
        ax.axhline(plan["memory_bytes"] / 2**30, color="k", linestyle=":", linewidth=1.2,
                   label=f"memory {plan['memory_bytes'] / 2**30:.1f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("planned peak of a training step (GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path
