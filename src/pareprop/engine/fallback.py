"""Never slower than Reprop: which schedule a stack under engine "pareprop" runs.

NOTE [ PaReprop's fallback to Reprop ]
    PaReprop overlaps rebuilding block l-1 with block l's gradients on a second CUDA stream.
    Whether that pays depends on the GPU, the model and the batch: at large batches one block's
    kernels already fill the device, and the second stream's allocator pool (NOTE [ PaReprop on
    two CUDA streams ] in engine/backward.py) can push a step near capacity into the caching
    allocator's out-of-memory retry (free the cache with a device sync, allocate again). So each
    stack under "pareprop" measures both schedules on its first backward passes and keeps the
    faster:

    * passes 1-2 run PaReprop, then Reprop, untimed (streams, allocator pools, kernel caches);
    * passes 3-8 alternate the two, each timed by CUDA events on the main stream around the
      stack's backward, and counting the allocator's ``num_alloc_retries`` while it is queued;
    * once the device has finished them (read with ``Event.query``, so the host never waits),
      the stack keeps Reprop if PaReprop's passes hit more allocator retries or its median
      time is longer, else PaReprop, and says so once on the ``"pareprop"`` logger (INFO when
      it keeps PaReprop, WARNING when it falls back). Until then it runs PaReprop.

    Both schedules run the same kernels on the same inputs, so gradients do not depend on the
    choice (tested in float64 across the switch); only speed and memory differ. The choice is
    made once per stack: ``set_engine`` or ``store_blocks`` measures again.
    ``pareprop.set_engine(model, "pareprop", fallback=False)`` always runs PaReprop, as
    benchmarks do. On the CPU both schedules run in program order, so there is nothing to
    measure: the stack runs PaReprop. Tests replace :func:`clock_for` to drive the choice there.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["SCHEDULES", "PaRepropFallback", "clock_for"]

SCHEDULES = ("pareprop", "reversible")

logger = logging.getLogger("pareprop")


class CudaClock:
    """Device time between CUDA events on the current stream, and the allocator's retries."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the main one, around the stack's backward
        return event

    def elapsed_ms(self, start: Any, end: Any) -> Optional[float]:
        """Milliseconds from ``start`` to ``end``; None while the device has not reached end."""
        return start.elapsed_time(end) if end.query() else None

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


def clock_for(device: torch.device) -> Optional[Any]:
    """The clock that times a stack's backward on ``device``; None where there is nothing to
    measure (the CPU runs both schedules in program order)."""
    return CudaClock(device) if device.type == "cuda" else None


@dataclass
class _Trial:
    schedule: str
    start: Any
    retries: int  # the allocator's count at the start, then the growth during the pass
    end: Any = None
    ms: Optional[float] = None


class PaRepropFallback:
    """One stack's choice between PaReprop and Reprop (NOTE [ PaReprop's fallback to Reprop ])."""

    WARMUP = 1  # untimed passes of each schedule
    TRIALS = 3  # timed passes of each schedule

    def __init__(self, label: str = "a ReversibleStack", enabled: bool = True):
        self.label = label
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        """Measure again from the next backward pass."""
        self.chosen: Optional[str] = None
        self.passes = 0
        self.trials: List[_Trial] = []
        self.clock: Optional[Any] = None
        self.times: Dict[str, float] = {}
        self.why = ""

    # A model is deep-copied (EMA, checkpoint tools) and pickled: CUDA events are neither, and
    # a copy measures for itself anyway.
    def __getstate__(self) -> Dict[str, Any]:
        return {"label": self.label, "enabled": self.enabled}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["label"], state["enabled"])

    def state(self, device: torch.device) -> str:
        """"pareprop", "reversible" or "measuring", for a stack on ``device``."""
        if not self.enabled:
            return "pareprop"
        self._read()
        if self.chosen is not None:
            return self.chosen
        return "measuring" if self.clock is not None or clock_for(device) is not None \
            else "pareprop"

    def reason(self, device: torch.device) -> str:
        """Why :meth:`state` is what it is, in a line."""
        state = self.state(device)
        if not self.enabled:
            return "the fallback is off (set_engine(..., fallback=False))"
        if state == "measuring":
            return "timing both schedules on the first backward passes"
        if self.why:
            return self.why
        return "on the CPU both schedules run in program order: nothing to measure"

    def begin(self, device: torch.device) -> Tuple[str, Optional[_Trial]]:
        """The schedule of the backward pass that starts now, and its trial if it is timed."""
        if not self.enabled:
            return "pareprop", None
        if self.chosen is None and self.clock is None:
            self.clock = clock_for(device)
            if self.clock is None:
                self.chosen = "pareprop"
        self._read()
        if self.chosen is not None:
            return self.chosen, None
        n, self.passes = self.passes, self.passes + 1
        if n >= 2 * (self.WARMUP + self.TRIALS):  # all timed; the device is still on them
            return "pareprop", None
        schedule = SCHEDULES[n % 2]
        if n < 2 * self.WARMUP:
            return schedule, None
        trial = _Trial(schedule, self.clock.mark(), self.clock.alloc_retries())
        self.trials.append(trial)
        return schedule, trial

    def end(self, trial: Optional[_Trial]) -> None:
        """The backward pass of ``trial`` is queued (call it even when the pass raised)."""
        if trial is None:
            return
        trial.end = self.clock.mark()
        trial.retries = self.clock.alloc_retries() - trial.retries

    def _read(self) -> None:
        if self.chosen is not None or self.clock is None:
            return
        for trial in self.trials:
            if trial.ms is None and trial.end is not None:
                trial.ms = self.clock.elapsed_ms(trial.start, trial.end)
        done = [t for t in self.trials if t.ms is not None]
        if len(done) < 2 * self.TRIALS:
            return
        times = {s: statistics.median(t.ms for t in done if t.schedule == s) for s in SCHEDULES}
        retries = {s: sum(t.retries for t in done if t.schedule == s) for s in SCHEDULES}
        if retries["pareprop"] > retries["reversible"]:
            chosen, why = "reversible", "PaReprop hit more allocator retries"
        elif times["reversible"] < times["pareprop"]:
            chosen, why = "reversible", "Reprop was faster"
        else:
            chosen, why = "pareprop", "PaReprop was at least as fast"
        self.chosen, self.times = chosen, times
        self.why = (f"{why} (PaReprop {times['pareprop']:.3f} ms, Reprop "
                    f"{times['reversible']:.3f} ms per backward, median of {self.TRIALS}; "
                    f"allocator retries {retries['pareprop']} / {retries['reversible']})")
        self.trials, self.clock = [], None
        log = logger.info if chosen == "pareprop" else logger.warning
        log("%s: PaReprop %.3f ms, Reprop %.3f ms per backward (median of %d; allocator "
            "retries %d / %d): %s, running %s from now on", self.label, times["pareprop"],
            times["reversible"], self.TRIALS, retries["pareprop"], retries["reversible"], why,
            "PaReprop" if chosen == "pareprop" else "Reprop")
