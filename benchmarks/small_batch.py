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

Each engine fails alone (NOTE [ Each engine fails alone ]): an engine that raises (a capture
that fails, out of memory) is recorded in that batch's row under ``errors`` (the error's type
and first line), named under ``not_run`` in later rows, and the others go on. The JSON is
rewritten after every batch.

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
from typing import Any, Dict, List, Optional, Tuple

import torch
from _steps import Timer, build, configure, failure, inputs_for, synchronize, training_step

import pareprop

ENGINES = ("autograd", "reversible", "pareprop", "pareprop-fallback")
GRAPHED = ("autograd+graphs", "reversible+graphs", "pareprop+graphs")
CHECKPOINTED = "timm checkpointed"
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


def _ratio(ms: Dict[str, float], a: str, b: str) -> Optional[float]:
    """ms[a] / ms[b]; None when either engine did not run."""
    return ms[a] / ms[b] if a in ms and b in ms else None


def _ratios(ms: Dict[str, float], row: Dict[str, Any]) -> None:
    """The row's ratios (None where an engine did not run); with graphs asked for and run
    (``row["graphs"]`` None), the graphed engines' ratios in ``row["graphs"]``."""
    row.update(reversible_over_autograd=_ratio(ms, "reversible", "autograd"),
               pareprop_throughput_over_reprop=_ratio(ms, "reversible", "pareprop"),
               fallback_over_reprop=_ratio(ms, "pareprop-fallback", "reversible"),
               reversible_over_checkpointed=_ratio(ms, "reversible", CHECKPOINTED))
    if row["graphs"] is None:
        row["graphs"] = dict(
            reversible_over_autograd=_ratio(ms, "reversible+graphs", "autograd+graphs"),
            reversible_over_eager_autograd=_ratio(ms, "reversible+graphs", "autograd"),
            pareprop_throughput_over_reprop=_ratio(ms, "reversible+graphs", "pareprop+graphs"),
            reversible_over_checkpointed=_ratio(ms, "reversible+graphs", CHECKPOINTED),
            eager_over_graphed={e: ms[e] / ms[f"{e}+graphs"] for e in ("autograd", "reversible",
                                                                       "pareprop")
                                if e in ms and f"{e}+graphs" in ms})


def _f(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _print_row(rev: str, batch: int, ms: Dict[str, float], row: Dict[str, Any]) -> None:
    print(f"  {rev} batch {batch:3d}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
          + " ms", flush=True)
    print(f"      reversible/autograd {_f(row['reversible_over_autograd'])} (target <= 1.5"
          f" at <= 32), PaReprop/Reprop throughput "
          f"{_f(row['pareprop_throughput_over_reprop'])} (target 1.15), fallback chose "
          f"{row['fallback_choice']}: {_f(row['fallback_over_reprop'])}x Reprop's time (target "
          f"<= 1.02), reversible/timm checkpointed {_f(row['reversible_over_checkpointed'])}",
          flush=True)
    for why in row["fallback_why"]:
        print(f"      fallback: {why}", flush=True)
    g = row.get("graphs")
    if isinstance(g, dict):
        speedups = ", ".join(f"{e} {v:.2f}x" for e, v in g["eager_over_graphed"].items())
        print(f"      with graphs: reversible/autograd {_f(g['reversible_over_autograd'])}, "
              f"reversible/eager autograd {_f(g['reversible_over_eager_autograd'])} (target <= "
              f"1.5 at <= 32), PaReprop/Reprop throughput "
              f"{_f(g['pareprop_throughput_over_reprop'])} (target 1.15), reversible/timm "
              f"checkpointed {_f(g['reversible_over_checkpointed'])}; eager/graphed "
              f"{speedups or '-'}", flush=True)
    else:
        print(f"      with graphs: {g}", flush=True)
    for k, err in row.get("errors", {}).items():
        print(f"      {k} failed: {err}", flush=True)
    for k, why in row.get("not_run", {}).items():
        print(f"      {k} not run: {why}", flush=True)


# NOTE [ Each engine fails alone ]
# One device run of a few minutes has to give every figure it can: a graphed engine that fails
# to capture, or an engine that runs out of memory at batch 64, must not take the other rows
# with it. So each engine's build, inputs, priming and every step run in their own ``try``; an
# engine that fails is recorded in that batch's row (``errors``: the error's type and first
# line), dropped with its model and optimizer (their memory goes to the others), and named in
# later rows (``not_run``), while the others go on being timed round by round. An error the
# device reports later (an asynchronous CUDA error, seen at the next synchronisation) cannot be
# told to one engine, and a CUDA context that saw one is broken for all: it ends the pair with
# the error in its row, and the script goes on with the next pair.


def _build(rev: str, std: str, engines: Tuple[str, ...], args: argparse.Namespace,
           device: torch.device) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, str]]:
    """Each engine's (model, request), and why each engine that could not be built failed."""
    nets: Dict[str, Tuple[Any, Any]] = {}
    failed: Dict[str, str] = {}
    try:
        base, request = build(rev, "autograd", device, img_size=args.img_size, depth=args.depth)
    except Exception as err:
        failed.update({e: f"build failed: {failure(err)}" for e in engines})
    else:
        # One build, copied for each engine: every copy starts from the same weights (a
        # full-size model's initialisation takes seconds on the host).
        for e in engines:
            try:
                nets[e] = (configure(copy.deepcopy(base), e), request)
            except Exception as err:
                failed[e] = f"build failed: {failure(err)}"
        del base
    try:
        nets[CHECKPOINTED] = build(std, "checkpointed", device, img_size=args.img_size)
    except Exception as err:
        failed[CHECKPOINTED] = f"build failed: {failure(err)}"
    return nets, failed


def measure_pair(rev: str, std: str, args: argparse.Namespace, start: float,
                 rows: List[Dict]) -> None:
    device = torch.device(args.device)
    amp = None if args.amp == "none" else args.amp
    skipped = graphs_run(args)
    if time.monotonic() - start > args.time_limit:  # not even its models built
        print(f"  {rev}: skipped (time limit)", flush=True)
        return
    nets, failed = _build(rev, std, ENGINES + (GRAPHED if skipped is None else ()), args,
                          device)
    optimizers = {k: torch.optim.AdamW(net.parameters(), lr=1e-5)
                  for k, (net, _) in nets.items()}
    for batch in args.batch_sizes:
        if time.monotonic() - start > args.time_limit:
            print(f"  {rev} batch {batch}: skipped (time limit)", flush=True)
            continue
        if not nets:
            print(f"  {rev} batch {batch}: skipped (no engine left)", flush=True)
            break
        errors: Dict[str, str] = {}
        inputs: Dict[str, Any] = {}
        held = (nets, optimizers, inputs)
        for k in list(nets):
            try:
                inputs[k] = inputs_for(*nets[k], batch, device)
                if k != CHECKPOINTED:
                    configure(nets[k][0], k)  # the fallback measures anew; graphs capture anew
                if k in GRAPHED:
                    _prime(nets[k][0], inputs[k], optimizers[k], amp)
            except Exception as err:
                _drop(k, err, f"failed at batch {batch}", errors, failed, held)
        _release(device)
        timers = {k: Timer(device) for k in nets}
        row: Dict[str, Any] = dict(model=rev, baseline=std, batch=batch, graphs=skipped)
        try:
            for round_ in range(args.warmup + args.rounds):
                running = len(nets)
                for k in list(nets):
                    begin = timers[k].start()
                    try:
                        training_step(nets[k][0], inputs[k], optimizers[k], amp)
                    except Exception as err:
                        _drop(k, err, f"failed at batch {batch}", errors, failed, held)
                        continue
                    if round_ >= args.warmup:
                        timers[k].stop(begin)
                if len(nets) < running:
                    _release(device)
                synchronize(device)
            ms = {k: statistics.median(timers[k].read()) for k in nets}
        except Exception as err:  # NOTE [ Each engine fails alone ]: not one engine's error
            row.update(error=failure(err), errors=errors)
            rows.append(row)
            print(f"  {rev} batch {batch}: failed: {row['error']}", flush=True)
            _write(args, rows)
            return
        fallback = nets.get("pareprop-fallback")
        reasons = pareprop.schedule_reasons(fallback[0]) if fallback else {}
        row.update(ms=ms, errors=errors,
                   not_run={k: why for k, why in failed.items() if k not in errors},
                   fallback_choice=pareprop.chosen_schedule(fallback[0]) if fallback else None,
                   fallback_why=sorted({why for _, why in reasons.values()}))
        _ratios(ms, row)
        rows.append(row)
        _print_row(rev, batch, ms, row)
        _write(args, rows)  # after every batch: a step stopped at its time limit keeps the rest
        del inputs, held
        _release(device)


def _drop(k: str, err: BaseException, why: str, errors: Dict[str, str], failed: Dict[str, str],
          held: Tuple[Dict[str, Any], ...]) -> None:
    """Engine ``k`` failed with ``err``: recorded, and its model, optimizer and inputs let go
    (freed by :func:`_release` once the ``except`` block, whose traceback holds the failed
    step's tensors, has ended)."""
    errors[k], failed[k] = failure(err), why
    for d in held:
        d.pop(k, None)


def _release(device: torch.device) -> None:
    # What a dropped engine or the last batch held, back to the device before the next timing.
    # On the CPU (the dry run) the collector's own schedule does: a full collection there
    # costs a fraction of a second with torch and timm loaded, at every call.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _write(args: argparse.Namespace, rows: List[Dict]) -> None:
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def main(argv: List[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    skipped = graphs_run(args)
    print(f"small batches ({args.device}, amp {args.amp}): median of {args.rounds} interleaved "
          f"rounds after {args.warmup}; CUDA graphs: "
          + ("timed beside the eager engines" if skipped is None else skipped), flush=True)
    rows: List[Dict] = []
    for rev, std in args.pair:
        try:
            measure_pair(rev, std, args, start, rows)
        except Exception as err:  # the next pair still runs (NOTE [ Each engine fails alone ])
            rows.append(dict(model=rev, baseline=std, error=failure(err)))
            print(f"  {rev}: failed: {failure(err)}", flush=True)
        _release(torch.device(args.device))
    _write(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
