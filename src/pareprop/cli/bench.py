"""``pareprop bench``: step time and memory of every engine, against standard models.

With no options it runs a small CPU-sized sweep (a Rev-ViT-Ti stack at depths 4, 12, 24 and
batches 4 and 16 with the three engines and the same blocks checkpointed, sized so that
activations dominate the step's memory) that shows the claim in about two minutes, then one
training step of a tiny reversible Mask R-CNN (its time, peak split and plan:
``pareprop.bench.detection``; ``--no-detector`` skips it); every option overrides one part of
that sweep.
See docs/benchmarks.md.

Examples::

    pareprop bench
    pareprop bench --models rev_vit_base_patch16_224 vit_base_patch16_224 \\
        --engines autograd reversible pareprop plain checkpointed \\
        --batch-sizes 32 64 128 256 --amp bf16 --out runs/bench-vit
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, List, Optional, Sequence

import torch

from pareprop import bench, catalog
from pareprop.bench import ALL_ENGINES, AMP_MODES, default_config, stop
from pareprop.bench.detection import bench_detector, format_detector_table
from pareprop.bench.plots import plot_drift
from pareprop.cli.options import (
    Parser,
    device,
    fraction,
    non_negative_int,
    output_folder,
    positive_int,
    refuse_detectors,
)
from pareprop.engine import ENGINES
from pareprop.memory.drift import drift_report

__all__ = ["main", "build_parser"]


def _split(values: Optional[Sequence[str]]) -> Optional[List[str]]:
    # Accept both "--models a b" and "--models a,b".
    if values is None:
        return None
    return [v for item in values for v in item.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pareprop bench",
        description="Measure training-step time and memory of every engine (autograd, "
        "reversible, pareprop), of the same reversible model checkpointed (checkpointed) and "
        "of standard timm baselines (plain, checkpointed). With no options: a small CPU sweep "
        "of a Rev-ViT-Ti stack at depths 4, 12, 24, batches 4 and 16, 128 px, with "
        "autograd, reversible, pareprop and checkpointed.",
    )
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help="pareprop registry names (rev_vit_small_patch16_224, text_encoder_base, "
                   "...) and timm names for baselines (vit_base_patch16_224, mvitv2_base, ...)")
    p.add_argument("--engines", nargs="+", metavar="ENGINE",
                   help=f"any of {', '.join(ALL_ENGINES)}; each model runs those that apply "
                   "(plain: models without a reversible stack; checkpointed: their blocks "
                   "under torch.utils.checkpoint, or a reversible model's under autograd)")
    p.add_argument("--memory-budgets", nargs="+", type=fraction, metavar="F",
                   help="memory budgets from 0 (every block recomputed) to 1 (every block "
                   "stored) for the reversible engines, each chosen on the benchmarked batch")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, metavar="N")
    p.add_argument("--depths", nargs="+", type=positive_int, metavar="N",
                   help="total number of blocks (staged models change their deepest stage)")
    p.add_argument("--img-size", type=positive_int, metavar="PX", help="input side for images")
    p.add_argument("--num-frames", type=positive_int, metavar="T",
                   help="frames per clip of video models (rev_mvit_base_16x4, mvit_v1_b)")
    p.add_argument("--seq-len", nargs="+", type=positive_int, metavar="T",
                   help="sequence lengths for text models")
    p.add_argument("--device", type=device,
                   help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--amp", choices=AMP_MODES, help="autocast dtype (default: none)")
    p.add_argument("--warmup", type=non_negative_int, help="untimed steps (default 1)")
    p.add_argument("--iters", type=positive_int, help="timed steps (default 3)")
    p.add_argument("--num-classes", type=positive_int, help="classifier width (default 10)")
    p.add_argument("--out", default="bench_results", metavar="DIR", type=output_folder,
                   help="where results.json, results.csv and the plots go (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="CPU threads per measurement (default: torch's; the default sweep: 1)")
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="start no configuration after S seconds (the rest: status skipped)")
    p.add_argument("--no-grad-check", action="store_true",
                   help="skip the gradient comparison against autograd")
    p.add_argument("--no-activation-bytes", action="store_true",
                   help="skip the activation_bytes measurement (one extra forward each)")
    p.add_argument("--no-plan", action="store_true",
                   help="skip planned_peak_bytes (pareprop.plan_memory of each configuration)")
    p.add_argument("--isolate", action="store_true",
                   help="measure every configuration in a fresh subprocess")
    p.add_argument("--keep-going-after-oom", action="store_true",
                   help="still try larger batches of a model/engine after an out-of-memory")
    p.add_argument("--compile", action="store_true",
                   help="compiled F and G (pareprop.compile_blocks) for reversible models; "
                   "compiled during the warm-up steps")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="reversible models: their non-reversible blocks (MViTv2 transitions, "
                   "Swin merging and fusion) under activation checkpointing")
    p.add_argument("--chunk-bytes", metavar="SIZE",
                   help="reversible engines: rebuild and differentiate each block's branches in "
                   "chunks whose graphs save at most SIZE bytes (256MiB...; default: whole)")
    p.add_argument("--no-detector", action="store_true",
                   help="the default sweep: skip its detector step (a tiny Mask R-CNN)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--drift", action="store_true",
                   help="reconstruction-drift report per block (pareprop.drift_report)")
    return p


def _config(args: argparse.Namespace):
    config = default_config()
    config.device = None  # the default sweep too runs on the GPU when there is one
    if args.models is not None:
        config.models = _split(args.models)
        # Another model's depth and size are its own unless asked for.
        config.depths, config.img_size = (None,), None
        config.chunked_variant = None  # the default sweep's reversible_chunked, too
    if args.engines is not None:
        config.engines = _split(args.engines)
    if args.memory_budgets is not None:
        config.memory_budgets = args.memory_budgets
    if args.batch_sizes is not None:
        config.batch_sizes = args.batch_sizes
    if args.depths is not None:
        config.depths = args.depths
    if args.img_size is not None:
        config.img_size = args.img_size
    if args.num_frames is not None:
        config.model_overrides = {**config.model_overrides, "num_frames": args.num_frames}
    if args.seq_len is not None:
        config.seq_lens = args.seq_len
    if args.time_budget is not None:
        config.time_budget_s = args.time_budget
    for name in ("device", "amp", "warmup", "iters", "num_classes", "threads"):
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    config.grad_check = not args.no_grad_check
    config.activation = not args.no_activation_bytes
    config.plan = not args.no_plan
    config.isolate = True if args.isolate else None
    config.stop_after_oom = not args.keep_going_after_oom
    config.progress = not args.quiet
    config.compile = args.compile
    config.grad_checkpointing = args.grad_checkpointing
    config.chunk_bytes = args.chunk_bytes
    return config


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:  # argparse already printed the message
        return int(exit_.code or 0)

    config = _config(args)
    try:
        refuse_detectors(config.models, "bench")
        config.validate()
        if args.drift:
            return _drift(config, args.out)
        bench.sweep_jobs(config)  # raises for a model that none of the engines applies to
    except ValueError as err:
        print(f"pareprop bench: error: {err}", file=sys.stderr)
        return 2

    device = config.resolved_device()
    print(f"pareprop bench: {len(config.models)} model(s), engines {', '.join(config.engines)}, "
          f"batch sizes {list(config.batch_sizes)}, depths {list(config.depths)}, "
          f"device {device}, amp {config.amp}, warmup {config.warmup}, iters {config.iters}",
          flush=True)
    os.makedirs(args.out, exist_ok=True)
    # Records also stream to results.jsonl, so a run killed from outside still leaves its data.
    stream = open(os.path.join(args.out, "results.jsonl"), "w")

    def keep(record: dict) -> None:
        stream.write(json.dumps(bench.jsonable(record)) + "\n")
        stream.flush()

    # `timeout` ends us with SIGTERM: stop at the next safe point and keep the records
    # (NOTE [ Stopping on a signal ] in pareprop/bench/stop.py).
    stop.clear()
    previous = signal.signal(signal.SIGTERM, stop.request_stop)
    try:
        records = bench.run_bench(config, on_record=keep)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stream.close()
    # run_bench records every configuration it reaches, skipped or not: fewer records than
    # configurations means a signal or Ctrl-C stopped it (NOTE [ Stopping on a signal ]).
    planned = len(bench.sweep_jobs(config))
    interrupted = len(records) < planned
    paths = bench.write_results(records, args.out)
    print()
    print(bench.format_table(records))
    ratios = bench.format_ratios(records)
    if ratios:
        print("\nratios in this run (time: lower is faster; memory: how many times less)")
        print(ratios)
    headline = bench.format_headline(records)
    if headline and not interrupted:
        print("\n" + headline + "  (peak: the whole step; largest batch: planned)")
    if args.models is None and not args.no_detector and not interrupted:
        _detector(config, args.out)
    print(f"\nwrote {paths['json']}, {paths['csv']} and {len(paths['plots'])} plot(s) in "
          f"{args.out}")
    if interrupted:
        print(f"pareprop bench: interrupted after {len(records)} of {planned} configurations; "
              "the tables cover only those (no headline)", file=sys.stderr)
        # 128 + the signal, as a shell reports it: SIGTERM/SIGALRM asked to stop, else Ctrl-C.
        return 143 if stop.stop_requested() else 130
    failed = [r for r in records if r["status"] not in ("ok", "oom")]
    if failed:
        print(f"pareprop bench: {len(failed)} configuration(s) failed; see the status column",
              file=sys.stderr)
    return 1 if failed and len(failed) == len(records) else 0


def _detector(config: Any, out_dir: str) -> None:
    """The default sweep's detector step on the CPU (pareprop/bench/detection.py)."""
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        records = bench_detector(plan=config.plan)
    finally:
        torch.set_num_threads(threads)
    print("\ndetector step (CPU, a tiny Mask R-CNN on 64x64 images; peak counted on a real "
          "step, split at the peak)")
    print(format_detector_table(records))
    with open(os.path.join(out_dir, "detector.json"), "w") as fh:
        json.dump(records, fh, indent=1)


# NOTE [ --drift ]
#     ``pareprop.drift_report`` measures, for one step under autocast, how far each reversible
#     block's rebuilt inputs and every gradient are from a float32 reference. ``--drift`` runs it
#     per model and depth instead of the timing sweep, writes drift.json and plots error
#     against depth.
def _drift(config: Any, out_dir: str) -> int:
    device = torch.device(config.resolved_device())
    # Drift is a low-precision effect: without --amp, measure under bf16 autocast.
    amp_dtype = torch.float16 if config.amp == "fp16" else torch.bfloat16
    engines = [e for e in config.engines if e in ENGINES] or list(ENGINES)
    if "autograd" not in engines:  # the ratio to autograd under the same autocast is the point
        engines.insert(0, "autograd")
    rows = []
    for name in config.models:
        facts = catalog.model_facts(name)
        if not facts.reversible:
            print(f"pareprop bench: --drift skips {name} (no reversible stack)", file=sys.stderr)
            continue
        for job in bench.sweep_jobs(config):
            if job.model != name or job.engine != engines[0] or job.batch_size != min(
                config.batch_sizes
            ):
                continue
            torch.manual_seed(config.seed)
            request = job.request()
            model = catalog.build_model(request, facts).to(device).train()
            inputs = catalog.example_inputs(model, request, job.batch_size, device, facts)
            report = drift_report(model, inputs, amp_dtype=amp_dtype, engines=engines,
                                  seed=config.seed)
            depth = job.depth if job.depth is not None else catalog.model_depth(model)
            rows.append({"model": name, "depth": depth, "batch_size": job.batch_size,
                         "device": str(device), **report.to_dict(), "ratios": report.ratios()})
            errs = ", ".join(f"{e} {v:.2e}" for e, v in report.grad_error.items())
            ratios = ", ".join(f"{e}/autograd {v:.2f}" for e, v in report.ratios().items())
            print(f"{name} depth {depth}: gradient error vs {report.reference_dtype}: {errs}"
                  f" ({ratios})", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "drift.json")
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1, default=str)
    plots = plot_drift(rows, out_dir) if rows else []
    print(f"wrote {path}" + (f" and {len(plots)} plot(s)" if plots else ""))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
