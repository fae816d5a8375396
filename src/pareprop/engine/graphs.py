"""CUDA graphs of a stack's training step: its forward and its backward, each replayed in one
launch, so that the host stops setting the pace at small batches.

NOTE [ CUDA graphs of a stack ]
    At small per-GPU batches a step is host-bound: the device finishes each kernel before the
    host has issued the next (on an H200 Rev-ViT-L's autograd step barely moves from batch 8 to
    32), and the reversible engines issue about twice autograd's kernels. A second CUDA stream
    cannot make the host faster; replaying captured kernels can. A stack under
    ``cuda_graphs=True`` (``pareprop.set_engine(model, engine, cuda_graphs=True)``) captures its
    training forward and its backward, under its engine, as two CUDA graphs, the way
    ``torch.cuda.make_graphed_callables`` graphs a module (torch's "partial-network capture":
    the embedding, the head, the loss and the optimizer stay eager), and replays them:

    * warm-up: the first ``WARMUP_STEPS`` training forwards of a stack run eagerly (kernels
      are chosen, workspaces made, compiled F and G compiled); the next one captures;
    * capture: the inputs and tensor keywords are cloned into static buffers; forward is
      captured on them, with aliases of the parameters swapped in (NOTE [ Parameter aliases in
      a capture ]), then at once backward, with ``torch.autograd.grad`` of the captured
      outputs against the inputs and the aliases, with autocast off as in ``loss.backward()``;
      both graphs share one private memory pool per stack. The engine runs unchanged inside:
      PaReprop's side stream joins the capture through its ``wait_stream`` from the capturing
      stream and rejoins it at the end (``_Lanes.join``), so the backward graph keeps the two
      lanes as two branches of one graph;
    * replay: each training forward copies its inputs (and tensor keywords that changed) into
      the static buffers, replays the forward graph and returns copies of its outputs; backward
      copies the gradients coming in, replays the backward graph and returns new tensors with
      its gradients, which autograd adds into ``.grad`` as it does for any Function
      (gradient accumulation and DDP's hooks work as without graphs). Warm-up, capture and
      replays all run with autocast's weight cache off (NOTE [ Autocast's weight cache under
      CUDA graphs ]), so compiled F and G are compiled in warm-up, never in the capture.

    A replay redoes the kernels, not the host code that chose them. So what the host decided
    at capture is checked at every call (:class:`_Guards`): the inputs' shapes, dtypes and
    devices, the keywords, autocast and backend flags, the parameters' and buffers' storage,
    the modules' training flags and dropout rates. A call that differs is refused, naming what
    changed (``set_engine`` again captures anew); so is a parameter modified in place between
    a forward and its backward, a second forward before the backward of the first (its replay
    would overwrite what that backward reads), and a second backward. Randomness: each branch
    draws from its own stream (NOTE [ Randomness in CUDA graphs ] in replay.py).

    Refused (a ValueError naming the option): inputs not on a CUDA device; chunked branches
    (a chunk count is chosen on the host per input; chunking is for large batches, graphs for
    small ones); FSDP2 sharding (collectives and hooks around each block); checkpointed blocks
    (``torch.utils.checkpoint`` reads the CUDA generator state on the host, which a capture
    refuses); ``debug_reconstruction`` (it reads errors with ``.item()``); the fallback to
    Reprop (it times eager backward passes: choose the engine). Not checked: host-side
    randomness or data-dependent Python inside a custom block's F or G (a capture freezes it).

    Speed is not measured yet: ``benchmarks/small_batch.py --graphs`` (run by
    ``benchmarks/gpu.sh``) times it beside the eager engines. Memory: the pool keeps the
    step's activations, and the parameter gradients exist twice (in the pool, and in ``.grad``).
    On the CPU, tests replace :func:`backend_for` with :class:`_EagerStandIn`, which runs the
    same capture and replay code eagerly (float64, against plain autograd).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pareprop.engine.lanes import _side_stream
from pareprop.engine.replay import (
    _AutocastState,
    _BackendState,
    _block_rates,
    _CpuBranchRng,
    _CudaBranchRng,
    _has_autocast,
)

Tensor = torch.Tensor

WARMUP_STEPS = 2  # eager training forwards of a stack before it captures

_GRAPH_API = ((torch.cuda.CUDAGraph, "register_generator_state"),
              (torch.Generator, "clone_state"), (torch.Generator, "graphsafe_get_state"),
              (torch.Generator, "graphsafe_set_state"), (torch.Generator, "get_offset"),
              (torch.Generator, "set_offset"))


def _off_hint(what: str) -> str:
    return f"{what}, or turn CUDA graphs off: pareprop.set_engine(model, engine, cuda_graphs=False)"


def backend_for(device: torch.device) -> Any:
    """What captures and replays a stack's step on ``device``: CUDA graphs, on CUDA only.
    Tests replace this function with one returning :class:`_EagerStandIn` to run the same
    steps on the CPU."""
    if device.type != "cuda":
        raise ValueError(
            f"cuda_graphs=True captures a stack's work as CUDA graphs, but its inputs are on "
            f"{device}; " + _off_hint("move the model and its inputs to a CUDA device"))
    missing = [f"{owner.__name__}.{name}" for owner, name in _GRAPH_API
               if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(
            f"cuda_graphs=True needs graph-safe generator states, which torch {torch.__version__}"
            f" lacks ({', '.join(missing)}); " + _off_hint("upgrade torch"))
    return _CudaGraphs(device)


class _CudaGraphs:
    """Captures on a CUDA device: one private memory pool per stack, shared by its two graphs
    (captured forward then backward, replayed in the same order)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def branch_rng(self, seeds: Dict[Tuple[int, str], int]) -> _CudaBranchRng:
        return _CudaBranchRng(self.device, seeds)

    def capture(self, fn: Callable[[], None], states: List[Any]) -> "torch.cuda.CUDAGraph":
        graph = torch.cuda.CUDAGraph()
        for state in states:  # before the capture begins (NOTE [ Randomness in CUDA graphs ])
            graph.register_generator_state(state)
        _side_stream(self.device)  # PaReprop's side stream, made outside the capture
        with torch.cuda.graph(graph, pool=self.pool):  # the weight cache is off: _StackGraphs
            fn()
        return graph


class _EagerStandIn:
    """A CUDA graph's stand-in for tests on the CPU (or the meta device): capturing runs the
    function once, and each replay runs it again, writing into the first run's tensors, as a
    replay writes into the captured ones. The branches' streams live on the CPU generator."""

    def branch_rng(self, seeds: Dict[Tuple[int, str], int]) -> _CpuBranchRng:
        return _CpuBranchRng(seeds)

    def capture(self, fn: Callable[[], None], states: List[Any]) -> Any:
        fn()
        return types.SimpleNamespace(replay=fn)


# NOTE [ Autocast's weight cache under CUDA graphs ]
# Autocast's weight cache would hand a capture casts made before it, whose memory is freed
# when the user's autocast region ends (torch.cuda.make_graphed_callables refuses the cache for
# this reason), so a stack captures with the cache off: its casts are made in the graph. The
# cache's state is also one of the global flags Dynamo guards a compiled frame on: compiled F
# and G (pareprop.compile_blocks) warmed up with the cache on would be compiled again inside
# the capture, where Inductor's compilation and autotuning synchronize the device. So every
# training forward of a graphed stack runs with the cache off, the eager warm-up steps as the
# capture (and the replays, which matters to the CPU stand-in only), and recomputation runs
# with the state its forward had (NOTE [ Autocast in recomputation ] in replay.py), on
# whichever thread autograd runs it: every compiled call is compiled in warm-up, and the
# capture and its replays compile nothing. Under autocast the warm-up steps cast each weight
# at each use, as the captured step does.


@contextlib.contextmanager
def _weight_cache_off() -> Iterator[None]:
    """Autocast's weight cache off (NOTE [ Autocast's weight cache under CUDA graphs ])."""
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cache)


def _meta(t: Tensor) -> Tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device, t.requires_grad


def _keywords_key(kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    leaves, spec = tree_flatten(kwargs)
    return spec, tuple(_meta(v) if isinstance(v, Tensor) else v for v in leaves)


class _Guards:
    """What the host decided a step by, recorded once and checked at every call, each check
    named for the refusal's message (NOTE [ CUDA graphs of a stack ]). Lists of references,
    not a walk of the module tree: a few hundred microseconds at most for Rev-ViT-L."""

    def __init__(self, stack: nn.Module, x1: Tensor, x2: Tensor, kwargs: Dict[str, Any]):
        self.inputs = (_meta(x1), _meta(x2))
        self.keywords = _keywords_key(kwargs)
        self.autocast = _AutocastState.capture(x1.device)
        self.backends = _BackendState.capture()
        modules = list(stack.modules())
        self.params = [(m._parameters, n, p, p.data_ptr(), p.requires_grad)
                       for m in modules for n, p in m._parameters.items() if p is not None]
        self.buffers = [(m._buffers, n, b, b.data_ptr())
                        for m in modules for n, b in m._buffers.items() if b is not None]
        self.modes = [(m, m.training) for m in modules]
        self.rates = [(m, attr, value) for block in stack.blocks
                      for m, _, attr, value in _block_rates(block)]

    def changed(self, x1: Tensor, x2: Tensor, kwargs: Dict[str, Any]) -> List[str]:
        found = []
        if (_meta(x1), _meta(x2)) != self.inputs:
            found.append("the inputs' shapes, dtypes, devices or requires_grad")
        if _keywords_key(kwargs) != self.keywords:
            found.append("the keyword arguments (tensor shapes, other values)")
        if _AutocastState.capture(x1.device) != self.autocast:
            found.append("the autocast state")
        if _BackendState.capture() != self.backends:
            found.append("the backend flags (SDPA kernels, cuDNN, TF32)")
        if any(d.get(n) is not p or p.data_ptr() != ptr or p.requires_grad != grad
               for d, n, p, ptr, grad in self.params):
            found.append("the parameters (replaced, moved, or requires_grad changed)")
        if any(d.get(n) is not b or b.data_ptr() != ptr for d, n, b, ptr in self.buffers):
            found.append("the buffers (replaced)")
        if any(m.training != flag for m, flag in self.modes):
            found.append("the modules' training flags")
        if any(getattr(m, attr) != value for m, attr, value in self.rates):
            found.append("the dropout or drop-path rates")
        return found


def _refusals(stack: nn.Module) -> List[str]:
    """What in ``stack``'s configuration a capture cannot run, each with the way out."""
    found = []
    if stack.chunking is not None:
        found.append("chunked branches (pareprop.set_chunking): a chunk count is chosen on the "
                     "host for each input; chunking is for large batches, CUDA graphs for small "
                     "ones. " + _off_hint("Turn chunking off with pareprop.set_chunking(model)"))
    if stack.sharding is not None:
        found.append("an FSDP2-sharded stack (pareprop.distributed.shard): its gathers and "
                     "gradient reductions are collectives around each block. "
                     + _off_hint("Use DDP"))
    if stack.checkpoint_blocks:
        found.append("checkpointed blocks (set_block_checkpointing): torch.utils.checkpoint "
                     "saves the CUDA generator's state with torch.cuda.get_rng_state, which a "
                     "capture refuses. " + _off_hint("Use engine 'reversible'"))
    if stack._debug_tolerance is not None:
        found.append("debug_reconstruction: it reads each block's error on the host (.item()), "
                     "a device sync that a capture refuses. " + _off_hint(
                         "Disarm it with debug_reconstruction(model, None)"))
    return found


def check_capturable(stack: nn.Module, label: str) -> None:
    """Refuse, naming the option, what :func:`_refusals` finds in ``stack``."""
    found = _refusals(stack)
    if found:
        raise ValueError(f"{label}: cuda_graphs=True cannot capture " + found[0])


class _StackGraphs:
    """One stack's CUDA graphs: eager warm-up steps, then one captured step, replayed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Capture anew at the next training forward (after the warm-up steps)."""
        self.backend: Optional[Any] = None
        self.warm: Optional[_Guards] = None  # the warm-up steps' settings
        self.warmed = 0
        self.captured: Optional[_Captured] = None

    # A copy of a model (EMA, deepcopy) or a pickled one warms up and captures for itself.
    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.reset()

    def status(self) -> str:
        if self.captured is not None:
            return f"captured (inputs {tuple(self.captured.inputs[0].shape)})"
        return f"warming up ({self.warmed} of {WARMUP_STEPS} eager steps)"

    @torch.compiler.disable
    def run(self, stack: nn.Module, x1: Tensor, x2: Tensor, kwargs: Dict[str, Any],
            label: str) -> Tuple[Tensor, Tensor]:
        check_capturable(stack, label)
        if self.backend is None:
            self.backend = backend_for(x1.device)
        if not (x1.requires_grad or x2.requires_grad
                or any(p.requires_grad for p in stack.parameters())):
            return stack._run(x1, x2, kwargs)  # nothing to differentiate
        if self.captured is None:
            if self.warm is None or self.warm.changed(x1, x2, kwargs):
                self.warm, self.warmed = _Guards(stack, x1, x2, kwargs), 0
            if self.warmed < WARMUP_STEPS:
                self.warmed += 1
                with _weight_cache_off():
                    return stack._run(x1, x2, kwargs)
            self.captured = _Captured(stack, self.backend, x1, x2, kwargs)
        else:
            changed = self.captured.guards.changed(x1, x2, kwargs)
            if changed:
                raise ValueError(
                    f"{label} was captured as CUDA graphs for inputs of shape "
                    f"{tuple(self.captured.inputs[0].shape)}, and since then "
                    f"{' and '.join(changed)} changed: a captured step replays what the host "
                    "decided at capture, so shapes and settings must stay as they were (a "
                    "DataLoader's drop_last=True keeps the batch size). Call "
                    "pareprop.set_engine(model, engine, cuda_graphs=True) again to capture anew")
        return self.captured(x1, x2, kwargs)


class _Turn:
    """One replayed forward, until its backward: the parameters' versions at forward."""

    def __init__(self, versions: List[int]):
        self.versions = versions
        self.done = False


def _no_autocast(device: torch.device) -> contextlib.ExitStack:
    """Autocast off, as in ``loss.backward()`` called after the autocast region (captured
    backward runs inside the user's forward, so inside its autocast region)."""
    stack = contextlib.ExitStack()
    for device_type in {"cpu", device.type}:
        if _has_autocast(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


# NOTE [ Parameter aliases in a capture ]
# The captured backward differentiates with torch.autograd.grad, inside the capture. With
# respect to the parameters themselves it would end at their AccumulateGrad nodes, and a node
# made before the capture, on the stream that was current then, is one autograd hands the
# gradient to on that stream: it makes that stream wait for the capturing stream, an event
# recorded inside the capture, which the capture refuses (or joins the stream into it). Such
# nodes live as long as something holds them: DDP's reducer holds every parameter's, made on
# the default stream when DDP wraps the model, to hook its gradient reduction on them (so do
# register_post_accumulate_grad_hook and torch's optimizer-in-backward). So, as PaReprop's
# lanes do (NOTE [ Parameter aliases on the lanes ] in lanes.py), the captured forward runs
# with per-capture aliases swapped into the modules: ``nn.Parameter(p.detach())``, the same
# storage and version counter, a new leaf whose AccumulateGrad node is made inside the capture
# (and of the same type, so compiled F and G are not compiled again for it). Backward
# differentiates with respect to the aliases, and the replay hands their gradients to autograd
# as the gradients of the real parameters, inputs of :class:`_GraphedStack`: their
# AccumulateGrad nodes, and DDP's hooks on them, run eagerly after the replay, as for any
# Function. Recomputation swaps the aliases in again itself (NOTE [ Recomputing with the
# forward's parameters ] in rebuild.py); outside the captured forward the modules hold the
# real parameters, which is what the checks at every call compare.


class _Captured:
    """A stack's captured step: static inputs, outputs and gradients, and its two graphs."""

    def __init__(self, stack: nn.Module, backend: Any, x1: Tensor, x2: Tensor,
                 kwargs: Dict[str, Any]):
        self.guards = _Guards(stack, x1, x2, kwargs)
        self.stack = weakref.ref(stack)  # the stack holds this object
        named = [(n, p) for n, p in stack.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # NOTE [ Parameter aliases in a capture ]
        aliases = {id(p): nn.Parameter(p.detach(), requires_grad=True) for p in self.params}
        self.aliases = [aliases[id(p)] for p in self.params]
        self.slots = [(m._parameters, n, aliases[id(p)]) for m in stack.modules()
                      for n, p in m._parameters.items() if p is not None and id(p) in aliases]
        with torch.no_grad():
            self.inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in (x1, x2)]
            leaves, self.spec = tree_flatten(kwargs)
            self.keywords = [v.detach().clone() if isinstance(v, Tensor) else v for v in leaves]
        # The tensor each keyword was last copied from, and its version: a mask a model keeps
        # (Rev-Swin's window masks) is copied once, not at every step.
        self.sources: List[Optional[Tuple[Tensor, int]]] = [
            (v, v._version) if isinstance(v, Tensor) else None for v in leaves]
        self.wants = [x for x in self.inputs if x.requires_grad] + self.aliases
        seeds = torch.randint(0, 2**62, (2 * len(stack.blocks),)).tolist()
        self.rng = backend.branch_rng({(i, branch): seeds[2 * i + k]
                                       for i in range(len(stack.blocks))
                                       for k, branch in enumerate(("f", "g"))})
        self.outputs: Optional[List[Tensor]] = None
        self.grads: Optional[List[Optional[Tensor]]] = None
        self._live: Optional[List[Tensor]] = None  # captured outputs, with their graph
        self.turn: Optional[weakref.ref] = None
        with _weight_cache_off():  # as in warm-up (the guards above hold the caller's state)
            self.forward_graph = backend.capture(self._forward, self.rng.states("forward"))
            self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
            self.backward_graph = backend.capture(self._backward, self.rng.states("backward"))

    # -- what is captured ---------------------------------------------------------------------

    def _forward(self) -> None:
        stack = self.stack()
        kwargs = tree_unflatten(self.keywords, self.spec)
        stack._graph_rng = self.rng
        real = [(slot, name, slot[name]) for slot, name, _ in self.slots]
        for slot, name, alias in self.slots:  # recomputation swaps them in again itself
            slot[name] = alias
        try:
            with torch.enable_grad():
                outs = list(stack._run(*self.inputs, kwargs))
        finally:
            stack._graph_rng = None
            for slot, name, param in real:
                slot[name] = param
        self._live = outs
        detached = [o.detach() for o in outs]
        if self.outputs is None:
            self.outputs = detached
        else:  # the stand-in's replay writes where a graph's replay would
            torch._foreach_copy_(self.outputs, detached)

    def _backward(self) -> None:
        outs, self._live = self._live, None
        used = [i for i, o in enumerate(outs) if o.requires_grad]
        with _no_autocast(self.inputs[0].device):
            grads = torch.autograd.grad([outs[i] for i in used], self.wants,
                                        [self.grad_outputs[i] for i in used], allow_unused=True)
        if self.grads is None:
            self.grads = list(grads)
        else:
            for static, grad in zip(self.grads, grads):
                if static is not None:
                    static.copy_(grad)

    # -- replay -------------------------------------------------------------------------------

    def __call__(self, x1: Tensor, x2: Tensor, kwargs: Dict[str, Any]) -> Tuple[Tensor, Tensor]:
        leaves, _ = tree_flatten(kwargs)
        with torch.no_grad():
            for i, value in enumerate(leaves):
                source = self.sources[i]
                if source is not None and (source[0] is not value or value._version != source[1]):
                    self.keywords[i].copy_(value)
                    self.sources[i] = (value, value._version)
        return _GraphedStack.apply(self, x1, x2, *self.params)

    def replay_forward(self, x1: Tensor, x2: Tensor) -> _Turn:
        previous = self.turn() if self.turn is not None else None
        if previous is not None and not previous.done:
            raise RuntimeError(
                "a second training forward through a stack captured as CUDA graphs before the "
                "backward of the first: its replay would overwrite what that backward reads. "
                "Call backward first (gradient accumulation: forward and backward one "
                "micro-batch at a time), or drop the first's outputs (del loss)")
        self.inputs[0].copy_(x1)
        self.inputs[1].copy_(x2)
        self.rng.step_begin()
        with _weight_cache_off():  # a CUDA replay runs no host code, but the stand-in's does
            self.forward_graph.replay()
        turn = _Turn([p._version for p in self.params])
        self.turn = weakref.ref(turn)
        return turn

    def replay_backward(self, turn: _Turn, grads_in: Tuple[Optional[Tensor], ...]
                        ) -> List[Optional[Tensor]]:
        if turn.done:
            raise RuntimeError(
                "backward through a stack captured as CUDA graphs a second time: its replay "
                "reuses memory of the first (retain_graph=True cannot keep it); turn CUDA "
                "graphs off to backpropagate twice")
        for name, p, version in zip(self.names, self.params, turn.versions):
            if p._version != version:
                raise RuntimeError(
                    f"parameter {name!r} was modified in place between forward and backward "
                    "(an optimizer step before backward?); the captured backward would use the "
                    "new value, so its gradients would be wrong")
        turn.done = True
        for static, grad in zip(self.grad_outputs, grads_in):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        with _weight_cache_off():
            self.backward_graph.replay()
        # New tensors for autograd to add into .grad: the static ones are overwritten by the
        # next replay. x * 1.0 is x exactly, and one call allocates and fills every copy.
        present = [g for g in self.grads if g is not None]
        fresh = iter(torch._foreach_mul(present, 1.0) if present else ())
        return [next(fresh) if g is not None else None for g in self.grads]


class _GraphedStack(torch.autograd.Function):
    """A captured step replayed: forward and backward each one graph launch plus copies."""

    @staticmethod
    def forward(ctx, captured: _Captured, x1: Tensor, x2: Tensor, *params: Tensor):
        ctx.captured = captured
        ctx.turn = captured.replay_forward(x1, x2)
        return tuple(o.clone() for o in captured.outputs)

    @staticmethod
    def backward(ctx, dy1: Tensor, dy2: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a stack captured as CUDA graphs does not support double backward "
                "(create_graph=True); turn CUDA graphs off for higher-order gradients")
        captured: _Captured = ctx.captured
        grads = iter(captured.replay_backward(ctx.turn, (dy1, dy2)))
        inputs = [next(grads) if x.requires_grad else None for x in captured.inputs]
        return (None, *inputs, *grads)

