"""A real CPU training step's peak against its plan, for the video models, side by side.

    PYTHONPATH=src python benchmarks/video_real_step.py [--num-frames 8] [--img-size 64]
        [--batch-size 4] [--threads 2] [--out DIR]

Rev-MViT-B 16x4 (full width and depth; reversible engine, transitions checkpointed) and
torchvision's ``mvit_v1_b`` (every block checkpointed) at a small clip size: one real step
(forward, cross-entropy, backward, AdamW) measured by ``pareprop.memory_report`` (pareprop's
StepPeakTracker on real tensors, not RSS) against ``pareprop.plan_memory`` of the same
configuration (FakeTensorMode, nothing allocated). Prints every field of both reports and
their difference; writes results.json under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, List

import torch

from pareprop.catalog import ModelRequest, build_model, example_inputs
from pareprop.memory import BYTE_FIELDS, memory_report, plan_memory

# name: (engine, grad_checkpointing): the modes compared on the CPU.
CASES = {
    "rev_mvit_base_16x4": ("reversible", True),
    "mvit_v1_b": ("checkpointed", False),
}
FIELDS = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "transient",
          "peak")


def compare(name: str, engine: str, grad_checkpointing: bool, batch_size: int,
            num_frames: int, img_size: int) -> Dict[str, Any]:
    """Plan and real step of one model; the two reports and the wall times."""
    sizes = dict(num_frames=num_frames, img_size=img_size)
    start = time.perf_counter()
    plan = plan_memory(name, batch_size, engine, device="cpu",
                       grad_checkpointing=grad_checkpointing, **sizes)
    planned_s = time.perf_counter() - start
    request = ModelRequest(model=name, engine=engine, img_size=img_size,
                           grad_checkpointing=grad_checkpointing,
                           overrides=dict(num_frames=num_frames))
    torch.manual_seed(0)
    model = build_model(request)
    inputs = example_inputs(model, request, batch_size)
    start = time.perf_counter()
    real = memory_report(model, inputs, engine=engine)
    real_s = time.perf_counter() - start
    return {"model": name, "engine": engine, "grad_checkpointing": grad_checkpointing,
            "batch_size": batch_size, "num_frames": num_frames, "img_size": img_size,
            "plan": plan.to_dict(), "real": real.to_dict(),
            "plan_s": round(planned_s, 1), "real_s": round(real_s, 1)}


def _table(rows: List[Dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        mode = r["engine"] + ("+ckpt" if r["grad_checkpointing"] else "")
        lines.append(f"{r['model']} / {mode} / batch {r['batch_size']} / "
                     f"{r['num_frames']}x{r['img_size']}x{r['img_size']} "
                     f"(plan {r['plan_s']} s, real step {r['real_s']} s)")
        lines.append(f"  {'MiB':<16} {'planned':>10} {'real':>10} {'diff':>8}")
        for f in FIELDS:
            p, q = r["plan"][f], r["real"][f]
            diff = (p - q) / q * 100 if q else 0.0
            lines.append(f"  {f:<16} {p / 2**20:>10.2f} {q / 2**20:>10.2f} {diff:>+7.2f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--num-frames", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [compare(name, *CASES[name], args.batch_size, args.num_frames, args.img_size)
            for name in args.models]
    print(_table(rows))
    worst = max(abs(r["plan"]["peak"] - r["real"]["peak"]) / r["real"]["peak"] for r in rows)
    print(f"largest peak difference: {worst * 100:.2f}% (target: within 5%)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump({"fields": list(BYTE_FIELDS), "torch": torch.__version__, "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
