"""Never a silently wrong gradient: store the blocks that a small skip scale cannot rebuild.

NOTE [ The precision guard ]
A coupling with skip scale beta rebuilds its inputs by dividing by beta, twice a block, so the
rounding error of a chain of rebuilt blocks grows like (1 / beta)^(2 per block): at beta = 0.5
and depth 12 that is 2^24, more than float32 holds. How much is too much depends on the
weights, the batch and the precision, so the guard measures it instead of guessing a
threshold: on the current training batch (the stack's own inputs, under the caller's autocast)
it runs the stack forward without a graph, then rebuilds block inputs from the top with the
engines' own arithmetic, and compares each rebuilt input with the real one (relative error, as
the drift report and debug_reconstruction do). Walking down, a block whose rebuilt inputs are
off by more than ``tolerance`` is stored instead (NOTE [ Stored blocks ] in engine/rebuild.py): it
keeps its graph from forward, its gradients are exact, and the chain below it restarts from its
exact inputs. What a stored block's gradients read are its forward inputs; what a rebuilt block's
gradients read are the rebuilt inputs of the block above, so the check covers every input a gradient
reads (the first block's X1 is rebuilt but read by nobody, and not checked).

Randomness is off for the measurement (dropout masks are noise here, not rounding), and the
generators are forked, so a guarded step draws exactly what an unguarded step draws. The
measurement runs again when the coupling changes by more than ``beta_step`` (any decrease of
beta at once), when the engine changes, and every ``every`` training steps, since the weights
move. Between measurements beta only rises under the schedules (error falls), or is measured.
beta = 0 cannot be rebuilt at all: every block is stored, without measuring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from pareprop.engine import ReversibleStack, skip_scale, skip_scale_value, stacks_of

__all__ = ["GuardReport", "PrecisionGuard", "measure_rebuild_errors"]

Tensor = torch.Tensor


def _relative_error(a: Tensor, b: Tensor) -> float:
    scale = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    if not math.isfinite(diff):
        return math.inf
    return diff / (scale if scale > 0 else 1.0)


def _saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes autograd keeps for the backward of ``fn()``, once per storage, parameters left
    out: pareprop.activation_bytes's count, which the layer order (README "Layout") keeps out
    of reach here; the guard needs only real tensors, so addresses identify storages."""
    saved: Dict[Tuple[str, int], int] = {}
    alive = []  # keeps each counted storage alive, so no address is reused while counting

    def pack(t: Tensor) -> Tensor:
        if not isinstance(t, nn.Parameter) and t.untyped_storage().nbytes() > 0:
            storage = t.untyped_storage()
            saved[(str(t.device), storage.data_ptr())] = storage.nbytes()
            alive.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = fn()
    del output
    alive.clear()
    return sum(saved.values())


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type``, or None (torch >= 2.4 signatures)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _streams(x1: Tensor, x2: Tensor) -> Tuple[Tensor, Tensor]:
    # As the stack does (NOTE [ Streams in float32 under autocast ] in engine/stack.py):
    # low-precision streams are widened under autocast.
    x1, x2 = x1.detach(), x2.detach()
    if x1.dtype in (torch.float16, torch.bfloat16) and _autocast_dtype(x1.device.type):
        return x1.float(), x2.float()
    return x1, x2


def measure_rebuild_errors(
    stack: ReversibleStack, x1: Tensor, x2: Tensor, tolerance: float, **kwargs: Any
) -> Tuple[List[float], List[int]]:
    """Rebuild errors of ``stack`` on inputs (x1, x2) and the blocks to store.

    Returns (errors, stored): per block, the relative error of the rebuilt inputs its own
    gradients and the block below read (``nan`` where the block is stored and nothing is
    rebuilt), and the indices of the blocks whose error exceeds ``tolerance``.
    """
    blocks = list(stack.blocks)
    was_training = stack.training
    stack.train(False)  # no dropout: its masks would hide the rounding being measured
    try:
        with torch.no_grad():
            x1, x2 = _streams(x1, x2)
            inputs = []
            for block in blocks:
                inputs.append((x1, x2))
                x1, x2 = block(x1, x2, **kwargs)  # the coupling, skip scale included
            errors = [math.nan] * len(blocks)
            stored: List[int] = []
            y1, y2 = x1, x2
            for index in reversed(range(len(blocks))):
                block, beta = blocks[index], skip_scale(blocks[index])
                if skip_scale_value(block) == 0.0:
                    error = math.inf
                else:
                    # the engines' inversion: X2 = (Y2 - G(Y1)) / beta, X1 = (Y1 - F(X2)) / beta
                    r2 = y2 - block.g(y1, **kwargs)
                    r2 = r2 if beta is None else r2 / beta
                    r1 = y1 - block.f(r2, **kwargs)
                    r1 = r1 if beta is None else r1 / beta
                    true1, true2 = inputs[index]
                    error = _relative_error(r2, true2)
                    if index > 0:
                        error = max(error, _relative_error(r1, true1))
                errors[index] = error
                if error > tolerance:
                    stored.append(index)
                    y1, y2 = inputs[index]  # a stored block hands down its exact inputs
                else:
                    y1, y2 = r1, r2
    finally:
        stack.train(was_training)
    return errors, sorted(stored)


@dataclass
class GuardReport:
    """What the guard measured last, and what it stores because of it."""

    alpha: float
    beta: float
    tolerance: float
    dtype: str  # the precision F and G ran in (the autocast dtype, or the streams')
    errors: List[float]  # per block; nan: not rebuilt (a stored block above or beta = 0)
    stored: List[int]
    reasons: Dict[int, str] = field(default_factory=dict)
    block_bytes: int = 0  # activations one stored block keeps, on the measured batch

    @property
    def stored_bytes(self) -> int:
        """About what storing costs over rebuilding: the stored blocks' activations."""
        return self.block_bytes * len(self.stored)

    def __str__(self) -> str:
        head = (f"coupling (alpha, beta) = ({self.alpha:.4g}, {self.beta:.4g}) in {self.dtype}, "
                f"tolerance {self.tolerance:.1e}: ")
        if not self.stored:
            return head + "every block rebuilt"
        lines = [head + f"{len(self.stored)} of {len(self.errors)} blocks stored, about "
                 f"{self.stored_bytes / 2**20:.1f} MiB of activations"]
        lines += [f"  block {i}: {self.reasons[i]}" for i in self.stored]
        return "\n".join(lines)


def _coupling_of(stack: ReversibleStack) -> Tuple[float, float]:
    block = stack.blocks[0]
    return getattr(block, "_alpha_value", 1.0), skip_scale_value(block)


class _Hook:
    """The stack's forward pre-hook: an object, not a closure, so that ``copy.deepcopy`` of a
    guarded model hooks its copy to the copied guard."""

    def __init__(self, guard: "PrecisionGuard", index: int):
        self.guard, self.index = guard, index

    def __call__(self, stack: ReversibleStack, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        self.guard._before_forward(self.index, stack, args, kwargs)
        return None


class PrecisionGuard:
    """Stores, per reversible stack of ``model``, the blocks whose rebuilt inputs would be off
    by more than ``tolerance`` (relative error) at the current coupling, measured on the
    training batch; see NOTE [ The precision guard ]. Attach with :func:`pareprop.convert`
    (default) or ``PrecisionGuard(model)``; ``model.precision_guard.report`` says what it stores
    and why. ``stored_blocks`` given to a stack by hand (the memory dial) stay stored.

    Args:
        model: a model with reversible stacks whose blocks carry a skip scale.
        tolerance: largest relative error of a rebuilt input the gradients may read.
        every: measure again after this many training steps, as the weights move.
        beta_step: measure again when beta or alpha moved this much since the last time.
    """

    def __init__(self, model: nn.Module, tolerance: float = 1e-3, every: int = 100,
                 beta_step: float = 0.02):
        if not tolerance > 0:
            raise ValueError(f"expected a tolerance > 0, got {tolerance!r}")
        if every < 1:
            raise ValueError(f"expected every >= 1, got {every!r}")
        self.tolerance = float(tolerance)
        self.every = int(every)
        self.beta_step = float(beta_step)
        self.stacks = [m for _, m in stacks_of(model)]
        if not self.stacks:
            raise ValueError("model has no ReversibleStack to guard")
        self.reports: List[Optional[GuardReport]] = [None] * len(self.stacks)
        # Blocks stored by hand stay stored; at beta = 0 every block is stored because of the
        # coupling, which is the guard's business from now on.
        self._base = [() if _coupling_of(s)[1] == 0.0 else tuple(s.stored_blocks)
                      for s in self.stacks]
        self._last: List[Optional[Tuple[float, float, str]]] = [None] * len(self.stacks)
        self._steps = [0] * len(self.stacks)
        self.measurements = 0
        self._handles = [
            s.register_forward_pre_hook(_Hook(self, i), with_kwargs=True)
            for i, s in enumerate(self.stacks)
        ]
        model.precision_guard = self

    @property
    def report(self) -> Optional[GuardReport]:
        """The first stack's last report (a converted ViT has one stack)."""
        return self.reports[0]

    def remove(self) -> None:
        """Detach the guard; the stored blocks stay as they are."""
        for handle in self._handles:
            handle.remove()

    def invalidate(self) -> None:
        """Measure again at the next training step (set_coupling calls this)."""
        self._last = [None] * len(self.stacks)

    def _due(self, index: int, stack: ReversibleStack) -> bool:
        last = self._last[index]
        if last is None or self._steps[index] >= self.every or last[2] != stack.engine:
            return True
        alpha, beta = _coupling_of(stack)
        return (beta < last[1] or abs(beta - last[1]) > self.beta_step
                or abs(alpha - last[0]) > self.beta_step)

    def _before_forward(self, index: int, stack: ReversibleStack, args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> None:
        if not (stack.training and torch.is_grad_enabled()) or stack.engine == "autograd":
            return
        self._steps[index] += 1
        if not self._due(index, stack):
            return
        if stack.sharding is not None:
            raise RuntimeError(
                "the precision guard cannot measure an FSDP-sharded stack (its blocks' "
                "parameters are gathered only inside their own forward); build the model "
                "with tolerance=None (--model-arg tolerance=null) and keep beta where the "
                "drift report shows it safe, or train without --fsdp"
            )
        self.measure(index, stack, args[0], args[1], kwargs)

    def measure(self, index: int, stack: ReversibleStack, x1: Tensor, x2: Tensor,
                kwargs: Dict[str, Any]) -> GuardReport:
        alpha, beta = _coupling_of(stack)
        amp = _autocast_dtype(x1.device.type)
        dtype = str(amp if amp is not None else x1.dtype).replace("torch.", "")
        depth = len(stack.blocks)
        if beta == 0.0:
            errors, guarded = [math.nan] * depth, list(range(depth))
            reasons = {i: "beta = 0: the coupling cannot be inverted" for i in guarded}
        else:
            devices = [x1.device] if x1.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                errors, guarded = measure_rebuild_errors(stack, x1, x2, self.tolerance, **kwargs)
            reasons = {i: f"its rebuilt inputs would be off by {errors[i]:.2e} > "
                          f"{self.tolerance:.1e} at beta = {beta:.4g}" for i in guarded}
        stored = sorted(set(guarded) | set(self._base[index]))
        for i in self._base[index]:
            reasons.setdefault(i, "stored by hand (memory dial)")
        stack.store_blocks(stored)
        report = GuardReport(alpha, beta, self.tolerance, dtype, errors, stored, reasons,
                             self._block_bytes(stack, x1, x2, kwargs) if stored else 0)
        self.reports[index] = report
        self._last[index] = (alpha, beta, stack.engine)
        self._steps[index] = 0
        self.measurements += 1
        return report

    @staticmethod
    def _block_bytes(stack: ReversibleStack, x1: Tensor, x2: Tensor,
                     kwargs: Dict[str, Any]) -> int:
        # The activations the first block keeps when stored, on this batch (the blocks of a
        # converted ViT are all alike).
        devices = [x1.device] if x1.device.type == "cuda" else []
        x1, x2 = _streams(x1, x2)
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            # The block's coupling with a graph: what a stored block's graph saves; it also
            # keeps F's and G's outputs (NOTE [ Stored blocks ]), two stream-sized tensors.
            graph = _saved_bytes(lambda: stack.blocks[0](x1, x2, **kwargs))
        return graph + 2 * x1.numel() * x1.element_size()
