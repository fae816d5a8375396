"""The summary that ``benchmarks/gpu.sh`` prints last, from what its steps left in OUTDIR.

Usage::

    python benchmarks/gpu_summary.py OUTDIR      # prints it and writes OUTDIR/summary.txt

OUTDIR holds ``steps.tsv`` (one line per step: name, exit status, seconds, note) and one folder
per sweep (``vit``, ``mvit``, ``swin``, ``text``) with ``sweep.json`` (written by
``benchmarks/gpu_sweep.py``) and one folder per engine with ``results.json``, or only
``results.jsonl`` when the engine was cut off. Every table has one line per model:

* throughput of each engine at equal batch (the largest batch every engine of the sweep ran);
* PaReprop against Reprop, each at its own best batch;
* the largest batch each engine ran (``>=`` when it never ran out of memory in the sweep);
* peak memory at equal batch: allocated (``peak_mem_bytes``), reserved
  (``peak_reserved_bytes``) and the memory planner's prediction (``planned_peak_bytes``);
  a field a record lacks prints as ``-``;
* the caching allocator's out-of-memory retries (``alloc_retries``) at each engine's largest
  batch;
* PaReprop's step time over Reprop's at three batch sizes both ran (the smallest, the middle
  and the largest), with the schedule PaReprop chose there (``schedule``);
* against timm's checkpointed model: the reversible engines' step time over its at the
  largest batch all three ran, and the largest batch each ran (the moonshot: faster than
  checkpointing at equal batch, and more of it);
* chunked branches (sweeps run with ``gpu_sweep.py --chunk-bytes``, whose records are in
  ``reversible_chunked/`` and ``pareprop_chunked/``): the chunk size, each chunked engine's step
  time and peak over the same engine's with whole branches at the largest batch both ran, and
  the largest batch each ran;
* the issue's targets, each ``met``, ``NOT MET`` or ``unknown`` (not measured, or the sweep
  cannot decide it), then every failed configuration.

Exit status 1 when a step failed or a configuration ended in an error, so CI notices.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "ENGINES",
    "Sweep",
    "Figures",
    "load_sweeps",
    "load_steps",
    "analyse",
    "three_batches",
    "targets",
    "format_summary",
    "main",
]

ENGINES = ("plain", "checkpointed", "autograd", "reversible", "pareprop")
CHUNKED_SUFFIX = "_chunked"  # benchmarks/gpu_sweep.py: an engine run with --chunk-bytes
CHUNKED = ("reversible", "pareprop")  # the engines that have a chunked run
SWEEPS = ("vit", "mvit", "swin", "text")
# The targets for the first GPU run.
SPEEDUP_SWEEPS = ("mvit", "swin")  # PaReprop/Reprop at best batch matters most on these
SPEEDUP_TARGET = 1.15  # PaReprop >= 1.15x Reprop's throughput, each at its best batch
AUTOGRAD_TARGET = 0.9  # PaReprop >= 0.9x autograd's throughput at equal batch
BATCH_TARGET = 4.0  # largest batch >= 4x the standard model's (plain)

Record = Dict[str, Any]


@dataclass
class Sweep:
    """One model's sweep: its folder name, what it compared, and every record it left."""

    name: str
    label: str
    model: str
    baseline: str
    engines: Sequence[str]
    records: List[Record] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # unreadable files, and the like


@dataclass
class Figures:
    """What the summary shows for one sweep (``None``: not measured)."""

    equal_batch: Optional[int]
    at_equal: Dict[str, Record]  # engine -> its record at equal_batch
    best: Dict[str, Record]  # engine -> its record of highest throughput
    largest: Dict[str, Tuple[int, bool]]  # engine -> (largest batch that ran, exact)
    speedup: Optional[float]  # PaReprop/Reprop, each at its best batch
    vs_autograd: Optional[Tuple[float, int]]  # PaReprop/autograd at their largest common batch
    batch_ratio: Optional[Tuple[float, str]]  # reversible engines' largest / plain's, and kind
    counts: Dict[str, int]  # status kind -> number of configurations
    errors: List[Record]
    # engine -> alloc_retries at its largest batch (None: the records do not say)
    retries: Dict[str, Optional[int]] = field(default_factory=dict)
    # (batch, PaReprop's step time / Reprop's, PaReprop's schedule there) at up to 3 batches
    vs_reprop: List[Tuple[int, float, Optional[str]]] = field(default_factory=list)
    # (batch, reversible's step time / checkpointed's, pareprop's / checkpointed's), at the
    # largest batch the three ran; a ratio is None where that engine did not run there
    vs_checkpointed: Optional[Tuple[int, Optional[float], Optional[float]]] = None
    # engine -> (batch, chunked step time / whole, chunked peak / whole or None, chunk_bytes,
    # chunked largest batch): at the largest batch both ran, for each engine with a chunked run
    vs_whole: Dict[str, Tuple[int, float, Optional[float], Any, Tuple[int, bool]]] = field(
        default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Reading


def _read_records(engine_dir: str) -> Tuple[List[Record], List[str]]:
    """Records of one engine folder: results.json, else the streamed results.jsonl."""
    path = os.path.join(engine_dir, "results.json")
    notes = []
    if os.path.exists(path):
        try:
            with open(path) as fh:
                return json.load(fh), notes
        except (OSError, ValueError) as err:  # cut off while writing it
            notes.append(f"{path}: {err}; read results.jsonl instead")
    stream = os.path.join(engine_dir, "results.jsonl")
    records = []
    if os.path.exists(stream):
        with open(stream) as fh:
            for line in fh:
                try:
                    records.append(json.loads(line))
                except ValueError:  # the last line of a killed run may be partial
                    notes.append(f"{stream}: skipped a partial line")
    return records, notes


def load_sweeps(out_dir: str) -> List[Sweep]:
    """Every sweep folder of ``out_dir`` that has a ``sweep.json``, in :data:`SWEEPS` order."""
    names = [n for n in SWEEPS if os.path.isdir(os.path.join(out_dir, n))]
    names += sorted(n for n in os.listdir(out_dir) if n not in names
                    and os.path.exists(os.path.join(out_dir, n, "sweep.json")))
    sweeps = []
    for name in names:
        folder = os.path.join(out_dir, name)
        meta_path = os.path.join(folder, "sweep.json")
        if not os.path.exists(meta_path):
            continue
        with open(meta_path) as fh:
            meta = json.load(fh)
        sweep = Sweep(name, meta["label"], meta["model"], meta["baseline"], meta["engines"])
        for engine in sweep.engines:
            records, notes = _read_records(os.path.join(folder, engine))
            if engine.endswith(CHUNKED_SUFFIX):  # their records name the engine they ran
                records = [dict(r, engine=engine) for r in records]
            sweep.records += records
            sweep.notes += notes
        sweeps.append(sweep)
    return sweeps


def load_steps(out_dir: str) -> List[Tuple[str, str, str, str]]:
    """``steps.tsv`` as (step, exit status, seconds, note) rows; empty when absent."""
    path = os.path.join(out_dir, "steps.tsv")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            parts = line.rstrip("\n").split("\t")
            if parts and parts[0]:
                rows.append(tuple((parts + ["", "", "", ""])[:4]))
    return rows


# ---------------------------------------------------------------------------------------------
# Figures


def _kind(status: Any) -> str:
    status = str(status)
    for kind in ("ok", "oom", "skipped", "error"):
        if status.startswith(kind):
            return kind
    return "error"


def _number(x: Any) -> Optional[float]:
    # JSON has no inf/nan: bench writes them as strings.
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def analyse(sweep: Sweep) -> Figures:
    """The figures of one sweep; see :class:`Figures`."""
    ok: Dict[str, Dict[int, Record]] = {}
    oom: Dict[str, List[int]] = {}
    counts: Dict[str, int] = {}
    errors = []
    for r in sweep.records:
        kind = _kind(r.get("status"))
        counts[kind] = counts.get(kind, 0) + 1
        engine, bs = r.get("engine"), r.get("batch_size")
        if kind == "ok" and _number(r.get("samples_per_s")) is not None:
            ok.setdefault(engine, {})[bs] = r
        elif kind == "oom":
            oom.setdefault(engine, []).append(bs)
        elif kind == "error":
            errors.append(r)
    ran = [e for e in ENGINES if e in ok]

    common = set.intersection(*(set(ok[e]) for e in ran)) if ran else set()
    equal_batch = max(common) if common else None
    at_equal = {e: ok[e][equal_batch] for e in ran} if equal_batch is not None else {}
    best = {e: max(ok[e].values(), key=lambda r: r["samples_per_s"]) for e in ran}
    largest = {}
    for e in ran:
        top = max(ok[e])
        # Exact (to the sweep's step) when a larger batch of this engine ran out of memory.
        largest[e] = (top, any(b > top for b in oom.get(e, [])))

    speedup = None
    if "pareprop" in best and "reversible" in best:
        speedup = best["pareprop"]["samples_per_s"] / best["reversible"]["samples_per_s"]
    vs_autograd = None
    pair = set(ok.get("pareprop", {})) & set(ok.get("autograd", {}))
    if pair:
        bs = max(pair)
        vs_autograd = (ok["pareprop"][bs]["samples_per_s"] / ok["autograd"][bs]["samples_per_s"],
                       bs)
    batch_ratio = _batch_ratio(largest)
    # Records from before alloc_retries/schedule existed have neither: read with .get().
    retries = {e: _count(ok[e][largest[e][0]].get("alloc_retries")) for e in ran}
    return Figures(equal_batch, at_equal, best, largest, speedup, vs_autograd, batch_ratio,
                   counts, errors, retries, _vs_reprop(ok), _vs_checkpointed(ok),
                   _vs_whole(ok, oom))


def _vs_whole(ok: Dict[str, Dict[int, Record]], oom: Dict[str, List[int]],
              ) -> Dict[str, Tuple[int, float, Optional[float], Any, Tuple[int, bool]]]:
    out = {}
    for engine in CHUNKED:
        chunked, whole = ok.get(engine + CHUNKED_SUFFIX, {}), ok.get(engine, {})
        common = set(chunked) & set(whole)
        if not common:
            continue
        bs = max(common)
        c, w = chunked[bs], whole[bs]
        peaks = _number(c.get("peak_mem_bytes")), _number(w.get("peak_mem_bytes"))
        peak = peaks[0] / peaks[1] if None not in peaks and peaks[1] else None
        top = max(chunked)
        out[engine] = (bs, _time_ratio(c, w), peak, c.get("chunk_bytes"),
                       (top, any(b > top for b in oom.get(engine + CHUNKED_SUFFIX, []))))
    return out


def _count(x: Any) -> Optional[int]:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def _time_ratio(ours: Record, theirs: Record) -> float:
    """Our step time over theirs at the same batch (< 1: we are faster): their samples/s over
    ours, which every record has (step times are the same figure inverted)."""
    return theirs["samples_per_s"] / ours["samples_per_s"]


def three_batches(batches: Sequence[int]) -> List[int]:
    """The smallest, the middle and the largest of ``batches`` (all of them, if 3 or fewer)."""
    b = sorted(set(batches))
    return b if len(b) <= 3 else [b[0], b[len(b) // 2], b[-1]]


def _vs_reprop(ok: Dict[str, Dict[int, Record]]) -> List[Tuple[int, float, Optional[str]]]:
    par, rev = ok.get("pareprop", {}), ok.get("reversible", {})
    out = []
    for bs in three_batches(set(par) & set(rev)):
        schedule = par[bs].get("schedule")
        out.append((bs, _time_ratio(par[bs], rev[bs]),
                    schedule if isinstance(schedule, str) else None))
    return out


def _vs_checkpointed(
    ok: Dict[str, Dict[int, Record]],
) -> Optional[Tuple[int, Optional[float], Optional[float]]]:
    ckpt = ok.get("checkpointed", {})
    ours = [e for e in ("reversible", "pareprop") if ok.get(e)]
    if not ckpt or not ours:
        return None
    common = set(ckpt).intersection(*(set(ok[e]) for e in ours))
    if not common:
        return None
    bs = max(common)
    ratios = [_time_ratio(ok[e][bs], ckpt[bs]) if e in ours else None
              for e in ("reversible", "pareprop")]
    return bs, ratios[0], ratios[1]


def _batch_ratio(largest: Dict[str, Tuple[int, bool]]) -> Optional[Tuple[float, str]]:
    """Reversible engines' largest batch over plain's, with what the ratio is.

    Kinds: ``"exact"`` (both ran out of memory in the sweep), ``"lower"`` (plain's is exact,
    ours never ran out: at least this), ``"upper"`` (ours is exact, plain never ran out: at
    most this), ``"open"`` (neither ran out: the sweep decides nothing).
    """
    ours = [largest[e] for e in ("reversible", "pareprop") if e in largest]
    if not ours or "plain" not in largest:
        return None
    top, exact = max(ours, key=lambda t: (t[0], not t[1]))
    base, base_exact = largest["plain"]
    kind = {(True, True): "exact", (False, True): "lower", (True, False): "upper",
            (False, False): "open"}[(exact, base_exact)]
    return top / base, kind


def targets(sweeps: Sequence[Sweep], figures: Sequence[Figures]) -> List[Tuple[str, str]]:
    """The issue's targets as (verdict, explanation): ``met``, ``NOT MET`` or ``unknown``."""
    out = []
    for sweep, fig in zip(sweeps, figures):
        if sweep.name in SPEEDUP_SWEEPS:
            want = f"PaReprop >= {SPEEDUP_TARGET:g}x Reprop at best batch"
            if fig.speedup is None:
                out.append(("unknown", f"{sweep.label}: {want}: not measured"))
            else:
                par, rev = fig.best["pareprop"], fig.best["reversible"]
                out.append((_verdict(fig.speedup >= SPEEDUP_TARGET),
                            f"{sweep.label}: {want}: {fig.speedup:.2f}x "
                            f"(bs {par['batch_size']} vs {rev['batch_size']})"))
    for sweep, fig in zip(sweeps, figures):
        want = f"PaReprop >= {AUTOGRAD_TARGET:g}x autograd at equal batch"
        if fig.vs_autograd is None:
            out.append(("unknown", f"{sweep.label}: {want}: not measured"))
        else:
            ratio, bs = fig.vs_autograd
            out.append((_verdict(ratio >= AUTOGRAD_TARGET),
                        f"{sweep.label}: {want}: {ratio:.2f}x at bs {bs}"))
    for sweep, fig in zip(sweeps, figures):
        want = f"largest batch >= {BATCH_TARGET:g}x {sweep.baseline} plain"
        if fig.batch_ratio is None:
            out.append(("unknown", f"{sweep.label}: {want}: not measured"))
            continue
        ratio, kind = fig.batch_ratio
        met = ratio >= BATCH_TARGET
        if kind == "exact" or (kind == "lower" and met) or (kind == "upper" and not met):
            verdict = _verdict(met)
        else:
            verdict = "unknown"
        sign = {"exact": "", "lower": ">=", "upper": "<=", "open": "~"}[kind]
        why = {"exact": "", "lower": " (Reprop never ran out of memory)",
               "upper": " (plain never ran out of memory)",
               "open": " (neither ran out of memory: extend the batch sizes)"}[kind]
        out.append((verdict, f"{sweep.label}: {want}: {sign}{ratio:.1f}x{why}"))
    return out


def _verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


# ---------------------------------------------------------------------------------------------
# Text


def _size(n: Any) -> str:
    x = _number(n)
    if x is None:
        return "-"
    return f"{x / 2**30:.2f}G" if x >= 2**30 else f"{x / 2**20:.0f}M"


def _rate(r: Optional[Record]) -> str:
    x = None if r is None else _number(r.get("samples_per_s"))
    return "-" if x is None else f"{x:.1f}"


def _bound(largest: Optional[Tuple[int, bool]]) -> str:
    """A largest batch: ``256``, ``>=256`` (never ran out of memory in the sweep) or ``-``."""
    if largest is None:
        return "-"
    bs, exact = largest
    return ("" if exact else ">=") + str(bs)


def _align(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _context(sweeps: Sequence[Sweep]) -> str:
    devices = sorted({str(r.get("device")) for s in sweeps for r in s.records if r.get("device")})
    dtypes = sorted({str(r.get("dtype")) for s in sweeps for r in s.records if r.get("dtype")})
    line = f"device {', '.join(devices) or '-'}, {', '.join(dtypes) or '-'}"
    if devices and all(not d.startswith("cuda") for d in devices):
        line += " (no GPU: the targets are about the GPU; here they only exercise this code)"
    return line


def format_summary(sweeps: Sequence[Sweep],
                   steps: Sequence[Tuple[str, str, str, str]] = ()) -> str:
    """The whole summary as text (see the module docstring)."""
    figures = [analyse(s) for s in sweeps]
    parts = [f"GPU summary: {_context(sweeps)}"]
    if steps:
        rows = [("step", "exit", "seconds", "note")] + [tuple(s) for s in steps]
        parts.append(_align(rows))
    if not sweeps:
        parts.append("no sweep left any results")
        return "\n\n".join(parts)

    rows = [("model", "reversible", "standard", "ok", "oom", "skipped", "error")]
    for s, f in zip(sweeps, figures):
        rows.append((s.label, s.model, s.baseline,
                     *(str(f.counts.get(k, 0)) for k in ("ok", "oom", "skipped", "error"))))
    parts.append("configurations\n" + _align(rows))

    rows = [("model", "bs", *ENGINES, "pareprop/autograd")]
    for s, f in zip(sweeps, figures):
        at = f.at_equal
        ratio = "-"
        if "pareprop" in at and "autograd" in at:
            ratio = f"{at['pareprop']['samples_per_s'] / at['autograd']['samples_per_s']:.2f}"
        rows.append((s.label, "-" if f.equal_batch is None else str(f.equal_batch),
                     *(_rate(at.get(e)) for e in ENGINES), ratio))
    parts.append("samples/s at equal batch (bs: the largest batch every engine ran)\n"
                 + _align(rows))

    rows = [("model", "pareprop", "at bs", "reversible", "at bs", "pareprop/reversible")]
    for s, f in zip(sweeps, figures):
        par, rev = f.best.get("pareprop"), f.best.get("reversible")
        rows.append((s.label, _rate(par), "-" if par is None else str(par["batch_size"]),
                     _rate(rev), "-" if rev is None else str(rev["batch_size"]),
                     "-" if f.speedup is None else f"{f.speedup:.2f}"))
    parts.append("samples/s at each engine's best batch\n" + _align(rows))

    rows = [("model", *ENGINES, "reversible/plain")]
    for s, f in zip(sweeps, figures):
        cells = [_bound(f.largest.get(e)) for e in ENGINES]
        ratio = "-"
        if f.batch_ratio is not None:
            value, kind = f.batch_ratio
            ratio = {"exact": "", "lower": ">=", "upper": "<=", "open": "~"}[kind] + f"{value:.1f}"
        rows.append((s.label, *cells, ratio))
    parts.append("largest batch that ran (>=: never ran out of memory in the sweep)\n"
                 + _align(rows))

    rows = [("model", "bs", *ENGINES)]
    for s, f in zip(sweeps, figures):
        cells = []
        for e in ENGINES:
            r = f.at_equal.get(e)
            if r is None:
                cells.append("-")
                continue
            cell = f"{_size(r.get('peak_mem_bytes'))}/{_size(r.get('peak_reserved_bytes'))}"
            cells.append(cell + f" ({_size(r.get('planned_peak_bytes'))})")
        rows.append((s.label, "-" if f.equal_batch is None else str(f.equal_batch), *cells))
    parts.append("peak memory at equal batch: allocated/reserved (planned)\n" + _align(rows))

    rows = [("model", *ENGINES)]
    for s, f in zip(sweeps, figures):
        rows.append((s.label, *("-" if f.retries.get(e) is None else str(f.retries[e])
                                for e in ENGINES)))
    parts.append("allocator retries at each engine's largest batch (-: not recorded)\n"
                 + _align(rows))

    rows = [("model", "smallest bs", "middle bs", "largest bs")]
    for s, f in zip(sweeps, figures):
        cells = [f"{bs}: {ratio:.2f}" + (f" {schedule}" if schedule else "")
                 for bs, ratio, schedule in f.vs_reprop]
        if len(cells) == 2:  # the smallest and the largest
            cells.insert(1, "-")
        rows.append((s.label, *(cells + ["-"] * (3 - len(cells)))))
    parts.append("pareprop/reversible step time (< 1: pareprop faster), bs: ratio and the "
                 "schedule pareprop chose\n" + _align(rows))

    rows = [("model", "bs", "reversible/ckpt", "pareprop/ckpt", "largest: ckpt", "reversible",
             "pareprop")]
    for s, f in zip(sweeps, figures):
        v = f.vs_checkpointed
        ratios = (None, None) if v is None else v[1:]
        rows.append((s.label, "-" if v is None else str(v[0]),
                     *("-" if x is None else f"{x:.2f}" for x in ratios),
                     *(_bound(f.largest.get(e)) for e in ("checkpointed", "reversible",
                                                          "pareprop"))))
    parts.append("against timm's checkpointed model: step time at the largest batch all three "
                 "ran (< 1: faster), largest batch that ran\n" + _align(rows))

    rows = [("model", "engine", "chunk", "bs", "time chunked/whole", "peak chunked/whole",
             "largest: whole", "chunked")]
    for s, f in zip(sweeps, figures):
        for engine, (bs, time_ratio, peak, chunk, top) in f.vs_whole.items():
            rows.append((s.label, engine, _size(chunk) if isinstance(chunk, int) else str(chunk),
                         str(bs), f"{time_ratio:.2f}", "-" if peak is None else f"{peak:.2f}",
                         _bound(f.largest.get(engine)), _bound(top)))
    if len(rows) > 1:
        parts.append("chunked branches against whole ones: at the largest batch both ran "
                     "(< 1: less), largest batch that ran\n" + _align(rows))

    verdicts = targets(sweeps, figures)
    width = max(len(v) for v, _ in verdicts)
    parts.append("targets\n" + "\n".join(f"  {v.ljust(width)}  {text}" for v, text in verdicts))

    problems = []
    for s, f in zip(sweeps, figures):
        problems += [f"  {s.label} {r.get('model')} {r.get('engine')} bs {r.get('batch_size')}: "
                     f"{str(r.get('status'))[:200]}" for r in f.errors]
    problems += [f"  step {name}: exit status {status}" for name, status, *_ in steps
                 if status not in ("0", "skipped")]
    parts.append("problems\n" + ("\n".join(problems) if problems else "  none"))
    notes = [f"  {s.label}: {note}" for s in sweeps for note in s.notes]
    if notes:
        parts.append("notes\n" + "\n".join(notes))
    return "\n\n".join(parts)


def has_problems(sweeps: Sequence[Sweep], steps: Sequence[Tuple[str, str, str, str]]) -> bool:
    """True when a step failed or a configuration ended in an error."""
    if any(status not in ("0", "skipped") for _, status, *_ in steps):
        return True
    return any(_kind(r.get("status")) == "error" for s in sweeps for r in s.records)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not os.path.isdir(args[0]):
        print("usage: python benchmarks/gpu_summary.py OUTDIR (the folder gpu.sh wrote)",
              file=sys.stderr)
        return 2
    out_dir = args[0]
    sweeps, steps = load_sweeps(out_dir), load_steps(out_dir)
    text = format_summary(sweeps, steps)
    print(text)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
    return 1 if has_problems(sweeps, steps) else 0


if __name__ == "__main__":
    sys.exit(main())
