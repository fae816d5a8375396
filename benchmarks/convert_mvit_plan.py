"""Planned largest batch in 80 GiB of converted MViTs against their sources checkpointed
(the target: at least 2x): timm's mvitv2_base (224 px images) and torchvision's mvit_v2_s (16 x 224
x 224 clips), bf16 autocast, AdamW, a whole training step planned on fake tensors.

    PYTHONPATH=src python benchmarks/convert_mvit_plan.py [--only mvitv2|tv] [--memory-gib 80] \
        [--side converted|source]

The converted models run at coupling (0, 1) (every block rebuilt: no precision guard, which
cannot measure fake tensors), their branches in 1 GiB chunks and the blocks kept from the
source (those that pool the shortcut or widen) checkpointed; the sources with every block
checkpointed (timm's ``set_grad_checkpointing()``; torchvision's blocks under
``torch.utils.checkpoint``, the catalog's ``checkpointed`` mode).
"""

from __future__ import annotations

import argparse
import json
import time

import pareprop

CONVERTED = dict(engine="reversible", tolerance=None, coupling=(0.0, 1.0), chunk_bytes=2**30,
                 grad_checkpointing=True)
PAIRS = {
    "mvitv2": (("converted_mvitv2", dict(source="mvitv2_base", **CONVERTED)),
               ("mvitv2_base", dict(engine="checkpointed"))),
    "tv": (("converted_tv_mvit", dict(source="mvit_v2_s", **CONVERTED)),
           ("mvit_v2_s", dict(engine="checkpointed"))),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(PAIRS))
    parser.add_argument("--memory-gib", type=float, default=80.0)
    parser.add_argument("--side", choices=("converted", "source"),
                        help="plan only the converted models, or only the sources")
    args = parser.parse_args()
    memory = int(args.memory_gib * 2**30)
    for family, pair in PAIRS.items():
        if args.only not in (None, family):
            continue
        found = {}
        for side, (name, kwargs) in zip(("converted", "source"), pair):
            if args.side not in (None, side):
                continue
            kwargs = dict(kwargs)
            engine = kwargs.pop("engine")
            start = time.perf_counter()
            batch, reports = pareprop.largest_batch(name, engine, memory, amp="bf16", **kwargs)
            found[name] = batch
            print(json.dumps({"model": name, "engine": engine, **{k: str(v) for k, v in
                              kwargs.items()}, "largest_batch": batch,
                              "peak_gib": next((r.peak / 2**30 for r in reports
                                                if r.batch_size == batch), None),
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        if len(found) == 2:
            ours, theirs = (found[name] for name, _ in pair)
            print(f"{family}: {ours} / {theirs} = {ours / max(theirs, 1):.2f}x", flush=True)


if __name__ == "__main__":
    main()
