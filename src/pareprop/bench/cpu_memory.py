"""Peak memory of one configuration on the CPU: the process's peak resident set, reset.

NOTE [ Measuring memory on the CPU ]
    On a GPU, peak memory is ``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``, per configuration. On the CPU there is no allocator peak, so
    we use the growth of the process's peak resident set size (``ru_maxrss``) during the
    configuration. ``ru_maxrss`` never decreases, so on its own it would only show the largest
    configuration so far. On Linux we reset it before every configuration by writing ``5`` to
    ``/proc/self/clear_refs`` (which sets the peak back to the current RSS), after freeing the
    previous configuration's tensors and returning freed heap to the OS with ``malloc_trim``.
    Where that reset is not possible, every configuration runs in a fresh subprocess
    (``isolate=True``, :mod:`pareprop.bench.isolate`), which is slower (one ``import torch``
    each) but measures the same thing. The growth includes parameters, gradients, optimizer
    state and the allocator's slack, so it is noisier than ``activation_bytes``, the exact byte
    count of the tensors autograd keeps for backward (parameters excluded), which we report as
    well, and than ``planned_peak_bytes``, the allocator-level prediction of
    :func:`pareprop.plan_memory`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys

import torch


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _reset_rss_peak() -> bool:
    """Set the process's peak RSS back to its current RSS (Linux >= 4.0); False if impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


_CAN_RESET_RSS: bool | None = None


def _can_reset_rss() -> bool:
    global _CAN_RESET_RSS
    if _CAN_RESET_RSS is None:
        _CAN_RESET_RSS = sys.platform.startswith("linux") and _reset_rss_peak()
    return _CAN_RESET_RSS
