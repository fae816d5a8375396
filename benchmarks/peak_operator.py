"""What sets a planned step's peak: the operator running at the peak, where it was called from
in pareprop, and the largest tensors alive then, each with the operator and call site that made
it. Plans one step as ``pareprop plan`` does (fake tensors, nothing allocated).

    python benchmarks/peak_operator.py rev_vit_base_patch16_224 reversible 14543 \
        [--amp bf16] [--img-size 224] [--chunk-bytes 1GiB] [--grad-checkpointing]
        [--depth N] [--device cuda] [--top 16] [--model-arg KEY=VALUE ...]

The breakdown table (parameters, activations kept, transient, floor) is the plan's own;
the rest comes from a subclass of pareprop's StepPeakTracker (the counter plan_memory uses) that, at
each new peak, records the operator and the tensors alive. Used for BENCHMARKS.md's "what sets
the peak" lines.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import pareprop.memory.measure as measure
from pareprop.memory.plan import plan_memory

_SMALLEST = 2**20  # tensors below 1 MiB are not described


def _pareprop_frames(limit: int) -> List[str]:
    frames = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack()
              if "pareprop" in f.filename and "peak_operator" not in f.filename
              and f.name not in ("__torch_function__", "__torch_dispatch__")]
    return frames[-limit:]


def _tracker_class():
    class PeakOperatorTracker(measure.StepPeakTracker):
        """The planner's counter that, at each new peak, records what is alive."""

        peak_info: Optional[Tuple[int, str, List[str], List[Tuple[int, str]]]] = None
        _op: str = ""

        def __init__(self) -> None:
            super().__init__()
            self._made_by: Dict[int, str] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def track(self, t: Any) -> None:
            key = id(t.untyped_storage())
            new = key not in self._sizes and key not in self._aside
            super().track(t)
            # While a chunk's cost is measured the counter sets a new storage aside instead of
            # counting it (StepPeakTracker.track); it is counted later if it outlives the
            # measurement, so it is described now, from whichever table holds it.
            entry = self._sizes.get(key) or self._aside.get(key)
            if new and entry is not None and entry[1] >= _SMALLEST:
                site = " < ".join(reversed(_pareprop_frames(3)))
                self._made_by[key] = f"{self._op} {tuple(t.shape)} {t.dtype} at {site}"
            elif new:
                self._made_by.pop(key, None)  # an id reused by a small storage

        def _new_peak(self) -> None:
            live = [(size, self._made_by.get(key, "(made before the step)"))
                    for key, (ref, size) in self._sizes.items() if ref() is not None]
            live.sort(key=lambda item: -item[0])
            self.peak_info = (self.current, self._op, _pareprop_frames(8), live)

    return PeakOperatorTracker


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("engine")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--chunk-bytes", default=None)
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=16, help="largest live tensors shown")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword of the model (JSON value, else a string), e.g. "
                             "source=mvitv2_base, coupling=[0,1], tolerance=null")
    args = parser.parse_args(argv)

    trackers: List[Any] = []
    cls = _tracker_class()

    def make() -> Any:
        trackers.append(cls())
        return trackers[-1]

    measure._step_tracker = make  # the planner's counter, with the peak's details recorded
    overrides: Dict[str, Any] = {"img_size": args.img_size}
    if args.depth is not None:
        overrides["depth"] = args.depth
    for item in args.model_arg:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    start = time.perf_counter()
    report = plan_memory(args.model, args.batch_size, args.engine, amp=args.amp,
                         device=args.device, chunk_bytes=args.chunk_bytes,
                         grad_checkpointing=args.grad_checkpointing, **overrides)
    print(report.table())
    print(f"planned in {time.perf_counter() - start:.1f} s")
    info = trackers[-1].peak_info
    if info is None:
        return 0
    total, op, frames, live = info
    gib = 2**30
    print(f"\noperator at the peak ({total / gib:.2f} GiB): {op}")
    print("called from: " + " < ".join(reversed(frames)))
    print(f"\nlargest tensors alive then (of {len(live)}):")
    for nbytes, made_by in live[: args.top]:
        print(f"  {nbytes / gib:8.2f} GiB  {made_by}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
