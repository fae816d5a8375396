"""Backward of one block, whole branches: recover and grads.

recover(l) rebuilds block l's local graphs and inputs from its outputs (a stored block hands
over the graphs it built in forward); grads(l) backpropagates through them. Both engines are
schedules of these two steps (:mod:`pareprop.engine.backward`); chunked blocks do the same a
chunk at a time (:mod:`pareprop.engine.chunked`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from pareprop.engine.block import ReversibleBlock, _skip, _unskip, skip_scale
from pareprop.engine.forward import _call_checked, _drawing
from pareprop.engine.plan import _Plan, _plan_beta, _Rebuilt

Tensor = torch.Tensor


# NOTE [ Recomputing with the forward's parameters ]
# Recomputation must see the very parameter tensors that forward used. Two things could break
# that silently: a parameter modified in place between forward and backward (an optimizer
# step too early), which we refuse; and parameters swapped for the duration of forward only
# (torch.func.functional_call), which we swap in again while recomputing.


@contextlib.contextmanager
def _forward_parameters(plan: _Plan, index: int) -> Iterator[None]:
    swapped = []
    try:
        for loc in plan.block_locations[index]:
            if loc.tensor._version != loc.version:
                raise RuntimeError(
                    f"parameter {loc.name!r} of block {index} ({type(plan.blocks[index]).__name__})"
                    " was modified in place between forward and backward (an optimizer step "
                    "before backward?); the reversible engines recompute with it, so its "
                    "gradients would be wrong"
                )
            current = loc.module._parameters[loc.name]
            if current is not loc.tensor:
                swapped.append((loc.module, loc.name, current))
                loc.module._parameters[loc.name] = loc.tensor
        yield
    finally:
        for module, name, current in reversed(swapped):
            module._parameters[name] = current


def _relative_error(a: Tensor, b: Tensor) -> float:
    scale = b.double().norm().item()
    return (a.double() - b.double()).norm().item() / (scale if scale > 0 else 1.0)


def _profiled(label: str) -> Callable:
    """Name a backward phase in profiler traces (``torch.profiler``: ``pareprop::recover``,
    the rebuild of a block's inputs; ``pareprop::grads``, its gradients), so where the
    reversible engines spend their time can be read off a profile. Free without a profiler."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return run

    return wrap


@_profiled("pareprop::recover")
def _recover(plan: _Plan, index: int, y1: Tensor, y2: Tensor) -> _Rebuilt:
    if plan.sharding is not None:
        plan.sharding.gather(index)
    if plan.stored[index]:
        return _take_stored(plan, index)
    block, record = plan.blocks[index], plan.records[index]
    plan.keywords.check(index, block)
    with torch.enable_grad(), plan.autocast.replay(), plan.backends.replay(), \
            record.modes.replay(), _forward_parameters(plan, index):
        y1 = y1.detach().requires_grad_(True)
        with _as_in_forward(plan, index, "g"):
            g_out = _call_checked(block, "g", y1, plan.kwargs)
        beta = _plan_beta(plan, index)
        with torch.no_grad():
            x2 = _unskip(beta, y2 - g_out).requires_grad_(True)
        with _as_in_forward(plan, index, "f"):
            f_out = _call_checked(block, "f", x2, plan.kwargs)
        with torch.no_grad():
            x1 = _unskip(beta, y1 - f_out)
    if record.inputs is not None:
        _check_reconstruction(plan, index, (x1, x2), record.inputs)
    return _Rebuilt(y1, g_out, x2, f_out, x1)


@contextlib.contextmanager
def _as_in_forward(plan: _Plan, index: int, branch: str) -> Iterator[None]:
    """Block ``index``'s F or G recomputed drawing what forward drew: the generators put back to
    forward's state before the call (NOTE [ Exact replay of randomness ] in replay.py), or in a
    captured step the branch's backward stream (NOTE [ Randomness in CUDA graphs ])."""
    if plan.graph_rng is not None:
        with plan.graph_rng.recompute(index, branch):
            yield
        return
    record = plan.records[index]
    (record.f_rng if branch == "f" else record.g_rng).restore(plan.device)
    yield


# NOTE [ Stored blocks ]
# A stored block keeps its graphs from forward, as under autograd, and is not recomputed: the
# memory dial of pareprop.set_memory_budget. In forward it builds exactly the two local graphs
# that recover() would rebuild (F from a leaf X2, G from a leaf Y1), so grads() treats stored
# and rebuilt blocks alike, and the saved tensors are autograd's own (so activation_bytes and
# torch's memory tools see them). Its outputs are not kept: the block above rebuilds them, or
# keeps them in its own graph if it is stored too. Its input X1 is kept only when the block
# below is recomputed, which needs it (X2 is in the graph of F already). The whole stack stays
# one autograd Function, so parameters are still its inputs and PaReprop's schedule is
# unchanged: recover() of a stored block hands over its graphs, and its grads run on the main
# stream, where its forward kernels ran, overlapping with the recover of the block below.


def _store(
    block: ReversibleBlock,
    x1: Tensor,
    x2: Tensor,
    kwargs: Dict[str, Any],
    keep_x1: bool,
    rng: Optional[Any] = None,
    index: int = 0,
) -> _Rebuilt:
    """Forward of a stored block, building the graphs that recover() would rebuild. ``rng``:
    the branches' streams in a captured step (block ``index``), None outside one."""
    # F and G take views of the detached inputs, not the leaves themselves: tools that hook
    # module inputs in forward (torch's ModTracker, inside MemTracker and so plan_memory) ask
    # autograd, when our nested autograd.grad runs, whether each input's node will execute,
    # which autograd cannot answer for a leaf. A view costs no memory, and the gradient
    # captured at it is the leaf's.
    with torch.enable_grad():
        x2_in = x2.detach().requires_grad_(True).view_as(x2)
        with _drawing(rng, index, "f"):
            f_out = _call_checked(block, "f", x2_in, kwargs)
        with torch.no_grad():
            y1 = _skip(skip_scale(block), x1) + f_out
        y1_in = y1.detach().requires_grad_(True).view_as(y1)
        with _drawing(rng, index, "g"):
            g_out = _call_checked(block, "g", y1_in, kwargs)
    return _Rebuilt(y1_in, g_out, x2_in, f_out, x1 if keep_x1 else None)


def _take_stored(plan: _Plan, index: int) -> _Rebuilt:
    rebuilt = plan.graphs[index]
    if rebuilt is None:
        raise RuntimeError(
            f"block {index} is stored and its graph was freed by an earlier backward; a second "
            "backward through a stack with stored blocks is not supported, even with "
            "retain_graph=True (call stack.store_blocks([]) to recompute every block)"
        )
    plan.graphs[index] = None  # freed as soon as its gradients are computed, as under autograd
    return rebuilt


def _check_reconstruction(
    plan: _Plan, index: int, rebuilt: Tuple[Tensor, Tensor], actual: Tuple[Tensor, Tensor]
) -> None:
    errors = tuple(_relative_error(r.detach(), a) for r, a in zip(rebuilt, actual))
    plan.reconstruction_errors[index] = errors
    tol = plan.debug_tolerance
    if tol is not None and max(errors) > tol:
        warnings.warn(
            f"block {index} ({type(plan.blocks[index]).__name__}): rebuilt inputs differ from "
            f"the forward's by relative error X1 {errors[0]:.3e}, X2 {errors[1]:.3e} "
            f"(tolerance {tol:.1e}); is F or G not a pure function of its input?",
            RuntimeWarning,
            stacklevel=2,
        )


def _vjp(out: Tensor, inputs: List[Tensor], grad_out: Tensor) -> List[Optional[Tensor]]:
    if not out.requires_grad:  # F or G ignores its input and has no trainable parameter
        return [None] * len(inputs)
    return list(
        torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True)
    )


@_profiled("pareprop::grads")
def _grads(
    plan: _Plan,
    index: int,
    rebuilt: _Rebuilt,
    dy1: Tensor,
    dy2: Tensor,
    param_grads: List[Optional[Tensor]],
) -> Tuple[Tensor, Tensor]:
    owned = plan.block_params[index]
    params = [p for _, p in owned]
    if plan.sharding is not None:  # a sharded block's gradients go to FSDP, not the Function
        param_grads = [None] * len(owned)
    beta = _plan_beta(plan, index)
    # Y2 = beta X2 + G(Y1): dY2 flows into G, whose input gradient joins dY1.
    g_in, *g_params = _vjp(rebuilt.g_out, [rebuilt.y1, *params], dy2)
    dy1_total = dy1 if g_in is None else dy1 + g_in
    # Y1 = beta X1 + F(X2): the total dY1 flows into F, whose input gradient joins beta dY2.
    f_in, *f_params = _vjp(rebuilt.f_out, [rebuilt.x2, *params], dy1_total)
    dx2 = _skip(beta, dy2) if f_in is None else _skip(beta, dy2) + f_in
    _add_param_grads(owned, g_params, param_grads)
    _add_param_grads(owned, f_params, param_grads)
    if plan.sharding is not None:
        plan.sharding.reduce(index, params, param_grads)
    return _skip(beta, dy1_total), dx2


def _add_param_grads(
    owned: List[Tuple[int, Tensor]],
    grads: Sequence[Optional[Tensor]],
    param_grads: List[Optional[Tensor]],
    sums: Optional[Set[int]] = None,
) -> None:
    """Add ``grads`` into ``param_grads``: a parameter shared by F and G, by several chunks or
    by several blocks sums its gradients. ``sums`` holds the ids of sums made here, which are
    ours to add into in place (a gradient autograd returned may alias another tensor, such as
    the gradient flowing in); chunks add many times, so this keeps one sum per parameter."""
    for (slot, _), grad in zip(owned, grads):
        if grad is None:
            continue
        previous = param_grads[slot]
        if previous is None:
            param_grads[slot] = grad
        elif sums is not None and id(previous) in sums:
            previous.add_(grad)
        else:
            param_grads[slot] = previous + grad
            if sums is not None:
                sums.add(id(param_grads[slot]))
