"""The quick gradient check of a sweep: a reversible engine against autograd, float32."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from pareprop.bench.models import _logits
from pareprop.engine import set_engine

__all__ = ["grad_rel_err"]


def grad_rel_err(
    model: nn.Module, inputs: Tuple[torch.Tensor, ...], engine: str, seed: int = 0
) -> float:
    """Largest relative error of ``engine``'s output and gradients against the autograd engine.

    Uses ``pareprop.testing.engine_errors`` when the core provides it; otherwise runs the two
    engines here with the same seed. The model is left on ``engine``.
    """
    try:
        from pareprop.testing import engine_errors
    except ImportError:
        engine_errors = None
    if engine_errors is not None:
        # Float32: gradients that are zero by construction are rounding noise (see noise_floor).
        errors = engine_errors(model, inputs, engines=(engine,), seed=seed,
                               noise_floor=1e-4)[engine]
        set_engine(model, engine)
        return float(max(errors.values()))

    def run(name: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor | None]]:
        set_engine(model, name)
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=_rng_devices(inputs)):
            torch.manual_seed(seed)
            out = _logits(model(*inputs))
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
            (out * weights.to(out)).sum().backward()
        grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                 for n, p in model.named_parameters()}
        return out.detach(), grads

    ref_out, ref_grads = run("autograd")
    out, grads = run(engine)
    model.zero_grad(set_to_none=True)
    worst = _rel(out, ref_out)
    for name, ref in ref_grads.items():
        got = grads[name]
        if ref is None and got is None:
            continue
        if ref is None or got is None:
            return math.inf
        worst = max(worst, _rel(got, ref))
    return worst


def _rng_devices(inputs: Tuple[torch.Tensor, ...]) -> List[int]:
    return sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.double() - b.double()).norm().item()
    ref = b.double().norm().item()
    return diff / ref if ref > 0 else diff
