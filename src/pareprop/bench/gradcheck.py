"""The quick gradient check of a sweep: a reversible engine against autograd, float32."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from pareprop.engine import set_stack_engine
from pareprop.engine.testing import engine_errors

__all__ = ["grad_rel_err"]


def grad_rel_err(
    model: nn.Module, inputs: Tuple[torch.Tensor, ...], engine: str, seed: int = 0
) -> float:
    """Largest relative error of ``engine``'s output and gradients against the autograd engine
    (:func:`pareprop.engine.testing.engine_errors`). The model is left on ``engine``."""
    # Float32: gradients that are zero by construction are rounding noise (see noise_floor).
    errors = engine_errors(model, inputs, engines=(engine,), seed=seed, noise_floor=1e-4)[engine]
    set_stack_engine(model, engine)
    return float(max(errors.values()))
