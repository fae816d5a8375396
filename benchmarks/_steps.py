"""What the device scripts share: a model built by name in an engine, and one training step.

The engines a script may name: the catalog's modes (``autograd``, ``reversible``,
``pareprop``, ``checkpointed``, ``plain``) and ``pareprop-fallback``, engine "pareprop" with
its fallback to Reprop on (NOTE [ PaReprop's fallback to Reprop ]); plain ``pareprop`` has it
off, as benchmarks run it. ``ENGINE+graphs`` (``autograd``, ``reversible`` or ``pareprop``)
runs that engine with each stack's training step captured as CUDA graphs
(``pareprop.set_engine(..., cuda_graphs=True)``; CUDA only).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import pareprop
from pareprop import catalog
from pareprop.bench.measure import _is_oom


def build(model: str, engine: str, device: torch.device, img_size: Optional[int] = None,
          chunk_bytes: Optional[str] = None, grad_checkpointing: bool = False,
          depth: Optional[int] = None, seed: int = 0) -> Tuple[nn.Module, catalog.ModelRequest]:
    """``model`` in ``engine`` on ``device`` (seeded, so every engine starts from the same
    weights), and the request it was built from (for its example inputs)."""
    request = catalog.ModelRequest(model=model, engine=base_engine(engine), img_size=img_size,
                                   depth=depth, grad_checkpointing=grad_checkpointing)
    torch.manual_seed(seed)
    net = catalog.build_model(request).to(device)
    if chunk_bytes:
        pareprop.set_chunking(net, max_bytes=chunk_bytes)
    return configure(net, engine), request


def base_engine(engine: str) -> str:
    """The catalog's mode under a script's engine name ("pareprop+graphs" -> "pareprop")."""
    engine = engine[:-len("+graphs")] if engine.endswith("+graphs") else engine
    return "pareprop" if engine == "pareprop-fallback" else engine


def configure(net: nn.Module, engine: str) -> nn.Module:
    """Put a reversible model (built under any engine, or a copy of one) in ``engine``."""
    base, graphs = base_engine(engine), engine.endswith("+graphs")
    if base in pareprop.ENGINES:
        fallback = (engine == "pareprop-fallback") if base == "pareprop" else None
        pareprop.set_engine(net, base, fallback=fallback, cuda_graphs=graphs)
    elif graphs:
        raise ValueError(f"{engine!r}: CUDA graphs go with the reversible models' engines")
    return net


def inputs_for(net: nn.Module, request: catalog.ModelRequest, batch: int,
               device: torch.device) -> Tuple[torch.Tensor, ...]:
    return catalog.example_inputs(net, request, batch, device)


def training_step(net: nn.Module, inputs: Tuple[torch.Tensor, ...],
                  optimizer: torch.optim.Optimizer, amp: Optional[str]) -> None:
    """Forward under autocast (``amp`` "bf16", or None), cross-entropy, backward, the step."""
    optimizer.zero_grad(set_to_none=True)
    device = inputs[0].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
        logits = catalog.logits(net(*inputs))
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=device)
    F.cross_entropy(logits.float().flatten(0, -2), target.flatten()).backward()
    optimizer.step()


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` says the device ran out of memory: torch's OutOfMemoryError, or cuBLAS
    failing to allocate its workspace near the cap (a RuntimeError that names no memory)."""
    return _is_oom(err) or "CUBLAS_STATUS_ALLOC_FAILED" in str(err)


def failure(err: BaseException) -> str:
    """What a script records of an error: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return type(err).__name__ + (f": {lines[0]}" if lines else "")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Milliseconds of the work queued between ``start()`` and ``stop()``: CUDA events on a
    GPU (the host never waits until ``read``), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list = []

    def start(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        import time

        return time.perf_counter()

    def stop(self, start: Any) -> None:
        self.marks.append((start, self.start()))

    def read(self) -> list:
        """The milliseconds of every stop, in order (waits for the device once)."""
        synchronize(self.device)
        if self.device.type == "cuda":
            out = [a.elapsed_time(b) for a, b in self.marks]
        else:
            out = [(b - a) * 1e3 for a, b in self.marks]
        self.marks = []
        return out
