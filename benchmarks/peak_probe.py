"""What sets the peak of a planned training step: the operator at the peak, the modules it
runs in, the parts of memory there and the largest storages alive.

Runs :func:`pareprop.plan_memory` (fake tensors, nothing allocated) with torch's MemTracker
extended to remember, at every new peak, which operator made it. For reading a plan, not a
test; figures it prints are a plan's, like ``pareprop plan``'s.

    PYTHONPATH=src python benchmarks/peak_probe.py rev_mvitv2_base --batch-size 64 \
        --engine reversible --amp bf16 --grad-checkpointing --chunk-bytes 1GiB
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import pareprop.memory.measure as measure
from pareprop.memory.plan import plan_memory

GIB = 2**30


def _probe_tracker(found: dict):
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class _PeakProbe(MemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op = func
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    sizes = Counter()
                    for winfo, _ in list(self._WINFO.values()):
                        sizes[(winfo.mem_consumed, str(winfo.reftype))] += 1
                    found.update(
                        op=str(getattr(self, "_op", "?")),
                        modules=sorted(self._mod_tracker.parents),
                        backward=self._mod_tracker.is_bw,
                        parts={str(k): v for k, v in snap.items()},
                        largest=sorted(sizes.items(), reverse=True)[:12],
                    )

    return _PeakProbe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--engine", default="reversible")
    ap.add_argument("--amp", default="bf16")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--chunk-bytes", default=None)
    args = ap.parse_args()
    found: dict = {}
    measure._step_tracker = lambda: _probe_tracker(found)
    report = plan_memory(args.model, args.batch_size, args.engine, amp=args.amp,
                         img_size=args.img_size, grad_checkpointing=args.grad_checkpointing,
                         chunk_bytes=args.chunk_bytes)
    print(f"{args.model} {args.engine} batch {args.batch_size}: peak {report.peak / GIB:.3f} GiB, "
          f"floor {report.floor / GIB:.3f} GiB, activations {report.activations / GIB:.3f} GiB")
    phase = "backward" if found.get("backward") else "forward"
    print(f"operator at the peak: {found.get('op')} ({phase})")
    print("modules:", ", ".join(m for m in found.get("modules", []) if m != "Global"))
    print("parts:", ", ".join(f"{k.split('.')[-1]} {v / GIB:.3f}"
                              for k, v in found.get("parts", {}).items() if v))
    print("largest storages alive (GiB x count, kind):")
    for (size, kind), n in found.get("largest", []):
        print(f"  {size / GIB:8.4f} x {n:3d}  {kind.split('.')[-1]}")


if __name__ == "__main__":
    main()
