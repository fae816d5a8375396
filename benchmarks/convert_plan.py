"""Planned largest training batch of a converted model at the reversible coupling, against its
source checkpointed with timm's ``set_grad_checkpointing()``.

Both planned by ``pareprop.largest_batch`` (fake tensors, AdamW, CUDA's foreach path; planned,
not run): the converted model at (alpha, beta) = (0, 1) on the reversible engine, without the
precision guard (fake tensors have no values to measure), branches and checkpointed
transitions in chunks of ``--chunk-bytes``, stem and transitions checkpointed; the source as
the catalog's ``checkpointed`` baseline.

    PYTHONPATH=src python benchmarks/convert_plan.py --converted converted_swin \\
        --source swin_tiny_patch4_window7_224 --amp bf16 --memory 80GiB --chunk-bytes 1GiB
"""

from __future__ import annotations

import argparse
import json
import time

import pareprop
from pareprop.memory.plan import parse_memory

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--converted", required=True, help="converted_swin, converted_vit, ...")
    p.add_argument("--source", required=True, help="the source's name (timm's or torchvision's)")
    p.add_argument("--amp", default="bf16")
    p.add_argument("--memory", default="80GiB")
    p.add_argument("--chunk-bytes", default="1GiB")
    p.add_argument("--start", type=int, default=1024, help="first batch tried")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    limit = parse_memory(args.memory)
    common = dict(amp=args.amp, device=args.device)
    cases = [
        (f"{args.converted}({args.source}) at (0, 1)", args.converted, "reversible",
         dict(source=args.source, tolerance=None, coupling=(0.0, 1.0), grad_checkpointing=True,
              chunk_bytes=args.chunk_bytes)),
        (f"{args.source} checkpointed", args.source, "checkpointed", {}),
    ]
    batches = []
    for label, name, engine, extra in cases:
        t0 = time.perf_counter()
        batch, reports = pareprop.largest_batch(name, engine, limit, start=args.start,
                                                **common, **extra)
        best = next((r for r in reports if r.batch_size == batch), None)
        batches.append(batch)
        print(json.dumps(dict(model=label, engine=engine, largest_batch=batch,
                              peak_gib=round(best.peak / GIB, 2) if best else None,
                              plans=len(reports), plan_s=round(time.perf_counter() - t0))),
              flush=True)
    print(f"ratio: {batches[0] / max(batches[1], 1):.2f}x")


if __name__ == "__main__":
    main()
