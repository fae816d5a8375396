"""Activation bytes kept for backward against depth, for Rev-ViT and Rev-MViTv2, per engine.

Counts, with ``pareprop.activation_bytes``, the tensors autograd keeps alive after one
training-mode forward (parameters excluded). Under the reversible engines a stack keeps only
its outputs, so Rev-ViT's bytes stay flat as depth grows; Rev-MViTv2 still grows with its
non-reversible stage transitions, which this script keeps fixed while the middle stack grows.

Usage:
    python benchmarks/activation_memory.py                       # CPU, float32, batch 8
    python benchmarks/activation_memory.py --device cuda --batch-size 32 --depths 4 8 16 32
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence, Tuple

import torch

import pareprop


def _vit(depth: int) -> Tuple[str, Dict]:
    # CIFAR-scale Rev-ViT: 32x32 input, 4x4 patches, 192 wide.
    return "rev_vit_tiny_patch4_32", dict(depth=depth)


def _mvit(depth: int) -> Tuple[str, Dict]:
    # CIFAR-scale Rev-MViTv2 with its middle stack grown: stacks of 1 and depth - 3 blocks
    # behind two fixed transitions (depth 4 is the SPEC CIFAR layout).
    return "rev_mvitv2_tiny_32", dict(depth=depth, last_block_indexes=(0, depth - 2))


FAMILIES = {"rev_vit": _vit, "rev_mvitv2": _mvit}


def measure(
    families: Sequence[str],
    depths: Sequence[int],
    batch_size: int,
    device: str,
    dtype: torch.dtype,
) -> List[Dict]:
    rows = []
    for family in families:
        for depth in depths:
            name, overrides = FAMILIES[family](depth)
            torch.manual_seed(0)
            model = pareprop.create_model(name, **overrides).to(device, dtype).train()
            inputs = model.example_inputs(batch_size, device=device, dtype=dtype)
            row = {
                "family": family,
                "depth": depth,
                "params": sum(p.numel() for p in model.parameters()),
            }
            for engine in pareprop.ENGINES:
                model.set_engine(engine)
                row[engine] = pareprop.activation_bytes(model, *inputs)
            rows.append(row)
    return rows


def format_table(rows: List[Dict]) -> str:
    mib = 2.0**20
    head = f"{'model':<11} {'depth':>5} " + " ".join(f"{e + ' MiB':>15}" for e in pareprop.ENGINES)
    head += f" {'autograd/reversible':>20}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{r[e] / mib:>15.2f}" for e in pareprop.ENGINES)
        ratio = r["autograd"] / max(r["reversible"], 1)
        lines.append(f"{r['family']:<11} {r['depth']:>5} {cells} {ratio:>19.1f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--depths", nargs="+", type=int, default=[4, 8, 16, 32])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)
    if min(args.depths) < 4:
        parser.error(
            "expected depths >= 4 (Rev-MViTv2 needs a stack behind two transitions), "
            f"got {args.depths}"
        )
    rows = measure(
        args.families, args.depths, args.batch_size, args.device, getattr(torch, args.dtype)
    )
    print(
        f"activation bytes kept for backward, batch {args.batch_size}, {args.dtype}, "
        f"{args.device} (pareprop.activation_bytes)"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
