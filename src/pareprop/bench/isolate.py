"""Measuring a configuration in a fresh interpreter (see NOTE [ Measuring memory on the CPU ]).

NOTE [ Why not fork a worker per configuration ]
    Forking is cheap but unsafe: once the parent has run a parallel OpenMP region (any matmul),
    a forked child that computes hangs in the OpenMP runtime. Resetting the peak in-process (or
    a fresh ``spawn``-style subprocess) avoids that.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any, Dict

from pareprop.bench.measure import _empty_record, _Job


def _measure_subprocess(job: _Job) -> Dict[str, Any]:
    """Measure ``job`` in a fresh interpreter, so its peak RSS is this configuration's alone."""
    code = (
        "import json, sys; from pareprop import bench; "
        "job = bench._Job(**json.load(sys.stdin)); "
        "print('\\n' + json.dumps(bench.measure(job)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(dataclasses.asdict(job)),
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    record = _empty_record(job)
    killed = proc.returncode in (-9, 137)  # the kernel's OOM killer sends SIGKILL
    tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    record["status"] = "oom" if killed else f"error: worker failed: {tail[0]}"
    return record


def _pythonpath() -> str:
    # The folder that holds the pareprop package: src/ of a checkout, or site-packages.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([here] + rest)
