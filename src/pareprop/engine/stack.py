"""ReversibleStack, a sequence of reversible blocks run by one of three engines, and the
functions that set an engine, chunking, checkpointing or a debug check on every stack inside a
model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pareprop.engine.block import ReversibleBlock, skip_scale
from pareprop.engine.chunk_cost import Chunking, parse_chunking
from pareprop.engine.fallback import PaRepropFallback
from pareprop.engine.forward import _couple
from pareprop.engine.function import _ReversibleFunction
from pareprop.engine.graphs import _StackGraphs, check_capturable
from pareprop.engine.plan import _block_params, _ParamLocation, _Plan
from pareprop.engine.replay import _autocast_state, _AutocastState, _BackendState, _KeywordVersions
from pareprop.engine.sharding import BlockSharding

ENGINES = ("autograd", "reversible", "pareprop")
REVERSIBLE_ENGINES = ENGINES[1:]  # the engines that rebuild inputs (and take a memory budget)

Tensor = torch.Tensor


def _check_fallback(graphs: bool, fallback: Optional[bool]) -> None:
    if graphs and fallback:
        raise ValueError(
            "fallback=True times PaReprop against Reprop on eager backward passes, and "
            "cuda_graphs=True captures one schedule as it is: choose the engine yourself "
            "('pareprop' or 'reversible'; benchmarks/small_batch.py --graphs times both), "
            "or turn CUDA graphs off")


def _check_engine(name: str) -> str:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
    return name


def _running_stat_modules(blocks: Iterable[nn.Module]) -> List[str]:
    found = []
    for i, block in enumerate(blocks):
        for name, module in block.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                found.append(f"blocks.{i}.{name}" if name else f"blocks.{i}")
    return found


class ReversibleStack(nn.Module):
    """A sequence of reversible blocks run by one of three backward engines.

    Args:
        blocks: the :class:`ReversibleBlock` instances, applied in order.
        engine: ``"autograd"``, ``"reversible"`` or ``"pareprop"``.
        stored_blocks: indices of blocks that keep their activations from forward (as under
            autograd) instead of being recomputed by the reversible engines; see
            :meth:`store_blocks`.

    ``forward(x1, x2, **kwargs)`` returns ``(y1, y2)``; keyword arguments reach every block's
    ``f`` and ``g`` in forward and in recomputation alike. They are constants: a tensor passed
    there must not require grad. In eval mode, under ``torch.no_grad()``, or when nothing
    requires grad, the stack runs its blocks plainly, whatever the engine.
    """

    def __init__(
        self,
        blocks: Iterable[ReversibleBlock],
        engine: str = "reversible",
        stored_blocks: Iterable[int] = (),
    ):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        if len(self.blocks) == 0:
            raise ValueError("a ReversibleStack needs at least one block, got none")
        for i, block in enumerate(self.blocks):
            if not isinstance(block, ReversibleBlock):
                raise TypeError(
                    f"block {i} is a {type(block).__name__}; expected a ReversibleBlock "
                    "subclass that defines f and g"
                )
        self.engine = "autograd"
        # Under cuda_graphs=True: the stack's captured step (NOTE [ CUDA graphs of a stack ] in
        # graphs.py); None: eager. _graph_rng: the branches' streams while a step is captured.
        self._cuda_graphs: Optional[_StackGraphs] = None
        self._graph_rng: Optional[Any] = None
        # Under "pareprop": PaReprop or Reprop, measured on the first backward passes.
        self._fallback = PaRepropFallback(
            f"a ReversibleStack of {len(self.blocks)} {type(self.blocks[0]).__name__} blocks")
        self.set_engine(engine)
        self._debug_tolerance: Optional[float] = None
        self.last_reconstruction_errors: List[Tuple[float, float]] = []
        self.stored_blocks: Tuple[int, ...] = ()
        self.store_blocks(stored_blocks)
        # Called around each stored block's forward (block index, its X1) -> a context; set
        # only while pareprop.memory.budget measures blocks.
        self.probe: Optional[Callable[[int, Tensor], contextlib.AbstractContextManager]] = None
        # Set by pareprop.distributed.shard when every block is an FSDP2 unit (NOTE [ FSDP2 and
        # reversible blocks ] in distributed/fsdp.py); None: the stack is not sharded.
        self.sharding: Optional[BlockSharding] = None
        self.chunking: Optional[Chunking] = None
        # Measured chunk costs for chunking by bytes (not state: they depend on the input).
        self._chunk_costs: Dict[Any, Tuple[float, float]] = {}
        # Under autograd: each block in torch.utils.checkpoint (see set_block_checkpointing).
        self.checkpoint_blocks = False

    def set_engine(
        self, name: str, fallback: Optional[bool] = None, cuda_graphs: Optional[bool] = None
    ) -> "ReversibleStack":
        """Run backward with engine ``name``. Under ``"pareprop"`` the stack measures PaReprop
        against Reprop on its first backward passes on a GPU and keeps the faster
        (:func:`chosen_schedule`); ``fallback=False`` always runs PaReprop, True measures
        again, None (the default) keeps the setting. Setting an engine measures again.

        ``cuda_graphs=True`` captures the stack's training forward and backward under the
        engine as CUDA graphs after a few eager steps and replays them (NOTE [ CUDA graphs of a
        stack ] in graphs.py), False runs eagerly, None keeps the setting; setting an engine
        with graphs on captures anew. Refused, naming the option: chunked branches, FSDP2
        sharding, checkpointed blocks, debug_reconstruction, and ``fallback=True``."""
        _check_engine(name)
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
        graphs = self._cuda_graphs is not None if cuda_graphs is None else cuda_graphs
        _check_fallback(graphs, fallback)
        if graphs:
            check_capturable(self, "this ReversibleStack")
        if fallback is not None:
            self._fallback.enabled = bool(fallback)
        self._fallback.reset()
        if name != "autograd":
            found = _running_stat_modules(self.blocks)
            if found:
                raise ValueError(
                    f"engine {name!r} recomputes F and G, which would update the running "
                    f"statistics of {', '.join(found)} twice; use LayerNorm/GroupNorm, "
                    "track_running_stats=False, or engine='autograd'"
                )
        self.engine = name
        self._cuda_graphs = _StackGraphs() if graphs else None  # captured anew
        return self

    @property
    def cuda_graphs(self) -> bool:
        """Whether the stack runs its training steps as CUDA graphs (:meth:`set_engine`)."""
        return self._cuda_graphs is not None

    @property
    def cuda_graph_status(self) -> str:
        """``"off"``, ``"warming up (k of n eager steps)"`` or ``"captured (inputs SHAPE)"``."""
        return "off" if self._cuda_graphs is None else self._cuda_graphs.status()

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self._fallback.reset()  # another device or dtype: PaReprop and Reprop measured again
        if self._cuda_graphs is not None:  # and captured again, on the new tensors
            self._cuda_graphs.reset()
        return super()._apply(fn, recurse)

    def store_blocks(self, indices: Iterable[int]) -> "ReversibleStack":
        """Keep the activations of the blocks at ``indices`` (negative counts from the end);
        recompute the others. Any subset works under every engine, with exact gradients; the
        memory kept grows by each stored block's activations and the step saves its
        recomputation. ``store_blocks([])`` recomputes every block again. Under ``autograd``
        every block is stored anyway. :func:`pareprop.set_memory_budget` chooses the subset."""
        depth = len(self.blocks)
        chosen = set()
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"block indices must be integers, got {i!r}")
            if not -depth <= i < depth:
                raise IndexError(f"block index {i} out of range for a stack of {depth} blocks")
            chosen.add(i % depth)
        if tuple(sorted(chosen)) != getattr(self, "stored_blocks", ()):
            self._fallback.reset()  # stored blocks change what PaReprop overlaps
            if self._cuda_graphs is not None:  # and what a captured step runs
                self._cuda_graphs.reset()
        self.stored_blocks = tuple(sorted(chosen))
        return self

    def set_chunking(
        self, *, chunks: Optional[int] = None, max_bytes: Union[int, str, None] = None
    ) -> "ReversibleStack":
        """Rebuild and differentiate the recomputed blocks' branches in chunks, under the
        reversible engines: ``chunks`` per branch (at most the split's size), or the fewest
        chunks whose graph saves at most ``max_bytes`` (bytes or "64MiB"; measured once per
        block and input shape). A branch whose split is None for its input runs whole; a block
        whose class declares neither ``f_split`` nor ``g_split`` is refused, named (chunking
        would leave it as it is). With neither argument every branch runs whole again.
        Gradients are unchanged; see NOTE [ Chunked backward ] in chunked.py. The same
        keywords as :func:`pareprop.set_chunking`."""
        return self.apply_chunking(parse_chunking(chunks, max_bytes))

    def apply_chunking(self, chunking: Optional[Chunking]) -> "ReversibleStack":
        """:meth:`set_chunking` with the chunking already parsed (None: whole branches)."""
        _check_chunking(chunking)
        if chunking is not None:
            _check_splits(self)
        # The measured chunk costs stay: they depend on the blocks and the input, not on this.
        self.chunking = chunking
        return self

    def debug_reconstruction(self, tolerance: Optional[float] = 1e-3) -> "ReversibleStack":
        """For the next training step only: keep the forward's block inputs and warn, naming
        the block, when a rebuilt input differs from them by more than ``tolerance`` (relative
        error). The errors are left in ``last_reconstruction_errors`` as (X1, X2) per block.
        ``None`` disarms a check that no step has used yet."""
        self._debug_tolerance = None if tolerance is None else float(tolerance)
        return self

    def extra_repr(self) -> str:
        stored = f", stored_blocks={list(self.stored_blocks)}" if self.stored_blocks else ""
        chunking = "" if self.chunking is None else (
            f", chunks={self.chunking.count}" if self.chunking.count is not None
            else f", chunk_bytes={self.chunking.max_bytes}")
        ckpt = ", checkpoint_blocks=True" if self.checkpoint_blocks else ""
        graphs = ", cuda_graphs=True" if self._cuda_graphs is not None else ""
        return f"engine={self.engine!r}{stored}{chunking}{ckpt}{graphs}"

    def keeps_outputs(self) -> bool:
        """Whether a forward now keeps the stack's two output streams for backward: a
        reversible engine in training with grad on rebuilds from them, unless its top block is
        stored (its own graph keeps what its backward needs). Callers that would save the
        outputs again can then save the streams themselves at no cost."""
        return (self.engine != "autograd" and self.training and torch.is_grad_enabled()
                and len(self.blocks) - 1 not in self.stored_blocks)

    def forward(self, x1: Tensor, x2: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        _check_streams(x1, x2)
        _check_constants(kwargs)
        if self.sharding is None:  # a sharded block's hooks are FSDP's, and its call runs them
            _refuse_block_hooks(self.blocks)
        x1, x2 = _full_precision_streams(x1, x2, self.blocks)
        if (self._cuda_graphs is not None and self.training and torch.is_grad_enabled()
                and self.probe is None):  # the memory dial measures blocks eagerly
            if self.engine != "autograd":  # a replay skips _forward_reversible's check
                _forward_betas(self.blocks, [i in self.stored_blocks
                                             for i in range(len(self.blocks))])
            return self._cuda_graphs.run(self, x1, x2, kwargs, self._fallback.label)
        return self._run(x1, x2, kwargs)

    def _run(self, x1: Tensor, x2: Tensor, kwargs: Dict[str, Any]) -> Tuple[Tensor, Tensor]:
        """The stack's forward under its engine, eager (or being captured: ``_graph_rng``)."""
        rng = self._graph_rng
        if self.engine == "autograd" or not self.training or not torch.is_grad_enabled():
            # A sharded block's own call runs FSDP's hooks (gather, and under autograd the
            # backward hooks), as for any FSDP unit.
            run = _call_block if self.sharding is not None else _couple
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
                for block in self.blocks:
                    x1, x2 = checkpoint(run, block, x1, x2, kwargs, use_reentrant=False)
                return x1, x2
            for index, block in enumerate(self.blocks):
                if rng is None:
                    x1, x2 = run(block, x1, x2, kwargs)
                else:  # every engine draws from the branches' streams in a captured step
                    x1, x2 = _couple(block, x1, x2, kwargs, rng=rng, index=index)
            return x1, x2
        return self._forward_reversible(x1, x2, **kwargs)

    # NOTE [ Whole-model torch.compile ]
    # The reversible path captures generator states and runs an autograd Function whose
    # backward walks the blocks: nothing Dynamo should trace. So torch.compile(model) breaks
    # the graph here, at the stack's boundary, and the stack runs its blocks' own f and g
    # (compiled ones after pareprop.compile_blocks). See docs/compile.md.
    @torch.compiler.disable
    def _forward_reversible(self, x1: Tensor, x2: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        params, block_params, block_locations = self._trainable_params()
        if self.sharding is not None:
            self.sharding.check_inputs(x1, x2)
        elif not (x1.requires_grad or x2.requires_grad or params):
            with torch.no_grad():
                return self.forward(x1, x2, **kwargs)
        tolerance, self._debug_tolerance = self._debug_tolerance, None
        stored = [i in self.stored_blocks for i in range(len(self.blocks))]
        plan = _Plan(
            blocks=list(self.blocks),
            engine=self.engine,
            kwargs=kwargs,
            block_params=block_params,
            block_locations=block_locations,
            num_params=len(params),
            device=x1.device,
            autocast=_AutocastState.capture(x1.device),
            backends=_BackendState.capture(),
            keywords=_KeywordVersions.capture(kwargs),
            stored=stored,
            betas=_forward_betas(self.blocks, stored),
            debug_tolerance=tolerance,
            probe=self.probe,
            sharding=self.sharding,
            chunking=self.chunking,
            chunk_costs=self._chunk_costs,
            # Under CUDA graphs the schedule named runs as it is (NOTE [ CUDA graphs of a stack ]).
            fallback=self._fallback if self._cuda_graphs is None else None,
            graph_rng=self._graph_rng,
        )
        # Backward fills the plan's list in place, so the stack sees the errors when it ends.
        self.last_reconstruction_errors = plan.reconstruction_errors
        return _ReversibleFunction.apply(plan, x1, x2, *params)

    def _trainable_params(self):
        params: List[Tensor] = []
        slots: Dict[int, int] = {}
        block_params: List[List[Tuple[int, Tensor]]] = []
        block_locations: List[List[_ParamLocation]] = []
        for block in self.blocks:
            if self.sharding is not None:  # gathered and listed in forward, block by block
                block_params.append([])
                block_locations.append([])
                continue
            owned, locations = _block_params(block, params, slots)
            block_params.append(owned)
            block_locations.append(locations)
        return params, block_params, block_locations


def _forward_betas(blocks: Sequence[nn.Module], stored: Sequence[bool]):
    betas = []
    for index, block in enumerate(blocks):
        beta = skip_scale(block)
        zero = getattr(block, "_skip_scale_value", 1.0) == 0.0
        if beta is not None and not stored[index] and zero:
            raise ValueError(
                f"block {index} ({type(block).__name__}) has skip scale beta = 0, which the "
                "reversible engines cannot invert (they divide by beta); store the block "
                "(stack.store_blocks, or pareprop.PrecisionGuard) or use engine='autograd'"
            )
        betas.append(None if beta is None else (beta, beta._version))
    return betas


def _check_streams(x1: Tensor, x2: Tensor) -> None:
    if not (isinstance(x1, Tensor) and isinstance(x2, Tensor)):
        raise TypeError(
            f"expected two tensors x1, x2, got {type(x1).__name__} and {type(x2).__name__}"
        )
    if x1.shape != x2.shape:
        raise ValueError(
            f"the two streams must have the same shape, got {tuple(x1.shape)} and "
            f"{tuple(x2.shape)}"
        )
    if x1.dtype != x2.dtype or x1.device != x2.device:
        raise ValueError(
            "the two streams must share dtype and device, got "
            f"{x1.dtype} on {x1.device} and {x2.dtype} on {x2.device}"
        )


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _full_precision_streams(
    x1: Tensor, x2: Tensor, blocks: Iterable[nn.Module]
) -> Tuple[Tensor, Tensor]:
    # NOTE [ Streams in float32 under autocast ]
    # Inversion subtracts F and G from the streams; rounding the streams themselves to 8 bits
    # of mantissa would lose far more than F and G's own low precision. So under autocast the
    # streams are float32 (the sums X + F(X) promote to it) while F and G compute in the
    # autocast dtype. An input that arrives in low precision (from a conv or linear under
    # autocast) is widened here. Not when the weights themselves are in low precision
    # (create_model(..., dtype=torch.bfloat16)): the norms would then meet float32 inputs with
    # bfloat16 weights, which CPU kernels refuse, and such a model is low precision throughout
    # anyway, so its streams stay in the weights' dtype, as in timm's models.
    if x1.dtype in _LOW_PRECISION and _autocast_state(x1.device.type)[0]:
        weight = next((p for b in blocks for p in b.parameters() if p.is_floating_point()), None)
        if weight is None or weight.dtype not in _LOW_PRECISION:
            return x1.float(), x2.float()
    return x1, x2


# NOTE [ Hooks on a reversible block ]
# The engines call a block's coupling (F and G), never its ``forward`` through ``__call__``: in
# forward, in recomputation and in backward alike. A module hook on the block itself would
# never fire, so it is refused at the stack's next forward (a registration cannot be refused:
# FSDP2 hooks the blocks it shards). Hooks on the block's submodules (attention, MLP, norms)
# and on the stack run as on any module.

_HOOK_KINDS = (("forward", "_forward_hooks"), ("forward pre", "_forward_pre_hooks"),
               ("backward", "_backward_hooks"), ("backward pre", "_backward_pre_hooks"))


def _refuse_block_hooks(blocks: Sequence[nn.Module]) -> None:
    """NOTE [ Hooks on a reversible block ]."""
    for index, block in enumerate(blocks):
        kinds = [kind for kind, attr in _HOOK_KINDS if getattr(block, attr, None)]
        if kinds:
            parts = ", ".join(name for name, _ in block.named_children()) or "none"
            raise RuntimeError(
                f"block {index} of a reversible stack ({type(block).__name__}) has "
                f"{', '.join(kinds)} hook(s): the engines run its F and G, never its forward, "
                "so they would not fire. Remove them (handle.remove()), or register them on "
                f"its submodules ({parts}) or on the stack, which do run"
            )


def _check_constants(kwargs: Dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if isinstance(value, Tensor) and value.requires_grad:
            raise ValueError(
                f"keyword input {key!r} requires grad, but keyword inputs of a "
                "ReversibleStack are constants; pass it detached, or make it a stream"
            )


def stacks_of(module: nn.Module) -> List[Tuple[str, ReversibleStack]]:
    """Every :class:`ReversibleStack` inside ``module`` (``module`` itself included), with its
    path, in module order: the one scan every model-wide setter and report goes through."""
    return [(path, m) for path, m in module.named_modules() if isinstance(m, ReversibleStack)]


def engine_of(module: nn.Module) -> Optional[str]:
    """The engine the reversible stacks inside ``module`` run, when they share one; None for a
    module without a stack, or whose stacks run different engines."""
    engines = {m.engine for _, m in stacks_of(module)}
    return engines.pop() if len(engines) == 1 else None


def set_stack_engine(
    module: nn.Module, name: str, fallback: Optional[bool] = None,
    cuda_graphs: Optional[bool] = None,
) -> nn.Module:
    """Switch every :class:`ReversibleStack` inside ``module`` to engine ``name``.

    ``"auto"`` (the blocks that fit a memory budget stored, the rest recomputed) is chosen
    above the engine, by :func:`pareprop.set_engine` (:mod:`pareprop.memory.budget`).
    ``fallback`` (engine ``"pareprop"``): False always runs PaReprop, True lets each stack keep
    Reprop where it measures faster (the default; NOTE [ PaReprop's fallback to Reprop ] in
    pareprop/engine/fallback.py); None keeps each stack's setting.
    ``cuda_graphs``: True captures each stack's training step as CUDA graphs and replays it
    (for host-bound small batches; NOTE [ CUDA graphs of a stack ] in engine/graphs.py), False
    runs eagerly, None keeps each stack's setting. Every stack is checked before any changes.
    """
    if name == "auto":
        raise ValueError(
            "engine 'auto' is chosen by a memory budget: call pareprop.set_engine(model, 'auto', "
            "memory_budget=..., example_inputs=...) or pareprop.set_memory_budget"
        )
    _check_engine(name)
    if fallback is not None and not isinstance(fallback, bool):
        raise TypeError(f"fallback must be True, False or None, got {fallback!r}")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    stacks = stacks_of(module)
    for path, m in stacks:  # checked before any stack changes
        if cuda_graphs or (cuda_graphs is None and m.cuda_graphs):
            _check_fallback(True, fallback)
            check_capturable(m, _stack_label(path, m))
    for path, m in stacks:
        m.set_engine(name, fallback, cuda_graphs)
        m._fallback.label = _stack_label(path, m)
    return module


def _stack_label(path: str, stack: ReversibleStack) -> str:
    return (f"stack {path or '(the model)'} ({len(stack.blocks)} "
            f"{type(stack.blocks[0]).__name__} blocks)")


def chosen_schedule(module: nn.Module) -> Optional[str]:
    """What the stacks under engine ``"pareprop"`` inside ``module`` run in backward.

    Returns:
        ``"pareprop"`` or ``"reversible"`` when every such stack has settled on it (on the CPU,
        and with ``fallback=False``, ``"pareprop"`` at once); ``"measuring"`` while any of them
        still times both schedules on a GPU (NOTE [ PaReprop's fallback to Reprop ] in
        pareprop/engine/fallback.py); ``"mixed"`` when they settled differently; None when no stack
        uses engine ``"pareprop"``.
    """
    states = {state for state, _ in schedule_reasons(module).values()}
    if not states:
        return None
    if "measuring" in states:
        return "measuring"
    return states.pop() if len(states) == 1 else "mixed"


def schedule_reasons(module: nn.Module) -> Dict[str, Tuple[str, str]]:
    """For each stack under engine ``"pareprop"`` inside ``module`` (by its path): what it runs
    in backward (as :func:`chosen_schedule` says) and why, in a line."""
    reasons = {}
    for path, m in stacks_of(module):
        if m.engine == "pareprop":
            if m.chunking is not None:
                reasons[path] = ("reversible", "chunked branches run Reprop's schedule: chunking "
                                 "is for memory, PaReprop for idle device time (NOTE [ Chunking "
                                 "runs Reprop ])")
                continue
            if m.cuda_graphs:
                reasons[path] = ("pareprop", "CUDA graphs capture PaReprop's schedule as it is: "
                                 "the fallback does not measure (engine 'reversible' for "
                                 "Reprop's)")
                continue
            device = next((p.device for p in m.parameters()), torch.device("cpu"))
            m._fallback.label = _stack_label(path, m)
            reasons[path] = (m._fallback.state(device), m._fallback.reason(device))
    return reasons


def _call_block(
    block: ReversibleBlock, x1: Tensor, x2: Tensor, kwargs: Dict[str, Any]
) -> Tuple[Tensor, Tensor]:
    return block(x1, x2, **kwargs)


# NOTE [ Checkpointed blocks: the competitor ]
# What users run instead of a reversible engine is activation checkpointing: timm's
# set_grad_checkpointing() puts each block in torch.utils.checkpoint (non-reentrant), so a
# block keeps only its input and runs again in backward. set_block_checkpointing does the
# same for a stack's blocks under the autograd engine, so that the benchmark and the planner
# measure the same model, blocks and kernels under both methods (pareprop.catalog's mode
# "checkpointed"). The reversible engines ignore it: they keep nothing of their blocks anyway.
# RNG and autocast replay are torch.utils.checkpoint's own.
def set_block_checkpointing(module: nn.Module, enable: bool = True) -> nn.Module:
    """Under the ``autograd`` engine, run each block of every :class:`ReversibleStack`
    inside ``module`` in ``torch.utils.checkpoint`` (non-reentrant), as timm's
    ``set_grad_checkpointing()`` does for its blocks; see NOTE [ Checkpointed blocks: the
    competitor ]. Returns ``module``."""
    for _, m in stacks_of(module):
        m.checkpoint_blocks = bool(enable)
    return module


def set_chunking(
    module: nn.Module, *, chunks: Optional[int] = None, max_bytes: Union[int, str, None] = None
) -> nn.Module:
    """Chunk the branches of every :class:`ReversibleStack` inside ``module`` in backward
    (:meth:`ReversibleStack.set_chunking`, the same keywords): the fewest chunks whose graph
    saves at most ``max_bytes``, or ``chunks`` per branch; neither turns chunking off. Returns
    ``module``."""
    return apply_chunking(module, parse_chunking(chunks, max_bytes))


# NOTE [ Chunk sizes are parsed at the edge ]
# A chunk size arrives as a count, bytes, "256MiB" or (for a plan) "auto", from the command
# line, a run's config or a Python call. Each of those entry points parses it once, into a
# Chunking (pareprop.engine.chunk_cost.parse_chunking: the one message for a bad size), and
# everything past it (the stacks, the trainer's setup, the planner's traced model) takes only
# that object: a size is never parsed again, and a layer cannot be handed text it would read
# differently. A run's config keeps the size as given (its saved form) beside the parsed one.


def apply_chunking(module: nn.Module, chunking: Optional[Chunking]) -> nn.Module:
    """:func:`set_chunking` with the chunking already parsed (NOTE [ Chunk sizes are parsed at
    the edge ]); None runs every branch whole. Returns ``module``."""
    _check_chunking(chunking)
    # Checked once, before any stack changes.
    if chunking is not None:
        for path, m in stacks_of(module):
            _check_splits(m, path)
    for _, m in stacks_of(module):
        m.chunking = chunking
    return module


def _check_chunking(chunking: Any) -> None:
    if chunking is not None and not isinstance(chunking, Chunking):
        raise TypeError(
            f"expected a Chunking or None (parse a size with parse_chunking), got {chunking!r}")


def _check_splits(stack: ReversibleStack, path: str = "") -> None:
    """Refuse chunking for a stack with a block that declares no split: chunking would leave
    it whole, and a chunk size would promise memory it does not save."""
    for i, block in enumerate(stack.blocks):
        cls = type(block)
        if cls.f_split is ReversibleBlock.f_split and cls.g_split is ReversibleBlock.g_split:
            where = f"{path}.blocks.{i}" if path else f"block {i}"
            raise ValueError(
                f"{where} ({cls.__name__}) declares no split (f_split / g_split), so chunking "
                "would leave it whole and save nothing; define f_split and f_chunk (or g_split "
                "and g_chunk; NOTE [ Chunked branches ] in pareprop/chunking.py), or leave "
                "chunking off"
            )


def debug_reconstruction(module: nn.Module, tolerance: float = 1e-3) -> nn.Module:
    """Arm :meth:`ReversibleStack.debug_reconstruction` on every stack inside ``module``."""
    for _, m in stacks_of(module):
        m.debug_reconstruction(tolerance)
    return module
