"""``pareprop demo``: every engine on a small reversible stack, checked against autograd.

Builds a small transformer-like reversible stack, runs a few training steps with each engine
from the same seed, and prints how far each engine's gradients are from autograd's and how
many bytes each keeps for backward at two depths.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp

import pareprop
from pareprop.engine.testing import engine_errors, worst_error


class DemoBlock(pareprop.ReversibleBlock):
    """F: LayerNorm + self-attention; G: LayerNorm + MLP; both with drop-path."""

    def __init__(self, dim: int, heads: int, drop_path: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)
        self.drop_path = DropPath(drop_path)

    def f(self, x, **kwargs):
        x = self.norm1(x)
        return self.drop_path(self.attn(x, x, x, need_weights=False)[0])

    def g(self, x, **kwargs):
        return self.drop_path(self.mlp(self.norm2(x)))


class DemoModel(nn.Module):
    def __init__(self, depth: int, dim: int = 64, heads: int = 4, classes: int = 10):
        super().__init__()
        blocks = [DemoBlock(dim, heads, drop_path=0.1) for _ in range(depth)]
        self.stack = pareprop.ReversibleStack(blocks)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, x):  # (B, N, C)
        y1, y2 = self.stack(x, x)
        return self.head(torch.cat([y1, y2], dim=-1).mean(dim=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pareprop demo", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=6, help="blocks in the stack (default 6)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sample (default 32)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    if min(args.depth, args.tokens, args.batch_size) < 1:
        parser.error("--depth, --tokens and --batch-size must be positive")

    torch.manual_seed(0)
    x = torch.randn(args.batch_size, args.tokens, 64, dtype=torch.float64)
    model = DemoModel(args.depth).double()
    report = engine_errors(model, x)  # the reversible engines
    print(f"gradient agreement with autograd (float64, depth {args.depth}, drop-path on):")
    for engine, errors in report.items():
        key, err = max(errors.items(), key=lambda kv: kv[1])
        print(f"  {engine:<10} worst relative error {err:.2e} ({key}, {len(errors)} tensors)")

    print("bytes kept for backward (float32):")
    x32 = x.float()
    print(f"  {'engine':<10} {'depth 2':>12} {f'depth {4 * args.depth}':>12}")
    for engine in pareprop.ENGINES:
        row = []
        for depth in (2, 4 * args.depth):
            m = DemoModel(depth)
            pareprop.set_engine(m, engine)
            row.append(pareprop.activation_bytes(m, x32))
        print(f"  {engine:<10} {row[0]:>12,} {row[1]:>12,}")
    return 0 if worst_error(report)[2] < 1e-8 else 1
