"""``pareprop plan``: the peak memory of a training step, predicted, and the largest batch.

Nothing is allocated: the step runs on fake tensors (see :func:`pareprop.plan_memory`), so a
CPU plans GPU sizes in seconds per configuration.

Examples::

    pareprop plan --models rev_vit_base_patch16_224 vit_base_patch16_224 \\
        --engines reversible autograd plain checkpointed --amp bf16 --memory 80GiB
    pareprop plan --models rev_swin_tiny --engines reversible --batch-sizes 64 128 256
    pareprop plan --models rev_vit_base_patch16_224 --engines reversible autograd \\
        --memory-budgets 0 0.5 1 --amp bf16 --memory 80GiB
    pareprop plan --models rev_vit_base_patch16_224 vit_base_patch16_224 \\
        --engines reversible checkpointed --amp bf16 --memory 80GiB --chunk-bytes auto
    pareprop plan --models rev_mvit_base_16x4 mvit_v1_b --engines reversible plain \\
        checkpointed --amp bf16 --memory 80GiB --grad-checkpointing
    pareprop plan --models converted:vit_base_patch16_224 vit_base_patch16_224 \\
        --engines reversible checkpointed --amp bf16 --memory 80GiB --chunk-bytes 1GiB
    pareprop plan --models converted:vit_base_patch16_224 --engines reversible \\
        --coupling 0.5 0.5 --amp bf16 --batch-sizes 64
    pareprop plan --models maskrcnn:detectron2:vitdet_b --engines reversible checkpointed \\
        plain --amp bf16 --memory 80GiB --chunk-bytes 1GiB --img-size 1024x1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from pareprop.bench.plots import plot_plan
from pareprop.catalog import ALL_ENGINES, REVERSIBLE_ENGINES, is_converted
from pareprop.cli.bench import _split
from pareprop.cli.options import (
    CouplingPair,
    Parser,
    fraction,
    output_folder,
    positive_int,
)
from pareprop.memory import parse_memory
from pareprop.memory.step import AMP_MODES
from pareprop.memory.sweep import format_plan, plan_sweep

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pareprop plan",
        description="Predict the peak memory of one training step (forward, loss, backward, "
        "AdamW) per model, engine and batch without allocating it, and with --memory the "
        "largest batch that fits.",
    )
    p.add_argument("--models", nargs="+", required=True, metavar="NAME",
                   help="pareprop registry names, timm names, torchvision's video MViTs "
                   "mvit_v1_b, mvit_v2_s and 2-D Swins swin_t ... swin_v2_b (baselines), and "
                   "converted:SOURCE (timm's or torchvision's SOURCE converted by "
                   "pareprop.convert, at coupling (0, 1) unless --coupling says otherwise)")
    p.add_argument("--engines", nargs="+", default=list(ALL_ENGINES), metavar="ENGINE",
                   help=f"any of {', '.join(ALL_ENGINES)} (default: all; each model plans those "
                   "that apply)")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[], metavar="N")
    p.add_argument("--amp", choices=AMP_MODES, default="none")
    p.add_argument("--img-size", type=_image_size, metavar="PX|HxW",
                   help="input side of image models; detectors (ARCH:BACKBONE) also take "
                   "HxW, e.g. 1024x1024 (their default)")
    p.add_argument("--num-frames", type=positive_int, metavar="T",
                   help="frames per clip of video models (rev_mvit_base_16x4, mvit_v1_b)")
    p.add_argument("--depth", type=positive_int, metavar="N", help="total number of blocks")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory to fit in: 80GiB, 80GB or 8e10 (bytes); adds the largest batch")
    p.add_argument("--memory-budgets", nargs="+", type=fraction, default=[None],
                   metavar="F", help="memory budgets from 0 (every block recomputed) to 1 "
                   "(every block stored) for the reversible engines: what each one gives")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="reversible models: run their non-reversible blocks (MViTv2 "
                   "transitions, Swin merging and fusion) under activation checkpointing")
    p.add_argument("--memory-light", action="store_true",
                   help="detectors (ARCH:detectron2:NAME): run the pyramid and the R-CNN heads "
                   "under activation checkpointing, only their outputs kept for backward")
    p.add_argument("--chunk-bytes", metavar="SIZE|auto",
                   help="reversible engines: rebuild and differentiate each block's branches in "
                   "chunks of at most SIZE saved bytes (256MiB...), or 'auto': the size whose "
                   "plan has the lowest peak; with --memory, chosen near the largest batch and "
                   "held through its search (default: whole branches)")
    p.add_argument("--coupling", nargs=2, action=CouplingPair, metavar=("ALPHA", "BETA"),
                   help="converted models (converted:SOURCE, converted_vit...): plan them at "
                   "the coupling z' = ALPHA z + BETA z_prev + H(z) (docs/convert.md): (1, 0) is "
                   "the pretrained network, whose every block is stored (beta = 0 cannot be "
                   "inverted), so its plan is the source's under autograd; (0, 1), the default "
                   "of converted:SOURCE, is reversible; any beta > 0 plans every block "
                   "rebuilt. Other models are planned as they are; refused when --models has no "
                   "converted model")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="device planned for (default: %(default)s)")
    p.add_argument("--out", default="plan_results", metavar="DIR", type=output_folder,
                   help="where plan.json and plan.png go (default: %(default)s)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)

    try:
        memory = parse_memory(args.memory) if args.memory is not None else None
        if not args.batch_sizes and memory is None:
            raise ValueError("expected --batch-sizes, --memory or both")
        budgets = [b for b in args.memory_budgets if b is not None]
        if budgets and not set(_split(args.engines)) & set(REVERSIBLE_ENGINES):
            raise ValueError(
                f"--memory-budgets {' '.join(map(str, budgets))} choose blocks for the "
                f"reversible engines to store, and --engines {' '.join(_split(args.engines))} "
                "has none: add reversible or pareprop, or drop --memory-budgets"
            )
        _check_coupling(args)
        extra = {} if args.depth is None else {"depth": args.depth}
        if args.num_frames is not None:
            extra["num_frames"] = args.num_frames
        if args.memory_light:
            extra["memory_light"] = True
        plan = plan_sweep(_split(args.models), _split(args.engines), args.batch_sizes,
                          amp=args.amp, img_size=args.img_size, memory_bytes=memory,
                          device=args.device, memory_budgets=args.memory_budgets,
                          grad_checkpointing=args.grad_checkpointing,
                          chunk_bytes=args.chunk_bytes, coupling=args.coupling, **extra)
    except ValueError as err:
        print(f"pareprop plan: error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "plan.json")
    with open(path, "w") as fh:
        json.dump(plan, fh, indent=1)
    png = plot_plan(plan, os.path.join(args.out, "plan.png"))
    print(f"\nwrote {path} and {png}")
    return 0


def _image_size(text: str):
    """``PX`` -> int; ``HxW`` -> (H, W)."""
    parts = text.lower().split("x")
    if len(parts) in (1, 2) and all(p.isdigit() and int(p) > 0 for p in parts):
        return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    raise argparse.ArgumentTypeError(f"expected a positive size PX or HxW, got {text!r}")


def _check_coupling(args: argparse.Namespace) -> None:
    if args.coupling is None:
        return
    pair = " ".join(f"{c:g}" for c in args.coupling)
    models = _split(args.models)
    if not any(is_converted(name) for name in models):
        raise ValueError(
            f"--coupling {pair} sets the coupling of converted models, and --models "
            f"{' '.join(models)} has none: add a converted:SOURCE name, or drop --coupling"
        )
    budgets = [b for b in args.memory_budgets if b is not None]
    if budgets and args.coupling[1] == 0.0:
        raise ValueError(
            f"--coupling {pair} stores every block of a converted model (beta = 0 cannot be "
            "inverted), so --memory-budgets has no block to choose: give beta > 0, or drop "
            "--memory-budgets"
        )


if __name__ == "__main__":
    sys.exit(main())
