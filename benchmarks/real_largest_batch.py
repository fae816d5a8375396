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
whole). With ``--trace-oom`` a planned batch that runs out of memory is repeated
under ``torch.cuda.memory._record_memory_history`` (Python stacks, a bounded history) and the
largest tensors alive when it failed are printed with the line that made them (NOTE [ Tracing
only the planned batch ]). The JSON is rewritten after every step and a case that fails is
recorded with its error, while the next one runs (NOTE [ Each case is written when it ends ]).

``--device cpu`` (the dry run) caps nothing: it runs the same steps on tiny models, and a
``--cap`` there only scales the search (a step "fits" when its measured peak is under it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from _steps import build, failure, inputs_for, is_oom, training_step

import pareprop
from pareprop.engine.chunk_cost import Chunking, parse_bytes
from pareprop.memory import memory_report

GiB = 2**30

# NOTE [ Tracing only the planned batch ]
# With --trace-oom, a planned batch that runs out of memory is run again under the allocator's
# memory history, and the largest tensors alive when it failed are printed with the Python line
# that made them: why the plan was wrong. Only the planned batch: the probe 5% above a plan that
# fits is expected to fail, and the bisection's steps below a failed plan add nothing to the
# first trace. Python frames only (``stacks="python"``): symbolising C++ frames costs seconds a
# step on a large model and names no line of ours. The blocks alive and the frames that made
# them are kept per block whatever the history's length, so the event ring buffer is bounded
# (TRACE_ENTRIES): one step of a large chunked model makes tens of thousands of events.
TRACE_ENTRIES = 20_000


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

    def step(self, batch: int, on_oom: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
        """One training step at ``batch``: its peak, the chunk counts, or out of memory.
        ``on_oom`` is called when it runs out, while the failed step's tensors are alive."""
        if self.device.type == "cuda":
            gc.collect()  # what the last case left, back to the device before the peak is reset
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
        except Exception as err:
            if not is_oom(err):
                raise
            record.update(fits=False, peak_gib=None)
            if on_oom is not None:  # the traceback still holds the step's frames
                on_oom()
        finally:
            del inputs
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                # The failed step's tensors back to the device before the next peak is read;
                # a CPU step's peak is counted by tracking, whatever the collector holds.
                gc.collect()
                torch.cuda.empty_cache()
        return record

    def trace(self, batch: int) -> List[str]:
        """The step at ``batch`` again under the allocator's memory history: the largest
        tensors alive when it ran out, each with the Python line that made it (NOTE [ Tracing
        only the planned batch ]); empty when it ran this time."""
        alive: List[str] = []

        def snapshot() -> None:
            alive.extend(largest_alive(torch.cuda.memory._snapshot()))

        torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES, stacks="python")
        try:
            self.step(batch, on_oom=snapshot)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return alive

    def search(self, on_step: Optional[Callable[[List[Dict[str, Any]]], None]] = None,
               ) -> Dict[str, Any]:
        """From the planned batch: 5% more when it fits, else bisect below it. ``on_step``
        gets the steps so far after each one (the caller writes them down)."""
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
                if len(steps) == 1 and self.args.trace_oom and self.device.type == "cuda":
                    rec["trace"] = self.trace(batch)  # the plan itself failed
                    for line in rec["trace"]:
                        print(f"      alive at OOM: {line}", flush=True)
            if on_step is not None:
                on_step(steps)
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
        head = dict(model=spec.model, engine=spec.engine, chunk_bytes=spec.chunk_bytes,
                    grad_checkpointing=spec.grad_checkpointing)
        if time.monotonic() - start > args.time_limit:
            print(f"  {label}: skipped (time limit)", flush=True)
            results.append(dict(head, skipped="time limit"))
            write(args, results)
            continue
        try:
            results.append(run_case(spec, args, label, head, results))
        except Exception as err:  # NOTE [ Each case is written when it ends ]
            results.append(dict(head, error=failure(err)))
            print(f"  {label}: failed: {failure(err)}", flush=True)
        write(args, results)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    by_key = {(r["model"], r["engine"]): r for r in results if "real" in r}
    for rev, base in (("rev_vit_base_patch16_224", "vit_base_patch16_224"),
                      ("rev_swin_tiny", "swin_tiny_patch4_window7_224")):
        r = next((v for (m, _), v in by_key.items() if m == rev), None)
        b = by_key.get((base, "checkpointed"))
        if r and b and b["real"]:
            print(f"  {rev} / {base} checkpointed: real {r['real'] / b['real']:.2f}x, planned "
                  f"{r['planned'] / b['planned']:.2f}x", flush=True)
    return 0


# NOTE [ Each case is written when it ends ]
# The device run gives this step a few minutes, and a timeout there must not take the cases
# already measured with it: the JSON is rewritten after every step of every case, the case in
# progress with ``finished: false`` and the steps it has, and a case that raises (a build that
# fails, an error that is not out of memory) is recorded with its error (type and first line)
# while the next case runs.


def run_case(spec: argparse.Namespace, args: argparse.Namespace, label: str,
             head: Dict[str, Any], done: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One case, searched from its planned batch; the JSON (``done`` and this case so far)
    rewritten after each step."""
    case = Case(spec, args)
    planned = case.planned
    print(f"  {label}: planned {planned}", flush=True)

    def progress(steps: List[Dict[str, Any]]) -> None:
        write(args, done + [dict(head, planned=planned, finished=False, steps=steps)])

    result = case.search(on_step=progress)
    print(f"  {label}: real {result['real']} (bracket {result['bracket']}), planned "
          f"{result['planned']}: real/planned {result['real_over_planned']}", flush=True)
    return dict(result, finished=True)


def write(args: argparse.Namespace, results: List[Dict[str, Any]]) -> None:
    if args.json:
        with open(args.json + ".tmp", "w") as fh:  # a kill mid-write leaves the last one
            json.dump(results, fh, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    sys.exit(main())
