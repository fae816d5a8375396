"""The training step whose memory is measured (real tensors) or planned (fake tensors).

Both :func:`pareprop.memory_report` and :func:`pareprop.plan_memory` run exactly this code, so
the two can only differ in how the bytes are counted, never in what runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from pareprop import catalog
from pareprop.engine import ReversibleStack, stacks_of

__all__ = ["OPTIMIZERS", "AMP_NAMES", "AMP_MODES"]

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
AMP_NAMES = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_MODES = tuple(name for name in AMP_NAMES if name is not None)  # what a command line offers


def amp_dtype(amp: Any) -> Optional[torch.dtype]:
    """``None``, ``"none"``, ``"bf16"``, ``"fp16"`` or a torch dtype -> the autocast dtype."""
    if isinstance(amp, torch.dtype):
        if amp not in (torch.bfloat16, torch.float16):
            raise ValueError(f"expected amp bf16 or fp16 (or None), got {amp}")
        return amp
    if amp not in AMP_NAMES:
        raise ValueError(f"expected amp among none, bf16, fp16 (or None), got {amp!r}")
    return AMP_NAMES[amp]


def amp_label(dtype: Optional[torch.dtype]) -> str:
    return {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def make_optimizer(
    model: nn.Module, name: str, foreach: Optional[bool] = None
) -> Optional[torch.optim.Optimizer]:
    """The optimizer of the step; ``foreach=True`` mimics the CUDA default on fake CPU tensors."""
    if name not in OPTIMIZERS:
        raise ValueError(f"expected optimizer among {', '.join(OPTIMIZERS)}, got {name!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=1e-4, foreach=foreach)


def create_optimizer_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Give the optimizer the state it holds after a first step, without running one.

    A step on zero gradients creates every moment buffer at its real size (the values do not
    matter for memory), so the measured step starts as every later step of training does.
    """
    if optimizer is None:
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def unique_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the storages of ``tensors``, each storage once (views share one)."""
    seen: Dict[int, Tuple[Any, int]] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = (st, st.nbytes())  # the storage is held, so its id stays its own
    return sum(n for _, n in seen.values())


def state_tensors(optimizer: Optional[torch.optim.Optimizer]) -> list:
    if optimizer is None:
        return []
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class _SavedBytes:
    """Storages autograd saves for backward while active, except those given to exclude.

    Held weakly: holding them here would keep them alive into backward and change the peak.
    """

    def __init__(self, exclude: Sequence[torch.Tensor]):
        self._exclude = {id(t.untyped_storage()) for t in exclude}
        self._keep = [t.untyped_storage() for t in exclude]  # their ids stay theirs
        self._saved = WeakIdKeyDictionary()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in self._exclude:
            self._saved[st] = st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def alive_bytes(self) -> int:
        return sum(self._saved.values())


def run_step(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    optimizer: Optional[torch.optim.Optimizer],
    dtype: Optional[torch.dtype],
) -> Dict[str, int]:
    """One training step; returns the byte counts that do not depend on the counting method.

    Returns:
        ``parameters``, ``inputs``, ``activations``, ``gradients``, ``optimizer_state``.
    """
    params = list(model.parameters()) + list(model.buffers())
    device_type = inputs[0].device.type
    counts = {"parameters": unique_bytes(params), "inputs": unique_bytes(inputs)}
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    saved = _SavedBytes(params + list(inputs))
    autocast = (torch.autocast(device_type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    streams = _StreamBytes(model)
    with saved.hooks(), streams:
        with autocast:
            logits = catalog.logits(model(*inputs))
        logits = logits.float().flatten(0, -2)
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        loss = F.cross_entropy(logits, target)
    counts["activations"] = saved.alive_bytes()
    del logits, target
    loss.backward()
    del loss
    counts["gradients"] = unique_bytes(p.grad for p in model.parameters())
    if optimizer is not None:
        optimizer.step()
    return finish_counts(counts, optimizer, streams)


def finish_counts(counts: Dict[str, int], optimizer: Any, streams: Any) -> Dict[str, int]:
    """A step's counts completed after its optimizer step: the optimizer state and the floor
    (NOTE [ The floor of a reversible step ]; 0 without a reversible stream)."""
    counts["optimizer_state"] = unique_bytes(state_tensors(optimizer))
    counts["floor"] = 0 if not streams.largest else (
        counts["parameters"] + counts["gradients"] + counts["optimizer_state"]
        + counts["inputs"] + FLOOR_MAPS * streams.largest)
    return counts


# NOTE [ The floor of a reversible step ]
#     What a reversible backward cannot avoid: the parameters, their gradients, the optimizer
#     state and the inputs, plus, for the largest stack, six stream-sized maps (float32 under
#     autocast, where the streams stay float32): while a block's backward runs, its two
#     output streams (rebuilt into its inputs in place), their two gradients (updated in
#     place) and the two gradients the stack's backward was handed, which autograd holds until
#     it returns. The chunked schedule holds exactly that (NOTE [ Chunked backward ] in
#     engine/chunked.py); whole branches hold the rebuilt inputs and their gradients apart
#     too. The floor is the chunked schedule's six maps, not the whole-branch schedule's
#     eight: a floor of eight would sit above the planned peak of steps that chunk everything
#     (BENCHMARKS.md, "Measurements behind the design"). A report's
#     ``floor`` is that sum (0 when no stack runs a reversible engine), so ``peak / floor``
#     says how far a configuration is from what no schedule of the reversible backward can go
#     below.
FLOOR_MAPS = 6


class _StreamBytes:
    """The bytes of one stream of the largest reversible stack that runs during a step."""

    def __init__(self, model: nn.Module):
        self.largest = 0
        self._stacks = [m for _, m in stacks_of(model)]
        self._hooks: list = []

    def _record(self, stack: ReversibleStack, args: Tuple[Any, ...]) -> None:
        if stack.engine == "autograd" or not stack.training or not args:
            return
        x = args[0]
        # Under autocast the stack widens low-precision streams to float32.
        size = 4 if x.dtype in (torch.float16, torch.bfloat16) else x.element_size()
        self.largest = max(self.largest, x.numel() * size)

    def __enter__(self) -> "_StreamBytes":
        self._hooks = [s.register_forward_pre_hook(self._record) for s in self._stacks]
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
