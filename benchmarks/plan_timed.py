"""``pareprop plan`` with every plan it makes logged to stderr: batch, chunk bytes, peak, seconds.

    PYTHONPATH=src python benchmarks/plan_timed.py --models rev_vit_base_patch16_224 \\
        --engines reversible --amp bf16 --memory 80GiB --img-size 224 --chunk-bytes auto

Takes ``pareprop plan``'s arguments; ends with the number of plans and the wall time.
"""

from __future__ import annotations

import sys
import time

from pareprop.cli.plan import main
from pareprop.memory import plan as plan_module
from pareprop.memory import sweep as sweep_module


def _logged(real):
    count = [0]

    def plan(*args, **kwargs):
        start = time.perf_counter()
        report = real(*args, **kwargs)
        count[0] += 1
        print(f"# plan {count[0]}: bs={args[1]} chunk={kwargs.get('chunk_bytes')} "
              f"peak={report.peak / 2**30:.3f} GiB {time.perf_counter() - start:.1f}s",
              file=sys.stderr, flush=True)
        return report

    return plan, count


if __name__ == "__main__":
    plan_module.plan_memory, made = _logged(plan_module.plan_memory)
    sweep_module.plan_memory = plan_module.plan_memory  # --batch-sizes plans
    t0 = time.perf_counter()
    rc = main(sys.argv[1:])
    print(f"# {made[0]} plans, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
