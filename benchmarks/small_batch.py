"""Step times at small per-device batches, every engine interleaved, with the fallback's choice.

    python benchmarks/small_batch.py --device cuda --batch-sizes 8 16 32 64 \\
        --pair rev_vit_large_patch16_224 vit_large_patch16_224 \\
        --pair rev_swin_base swin_base_patch4_window7_224

For each ``--pair REVERSIBLE STANDARD`` and batch size: the reversible model under
``autograd``, ``reversible``, ``pareprop`` (fallback off) and ``pareprop-fallback`` (engine
"pareprop" with its fallback to Reprop on), and the standard model under timm's activation
checkpointing, all built from one seed. The engines' steps are interleaved round by round (one
training step of each per round, bf16 autocast, AdamW), so that a busy host or a clock change
touches them all alike; each is timed with CUDA events (the wall clock on the CPU) and the
median of the rounds is kept. Printed per batch: each median, reversible/autograd (target at
most 1.5 at 32 and below), PaReprop's throughput over Reprop's (target 1.15), the fallback's
choice and its time over Reprop's (target at most 1.02), and reversible/checkpointed.

CUDA graphs (issue 31 item 3) are not built yet: there is no "with graphs" column.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
from _steps import Timer, build, inputs_for, synchronize, training_step

import pareprop

ENGINES = ("autograd", "reversible", "pareprop", "pareprop-fallback")


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", nargs=2, action="append", required=True,
                   metavar=("REVERSIBLE", "STANDARD"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--img-size", type=int)
    p.add_argument("--depth", type=int, help="blocks of the reversible model (dry runs)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--amp", default="bf16", choices=["bf16", "none"])
    p.add_argument("--time-limit", type=float, default=float("inf"),
                   help="seconds; batch sizes not started by then are skipped")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or args.rounds < 1 or args.warmup < 0:
        p.error("expected batch sizes and --rounds >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available (use --device cpu for the dry run)")
    return args


def measure_pair(rev: str, std: str, args: argparse.Namespace, start: float) -> List[Dict]:
    device = torch.device(args.device)
    amp = None if args.amp == "none" else args.amp
    nets: Dict[str, Any] = {}
    for engine in ENGINES:
        nets[engine] = build(rev, engine, device, img_size=args.img_size, depth=args.depth)
    nets["timm checkpointed"] = build(std, "checkpointed", device, img_size=args.img_size)
    optimizers = {k: torch.optim.AdamW(net.parameters(), lr=1e-5)
                  for k, (net, _) in nets.items()}
    rows = []
    for batch in args.batch_sizes:
        if time.monotonic() - start > args.time_limit:
            print(f"  {rev} batch {batch}: skipped (time limit)", flush=True)
            continue
        inputs = {k: inputs_for(net, req, batch, device) for k, (net, req) in nets.items()}
        for net, _ in nets.values():
            if hasattr(net, "stack") or pareprop.chosen_schedule(net) is not None:
                pareprop.set_engine(net, _engine_of(net))  # the fallback measures anew
        timers = {k: Timer(device) for k in nets}
        try:
            for round_ in range(args.warmup + args.rounds):
                for k, (net, _) in nets.items():
                    begin = timers[k].start()
                    training_step(net, inputs[k], optimizers[k], amp)
                    if round_ >= args.warmup:
                        timers[k].stop(begin)
                synchronize(device)
            ms = {k: statistics.median(t.read()) for k, t in timers.items()}
        except torch.cuda.OutOfMemoryError:
            print(f"  {rev} batch {batch}: out of memory", flush=True)
            break
        fallback_net = nets["pareprop-fallback"][0]
        reasons = pareprop.schedule_reasons(fallback_net)
        choice = pareprop.chosen_schedule(fallback_net)
        row = dict(model=rev, baseline=std, batch=batch, ms=ms, fallback_choice=choice,
                   fallback_why=sorted({why for _, why in reasons.values()}),
                   reversible_over_autograd=ms["reversible"] / ms["autograd"],
                   pareprop_throughput_over_reprop=ms["reversible"] / ms["pareprop"],
                   fallback_over_reprop=ms["pareprop-fallback"] / ms["reversible"],
                   reversible_over_checkpointed=ms["reversible"] / ms["timm checkpointed"])
        rows.append(row)
        print(f"  {rev} batch {batch:3d}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
              + " ms", flush=True)
        print(f"      reversible/autograd {row['reversible_over_autograd']:.2f} (target <= 1.5"
              f" at <= 32), PaReprop/Reprop throughput "
              f"{row['pareprop_throughput_over_reprop']:.2f} (target 1.15), fallback chose "
              f"{choice}: {row['fallback_over_reprop']:.2f}x Reprop's time (target <= 1.02), "
              f"reversible/timm checkpointed {row['reversible_over_checkpointed']:.2f}",
              flush=True)
        for why in row["fallback_why"]:
            print(f"      fallback: {why}", flush=True)
        del inputs
        gc.collect()
    return rows


def _engine_of(net: Any) -> str:
    for m in net.modules():
        if isinstance(m, pareprop.ReversibleStack):
            return m.engine
    return "autograd"


def main(argv: List[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    print(f"small batches ({args.device}, amp {args.amp}): median of {args.rounds} interleaved "
          f"rounds after {args.warmup}; CUDA graphs: not built (issue 31 item 3)", flush=True)
    rows = []
    for rev, std in args.pair:
        rows += measure_pair(rev, std, args, start)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
