"""Plans of many models, engines and batch sizes: what ``pareprop plan`` prints and writes."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from pareprop.catalog import (
    REVERSIBLE_ENGINES,
    engine_budgets,
    engine_label,
    engines_for,
    is_converted,
    model_facts,
)
from pareprop.memory.detection import DETECTOR_ENGINES, SPLIT_PARTS, is_detector_name
from pareprop.memory.plan import largest_batch, plan_chunking, plan_memory
from pareprop.memory.report import BYTE_FIELDS

__all__ = ["plan_sweep", "format_plan", "PLAN_FIELDS"]

# One record per model, engine and batch size, in plan.json and the printed table.
PLAN_FIELDS = ("model", "engine", "memory_budget", "grad_checkpointing", "batch_size",
               "amp", "img_size", "device", *BYTE_FIELDS,
               "inputs", "transient", "floor", "chunk_bytes", "coupling", "fits", "split")


def plan_sweep(
    models: Sequence[str],
    engines: Sequence[str],
    batch_sizes: Sequence[int] = (),
    amp: Optional[str] = None,
    img_size: Optional[int] = None,
    memory_bytes: Optional[int] = None,
    device: str = "cuda",
    memory_budgets: Sequence[Optional[float]] = (None,),
    grad_checkpointing: bool = False,
    chunk_bytes: Any = None,
    coupling: Optional[Tuple[float, float]] = None,
    **overrides: Any,
) -> Dict[str, Any]:
    """Plan every model with every engine that applies to it, at every batch size.

    Args:
        models, engines: as for ``pareprop bench`` (engines that do not apply are skipped).
        batch_sizes: batches to plan; with ``memory_bytes`` the largest-batch search adds its own.
        amp, device, **overrides: passed to :func:`plan_memory` (``depth``, ``num_classes``...).
        img_size: input side of image models (``None``: the model's).
        memory_bytes: the memory to fit in; ``None`` plans without a limit.
        memory_budgets: fractions from 0 to 1 planned for the reversible engines (see
            :func:`pareprop.set_memory_budget`; ``None``: the engine as it is). Other engines
            are planned once.
        grad_checkpointing: the reversible models' non-reversible blocks under activation
            checkpointing (timm's models are unaffected: their engine ``checkpointed`` is
            that).
        chunk_bytes: chunked branches for the reversible engines (``None``, bytes or
            ``"auto"``; see :func:`plan_memory`); other engines are planned without.
        coupling: ``(alpha, beta)`` of every converted model among ``models``
            (:func:`pareprop.catalog.is_converted`; ``None``: each one's own, (0, 1) for
            ``converted:SOURCE``); the other models have no coupling and are planned as they
            are. At beta = 0 a converted model stores every block (it cannot be inverted).

    Returns:
        ``{"memory_bytes", "records": [...], "largest_batch": [{"model", "engine",
        "memory_budget", "largest_batch", "peak"}]}``; records carry :data:`PLAN_FIELDS`
        (``coupling``: the converted model's ``[alpha, beta]``, read from the model planned;
        ``None`` for other models).
    """
    if img_size is not None:
        overrides["img_size"] = img_size
    chunking = plan_chunking(chunk_bytes)  # a bad size is refused before any model is planned
    records: List[Dict[str, Any]] = []
    largest: List[Dict[str, Any]] = []
    for name in models:
        detector = is_detector_name(name)
        mine = [e for e in engines if e in DETECTOR_ENGINES] if detector else engines_for(
            name, engines)
        if not mine:
            raise ValueError(f"expected an engine that applies to {name!r}, got {list(engines)}")
        # Only a converted model takes a coupling: any other model's constructor would refuse it.
        own = dict(overrides)
        if coupling is not None and is_converted(name):
            own["coupling"] = tuple(float(c) for c in coupling)
        for engine, budget in engine_budgets(mine, [None] if detector else memory_budgets):
            gc = grad_checkpointing and (engine in REVERSIBLE_ENGINES if detector
                                         else model_facts(name).reversible)
            chunked = chunking if engine in REVERSIBLE_ENGINES else None
            kw = dict(amp=amp, device=device, memory_budget=budget, grad_checkpointing=gc,
                      chunk_bytes=chunked, **own)
            reports = {bs: plan_memory(name, bs, engine, **kw) for bs in sorted(set(batch_sizes))}
            if memory_bytes is not None:
                best, searched = largest_batch(name, engine, memory_bytes, **kw)
                for r in searched:
                    reports.setdefault(r.batch_size, r)
                at = reports.get(best)
                largest.append({"model": name, "engine": engine, "memory_budget": budget,
                                "grad_checkpointing": gc, "largest_batch": best,
                                "peak": at.peak if at is not None else None,
                                "floor": at.floor if at is not None else None,
                                "split": at.split if at is not None else None,
                                "chunk_bytes": at.chunk_bytes if at is not None else None})
            for bs in sorted(reports):
                d = reports[bs].to_dict()
                coupling = reports[bs].coupling  # read from the model planned
                d.update(img_size=img_size, memory_budget=budget,
                         coupling=None if coupling is None else list(coupling),
                         fits=reports[bs].fits(memory_bytes))
                records.append({k: d.get(k) for k in PLAN_FIELDS})
    return {"memory_bytes": memory_bytes, "records": records, "largest_batch": largest}


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.3g}"


def format_plan(plan: Dict[str, Any]) -> str:
    """The breakdown per model, engine and batch (GiB), then the largest batch per engine."""
    head = ("model", "engine", "bs", "params", "grads", "optim", "acts", "transient", "peak GiB",
            "floor GiB", "chunks MiB", "fits")
    rows = [head]
    for r in plan["records"]:
        rows.append((r["model"], engine_label(r), str(r["batch_size"]), _gib(r["parameters"]),
                     _gib(r["gradients"]), _gib(r["optimizer_state"]), _gib(r["activations"]),
                     _gib(r["transient"]), _gib(r["peak"]), _gib(r.get("floor") or None),
                     _mib(r.get("chunk_bytes")),
                     "-" if r["fits"] is None else ("yes" if r["fits"] else "no")))
    out = [_align(rows)]
    if plan["largest_batch"]:
        mem = plan["memory_bytes"]
        rows = [("model", "engine", f"largest batch in {mem / 2**30:.1f} GiB", "peak GiB there",
                 "floor GiB there", "chunks MiB")]
        rows += [(x["model"], engine_label(x), str(x["largest_batch"]), _gib(x["peak"]),
                  _gib(x.get("floor") or None), _mib(x.get("chunk_bytes")))
                 for x in plan["largest_batch"]]
        out.append(_align(rows))
        split = [x for x in plan["largest_batch"] if x.get("split")]
        if split:  # detectors: what the peak at the largest batch holds, by part
            rows = [("model", "engine", "batch", *(f"{p} GiB" for p in SPLIT_PARTS))]
            rows += [(x["model"], engine_label(x), str(x["largest_batch"]),
                      *(_gib(x["split"].get(p)) for p in SPLIT_PARTS)) for x in split]
            out.append("peak split at the largest batch:\n" + _align(rows))
    elif any(r.get("split") for r in plan["records"]):
        rows = [("model", "engine", "bs", *(f"{p} GiB" for p in SPLIT_PARTS))]
        rows += [(r["model"], engine_label(r), str(r["batch_size"]),
                  *(_gib(r["split"].get(p)) for p in SPLIT_PARTS))
                 for r in plan["records"] if r.get("split")]
        out.append("peak split:\n" + _align(rows))
    return "\n\n".join(out)


def _align(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
