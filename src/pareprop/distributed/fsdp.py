"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with each reversible block as a unit.

NOTE [ FSDP2 and reversible blocks ]
    Units: each reversible block (the module holding F and G), each other child module that
    holds parameters and no reversible stack (embeddings, transition / fusion blocks, heads),
    and the root, which keeps what is left (position embeddings, final norms). Containers
    (ModuleList, stages) are walked into, not sharded as one unit.

    Gathering. FSDP gathers a unit's parameters in the pre-forward hook of the module's
    ``__call__``. The reversible engines call each block's ``f`` and ``g`` directly, in forward
    and in recomputation, so those hooks never fire; instead the engine asks the stack's
    :class:`_BlockSharding` to gather: ``block.unshard()`` before the block's forward and
    ``block.reshard()`` after it (when ``reshard_after_forward``), and in backward
    ``block.unshard()`` before its recomputation, with ``unshard(async_op=True)`` of the next
    block in recomputation order (the block below) as the explicit prefetch, issued on the lane
    that will wait for it (NOTE [ FSDP prefetch on the waiting lane ]). The unsharded
    parameters are the same tensor objects at every gather (FSDP refills their storage in
    place, preserving the version counter), so the graphs a stored block keeps from forward stay
    valid across a reshard, and the engine's check that parameters were not modified in place
    between forward and backward still holds. Under the autograd engine (and in eval / no-grad
    forwards) the stack calls each sharded block through its ``__call__``
    (``ReversibleBlock.forward`` is the same coupling), so FSDP's own hooks do everything.

    Gradients. A sharded block's parameters are not inputs of the engine's autograd Function
    (they are sharded DTensors there). The engine differentiates with respect to the gathered
    parameters, as always with ``torch.autograd.grad``, and hands the block's complete gradients
    to :meth:`_BlockSharding.reduce`, which accumulates them into the gathered parameters'
    ``.grad`` (exactly what autograd's AccumulateGrad does for an FSDP unit) and then runs the
    unit's post-backward: reduce-scatter into the sharded ``.grad`` (or keep accumulating when
    ``set_requires_gradient_sync(False)``) and reshard. So each block's gradients are
    reduce-scattered once, right after they are complete, and at most two blocks (PaReprop) or
    one (Reprop) are gathered in backward.

    What the public API lacks: FSDP2 has no public "reduce-scatter this unit's gradients now".
    Its post-backward runs from autograd nodes that the pre-forward hook inserts on the inputs of
    the module's ``forward``; the engine's recomputation is not such a graph (F and G are two
    calls, the unit is the block, and the gradients come from ``autograd.grad``, which fills no
    ``.grad``). So :func:`_post_backward` calls the unit's param group ``post_backward()``, the
    very method those nodes call: the one private touch point, kept in that function. Should a
    torch lack it, gradients are still exact: FSDP's end-of-backward callback runs
    post-backward for every unit whose hook did not fire, so all blocks reduce at the end of
    backward instead (more memory, same numbers; tests run both paths).


NOTE [ FSDP units called through other methods ]
    FSDP2 gathers a unit in the pre-forward hook of its ``__call__``, but the models call some
    units through other methods: MViT stages chain ``stage.forward_ends(x)`` (a stage without a
    reversible stack is one unit), checkpointed transition blocks run in chunks through
    ``block.forward_chunk(x, chunk)``, and users call the root's ``forward_features``,
    ``forward_head`` and ``forward_intermediates`` as in timm. Called so, a unit would compute
    with its sharded parameters ("got mixed torch.Tensor and DTensor"). So ``shard`` registers
    each such method of each unit with FSDP's public ``register_fsdp_forward_method``, which
    runs the unit's pre- and post-forward around the method.
    Those methods also run inside the unit's own ``forward`` (``forward`` is ``forward_chunk(x,
    None)``, the root's ``forward`` is ``forward_head(forward_features(x))``), where FSDP's hooks
    have already run. Run again there, the post-forward of the inner call would reshard the
    unit in the middle of its forward, with the rest of it still to compute. So the method runs
    FSDP's hooks only when called from outside the unit's ``__call__`` (a counter that the
    unit's own forward hooks raise and lower), and is the plain method inside it.
    ``register_fsdp_forward_method`` ships in ``torch.distributed.fsdp`` beside
    ``fully_shard`` (2.6 on); should a torch lack it, modules called through such methods are
    not made units at all: their parameters stay with the parent's unit, gathered with it
    (more memory, same numbers), and only direct calls of the root's methods stay unsupported.

NOTE [ FSDP prefetch on the waiting lane ]
    An explicit prefetch (``unshard(async_op=True)``) runs FSDP2's copy-in and all-gather on the
    current stream, so the all-gather buffer comes from that stream's allocator pool; the wait
    (``UnshardHandle.wait``) copies out of it on the then current stream and frees it on the
    host at once. Under PaReprop, gather(l) runs inside recover(l), on block l's lane, while the
    block below that it prefetches is rebuilt, and waited for, on the other lane. Issued from
    block l's lane, the buffer would go back to that lane's pool while the copy-out on the other
    lane is still queued, and grads(l), next on block l's lane and not ordered after that
    copy-out, could be handed the same memory: block l-1 rebuilt with corrupted weights. So the
    engine hands the sharding a ``prefetch_on(block)`` context for the duration of PaReprop's
    backward, and the prefetch is issued under the lane of the block that waits for it: buffer,
    copy-in, all-gather wait and copy-out all on one stream, whose later work runs after them.
    That lane first waits for the current one (where recover(l) has just waited for the step
    before it), so the buffer it allocates is ordered like recover's own allocations (NOTE
    [ Tensor lifetimes across streams ] in engine/backward.py); that wait costs nothing, since the
    lower lane's next work, grads(l+1), waits for the same events anyway. The prefetch still
    overlaps: its copy-in is a small kernel queued on the lower lane before grads(l+1), and the
    all-gather itself runs on the process group's own stream, alongside recover(l) and
    grads(l+1). (A synchronous unshard in recover(l-1) instead would be safe too, but would
    start each all-gather only when its block is about to be rebuilt.) Under Reprop every block
    runs on the main stream and ``prefetch_on`` is not set.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
import torch.distributed as tdist
import torch.nn as nn

from pareprop.engine import BlockSharding, ReversibleBlock, ReversibleStack, stacks_of

__all__ = ["shard", "fsdp_available", "is_sharded", "is_wrapper"]

# Norm layers stay with their parent's unit: a unit per LayerNorm costs a collective for a few
# hundred numbers.
_KEPT_WITH_PARENT = (nn.LayerNorm, nn.GroupNorm)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Methods called on a unit in place of its forward (NOTE [ FSDP units called through other
# methods ]): by the models (forward_ends, forward_chunk) and by timm-style callers.
_FORWARD_METHODS = (
    "forward_ends", "forward_chunk", "forward_features", "forward_head", "forward_intermediates",
)


def fsdp_available() -> bool:
    """True if this torch has FSDP2's ``fully_shard`` (PyTorch >= 2.6)."""
    try:  # FSDP2 is optional: older torch has none
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def is_wrapper(m: nn.Module) -> bool:
    """True for a data-parallel wrapper: DDP, FSDP1, or a module FSDP2 has sharded."""
    if isinstance(m, nn.parallel.DistributedDataParallel):
        return True
    try:  # FSDP is absent from torch builds without distributed
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(m, FullyShardedDataParallel):
            return True
    except ImportError:  # pragma: no cover - builds without distributed
        pass
    # FSDP2 (fully_shard) turns modules into subclasses named FSDP<Class>.
    return type(m).__name__.startswith("FSDP") and type(m).__name__ != "FSDPModule"


def is_sharded(model: nn.Module) -> bool:
    """True if ``model`` is an FSDP2 module (``fully_shard`` / :func:`shard` applied)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _fully_shard():
    try:  # FSDP2 is optional: older torch has none
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise RuntimeError(
            f"FSDP2 needs torch.distributed.fsdp.fully_shard (PyTorch >= 2.6); this is torch "
            f"{torch.__version__}. Upgrade PyTorch, or train with DDP (no --fsdp)"
        ) from e
    return fully_shard


def _forward_method_registrar() -> Optional[Callable[[nn.Module, str], None]]:
    """FSDP's ``register_fsdp_forward_method``, or None where this torch lacks it."""
    try:  # beside fully_shard since torch 2.6 (NOTE [ FSDP units called through other methods ])
        from torch.distributed.fsdp import register_fsdp_forward_method
    except ImportError:
        return None
    return register_fsdp_forward_method


def _forward_methods(module: nn.Module) -> List[str]:
    return [name for name in _FORWARD_METHODS if callable(getattr(module, name, None))]


def _register_forward_methods(
    unit: nn.Module, register: Callable[[nn.Module, str], None]
) -> None:
    """Make each of ``unit``'s :data:`_FORWARD_METHODS` gather it when called from outside its
    ``__call__`` (NOTE [ FSDP units called through other methods ])."""
    names = _forward_methods(unit)
    if not names:
        return
    depth = [0]  # how deep we are inside the unit's own __call__ (recursion, recomputation)

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    unit.register_forward_pre_hook(enter)
    unit.register_forward_hook(leave, always_call=True)
    for name in names:
        plain = getattr(unit, name)
        register(unit, name)  # sets unit.<name> to the method between FSDP's hooks
        _route(unit, name, plain, getattr(unit, name), depth)


def _route(unit: nn.Module, name: str, plain: Callable[..., Any],
           hooked: Callable[..., Any], depth: List[int]) -> None:
    def method(*args: Any, **kwargs: Any) -> Any:
        if depth[0]:  # inside the unit's forward: gathered already
            return plain(*args, **kwargs)
        depth[0] += 1
        try:
            return hooked(*args, **kwargs)
        finally:
            depth[0] -= 1

    setattr(unit, name, method)


def _post_backward(block: nn.Module) -> bool:
    """Run ``block``'s FSDP post-backward now (see the module NOTE); False where this torch
    does not expose it, leaving the reduction to FSDP's end-of-backward callback."""
    if not ENABLE_EARLY_REDUCE:
        return False
    state = getattr(block, "_get_fsdp_state", None)
    groups = getattr(state(), "_fsdp_param_groups", None) if state is not None else None
    if not groups or not all(callable(getattr(g, "post_backward", None)) for g in groups):
        return False
    for group in groups:
        group.post_backward()
    return True


# Tests switch this off to check the end-of-backward fallback.
ENABLE_EARLY_REDUCE = True


class _BlockSharding(BlockSharding):
    """What a sharded :class:`ReversibleStack`'s engine asks of FSDP, block by block (the
    engine's :class:`~pareprop.engine.BlockSharding`)."""

    def __init__(self, blocks: List[nn.Module], reshard_after_forward: bool):
        self.blocks = blocks
        self.reshard_after = reshard_after_forward
        self.pending: Dict[int, Any] = {}  # block index -> UnshardHandle of a prefetch
        # Enters the engine's lane of a block, set while PaReprop's backward runs; None: one
        # stream (NOTE [ FSDP prefetch on the waiting lane ]).
        self.prefetch_on: Optional[Callable[[int], ContextManager[None]]] = None

    def check_inputs(self, x1: torch.Tensor, x2: torch.Tensor) -> None:
        if not (x1.requires_grad or x2.requires_grad):
            raise ValueError(
                "a sharded ReversibleStack under a reversible engine needs stream inputs that "
                "require grad (the engine's backward carries the blocks' gradients); got two "
                "that do not. Use engine='autograd' for a stack fed by frozen inputs"
            )

    def _wait(self, index: int) -> None:
        handle = self.pending.pop(index, None)
        if handle is not None:
            handle.wait()

    def unshard_for_forward(self, index: int) -> None:
        self._wait(index)
        self.blocks[index].unshard()

    def reshard_after_forward(self, index: int) -> None:
        if self.reshard_after:
            self.blocks[index].reshard()

    def gather(self, index: int) -> None:
        """Before block ``index`` is recomputed: gather it, and prefetch the block below."""
        self._wait(index)
        self.blocks[index].unshard()
        below = index - 1
        if below >= 0 and below not in self.pending:
            # On the lane that waits for it: NOTE [ FSDP prefetch on the waiting lane ].
            lane = (contextlib.nullcontext() if self.prefetch_on is None
                    else self.prefetch_on(below))
            with lane:
                self.pending[below] = self.blocks[below].unshard(async_op=True)

    def reduce(
        self, index: int, params: List[torch.Tensor], grads: List[Optional[torch.Tensor]]
    ) -> None:
        """Block ``index``'s gradients are complete: into ``.grad``, then FSDP reduces."""
        for p, g in zip(params, grads):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g
        _post_backward(self.blocks[index])


def _units(module: nn.Module, methods_gather: bool = True) -> List[nn.Module]:
    """Children of ``module`` (recursively through containers and modules holding a stack)
    that become their own unit, innermost first; reversible stacks are handled apart.
    ``methods_gather`` False: modules called through :data:`_FORWARD_METHODS` stay with their
    parent's unit (NOTE [ FSDP units called through other methods ])."""
    units: List[nn.Module] = []
    for child in module.children():
        if isinstance(child, ReversibleStack):
            continue
        holds_stack = bool(stacks_of(child))
        if holds_stack or isinstance(child, _CONTAINERS):
            units += _units(child, methods_gather)
        elif (
            not isinstance(child, _KEPT_WITH_PARENT)
            and any(True for _ in child.parameters())
            and (methods_gather or not _forward_methods(child))
        ):
            units.append(child)
    return units


def shard(
    model: nn.Module,
    mesh: Any = None,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` with FSDP2, one unit per reversible block, for every engine.

    Args:
        model: a pareprop model (or any module holding :class:`ReversibleStack` s), on its
            device, not yet wrapped.
        mesh: the 1-D device mesh to shard over; default all processes of the default group.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``; default none.
        reshard_after_forward: free each unit's gathered parameters after its forward (and
            gather again in backward); False keeps them until backward (more memory, fewer
            all-gathers).

    Returns:
        ``model`` itself, now an ``FSDPModule`` (the optimizer must be built after this).

    Raises:
        RuntimeError: this torch has no ``fully_shard``, or no process group is initialised.
        ValueError: the model is already wrapped.
    """
    fully_shard = _fully_shard()
    if not tdist.is_available() or not tdist.is_initialized():
        raise RuntimeError(
            "shard needs an initialised process group: start with torchrun, or call "
            "torch.distributed.init_process_group first"
        )
    if any(is_wrapper(m) for m in model.modules()):
        raise ValueError("the model already holds a DDP/FSDP wrapper; shard the bare model once")
    kwargs: Dict[str, Any] = {"reshard_after_forward": bool(reshard_after_forward)}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for _, stack in stacks_of(model):
        blocks = list(stack.blocks)
        for block in blocks:
            if not isinstance(block, ReversibleBlock):
                raise TypeError(f"expected ReversibleBlock units, got {type(block).__name__}")
            fully_shard(block, **kwargs)
        stack.sharding = _BlockSharding(blocks, bool(reshard_after_forward))
    register = _forward_method_registrar()
    units = [*_units(model, methods_gather=register is not None), model]
    for unit in units:
        fully_shard(unit, **kwargs)
    if register is not None:
        for unit in units:
            _register_forward_methods(unit, register)
    return model
