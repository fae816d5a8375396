"""Reconstruction drift and gradient error of each engine under low-precision autocast.

Measures one training step of a Rev-ViT at the given depth with ``pareprop.drift_report`` and
prints the gradient error of every engine against a float32 autograd reference, the ratio of
the reversible engines' error to autograd's, and the worst rebuilt-input error.

    python benchmarks/drift.py --depth 24 --amp bf16 --out runs/drift
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import pareprop

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="rev_vit_small_patch16_224")
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--amp", choices=sorted(AMP), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seeds", type=int, default=3, help="repeat with this many seeds")
    parser.add_argument("--out", default=None, help="folder for drift.json and drift.png")
    args = parser.parse_args()

    ratios = []
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model = pareprop.create_model(
            args.model, depth=args.depth, img_size=args.img_size, num_classes=10
        ).to(args.device)
        x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=args.device)
        report = pareprop.drift_report(model, x, amp_dtype=AMP[args.amp], seed=seed)
        print(f"seed {seed}: {args.model} depth {args.depth} on {args.device}")
        print(report.table())
        ratios.append(report.ratios())
        if args.out and seed == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "drift.json"), "w") as fh:
                json.dump(report.to_dict(), fh, indent=1)
            report.plot(os.path.join(args.out, "drift.png"))
    for engine in ratios[0]:
        values = sorted(r[engine] for r in ratios)
        print(f"{engine}/autograd gradient error ratio over {len(values)} seeds: "
              f"median {values[len(values) // 2]:.3f}, max {values[-1]:.3f}")


if __name__ == "__main__":
    main()
