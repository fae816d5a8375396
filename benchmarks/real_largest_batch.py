"""The real largest batch under a memory cap, beside the planned one.

    python benchmarks/real_largest_batch.py --cap 40GiB \\
        --case rev_vit_base_patch16_224 reversible 7179 --chunk-bytes 1GiB \\
        --case vit_base_patch16_224 checkpointed 2767

Each ``--case MODEL ENGINE PLANNED`` (options after it apply to that case) runs one full
training step (bf16 autocast, cross-entropy, AdamW) per batch size, on a device capped at
``--cap`` with ``torch.cuda.set_per_process_memory_fraction``: the planned batch, then 5% more
when it ran (so "within 5%" is a measurement), or a bisection below it when it did not. Every
step prints its peak (``max_memory_allocated``) and, for chunked stacks, the chunk counts the
engine chose (the smallest count of each split size: a branch asked to chunk must never run
whole, issue 31). With ``--trace-oom`` a step that runs out of memory is repeated under
``torch.cuda.memory._record_memory_history`` and the largest tensors alive when it failed are
printed with the line that made them.

``--device cpu`` (the dry run) caps nothing: it runs the same steps on tiny models, and a
``--cap`` there only scales the search (a step "fits" when its measured peak is under it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

import torch
from _steps import build, inputs_for, training_step

import pareprop
from pareprop.chunking import Chunking, parse_bytes
from pareprop.memory import memory_report

GiB = 2**30


def parse_cases(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", required=True, help="memory cap, e.g. 40GiB")
    p.add_argument("--device", default="cuda")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--amp", default="bf16", choices=["bf16", "none"])
    p.add_argument("--steps", type=int, default=6, help="batch sizes tried per case at most")
    p.add_argument("--trace-oom", action="store_true")
    p.add_argument("--time-limit", type=float, default=math.inf,
                   help="seconds; cases not started by then are skipped")
    p.add_argument("--json", help="write the records here")
    head, cases, current = [], [], None
    for arg in argv:
        if arg == "--case":
            current = []
            cases.append(current)
        elif current is not None:
            current.append(arg)
        else:
            head.append(arg)
    args = p.parse_args(head)
    case_p = argparse.ArgumentParser(prog="--case")
    case_p.add_argument("model")
    case_p.add_argument("engine")
    case_p.add_argument("planned", help="the planned largest batch, or 'plan' to plan it here "
                        "(pareprop.largest_batch: minutes for a full-size model)")
    case_p.add_argument("--chunk-bytes")
    case_p.add_argument("--grad-checkpointing", action="store_true")
    case_p.add_argument("--depth", type=int)
    args.cases = [case_p.parse_args(c) for c in cases]
    for case in args.cases:
        if case.planned != "plan" and not case.planned.isdigit():
            p.error(f"--case {case.model}: expected a planned batch (an integer) or 'plan', "
                    f"got {case.planned!r}")
    if not args.cases:
        p.error("expected at least one --case MODEL ENGINE PLANNED")
    try:
        args.cap_bytes = parse_bytes(args.cap)
    except ValueError as err:
        p.error(f"--cap: {err}")
    return args


@contextlib.contextmanager
def chunk_counts() -> Iterator[Dict[int, int]]:
    """The smallest chunk count the engine chose for each split size during the block."""
    seen: Dict[int, int] = {}
    count_for = Chunking.count_for

    def spy(self: Chunking, size: int, fixed: float = 0.0, per_unit: float = 0.0) -> int:
        count = count_for(self, size, fixed, per_unit)
        seen[size] = min(seen.get(size, count), count)
        return count

    Chunking.count_for = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Chunking.count_for = count_for  # type: ignore[method-assign]


def largest_alive(snapshot: Dict[str, Any], top: int = 6) -> List[str]:
    """The largest blocks alive in a memory-history snapshot, with the frame that made them."""
    blocks = []
    for seg in snapshot.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            frames = blk.get("frames") or []
            ours = [f for f in frames if "pareprop" in f["filename"] or "timm" in f["filename"]]
            where = ours[0] if ours else (frames[0] if frames else None)
            name = f"{where['filename'].split('/')[-1]}:{where['line']} {where['name']}" \
                if where else "?"
            blocks.append((blk["size"], name))
    blocks.sort(reverse=True)
    return [f"{size / GiB:.2f} GiB  {name}" for size, name in blocks[:top]]


class Case:
    def __init__(self, spec: argparse.Namespace, args: argparse.Namespace):
        self.spec, self.args = spec, args
        self.device = torch.device(args.device)
        self.model, self.request = build(
            spec.model, spec.engine, self.device, img_size=args.img_size,
            chunk_bytes=spec.chunk_bytes, grad_checkpointing=spec.grad_checkpointing,
            depth=spec.depth)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.planned = int(spec.planned) if spec.planned != "plan" else self.plan()

    def plan(self) -> int:
        spec, args = self.spec, self.args
        batch, _ = pareprop.largest_batch(
            spec.model, spec.engine, args.cap_bytes, amp=None if args.amp == "none" else args.amp,
            img_size=args.img_size, grad_checkpointing=spec.grad_checkpointing,
            chunk_bytes=spec.chunk_bytes, device=args.device,
            **({"depth": spec.depth} if spec.depth else {}))
        return batch

    def step(self, batch: int) -> Dict[str, Any]:
        """One training step at ``batch``: its peak, the chunk counts, or out of memory."""
        gc.collect()
        record: Dict[str, Any] = dict(batch=batch)
        inputs = None
        try:
            inputs = inputs_for(self.model, self.request, batch, self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with chunk_counts() as counts:
                if self.device.type == "cuda":
                    training_step(self.model, inputs, self.optimizer, self.args.amp)
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated()
                else:
                    amp = None if self.args.amp == "none" else self.args.amp
                    peak = memory_report(self.model, inputs, amp=amp).peak
            record.update(peak_gib=round(peak / GiB, 3), chunks=dict(sorted(counts.items())))
            record["fits"] = self.device.type == "cuda" or peak <= self.args.cap_bytes
        except torch.cuda.OutOfMemoryError:
            record.update(fits=False, peak_gib=None)
        finally:
            del inputs
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return record

    def trace(self, batch: int) -> List[str]:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            self.step(batch)
            return largest_alive(torch.cuda.memory._snapshot())
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def search(self) -> Dict[str, Any]:
        """From the planned batch: 5% more when it fits, else bisect below it."""
        planned, steps = self.planned, []
        ok, bad = 0, None
        batch = planned
        for _ in range(self.args.steps):
            rec = self.step(batch)
            steps.append(rec)
            print(f"    batch {batch:6d}: " + (f"ran, peak {rec['peak_gib']:.2f} GiB"
                  if rec["fits"] else "out of memory") +
                  (f", chunks {rec['chunks']}" if rec.get("chunks") else ""), flush=True)
            if rec["fits"]:
                ok = max(ok, batch)
            else:
                bad = batch if bad is None else min(bad, batch)
                if self.args.trace_oom and self.device.type == "cuda" and "trace" not in steps[0]:
                    steps[0]["trace"] = self.trace(batch)
                    for line in steps[0]["trace"]:
                        print(f"      alive at OOM: {line}", flush=True)
            if bad is None:
                if batch >= math.ceil(planned * 1.05):
                    break
                batch = math.ceil(planned * 1.05)
            else:
                if bad - ok <= max(1, math.ceil(0.01 * planned)):
                    break
                batch = (ok + bad) // 2 if ok else max(1, bad // 2)
        real = ok
        return dict(model=self.spec.model, engine=self.spec.engine, planned=planned, real=real,
                    real_over_planned=round(real / planned, 3) if planned else None,
                    bracket=[ok, bad], chunk_bytes=self.spec.chunk_bytes,
                    grad_checkpointing=self.spec.grad_checkpointing, steps=steps)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_cases(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available (use --device cpu for the dry run)",
                  file=sys.stderr)
            return 2
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_bytes / total))
    start, results = time.monotonic(), []
    print(f"real largest batch under a {args.cap} cap ({args.device}, amp {args.amp}, "
          f"{args.img_size} px): one AdamW step per batch", flush=True)
    for spec in args.cases:
        label = f"{spec.model} {spec.engine}" + (f" chunks {spec.chunk_bytes}"
                                                 if spec.chunk_bytes else "") + \
            (" +grad-ckpt" if spec.grad_checkpointing else "")
        if time.monotonic() - start > args.time_limit:
            print(f"  {label}: skipped (time limit)", flush=True)
            continue
        case = Case(spec, args)
        print(f"  {label}: planned {case.planned}", flush=True)
        result = case.search()
        del case
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        results.append(result)
        print(f"  {label}: real {result['real']} (bracket {result['bracket']}), planned "
              f"{result['planned']}: real/planned {result['real_over_planned']}", flush=True)
    by_key = {(r["model"], r["engine"]): r for r in results}
    for rev, base in (("rev_vit_base_patch16_224", "vit_base_patch16_224"),
                      ("rev_swin_tiny", "swin_tiny_patch4_window7_224")):
        r = next((v for (m, _), v in by_key.items() if m == rev), None)
        b = by_key.get((base, "checkpointed"))
        if r and b and b["real"]:
            print(f"  {rev} / {base} checkpointed: real {r['real'] / b['real']:.2f}x, planned "
                  f"{r['planned'] / b['planned']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
