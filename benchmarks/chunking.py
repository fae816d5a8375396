"""What chunked branches (pareprop.set_chunking) cost in step time and save in peak memory, on
the CPU, in one run.

    python benchmarks/chunking.py [--models rev_vit_base_patch16_224] [--img-size 224]
        [--batch-size 8] [--depth 4] [--chunk-bytes 64MiB | --chunks 4] [--engines reversible]
        [--rounds 7] [--threads 2] [--out DIR]

For each model and engine: the engine with whole branches and with chunked ones. Each runs
full training steps (forward, cross-entropy, backward, AdamW); the configurations take turns,
one step each per round, so machine load falls on all alike; medians over the rounds. The
peak of one step is ``pareprop.memory_report`` on real CPU tensors (pareprop's
StepPeakTracker: every storage alive at once, parameters, gradients and AdamW's state
included). Prints a table and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

import pareprop


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["rev_vit_base_patch16_224"])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--depth", type=int, default=None,
                        help="total blocks (default: the model's)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--chunk-bytes", default="64MiB",
                      help="most bytes a chunk's graph may save (default 64MiB)")
    size.add_argument("--chunks", type=int, default=None, help="chunks per branch instead")
    parser.add_argument("--engines", nargs="+", default=["reversible"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/chunking")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows: List[Dict] = []
    for name in args.models:
        rows += _measure(name, args)
    print(_table(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(dict(args=vars(args), rows=rows), fh, indent=1)
    print(f"wrote {args.out}/results.json")
    return 0


def _chunking(args: argparse.Namespace, on: bool) -> Dict[str, Optional[object]]:
    if not on:
        return dict(chunks=None, max_bytes=None)
    if args.chunks is not None:
        return dict(chunks=args.chunks, max_bytes=None)
    return dict(chunks=None, max_bytes=args.chunk_bytes)


def _measure(name: str, args: argparse.Namespace) -> List[Dict]:
    torch.manual_seed(0)
    overrides = {} if args.depth is None else {"depth": args.depth}
    model = pareprop.create_model(name, img_size=args.img_size, **overrides).train()
    inputs = model.example_inputs(args.batch_size)
    target = torch.randint(0, model.num_classes, (args.batch_size,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    configs = [(engine, on) for engine in args.engines for on in (False, True)]

    def apply(config) -> None:
        engine, on = config
        pareprop.set_engine(model, engine)
        pareprop.set_chunking(model, **_chunking(args, on))

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(*inputs), target).backward()
        opt.step()
        return time.perf_counter() - start

    peaks = {}
    for config in configs:
        apply(config)
        peaks[config] = pareprop.memory_report(model, inputs).peak
    times: Dict = {c: [] for c in configs}
    for round_ in range(args.warmup + args.rounds):
        for config in configs:
            apply(config)
            took = step()
            if round_ >= args.warmup:
                times[config].append(took * 1e3)
        print(f"{name}: round {round_ + 1}/{args.warmup + args.rounds}", flush=True)
    rows = []
    for engine, on in configs:
        base = statistics.median(times[(engine, False)])
        ms = statistics.median(times[(engine, on)])
        label = "whole" if not on else (f"chunks={args.chunks}" if args.chunks is not None
                                        else f"chunk_bytes={args.chunk_bytes}")
        rows.append(dict(model=name, engine=engine, branches=label, step_ms=ms,
                         times_ms=times[(engine, on)], time_vs_whole=ms / base,
                         peak_mib=peaks[(engine, on)] / 2**20,
                         peak_vs_whole=peaks[(engine, on)] / peaks[(engine, False)]))
    return rows


def _table(rows: List[Dict]) -> str:
    lines = [f"{'model':<26}{'engine':<12}{'branches':<22}{'step ms':>9}{'/ whole':>9}"
             f"{'peak MiB':>10}{'/ whole':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<26}{r['engine']:<12}{r['branches']:<22}{r['step_ms']:>9.1f}"
                     f"{r['time_vs_whole']:>9.3f}{r['peak_mib']:>10.1f}{r['peak_vs_whole']:>9.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
