"""What set_grad_checkpointing costs and saves on the hierarchical models, in one run.

    python benchmarks/grad_checkpointing.py [--models rev_mvitv2_tiny rev_swin_tiny]
        [--img-size 112] [--batch-size 8] [--rounds 7] [--threads 2] [--out DIR]

For each model: autograd, reversible, and reversible with the non-reversible blocks (MViTv2's
stage transitions, Swin's patch merging and stream fusion) under activation checkpointing.
Each runs full training steps (forward, cross-entropy, backward, AdamW); the configurations of
a model take turns, one step each per round, so machine load falls on all alike; medians over
the rounds. Activation memory is ``pareprop.activation_bytes`` of one training forward (what
autograd keeps for backward, parameters excluded). Prints a table and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

import pareprop

CONFIGS = {  # name: (engine, grad_checkpointing)
    "autograd": ("autograd", False),
    "reversible": ("reversible", False),
    "reversible+ckpt": ("reversible", True),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["rev_mvitv2_tiny", "rev_swin_tiny"])
    parser.add_argument("--img-size", type=int, default=112)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/grad_checkpointing")
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


def _measure(name: str, args: argparse.Namespace) -> List[Dict]:
    torch.manual_seed(0)
    model = pareprop.create_model(name, img_size=args.img_size).train()
    (x,) = model.example_inputs(args.batch_size)
    target = torch.randint(0, model.num_classes, (args.batch_size,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def apply(config: str) -> None:
        engine, gc = CONFIGS[config]
        model.set_engine(engine)
        model.set_grad_checkpointing(gc)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), target).backward()
        opt.step()
        return time.perf_counter() - start

    kept = {}
    for config in CONFIGS:
        apply(config)
        kept[config] = pareprop.activation_bytes(model, x)
    times: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    for round_ in range(args.warmup + args.rounds):
        for config in CONFIGS:
            apply(config)
            took = step()
            if round_ >= args.warmup:
                times[config].append(took * 1e3)
        print(f"{name}: round {round_ + 1}/{args.warmup + args.rounds}", flush=True)
    ref = statistics.median(times["autograd"])
    rev = statistics.median(times["reversible"])
    return [dict(model=name, config=config, activation_mib=kept[config] / 2**20,
                 step_ms=statistics.median(times[config]), times_ms=times[config],
                 vs_autograd=statistics.median(times[config]) / ref,
                 vs_reversible=statistics.median(times[config]) / rev)
            for config in CONFIGS]


def _table(rows: List[Dict]) -> str:
    head = f"{'model':<20}{'config':<18}{'act MiB':>10}{'step ms':>10}{'/ autograd':>12}"
    lines = [head + f"{'/ reversible':>14}"]
    for r in rows:
        lines.append(f"{r['model']:<20}{r['config']:<18}{r['activation_mib']:>10.1f}"
                     f"{r['step_ms']:>10.1f}{r['vs_autograd']:>12.3f}{r['vs_reversible']:>14.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
