"""Plots of benchmark records (see :mod:`pareprop.bench`): one line per engine.

Two figures per model, written as PNG with matplotlib's Agg backend (no display needed):

* ``throughput_<model>.png``: samples per second against batch size, one panel per depth
  (and sequence length for text models).
* ``memory_<model>.png``: peak memory (left) and activation memory (right) against depth, at
  the batch size that most configurations of the model ran with.

Configurations that did not finish (``status`` other than ``ok``) are left out of the lines;
an engine whose largest batch ran out of memory shows where its line stops.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any, Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

__all__ = ["plot_results", "plot_throughput", "plot_memory", "plot_drift", "plot_plan"]

_MIB = 2**20
_MAX_PANELS = 4


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _engines(records: Sequence[Dict[str, Any]]) -> List[str]:
    return list(dict.fromkeys(r["engine"] for r in records))


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
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (depth, seq_len) in zip(axes[0], panels):
        for engine in _engines(records):
            pts = sorted(
                (r["batch_size"], r["samples_per_s"])
                for r in records
                if r["engine"] == engine and r["depth"] == depth and r["seq_len"] == seq_len
                and r["status"] == "ok"
            )
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_memory(records: Sequence[Dict[str, Any]], path: str, title: str = "") -> str:
    """Peak and activation memory (MiB) against depth, one line per engine.

    Uses the batch size (and sequence length) that most of ``records`` share, so every point of
    a line differs only in depth.

    Returns:
        ``path``.
    """
    batch, seq_len = Counter((r["batch_size"], r["seq_len"]) for r in records).most_common(1)[0][0]
    chosen = [r for r in records if r["batch_size"] == batch and r["seq_len"] == seq_len]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), squeeze=False)
    for ax, key, label in (
        (axes[0][0], "peak_mem_bytes", "peak memory (MiB)"),
        (axes[0][1], "activation_bytes", "activation memory (MiB)"),
    ):
        for engine in _engines(chosen):
            pts = sorted(
                (r["depth"], r[key] / _MIB)
                for r in chosen
                if r["engine"] == engine and r["status"] == "ok" and r[key] is not None
                and r["depth"] is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=engine)
        kinds = {r["peak_mem_kind"] for r in chosen if r["peak_mem_kind"]}
        note = f" [{', '.join(sorted(kinds))}]" if key == "peak_mem_bytes" and kinds else ""
        ax.set_title(label + note, fontsize=9)
        ax.set_xlabel("depth (blocks)")
        ax.set_ylabel("MiB")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    seq = f", seq {seq_len}" if seq_len is not None else ""
    fig.suptitle(f"{title} (batch {batch}{seq})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_results(records: Sequence[Dict[str, Any]], out_dir: str) -> List[str]:
    """Write both figures for every model in ``records`` into ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        device = mine[0]["device"]
        dtype = mine[0]["dtype"]
        title = f"{model} on {device}, {dtype}"
        paths.append(plot_throughput(mine, os.path.join(out_dir, f"throughput_{_safe(model)}.png"),
                                     title))
        paths.append(plot_memory(mine, os.path.join(out_dir, f"memory_{_safe(model)}.png"), title))
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
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
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
        plt.close(fig)
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
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = list(dict.fromkeys((r["model"], r["engine"]) for r in plan["records"]))
    for model, engine in keys:
        pts = sorted((r["batch_size"], r["peak"] / 2**30) for r in plan["records"]
                     if (r["model"], r["engine"]) == (model, engine))
        style = "-" if engine in ("autograd", "reversible", "pareprop") else "--"
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
    plt.close(fig)
    return path
