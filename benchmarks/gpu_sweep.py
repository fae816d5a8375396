"""One model's sweep for ``benchmarks/gpu.sh``: every engine gets its own share of the time.

Usage::

    python benchmarks/gpu_sweep.py --out DIR --budget SECONDS --label Rev-ViT-B \\
        --model rev_vit_base_patch16_224 --baseline vit_base_patch16_224 \\
        -- --device cuda --amp bf16 --batch-sizes 128 256 512

Everything after ``--`` goes to ``pareprop bench`` unchanged. The engines run one after the
other, the baseline's first (``plain``, ``checkpointed``, then ``autograd``, ``reversible``,
``pareprop``), each as one ``pareprop bench`` call into ``DIR/<engine>/``, all in this one
process (torch, timm and the CUDA context are set up once, not five times).

NOTE [ Why one bench call per engine ]
    ``pareprop bench`` orders its configurations model, engine, batch, and its ``--time-budget``
    only stops *starting* configurations. With one call per model, a short budget spends itself
    on the first engines' large batches and the last engines are never measured. Here each
    engine gets ``left / engines left`` of the time (what an engine does not use goes to the
    ones after it): ``--time-budget`` at :data:`SOFT_FRACTION` of that share, so no large batch
    starts late, and a ``SIGALRM`` at the full share, which ``pareprop bench`` takes as an
    interrupt (it then keeps what it measured, as under ``timeout``). Every record also streams
    to ``DIR/<engine>/results.jsonl``, so even an engine cut off while writing its results
    leaves its data.

With ``--chunk-bytes SIZE`` the reversible model also runs as ``reversible_chunked`` and
``pareprop_chunked``: the same engines with each block's branches rebuilt and differentiated in
chunks (``pareprop bench --chunk-bytes SIZE``, records name the size in ``chunk_bytes``), into
``DIR/reversible_chunked/`` and ``DIR/pareprop_chunked/``, after the whole-branch engines.

Writes ``DIR/sweep.json`` (label, models, engines, budget, chunk size) for
``benchmarks/gpu_summary.py``.
Exit status: 0 when every engine's bench call ran (configurations may be out of memory or
skipped for time), 1 when one failed.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before the imports: the budget counts from process start

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any, List, Optional, Sequence  # noqa: E402

from pareprop.bench import stop as bench_stop  # noqa: E402
from pareprop.engine.chunk_cost import parse_chunking  # noqa: E402

BASELINE_ENGINES = ("plain", "checkpointed")
REVERSIBLE_MODEL_ENGINES = ("autograd", "reversible", "pareprop")
CHUNKED_SUFFIX = "_chunked"  # an engine run with --chunk-bytes, in its own folder
CHUNKED_ENGINES = ("reversible" + CHUNKED_SUFFIX, "pareprop" + CHUNKED_SUFFIX)
ENGINE_ORDER = BASELINE_ENGINES + REVERSIBLE_MODEL_ENGINES + CHUNKED_ENGINES
SOFT_FRACTION = 0.6  # of an engine's share: start no configuration after this
MIN_SHARE_S = 3.0  # an engine left less than this is not started
WRITE_MARGIN_S = 2.0  # kept back at the end for the last engine's results and plots
# Also kept back: a bench asked to stop finishes the configuration it is in (its next safe
# point), which overran an engine's share by up to 7 s in a loaded CI dry run (2026-12-04).
OVERRUN_FRACTION = 0.1  # of the budget
OVERRUN_MAX_S = 10.0


def overrun_reserve(budget_s: float) -> float:
    """Seconds of the sweep's budget kept for the last engine's overrun of its share."""
    return min(OVERRUN_MAX_S, OVERRUN_FRACTION * budget_s)


def engine_share(left_s: float, engines_left: int) -> float:
    """Seconds the next engine may use: an equal part of what is left, never negative."""
    if engines_left < 1:
        raise ValueError(f"expected at least one engine left, got {engines_left}")
    return max(0.0, left_s) / engines_left


def soft_budget(share_s: float) -> float:
    """``--time-budget`` for an engine with ``share_s`` seconds.

    Never below one second: ``pareprop bench`` treats a budget of 0 as no budget at all.
    """
    return max(1.0, round(SOFT_FRACTION * share_s, 1))


def bench_argv(model: str, engine: str, budget_s: float, out_dir: str,
               bench_args: Sequence[str], chunk_bytes: Optional[str] = None) -> List[str]:
    """The ``pareprop bench`` command line (after ``pareprop``) for one engine.

    A ``*_chunked`` engine is its base engine with ``--chunk-bytes chunk_bytes``.
    """
    chunk: List[str] = []
    if engine.endswith(CHUNKED_SUFFIX):
        if chunk_bytes is None:
            raise ValueError(f"engine {engine} needs a chunk size")
        engine = engine[: -len(CHUNKED_SUFFIX)]
        chunk = ["--chunk-bytes", chunk_bytes]
    return ["bench", "--models", model, "--engines", engine, "--time-budget", f"{budget_s:g}",
            "--out", out_dir, *bench_args, *chunk]


# Both handlers only ask the running bench to stop: it does so at its next safe point and
# keeps its records (NOTE [ Stopping on a signal ] in pareprop/bench/stop.py; raising here
# once aborted the process from inside a tensor's destructor).
_terminated = False
_alarm_fired = False


def _on_alarm(signum: int, frame: Any) -> None:
    global _alarm_fired
    _alarm_fired = True
    bench_stop.request_stop()


def _on_term(signum: int, frame: Any) -> None:
    global _terminated
    _terminated = True
    bench_stop.request_stop()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for sweep.json and one folder per engine")
    p.add_argument("--budget", type=float, required=True, metavar="S",
                   help="seconds for the whole sweep, counted from process start")
    p.add_argument("--label", required=True, help="name in the summary, e.g. Rev-ViT-B")
    p.add_argument("--model", required=True, help="the reversible model (pareprop registry)")
    p.add_argument("--baseline", required=True, help="its standard model (timm or pareprop)")
    p.add_argument("--engines", nargs="+", choices=ENGINE_ORDER,
                   help="default: every engine; the *_chunked ones only with --chunk-bytes")
    p.add_argument("--chunk-bytes", metavar="SIZE",
                   help="also run the reversible engines with chunked branches of SIZE "
                   "(pareprop bench --chunk-bytes, e.g. 1GiB)")
    args, rest = p.parse_known_args(list(argv))
    if rest and rest[0] == "--":
        rest = rest[1:]
    for flag in ("--models", "--engines", "--time-budget", "--out", "--chunk-bytes"):
        if flag in rest:
            p.error(f"{flag} is set by gpu_sweep.py; pass it before '--' or not at all")
    if args.budget <= 0:
        p.error(f"expected a positive --budget, got {args.budget:g}")
    if args.chunk_bytes is not None:
        try:  # refused here, not once per chunked engine inside the sweep
            parse_chunking(max_bytes=args.chunk_bytes)
        except ValueError as err:
            p.error(f"--chunk-bytes: {err}")
    if args.engines is None:
        args.engines = [e for e in ENGINE_ORDER
                        if args.chunk_bytes is not None or e not in CHUNKED_ENGINES]
    elif args.chunk_bytes is None and set(args.engines) & set(CHUNKED_ENGINES):
        p.error("the *_chunked engines need --chunk-bytes SIZE")
    args.bench_args = rest
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    global _terminated, _alarm_fired
    args = _parse(sys.argv[1:] if argv is None else argv)
    _terminated = False
    deadline = STARTED + args.budget - WRITE_MARGIN_S - overrun_reserve(args.budget)
    # Baselines first: the order of ENGINE_ORDER, whatever the order on the command line.
    engines = [e for e in ENGINE_ORDER if e in args.engines]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as fh:
        json.dump({"label": args.label, "model": args.model, "baseline": args.baseline,
                   "engines": engines, "budget_s": args.budget,
                   "chunk_bytes": args.chunk_bytes,
                   "bench_args": args.bench_args}, fh, indent=1)

    # Imports and the CUDA context before the first share is set, so plain does not pay them.
    import torch

    from pareprop.cli import main as pareprop_main
    from pareprop.cli.bench import build_parser

    build_parser()  # imports pareprop.bench (and timm) now
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")

    previous = (signal.signal(signal.SIGALRM, _on_alarm),
                signal.signal(signal.SIGTERM, _on_term))  # `timeout`: stop, keep the data
    failed = []
    try:
        for i, engine in enumerate(engines):
            share = engine_share(deadline - time.monotonic(), len(engines) - i)
            if _terminated or share < MIN_SHARE_S:
                print(f"{args.label} {engine}: not started, {share:.0f} s left", flush=True)
                continue
            model = args.baseline if engine in BASELINE_ENGINES else args.model
            argv_ = bench_argv(model, engine, soft_budget(share),
                               os.path.join(args.out, engine), args.bench_args, args.chunk_bytes)
            print(f"== {args.label} {engine}: {share:.0f} s ({' '.join(argv_)})", flush=True)
            t0 = time.monotonic()
            status: Any
            _alarm_fired = False
            try:
                signal.setitimer(signal.ITIMER_REAL, share)
                status = pareprop_main(argv_)
            except Exception as err:  # noqa: BLE001 - the next engine still gets its turn
                status = f"{type(err).__name__}: {err}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if bench_stop.stop_requested():
                # The bench's own SIGTERM handler took a `timeout` during the run.
                _terminated = _terminated or not _alarm_fired
                status = "interrupted" if status in (0, 143) else status
                bench_stop.clear()
            took = time.monotonic() - t0
            print(f"{args.label} {engine}: exit status {status} after {took:.0f} s", flush=True)
            if status not in (0, "interrupted"):
                failed.append(engine)
    finally:
        signal.signal(signal.SIGALRM, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    if failed:
        print(f"{args.label}: bench failed for {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
