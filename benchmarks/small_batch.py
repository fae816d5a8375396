"""Step times at small per-device batches, every engine interleaved, with and without CUDA graphs.

    python benchmarks/small_batch.py --device cuda --batch-sizes 8 16 32 64 --graphs \\
        --pair rev_vit_large_patch16_224 vit_large_patch16_224 \\
        --pair rev_swin_base swin_base_patch4_window7_224

For each ``--pair REVERSIBLE STANDARD`` and batch size: the reversible model under
``autograd``, ``reversible``, ``pareprop`` (fallback off) and ``pareprop-fallback`` (engine
"pareprop" with its fallback to Reprop on), with ``--graphs`` also ``autograd+graphs``,
``reversible+graphs`` and ``pareprop+graphs`` (each stack's training step captured as CUDA
graphs and replayed: ``pareprop.set_engine(model, engine, cuda_graphs=True)``), and the
standard model under timm's activation checkpointing, all from one seed. The engines' steps are
interleaved round by round (one training step of each per round, bf16 autocast, AdamW), so that
a busy host or a clock change touches them all alike; each is timed with CUDA events (the wall
clock on the CPU) and the median of the rounds is kept. A graphed model first runs untimed
until its stacks have captured (``graphs.WARMUP_STEPS`` eager steps, then the capture) and
replayed once. Printed per batch: each median, reversible/autograd (target at most 1.5 at 32
and below), PaReprop's throughput over Reprop's (target 1.15), the fallback's choice and its
time over Reprop's (target at most 1.02), reversible/checkpointed, and with graphs the same
ratios among the graphed engines and each engine's eager time over its graphed time.

CUDA graphs capture CUDA work: without CUDA (the dry run on the CPU) the graphed engines are
not run, and the script says so in its log and its JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from _steps import Timer, build, configure, inputs_for, synchronize, training_step

import pareprop

ENGINES = ("autograd", "reversible", "pareprop", "pareprop-fallback")
GRAPHED = ("autograd+graphs", "reversible+graphs", "pareprop+graphs")
NO_CUDA = "not run (no CUDA: CUDA graphs capture CUDA work)"


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
    p.add_argument("--graphs", action="store_true",
                   help="also time each engine with CUDA graphs (CUDA only)")
    p.add_argument("--time-limit", type=float, default=float("inf"),
                   help="seconds; batch sizes not started by then are skipped")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or args.rounds < 1 or args.warmup < 0:
        p.error("expected batch sizes and --rounds >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available (use --device cpu for the dry run)")
    return args


def graphs_run(args: argparse.Namespace) -> Optional[str]:
    """None when the graphed engines run; otherwise why not."""
    if not args.graphs:
        return "not asked (--graphs)"
    return None if torch.device(args.device).type == "cuda" else NO_CUDA


def _stacks(net: Any) -> List[Any]:
    return [m for m in net.modules() if isinstance(m, pareprop.ReversibleStack)]


def _prime(net: Any, inputs: Any, optimizer: Any, amp: Optional[str]) -> None:
    """Untimed steps until every stack of a graphed model has captured, then one replay."""
    for _ in range(pareprop.engine.graphs.WARMUP_STEPS + 1):
        if all(s.cuda_graph_status.startswith("captured") for s in _stacks(net)):
            break
        training_step(net, inputs, optimizer, amp)
    training_step(net, inputs, optimizer, amp)


def _ratios(ms: Dict[str, float], row: Dict[str, Any]) -> None:
    row.update(reversible_over_autograd=ms["reversible"] / ms["autograd"],
               pareprop_throughput_over_reprop=ms["reversible"] / ms["pareprop"],
               fallback_over_reprop=ms["pareprop-fallback"] / ms["reversible"],
               reversible_over_checkpointed=ms["reversible"] / ms["timm checkpointed"])
    if "reversible+graphs" in ms:
        row["graphs"] = dict(
            reversible_over_autograd=ms["reversible+graphs"] / ms["autograd+graphs"],
            reversible_over_eager_autograd=ms["reversible+graphs"] / ms["autograd"],
            pareprop_throughput_over_reprop=ms["reversible+graphs"] / ms["pareprop+graphs"],
            reversible_over_checkpointed=ms["reversible+graphs"] / ms["timm checkpointed"],
            eager_over_graphed={e: ms[e] / ms[f"{e}+graphs"]
                                for e in ("autograd", "reversible", "pareprop")})


def _print_row(rev: str, batch: int, ms: Dict[str, float], row: Dict[str, Any]) -> None:
    print(f"  {rev} batch {batch:3d}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
          + " ms", flush=True)
    print(f"      reversible/autograd {row['reversible_over_autograd']:.2f} (target <= 1.5"
          f" at <= 32), PaReprop/Reprop throughput "
          f"{row['pareprop_throughput_over_reprop']:.2f} (target 1.15), fallback chose "
          f"{row['fallback_choice']}: {row['fallback_over_reprop']:.2f}x Reprop's time (target "
          f"<= 1.02), reversible/timm checkpointed {row['reversible_over_checkpointed']:.2f}",
          flush=True)
    for why in row["fallback_why"]:
        print(f"      fallback: {why}", flush=True)
    g = row.get("graphs")
    if isinstance(g, dict):
        speedups = ", ".join(f"{e} {v:.2f}x" for e, v in g["eager_over_graphed"].items())
        print(f"      with graphs: reversible/autograd {g['reversible_over_autograd']:.2f}, "
              f"reversible/eager autograd {g['reversible_over_eager_autograd']:.2f} (target <= "
              f"1.5 at <= 32), PaReprop/Reprop throughput "
              f"{g['pareprop_throughput_over_reprop']:.2f} (target 1.15), reversible/timm "
              f"checkpointed {g['reversible_over_checkpointed']:.2f}; eager/graphed {speedups}",
              flush=True)
    else:
        print(f"      with graphs: {g}", flush=True)


def measure_pair(rev: str, std: str, args: argparse.Namespace, start: float,
                 rows: List[Dict]) -> None:
    device = torch.device(args.device)
    amp = None if args.amp == "none" else args.amp
    skipped = graphs_run(args)
    engines = ENGINES + (GRAPHED if skipped is None else ())
    # One build, copied for each engine: every copy starts from the same weights (a
    # full-size model's initialisation takes seconds on the host).
    base, request = build(rev, "autograd", device, img_size=args.img_size, depth=args.depth)
    nets: Dict[str, Any] = {e: (configure(copy.deepcopy(base), e), request) for e in engines}
    del base
    nets["timm checkpointed"] = build(std, "checkpointed", device, img_size=args.img_size)
    optimizers = {k: torch.optim.AdamW(net.parameters(), lr=1e-5)
                  for k, (net, _) in nets.items()}
    for batch in args.batch_sizes:
        if time.monotonic() - start > args.time_limit:
            print(f"  {rev} batch {batch}: skipped (time limit)", flush=True)
            continue
        inputs = {k: inputs_for(net, req, batch, device) for k, (net, req) in nets.items()}
        for k, (net, _) in nets.items():
            if k != "timm checkpointed":
                configure(net, k)  # the fallback measures anew; graphs capture anew
        timers = {k: Timer(device) for k in nets}
        try:
            for k in GRAPHED:
                if k in nets:
                    _prime(nets[k][0], inputs[k], optimizers[k], amp)
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
        row: Dict[str, Any] = dict(
            model=rev, baseline=std, batch=batch, ms=ms,
            fallback_choice=pareprop.chosen_schedule(fallback_net),
            fallback_why=sorted({why for _, why in reasons.values()}),
            graphs=skipped)
        _ratios(ms, row)
        rows.append(row)
        _print_row(rev, batch, ms, row)
        if args.json:  # after every batch: a step stopped at its time limit keeps what it has
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        del inputs
        gc.collect()


def main(argv: List[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    skipped = graphs_run(args)
    print(f"small batches ({args.device}, amp {args.amp}): median of {args.rounds} interleaved "
          f"rounds after {args.warmup}; CUDA graphs: "
          + ("timed beside the eager engines" if skipped is None else skipped), flush=True)
    rows: List[Dict] = []
    for rev, std in args.pair:
        measure_pair(rev, std, args, start, rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
