"""Time against activation memory: pareprop's memory budget beside torch's checkpointing.

    python benchmarks/memory_budget.py [--depth 24] [--batch-size 16] [--img-size 64]
        [--rounds 11] [--budgets 0 0.25 0.5 0.75 1] [--every 1 2 3 4 6] [--out DIR]

Rev-ViT-S at the given depth under budgets from 0 (every block recomputed) to 1 (every block
stored), and its autograd engine; timm's ViT-S at the same depth plain, with every k-th block
under torch.utils.checkpoint, and with torch's selective activation checkpointing on every
block (matrix products and attention saved, the rest recomputed). Each configuration runs full
training steps (forward, cross-entropy, backward, AdamW). Configurations take turns, one step
each per round, so machine load falls on all of them alike; medians over the rounds. The
activation memory of each is what torch's MemTracker counts as activations alive after forward.
Writes results.json and time_vs_memory.png to --out and prints the table and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import pareprop


class Switchable(nn.Module):
    """A timm block run plainly, under checkpoint, or under selective checkpointing."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.mode = "plain"

    def forward(self, x):
        if self.mode == "plain" or not torch.is_grad_enabled():
            return self.block(x)
        context = _sac_context if self.mode == "selective" else checkpoint.noop_context_fn
        return checkpoint.checkpoint(self.block, x, use_reentrant=False, context_fn=context)


_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def _save_matmuls(ctx, op, *args, **kwargs):
    policy = checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in _SAVED_OPS else policy.PREFER_RECOMPUTE


def _sac_context():
    return checkpoint.create_selective_checkpoint_contexts(_save_matmuls)


def activation_mib(model: nn.Module, x: torch.Tensor) -> float:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model(x)
        snapshot = tracker.get_tracker_snapshot("current")[x.device]
    del out
    return next(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation") / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1])
    parser.add_argument("--every", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench_results/memory_budget")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import timm

    rev = pareprop.create_model("rev_vit_small_patch16_224", img_size=args.img_size,
                                depth=args.depth, engine="reversible")
    std = timm.create_model("vit_small_patch16_224", img_size=args.img_size, depth=args.depth)
    std.blocks = nn.Sequential(*[Switchable(b) for b in std.blocks])
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    configs: Dict[str, Callable[[], nn.Module]] = {}

    def rev_config(engine: str, stored: Dict[str, tuple]) -> Callable[[], nn.Module]:
        def apply():
            for name, stack in rev.named_modules():
                if isinstance(stack, pareprop.ReversibleStack):
                    stack.set_engine(engine).store_blocks(stored.get(name, ()))
            return rev
        return apply

    configs["rev autograd"] = rev_config("autograd", {})
    plans = {}
    for budget in args.budgets:
        plan = pareprop.set_memory_budget(rev, budget, x, engine="reversible")
        plans[budget] = plan
        engine = next(iter(plan.engines.values()))
        configs[f"rev budget {budget:g}"] = rev_config(engine, dict(plan.stored))

    def std_config(every: int, mode: str) -> Callable[[], nn.Module]:
        def apply():
            for i, block in enumerate(std.blocks):
                block.mode = mode if every and i % every == 0 else "plain"
            return std
        return apply

    configs["timm plain"] = std_config(0, "plain")
    for k in args.every:
        configs[f"timm checkpoint every {k}"] = std_config(k, "checkpoint")
    configs["timm selective"] = std_config(1, "selective")

    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (rev, std)}
    memory = {name: activation_mib(apply().train(), x) for name, apply in configs.items()}

    def step(model: nn.Module) -> float:
        opt = optimizers[id(model)]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), target).backward()
        opt.step()
        return time.perf_counter() - start

    times: Dict[str, List[float]] = {name: [] for name in configs}
    for round_ in range(args.warmup + args.rounds):
        for name, apply in configs.items():
            took = step(apply().train())
            if round_ >= args.warmup:
                times[name].append(took * 1e3)
        print(f"round {round_ + 1}/{args.warmup + args.rounds} done", flush=True)

    rows = []
    for name in configs:
        family_ref = "rev autograd" if name.startswith("rev") else "timm plain"
        median = statistics.median(times[name])
        rows.append(dict(config=name, activation_mib=memory[name], step_ms=median,
                         step_ms_min=min(times[name]), times_ms=times[name],
                         vs_own_autograd=median / statistics.median(times[family_ref]),
                         vs_own_autograd_min=min(times[name]) / min(times[family_ref])))
    print(_table(rows))
    print(_targets(rows, args.budgets))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(dict(args=vars(args), rows=rows,
                       plans={str(b): p.to_dict() for b, p in plans.items()}), fh, indent=1,
                  default=str)
    _plot(rows, os.path.join(args.out, "time_vs_memory.png"), args)
    print(f"wrote {args.out}/results.json and time_vs_memory.png")
    return 0


def _table(rows) -> str:
    lines = [f"{'config':<28}{'act MiB':>10}{'step ms':>10}{'min ms':>10}{'/ own autograd':>16}"
             f"{'(min)':>8}"]
    for r in rows:
        lines.append(f"{r['config']:<28}{r['activation_mib']:>10.1f}{r['step_ms']:>10.1f}"
                     f"{r['step_ms_min']:>10.1f}{r['vs_own_autograd']:>16.3f}"
                     f"{r['vs_own_autograd_min']:>8.3f}")
    return "\n".join(lines)


def _interpolate(points, mib):
    """Relative step time of the checkpointed curve at ``mib`` (linear between its points)."""
    points = sorted(points)
    if mib <= points[0][0]:
        return points[0][1]
    for (m0, t0), (m1, t1) in zip(points, points[1:]):
        if m0 <= mib <= m1:
            return t0 + (t1 - t0) * (mib - m0) / (m1 - m0) if m1 > m0 else min(t0, t1)
    return points[-1][1]


def _targets(rows, budgets) -> str:
    by = {r["config"]: r for r in rows}
    curve = [(r["activation_mib"], r["vs_own_autograd"]) for r in rows
             if r["config"].startswith("timm") and r["config"] != "timm plain"]
    curve.append((by["timm plain"]["activation_mib"], 1.0))
    lines = ["targets (step time relative to the same family's plain autograd):"]
    if 1 in budgets:
        t = by["rev budget 1"]["vs_own_autograd"]
        lines.append(f"  budget 1: {t:.3f}x autograd (target <= 1.03): "
                     f"{'met' if t <= 1.03 else 'missed'}")
    if 0.5 in budgets:
        t = by["rev budget 0.5"]["vs_own_autograd"]
        lines.append(f"  budget 0.5: {t:.3f}x autograd (target <= 1.20): "
                     f"{'met' if t <= 1.20 else 'missed'}")
    for b in budgets:
        r = by[f"rev budget {b:g}"]
        ref = _interpolate(curve, r["activation_mib"])
        verdict = "met" if r["vs_own_autograd"] <= ref else "missed"
        lines.append(f"  budget {b:g}: {r['vs_own_autograd']:.3f}x at {r['activation_mib']:.1f} "
                     f"MiB; checkpointed timm at that memory {ref:.3f}x: {verdict}")
    return "\n".join(lines)


def _plot(rows, path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = {
        "Rev-ViT-S, memory budget 0..1": [r for r in rows if r["config"].startswith("rev budget")],
        "timm ViT-S, checkpoint every k-th block": [
            r for r in rows if r["config"].startswith("timm checkpoint")
        ],
    }
    for label, group in groups.items():
        group = sorted(group, key=lambda r: r["activation_mib"])
        ax.plot([r["activation_mib"] for r in group], [r["vs_own_autograd"] for r in group],
                marker="o", label=label)
        for r in group:
            ax.annotate(r["config"].split()[-1], (r["activation_mib"], r["vs_own_autograd"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    for name, marker in (("timm selective", "s"), ("timm plain", "^"), ("rev autograd", "v")):
        r = next(r for r in rows if r["config"] == name)
        ax.scatter([r["activation_mib"]], [r["vs_own_autograd"]], marker=marker, label=name,
                   zorder=3)
    ax.set_xlabel("activation memory after forward (MiB)")
    ax.set_ylabel("step time / the same model's plain autograd")
    ax.set_title(f"depth {args.depth}, batch {args.batch_size}, {args.img_size} px, CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
