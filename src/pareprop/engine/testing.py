"""Check a model's gradients under every engine against plain autograd.

Used by pareprop's own tests, by ``pareprop bench`` for its quick agreement check, and by
users who write their own reversible blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from pareprop.engine.stack import REVERSIBLE_ENGINES, set_stack_engine, stacks_of

__all__ = ["engine_errors", "relative_error", "worst_error", "one_step"]

Tensor = torch.Tensor


def relative_error(value: Optional[Tensor], reference: Optional[Tensor]) -> float:
    """``||value - reference|| / ||reference||``; a missing gradient counts as zeros."""
    if value is None and reference is None:
        return 0.0
    if value is None:
        value = torch.zeros_like(reference)
    if reference is None:
        reference = torch.zeros_like(value)
    diff = (value.double() - reference.double()).norm().item()
    scale = reference.double().norm().item()
    if scale == 0.0:
        return diff
    return diff / scale


def _flatten(output: Any) -> List[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _flatten(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _flatten(item)]
    raise TypeError(f"cannot compare a model output of type {type(output).__name__}")



def _projection_loss(outputs: List[Tensor], seed: int) -> Tensor:
    """A fixed random projection, so that every output element gets its own gradient. It is
    computed in at least float32, so low-precision outputs are compared on the same loss."""
    gen = torch.Generator().manual_seed(seed + 1)
    total = 0.0
    for o in outputs:
        o = o if o.dtype == torch.float64 else o.float()
        # Drawn in float64 whatever the output's dtype: a float32 and a float64 draw from one
        # seed are different numbers, which would make a float64 reference a different loss.
        weights = torch.randn(o.shape, generator=gen, dtype=torch.float64)
        total = total + (o * weights.to(o.device, o.dtype)).sum()
    return total


def one_step(model, inputs, engine, seed, loss_fn, kwargs):
    """One seeded forward and backward with ``engine``: (outputs, input grads, param grads)."""
    set_stack_engine(model, engine)
    model.zero_grad(set_to_none=True)
    leaves = [
        x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, Tensor) else x
        for x in inputs
    ]
    devices = sorted({x.device.index or 0 for x in leaves if isinstance(x, Tensor) and x.is_cuda})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        outputs = _flatten(model(*leaves, **kwargs))
        loss = _projection_loss(outputs, seed) if loss_fn is None else loss_fn(outputs)
        loss.backward()
    input_grads = [x.grad for x in leaves if isinstance(x, Tensor) and x.requires_grad]
    param_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return [o.detach() for o in outputs], input_grads, param_grads


def engine_errors(
    model: nn.Module,
    inputs: Union[Tensor, Sequence[Any]],
    engines: Iterable[str] = REVERSIBLE_ENGINES,
    seed: int = 0,
    loss_fn: Optional[Callable[[List[Tensor]], Tensor]] = None,
    noise_floor: float = 0.0,
    **forward_kwargs: Any,
) -> Dict[str, Dict[str, float]]:
    """Relative errors of each engine's output and gradients against the autograd engine.

    Runs one training-mode forward and backward per engine from the same seed, so dropout and
    drop-path draw the same masks. The global RNG and the model's engine are left as found.

    ``noise_floor``: a parameter whose reference gradient is smaller than this fraction of the
    largest parameter gradient (norms) has its error measured against that largest gradient.
    Some gradients are zero by construction (MViTv2's key-norm bias: softmax ignores a shift
    shared by all keys), and at low precision their rounding noise compared with rounding
    noise is no error. 0 (the default, for float64 tests) keeps every error relative.

    Returns:
        ``{engine: {key: error}}`` with keys ``"output"``, ``"input:<i>"`` (floating inputs)
        and ``"param:<name>"`` (every trainable parameter).
    """
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    # Each stack's own engine, put back after: a model's stacks may run different engines.
    original, was_training = [(m, m.engine) for _, m in stacks_of(model)], model.training
    model.train()
    try:
        ref = one_step(model, inputs, "autograd", seed, loss_fn, forward_kwargs)
        norms = {n: float(g.double().norm()) for n, g in ref[2].items() if g is not None}
        largest = max(norms.values(), default=0.0)
        report: Dict[str, Dict[str, float]] = {}
        for engine in engines:
            got = one_step(model, inputs, engine, seed, loss_fn, forward_kwargs)
            errors = {"output": max(relative_error(a, b) for a, b in zip(got[0], ref[0]))}
            for i, (a, b) in enumerate(zip(got[1], ref[1])):
                errors[f"input:{i}"] = relative_error(a, b)
            for name, b in ref[2].items():
                err = relative_error(got[2][name], b)
                if b is not None and norms[name] < noise_floor * largest:
                    err = err * norms[name] / largest if norms[name] > 0 else err / largest
                errors[f"param:{name}"] = err
            report[engine] = errors
    finally:
        for stack, engine in original:
            stack.set_engine(engine)
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return report


def worst_error(report: Dict[str, Dict[str, float]]) -> Tuple[str, str, float]:
    """``(engine, key, error)`` of the largest error in an :func:`engine_errors` report."""
    return max(
        ((engine, key, err) for engine, errs in report.items() for key, err in errs.items()),
        key=lambda item: item[2],
    )
