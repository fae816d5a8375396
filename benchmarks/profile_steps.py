"""One profiled training step per question: how much PaReprop's two streams overlap, and where a
reversible model's step spends its kernels against timm's.

    python benchmarks/profile_steps.py --device cuda \\
        --overlap rev_vit_large_patch16_224 32 \\
        --kernels rev_vit_base_patch16_224 vit_base_patch16_224 128

``--overlap MODEL BATCH``: one step of MODEL under engine "pareprop" (fallback off) after a
warm-up step, traced by torch.profiler; from the trace's kernels, each CUDA stream's busy time
(the union of its kernels' intervals), the time both streams were busy at once, and the step's
span. On the CPU there are no kernels: the operators of each host thread stand in, so that the
dry run reads a trace the same way.

``--kernels REVERSIBLE STANDARD BATCH``: one step of each, REVERSIBLE under plain autograd
(engine "autograd"), STANDARD as timm builds it, and for each the operators with the most
self device time, with the share of copies (``aten::copy_``, ``clone``, ``contiguous``,
``_to_copy``): where an equal-batch gap between the two comes from.

Each part fails alone: an error (its type and first line) is printed and recorded in the
part's place in the JSON, which is written after each part, and the other part runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Tuple

import torch
from _steps import build, failure, inputs_for, synchronize, training_step
from torch.profiler import ProfilerActivity, profile

COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--img-size", type=int)
    p.add_argument("--depth", type=int, help="blocks of every model profiled (dry runs)")
    p.add_argument("--overlap", nargs=2, metavar=("MODEL", "BATCH"))
    p.add_argument("--kernels", nargs=3, metavar=("REVERSIBLE", "STANDARD", "BATCH"))
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not args.overlap and not args.kernels:
        p.error("expected --overlap and/or --kernels")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available (use --device cpu for the dry run)")
    return args


def _profiled_step(model: str, engine: str, batch: int, args: argparse.Namespace,
                   depth: int | None) -> profile:
    device = torch.device(args.device)
    net, request = build(model, engine, device, img_size=args.img_size, depth=depth)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    inputs = inputs_for(net, request, batch, device)
    training_step(net, inputs, optimizer, "bf16")  # warm-up: kernels chosen, pools filled
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        training_step(net, inputs, optimizer, "bf16")
        synchronize(device)
    return prof


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: List[Tuple[float, float]], y: List[Tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def lane_busy(trace_events: List[Dict]) -> Dict[str, object]:
    """Busy time of the two busiest lanes (CUDA streams, or host threads without kernels), the
    time both were busy, and the span, in ms, from a Chrome trace's events."""
    kernels = [e for e in trace_events if e.get("cat") == "kernel" and "dur" in e]
    if kernels:
        key, what = (lambda e: f"stream {e.get('args', {}).get('stream', '?')}"), "CUDA streams"
    else:
        kernels = [e for e in trace_events if e.get("cat") == "cpu_op" and "dur" in e]
        key, what = (lambda e: f"thread {e.get('tid')}"), "host threads (no CUDA kernels)"
    lanes: Dict[str, List[Tuple[float, float]]] = {}
    for e in kernels:
        lanes.setdefault(key(e), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    busy = {name: _union(iv) for name, iv in lanes.items()}
    ranked = sorted(busy, key=lambda n: -_length(busy[n]))
    both = _intersection(busy[ranked[0]], busy[ranked[1]]) if len(ranked) > 1 else 0.0
    starts = [a for iv in busy.values() for a, _ in iv]
    ends = [b for iv in busy.values() for _, b in iv]
    span = (max(ends) - min(starts)) if starts else 0.0
    return dict(lanes=what, busy_ms={n: _length(busy[n]) / 1e3 for n in ranked[:4]},
                both_busy_ms=both / 1e3, span_ms=span / 1e3)


def overlap(args: argparse.Namespace) -> Dict[str, object]:
    model, batch = args.overlap[0], int(args.overlap[1])
    prof = _profiled_step(model, "pareprop", batch, args, args.depth)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh).get("traceEvents", [])
    out = lane_busy(events)
    print(f"PaReprop's lanes, {model} batch {batch} (one step, {out['lanes']}):", flush=True)
    for name, ms in out["busy_ms"].items():
        print(f"  {name}: busy {ms:.2f} ms", flush=True)
    print(f"  both busy at once: {out['both_busy_ms']:.2f} ms of a {out['span_ms']:.2f} ms span",
          flush=True)
    return dict(model=model, batch=batch, **out)


def _self_time(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def kernel_table(args: argparse.Namespace) -> Dict[str, object]:
    rev, std, batch = args.kernels[0], args.kernels[1], int(args.kernels[2])
    device_clock = args.device == "cuda"
    result = {}
    for model, engine in ((rev, "autograd"), (std, "plain")):
        prof = _profiled_step(model, engine, batch, args, args.depth)
        rows = []
        for e in prof.key_averages():
            t = _self_time(e) if device_clock else float(e.self_cpu_time_total)
            if t > 0:
                rows.append((t, e.count, e.key))
        rows.sort(reverse=True)
        total = sum(t for t, _, _ in rows) or 1.0
        copies = sum(t for t, _, k in rows if k in COPIES)
        clock = "device" if device_clock else "host (CPU run)"
        print(f"{model} ({engine}), batch {batch}: {total / 1e3:.2f} ms of self {clock} time, "
              f"copies {100 * copies / total:.1f}%", flush=True)
        for t, n, k in rows[:args.top]:
            print(f"  {100 * t / total:5.1f}%  {t / 1e3:8.2f} ms  {n:5d}x  {k[:70]}", flush=True)
        result[model] = dict(engine=engine, total_ms=total / 1e3, copy_share=copies / total,
                             top=[dict(op=k, ms=t / 1e3, calls=n) for t, n, k in rows[:args.top]])
    return result


def main(argv: List[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    out: Dict[str, Any] = {}
    parts = [(name, run) for name, run, asked in (("overlap", overlap, args.overlap),
                                                  ("kernels", kernel_table, args.kernels))
             if asked]
    for name, run in parts:  # each part fails alone, its error recorded in its place
        try:
            out[name] = run(args)
        except Exception as err:
            out[name] = dict(error=failure(err))
            print(f"{name} failed: {failure(err)}", flush=True)
        if args.json:  # after each part: a step stopped at its allowance keeps the first
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
