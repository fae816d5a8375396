"""Records out: files (JSON, CSV, plots) and the tables printed after a sweep."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from typing import Any, Dict, List, Sequence, Tuple

from pareprop.bench.fields import RECORD_FIELDS, REVERSIBLE_ENGINES, engine_label
from pareprop.bench.plots import plot_results
from pareprop.engine import ENGINES
from pareprop.memory import largest_batch, parse_memory, plan_memory
from pareprop.memory.plan import MAX_BATCH

__all__ = ["write_results", "format_table", "format_ratios", "format_summary", "ratio_summary"]


# The figures pareprop.bench.plots.plot_results draws (and write_results replaces).
BENCH_PLOTS = ("memory_vs_depth_*.png", "memory_vs_batch_*.png", "time_*.png")


def write_results(records: Sequence[Dict[str, Any]], out_dir: str) -> Dict[str, str]:
    """Write ``results.json``, ``results.csv`` and the plots into ``out_dir``.

    Returns:
        ``{"json": path, "csv": path, "plots": [paths]}``.
    """
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as fh:
        json.dump([jsonable(r) for r in records], fh, indent=1)
    csv_path = os.path.join(out_dir, "results.csv")
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(RECORD_FIELDS), extrasaction="ignore")
        writer.writeheader()
        for r in records:
            writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in RECORD_FIELDS})
    # A reused --out would otherwise keep an earlier sweep's figures beside this one's.
    for pattern in BENCH_PLOTS:
        for stale in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            os.remove(stale)
    plots = plot_results(records, out_dir)
    return {"json": json_path, "csv": csv_path, "plots": plots}


def jsonable(record: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # JSON has no inf/nan
        out[k] = v
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(records: Sequence[Dict[str, Any]]) -> str:
    """One line per record: times, throughput, memory, gradient check and status."""
    head = ("model", "engine", "depth", "bs", "seq", "step ms", "min", "max", "samples/s",
            "peak MiB", "act MiB", "grad err", "status")
    rows = [head]
    for r in records:
        rows.append((
            r["model"], _stored_label(r), _num(r["depth"], "d"), str(r["batch_size"]),
            _num(r["seq_len"], "d"),
            _num(r["step_ms_median"], ".1f"), _num(r["step_ms_min"], ".1f"),
            _num(r["step_ms_max"], ".1f"), _num(r["samples_per_s"], ".1f"),
            _mib(r["peak_mem_bytes"]), _mib(r["activation_bytes"]),
            _num(r["grad_rel_err"], ".1e"), str(r["status"])[:60],
        ))
    return _align(rows)


def _stored_label(record: Dict[str, Any]) -> str:
    label = engine_label(record)
    if record.get("stored_blocks") is not None:
        label += f" ({record['stored_blocks']} stored)"
    return label


def _align(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def ratio_summary(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per model, depth, seq_len and batch size: every engine's ratios to its reference.

    The reference is ``autograd`` for reversible models (their ``checkpointed`` mode included)
    and ``plain`` for baselines. Fields:
    model, depth, batch_size, seq_len, engine (with its memory budget: ``reversible@0.5``),
    time_ratio (median step time / reference's),
    time_ratio_min (the same with the fastest steps, steadier on a busy machine),
    act_ratio (reference's activation bytes / this engine's), peak_ratio (same for peak
    memory), and for ``pareprop`` the throughput ratio to ``reversible`` (speedup_vs_reversible).
    """
    ok = {(r["model"], r["depth"], r["seq_len"], r["batch_size"], engine_label(r)): r
          for r in records if r["status"] == "ok"}
    out = []
    for (model, depth, seq_len, bs, label), r in ok.items():
        engine = r["engine"]
        # A reversible model's checkpointed blocks compare with its autograd engine too.
        ref_engine = ("autograd" if engine in ENGINES
                      or (model, depth, seq_len, bs, "autograd") in ok else "plain")
        if label == ref_engine:
            continue
        ref = ok.get((model, depth, seq_len, bs, ref_engine))
        if ref is None:
            continue
        row = dict(model=model, depth=depth, seq_len=seq_len, batch_size=bs, engine=label,
                   reference=ref_engine,
                   time_ratio=r["step_ms_median"] / ref["step_ms_median"],
                   time_ratio_min=r["step_ms_min"] / ref["step_ms_min"],
                   act_ratio=_div(ref["activation_bytes"], r["activation_bytes"]),
                   peak_ratio=_div(ref["peak_mem_bytes"], r["peak_mem_bytes"]),
                   speedup_vs_reversible=None)
        rev = ok.get((model, depth, seq_len, bs, label.replace("pareprop", "reversible", 1)))
        if engine == "pareprop" and rev is not None:
            row["speedup_vs_reversible"] = r["samples_per_s"] / rev["samples_per_s"]
        out.append(row)
    return out


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def format_ratios(records: Sequence[Dict[str, Any]]) -> str:
    """The ratio summary as a table, plus the largest batch that ran per model/engine/depth."""
    rows = [("model", "depth", "bs", "seq", "engine", "time / ref", "(min)", "ref act / act",
             "ref peak / peak", "vs reversible")]
    for s in ratio_summary(records):
        rows.append((
            s["model"], _num(s["depth"], "d"), str(s["batch_size"]), _num(s["seq_len"], "d"),
            f"{s['engine']} / {s['reference']}", f"{s['time_ratio']:.2f}",
            f"{s['time_ratio_min']:.2f}",
            _num(s["act_ratio"], ".1f"), _num(s["peak_ratio"], ".2f"),
            _num(s["speedup_vs_reversible"], ".2f"),
        ))
    parts = []
    if len(rows) > 1:
        parts.append(_align(rows))
    largest: Dict[Tuple, int] = {}
    for r in records:
        if r["status"] == "ok":
            key = (r["model"], engine_label(r), r["depth"], r["seq_len"])
            largest[key] = max(largest.get(key, 0), r["batch_size"])
    if len({r["batch_size"] for r in records}) > 1 and largest:
        fit = [("model", "engine", "depth", "seq", "largest batch that ran")]
        fit += [(m, e, _num(d, "d"), _num(s, "d"), str(b)) for (m, e, d, s), b in largest.items()]
        parts.append(_align(fit))
    return "\n\n".join(parts)


def format_summary(
    records: Sequence[Dict[str, Any]], baselines: Dict[str, str] | None = None
) -> str:
    """Best throughput and largest batch per model and engine, and the headline ratios.

    Args:
        records: records of a batch-size sweep.
        baselines: ``{reversible model: its standard baseline}``, e.g.
            ``{"rev_vit_base_patch16_224": "vit_base_patch16_224"}``, for the largest-batch
            ratio. A largest batch that never ran out of memory is a lower bound (``>=``).

    Returns:
        A table, then one line per reversible model with PaReprop/Reprop throughput at each
        one's best batch and the largest batch against the baseline's.
    """
    best: Dict[Tuple[str, str], Dict[str, Any]] = {}
    largest: Dict[Tuple[str, str], int] = {}
    hit_oom: set = set()
    for r in records:
        key = (r["model"], engine_label(r))
        if r["status"] == "oom":
            hit_oom.add(key)
        if r["status"] != "ok":
            continue
        largest[key] = max(largest.get(key, 0), r["batch_size"])
        if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = r

    def bound(key: Tuple[str, str]) -> str:
        if key not in largest:
            return "none"
        return ("" if key in hit_oom else ">=") + str(largest[key])

    rows = [("model", "engine", "best samples/s", "at batch", "largest batch", "peak GiB there")]
    for key in dict.fromkeys((r["model"], engine_label(r)) for r in records):
        b = best.get(key)
        at_largest = [r for r in records if (r["model"], engine_label(r)) == key
                      and r["status"] == "ok" and r["batch_size"] == largest.get(key)]
        peak = at_largest[0]["peak_mem_bytes"] if at_largest else None
        rows.append((key[0], key[1], _num(b and b["samples_per_s"], ".1f"),
                     str(b["batch_size"]) if b else "-", bound(key),
                     "-" if peak is None else f"{peak / 2**30:.1f}"))
    lines = [_align(rows), ""]
    for model in dict.fromkeys(r["model"] for r in records):
        rev, par = best.get((model, "reversible")), best.get((model, "pareprop"))
        if rev is None and par is None:
            continue
        parts = [model + ":"]
        if rev is not None and par is not None:
            ratio = par["samples_per_s"] / rev["samples_per_s"]
            parts.append(f"PaReprop/Reprop best throughput {ratio:.2f}x"
                         f" (bs {par['batch_size']} vs {rev['batch_size']})")
        base = (baselines or {}).get(model)
        ours = max((largest.get((model, e), 0) for e in REVERSIBLE_ENGINES), default=0)
        if base is not None and ours:
            theirs = largest.get((base, "plain"))
            if theirs:
                sign = "" if (base, "plain") in hit_oom else "<="
                parts.append(f"largest batch {ours} vs {base} plain {theirs} "
                             f"({sign}{ours / theirs:.1f}x)")
            elif (base, "plain") in hit_oom:
                parts.append(f"largest batch {ours}; {base} plain fitted no batch of the sweep")
        lines.append(" ".join(parts))
    return "\n".join(lines).rstrip()


def format_headline(
    records: Sequence[Dict[str, Any]], memory: str = "16GiB", plan_largest: bool = True
) -> str:
    """One line of what the run measured at its deepest depth (its largest batch there):
    reversible against autograd and, where the run has it, against checkpointing (the same
    model's blocks under ``torch.utils.checkpoint``, engine mode ``checkpointed``).

    ``depth D: reversible keeps 2.2x less peak memory than autograd and 1.3x less than
    checkpointing (planned; measured 1.5x less and 1.1x less), at 1.38x autograd's and 1.05x
    checkpointing's step time; largest batch in 16 GiB: reversible A, checkpointed C, autograd
    B``. The first peak ratios are planned (``planned_peak_bytes``: the allocator-level count
    of the same step) where both records have a plan, the measured ones are
    ``peak_mem_bytes`` (RSS growth on a CPU, which freed pages that stay mapped blur). Step
    times are medians of the same run. The largest batches are planned
    (:func:`pareprop.largest_batch`).

    Returns:
        The line, or ``""`` when the run has no autograd/reversible pair.
    """
    compared = ("autograd", "checkpointed")
    ok = [r for r in records if r["status"] == "ok" and r.get("memory_budget") is None
          and r["engine"] in ("reversible", *compared)]
    groups: Dict[Tuple, Dict[str, Dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault((r["model"], r["depth"], r["batch_size"], r["seq_len"]), {})[
            _headline_label(r)] = r
    for group in groups.values():
        # Every reversible record chunked (--chunk-bytes): they are the run's reversible ones.
        if "reversible" not in group and CHUNKED in group:
            group["reversible"] = group.pop(CHUNKED)
    ok = [r for group in groups.values() for r in group.values()]
    full = [k for k, v in groups.items() if "autograd" in v and "reversible" in v]
    if not full:
        return ""
    # The deepest depth, its largest batch, preferring a group with the checkpointed record.
    key = max(full, key=lambda k: (k[1] or 0, "checkpointed" in groups[k], k[2]))
    rev = groups[key]["reversible"]
    others = [(e, groups[key][e]) for e in compared if e in groups[key]]
    names = {"autograd": "autograd", "checkpointed": "checkpointing"}

    planned = [_div(o.get("planned_peak_bytes"), rev.get("planned_peak_bytes"))
               for _, o in others]
    measured = [_div(o.get("peak_mem_bytes"), rev.get("peak_mem_bytes")) for _, o in others]
    main = planned if all(x is not None for x in planned) else measured
    memory_part = " and ".join(_compare(x, " peak memory" if i == 0 else "", names[e])
                               for i, ((e, _), x) in enumerate(zip(others, main)))
    if main is planned and any(x is not None for x in measured):
        memory_part += " (planned; measured " + " and ".join(
            _amount(x) for x in measured) + ")"
    elif main is measured:
        memory_part += " (measured)"
    times = " and ".join(f"{rev['step_ms_median'] / r['step_ms_median']:.2f}x {names[e]}'s"
                         for e, r in others)
    line = f"depth {key[1]}: reversible keeps {memory_part}, at {times} step time"
    chunked = groups[key].get(CHUNKED)
    if chunked is not None:
        line += "; " + _chunking_part(chunked, rev, groups[key].get("checkpointed"))
    if plan_largest:
        ref = groups[key]["autograd"]
        amp = {"bfloat16-amp": "bf16", "float16-amp": "fp16"}.get(ref["dtype"])
        kw = dict(amp=amp, device=str(ref["device"]).split(":")[0],
                  img_size=ref["img_size"], depth=ref["depth"], num_classes=10)
        if ref["seq_len"] is not None:
            kw["seq_len"] = ref["seq_len"]
        engines = ["reversible", *(e for e, _ in others if e == "checkpointed"), "autograd"]
        if chunked is not None:
            engines.insert(0, CHUNKED)
        labels = {id(r): label for group in groups.values() for label, r in group.items()}
        try:
            sizes = []
            for e in engines:
                known = {r["batch_size"]: r.get("planned_peak_bytes") for r in ok
                         if labels[id(r)] == e and (r["model"], r["depth"], r["seq_len"])
                         == (key[0], key[1], key[3])}
                chunk = groups[key][e].get("chunk_bytes") if e in groups[key] else None
                sizes.append(_planned_largest(key[0], e.replace("_chunked", ""),
                                              parse_memory(memory), known, chunk_bytes=chunk,
                                              **kw))
            line += f"; largest batch in {memory[:-3]} GiB: " + ", ".join(
                f"{e} {n}" for e, n in zip(engines, sizes))
            if chunked is not None and min(sizes[1:3]) > 0:
                line += (f" (chunking buys {sizes[0] / sizes[1]:.2f}x whole branches' batch, "
                         f"{sizes[0] / sizes[2]:.2f}x {engines[2]}'s)")
        except Exception as err:  # noqa: BLE001 - the headline reports, never fails the run
            line += f"; largest batch not planned ({type(err).__name__}: {err})"
    return line


CHUNKED = "reversible_chunked"  # engine reversible with chunked branches (chunk_bytes set)


def _headline_label(record: Dict[str, Any]) -> str:
    if record["engine"] == "reversible" and record.get("chunk_bytes") is not None:
        return CHUNKED
    return record["engine"]


def _chunking_part(chunked: Dict[str, Any], whole: Dict[str, Any],
                   ckpt: Dict[str, Any] | None) -> str:
    """``chunked branches (1MiB) keep 1.4x less peak memory than whole ones and 1.6x less
    than checkpointing (planned; measured ...), at 1.05x whole's step time``."""
    others = [("whole ones", whole)] + ([("checkpointing", ckpt)] if ckpt is not None else [])
    planned = [_div(o.get("planned_peak_bytes"), chunked.get("planned_peak_bytes"))
               for _, o in others]
    measured = [_div(o.get("peak_mem_bytes"), chunked.get("peak_mem_bytes")) for _, o in others]
    main = planned if all(x is not None for x in planned) else measured
    part = " and ".join(_compare(x, " peak memory" if i == 0 else "", name)
                        for i, ((name, _), x) in enumerate(zip(others, main)))
    if main is planned and any(x is not None for x in measured):
        part += " (planned; measured " + " and ".join(_amount(x) for x in measured) + ")"
    elif main is measured:
        part += " (measured)"
    size = chunked["chunk_bytes"]
    size = f"{size / 2**20:g} MiB" if isinstance(size, int) else str(size)
    time = chunked["step_ms_median"] / whole["step_ms_median"]
    return (f"chunked branches ({size} a chunk) keep {part}, at {time:.2f}x whole branches' "
            "step time")


# NOTE [ The headline's largest batches ]
#     A planned peak grows with the batch, piece by piece linearly: it is the largest of a few
#     moments of the step (the optimizer's step, the end of forward, a block's backward), each
#     affine in the batch, so it is convex. The run's records already hold the planned peaks of
#     its batch sizes. The line through the largest two predicts the largest batch; a plan of
#     it (and of the next batch) confirms it exactly. Where a steeper piece takes over at large
#     batches, the prediction does not fit, and the chord between the largest batch known to fit
#     and the smallest known not to (regula falsi) gives a batch that fits, by convexity; a
#     chord or two later it is exact. A handful of plans instead of pareprop.largest_batch's
#     search from batch 1: at depth 24 a plan takes seconds on the CPU, and this keeps the
#     default `pareprop bench` short. The search remains the fallback.
def _planned_largest(name: str, engine: str, memory_bytes: int, known: Dict[int, Any],
                     tries: int = 8, **kw: Any) -> int:
    """The largest batch whose planned peak fits ``memory_bytes`` (``known``: batch ->
    planned peak of this configuration, from the records; see NOTE above)."""
    points = sorted((bs, p) for bs, p in known.items() if p)
    fit = [pt for pt in points if pt[1] <= memory_bytes]
    over = [pt for pt in points if pt[1] > memory_bytes]
    lo = fit[-1] if fit else None  # (batch, peak): the largest known to fit
    hi = over[0] if over else None  # the smallest known not to fit
    if len(points) < 2 or lo is None:
        return largest_batch(name, engine, memory_bytes, **kw)[0]
    last = points[-2:]
    for _ in range(tries):
        if hi is not None and hi[0] - lo[0] <= 1:
            return lo[0]
        (b0, p0), (b1, p1) = (lo, hi) if hi is not None else last
        if p1 <= p0:  # flat so far: grow geometrically
            guess = 2 * b1
        else:
            guess = b0 + int((memory_bytes - p0) * (b1 - b0) // (p1 - p0))
        guess = max(guess, lo[0] + 1)
        if hi is not None:
            guess = min(guess, hi[0] - 1)
        if guess >= MAX_BATCH:
            break
        point = (guess, plan_memory(name, guess, engine, **kw).peak)
        if point[1] <= memory_bytes:
            lo = point
        else:
            hi = point
        last = [last[-1], point]
    return largest_batch(name, engine, memory_bytes, start=lo[0], **kw)[0]


def _amount(ratio: float | None) -> str:
    """A ratio ``other's memory / ours`` in words: ``2.2x less``, ``1.3x more`` (never "0.8x
    less"), ``about as much`` where it rounds to 1.0x either way, ``-`` when unknown."""
    if ratio is None or not 0 < ratio < math.inf:
        return "-"  # unknown, or a measured peak of 0 (tiny models' RSS may not grow)
    if f"{ratio:.1f}" == "1.0" or f"{1 / ratio:.1f}" == "1.0":
        return "about as much"
    return f"{ratio:.1f}x less" if ratio > 1 else f"{1 / ratio:.1f}x more"


def _compare(ratio: float | None, noun: str, other: str) -> str:
    """``2.2x less peak memory than autograd``, ``about as much as checkpointing``."""
    amount = _amount(ratio)
    return f"{amount}{noun} {'as' if amount == 'about as much' else 'than'} {other}"
