""":class:`MemoryReport`: the memory of one training step, broken down."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["MemoryReport", "BYTE_FIELDS"]

# The byte fields of a report, in the order tables and plan.json show them.
BYTE_FIELDS = ("parameters", "gradients", "optimizer_state", "activations", "peak")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


@dataclass
class MemoryReport:
    """Memory of one full training step (forward, loss, backward, optimizer step).

    Attributes:
        parameters: bytes of the model's parameters and buffers.
        gradients: bytes of the parameters' gradients after backward.
        optimizer_state: bytes of the optimizer's state after the step (AdamW: two moments per
            parameter and a step counter). The step measured is not the first one, so the state
            already exists when it starts, as it does in every step of a training run.
        activations: bytes the forward (and the loss) allocated that autograd keeps for
            backward: what depth costs. Parameters, buffers and inputs are not counted here.
        peak: the most bytes alive at once during the step, everything included.
        inputs: bytes of the inputs and the targets.
        transient: ``peak - parameters - optimizer_state - inputs - activations``: what the step
            adds at its peak on top of what lives across the step and what forward kept, that
            is the gradients accumulated so far and backward's temporaries (under the
            reversible engines: one block's rebuilt graphs, two under PaReprop). Never negative:
            the kept activations are all alive when backward starts.
        model, engine, batch_size, amp, device: what was measured or planned.
        grad_checkpointing: whether the model's non-reversible blocks ran under activation
            checkpointing (``model.set_grad_checkpointing()``).
        method: how ``peak`` was obtained (``cuda_max_allocated``, ``tracked_real``,
            ``tracked_fake``: see docs/memory.md).
        floor: what a reversible step cannot go below: parameters, gradients, optimizer
            state, inputs and six stream-sized maps of the largest stack (its two streams,
            their gradients, and the two gradients its backward was handed); 0 when no stack
            runs a reversible engine (NOTE [ The floor of a reversible step ] in
            memory/step.py).
        chunk_bytes: the chunking planned (``pareprop.set_chunking(max_bytes=...)``); None for
            whole branches.
        split: detectors only: the bytes alive at the peak by part (``inputs``, ``backbone``,
            ``pyramid``, ``heads``, ``optimizer``), summing to ``peak`` (NOTE [ The peak split
            of a detector ] in memory/detection.py); None for other models.
        coupling: a converted model's ``(alpha, beta)`` as built; None for other models.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int
    inputs: int = 0
    model: str = ""
    engine: str = ""
    batch_size: int = 0
    amp: str = "none"
    device: str = "cpu"
    method: str = ""
    grad_checkpointing: bool = False
    floor: int = 0
    chunk_bytes: Optional[int] = None
    split: Optional[Dict[str, int]] = None
    coupling: Optional[Tuple[float, float]] = None

    @property
    def transient(self) -> int:
        return self.peak - self.parameters - self.optimizer_state - self.inputs - self.activations

    def to_dict(self) -> Dict[str, Any]:
        """Every field, plus ``transient``, as plain Python values (JSON-ready)."""
        out = dataclasses.asdict(self)
        out["transient"] = self.transient
        return out

    def fits(self, memory_bytes: Optional[int]) -> Optional[bool]:
        """Whether ``peak`` fits in ``memory_bytes``; ``None`` when no memory is given."""
        return None if memory_bytes is None else self.peak <= memory_bytes

    def table(self) -> str:
        """A small two-column table in GiB, the parts first and the peak last."""
        engine = (self.engine or "-") + ("+ckpt" if self.grad_checkpointing else "")
        if self.chunk_bytes is not None:
            engine += f" in chunks of {self.chunk_bytes / 2**20:.3g} MiB"
        what = f"{self.model or 'model'} / {engine} / batch {self.batch_size}"
        rows = [
            ("parameters (+ buffers)", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("inputs", self.inputs),
            ("activations kept after forward", self.activations),
            ("transient at the peak (grads + backward)", self.transient),
            ("peak of the step", self.peak),
        ]
        if self.split:
            rows += [(f"  at the peak: {part}", n) for part, n in self.split.items()]
        if self.floor:
            rows.append(("floor (streams, their gradients, incoming ones)", self.floor))
        width = max(len(r[0]) for r in rows)
        lines = [f"{what}  ({self.device}, amp {self.amp}, {self.method})",
                 f"{'':<{width}}  {'GiB':>9}"]
        lines += [f"{name:<{width}}  {_gib(n):>9}" for name, n in rows]
        return "\n".join(lines)
