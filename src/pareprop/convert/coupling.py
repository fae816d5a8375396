"""The coefficients of a converted model's coupling, and the schedules that move them.

Dr2Net (Zhao et al., CVPR 2024) fine-tunes from the pretrained network (alpha, beta) = (1, 0)
towards the reversible coupling (0, 1): alpha falls and beta rises together, alpha = 1 - t and
beta = t for a progress t that goes from 0 to 1 (linearly or on a cosine) over a number of
steps. Re2TAL (Zhao et al., CVPR 2023) takes (0, 1) from the first step: the same parameters,
rewired at once. :class:`CouplingSchedule` is stepped by the trainer (or by hand) once per
optimizer step.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch.nn as nn

from pareprop.engine import ReversibleStack, skip_scale_value, stacks_of

__all__ = [
    "SCHEDULES", "CouplingSchedule", "check_coupling", "coupling_of", "coupling_pair",
    "set_coupling",
]

SCHEDULES = ("linear", "cosine", "reversible")


def _coupled_blocks(model: nn.Module) -> List[Tuple[ReversibleStack, List[nn.Module]]]:
    found = []
    for _, m in stacks_of(model):
        blocks = [b for b in m.blocks if hasattr(b, "set_alpha")]
        if blocks:
            found.append((m, blocks))
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no converted blocks, so no coupling to set: "
            "build it with pareprop.convert(source) or create_model('converted_...')"
        )
    return found


def check_coupling(alpha: Any, beta: Any) -> Tuple[float, float]:
    """``(alpha, beta)`` as floats, refused unless both are finite and beta >= 0 (the skip
    scale a block takes: NOTE [ Skip scale of the coupling ] in pareprop/engine/block.py).

    What :func:`set_coupling` accepts, checked once here so ``pareprop plan --coupling``
    refuses the same values with the same words before anything is built.

    Raises:
        ValueError: what was expected and what was given.
    """
    try:
        alpha, beta = float(alpha), float(beta)
    except (TypeError, ValueError):
        raise ValueError(f"expected numbers alpha and beta, got ({alpha!r}, {beta!r})") from None
    if not (math.isfinite(alpha) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"expected finite alpha and beta >= 0, got ({alpha!r}, {beta!r})")
    return alpha, beta


def coupling_pair(coupling: Any) -> Tuple[float, float]:
    """A converted model's ``coupling`` keyword, ``(alpha, beta)``, as :func:`check_coupling`
    accepts it; anything but two numbers is refused in one line."""
    if isinstance(coupling, (str, bytes)) or not hasattr(coupling, "__len__") or \
            len(coupling) != 2:
        raise ValueError(f"expected coupling=[alpha, beta], two numbers, got {coupling!r}")
    return check_coupling(*coupling)


def set_coupling(model: nn.Module, alpha: float, beta: float) -> nn.Module:
    """Set (alpha, beta) of every converted block of ``model``.

    Changes two float32 buffers per block in place: nothing is rebuilt or recompiled. At
    beta = 0 every block is stored (the coupling cannot be inverted). Otherwise, with a
    :class:`~pareprop.PrecisionGuard` attached (:func:`pareprop.convert` attaches one), the
    guard measures on the next training step which blocks must be stored; without one, every
    block is rebuilt.
    """
    alpha, beta = check_coupling(alpha, beta)
    guard = getattr(model, "precision_guard", None)
    for stack, blocks in _coupled_blocks(model):
        for block in blocks:
            block.set_alpha(alpha)
            block.set_skip_scale(beta)
        if beta == 0.0:
            stack.store_blocks(range(len(stack.blocks)))
        elif guard is None:
            stack.store_blocks(())
    if hasattr(model, "coupling"):
        model.coupling = (alpha, beta)
    if isinstance(getattr(model, "model_kwargs", None), dict):
        model.model_kwargs["coupling"] = [alpha, beta]  # a checkpoint rebuilds it here
    if guard is not None:
        guard.invalidate()
    return model


def coupling_of(model: nn.Module) -> Tuple[float, float]:
    """(alpha, beta) of the first converted block of ``model``."""
    block = _coupled_blocks(model)[0][1][0]
    return block._alpha_value, skip_scale_value(block)


class CouplingSchedule:
    """Moves (alpha, beta) from (1, 0) to (0, 1) over ``steps`` calls of :meth:`step`.

    ``kind``: ``"linear"`` (t = s / steps), ``"cosine"`` (t = (1 - cos(pi s / steps)) / 2) or
    ``"reversible"`` (Re2TAL: (0, 1) from the first step; ``steps`` is ignored). alpha = 1 - t,
    beta = t. Construction sets the step-0 coupling (unless ``apply=False``); the trainer calls
    :meth:`step` after each optimizer step. ``state_dict``/``load_state_dict`` resume it.
    """

    def __init__(self, model: nn.Module, kind: str = "cosine", steps: int = 1000,
                 apply: bool = True):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown coupling schedule {kind!r}; expected one of {SCHEDULES}")
        if kind != "reversible" and int(steps) < 1:
            raise ValueError(f"expected steps >= 1 for the {kind} schedule, got {steps!r}")
        _coupled_blocks(model)
        self.model, self.kind, self.steps = model, kind, max(int(steps), 1)
        self.step_count = 0
        if apply:  # False: keep the model's coupling (a resumed run loads the schedule's state)
            self._apply()

    def progress(self, step: int) -> float:
        if self.kind == "reversible":
            return 1.0
        s = min(max(step, 0), self.steps) / self.steps
        return s if self.kind == "linear" else (1.0 - math.cos(math.pi * s)) / 2.0

    def coupling(self, step: int) -> Tuple[float, float]:
        t = self.progress(step)
        return 1.0 - t, t

    def _apply(self) -> None:
        set_coupling(self.model, *self.coupling(self.step_count))

    def step(self) -> Tuple[float, float]:
        """Advance one step and set the new coupling; returns it."""
        self.step_count += 1
        previous = coupling_of(self.model)
        now = self.coupling(self.step_count)
        if now != previous:
            self._apply()
        return now

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "steps": self.steps, "step_count": self.step_count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.kind, self.steps = state["kind"], int(state["steps"])
        self.step_count = int(state["step_count"])
        self._apply()
