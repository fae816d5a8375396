"""The memory dial: store some blocks, recompute the rest, chosen for a budget of activation memory.

Under the reversible engines a stack keeps only its outputs; storing block b keeps its
activations as autograd would (``ReversibleStack.store_blocks``) and saves its recomputation in
backward. :func:`set_memory_budget` measures, on the model itself, what each block keeps and
what its recomputation costs, then stores the blocks that save the most time per byte until the
budget is spent (SPEC section 7). The plan it returns says which blocks, the activation bytes
predicted and measured, and the recomputation time saved per step.

The budget is the memory autograd keeps for backward after a training forward, counted as
:func:`pareprop.activation_bytes` counts it (parameters, gradients and optimizer state are
apart from it): bytes (``12 * 2**30``, ``"12GiB"``) or a fraction between the reversible floor
(0: every block recomputed) and what autograd needs (1: every block stored).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from pareprop import engine as engine_lib
from pareprop.engine import ReversibleStack, stacks_of
from pareprop.engine.stack import REVERSIBLE_ENGINES
from pareprop.memory.saved import activation_bytes, is_parameter, storage_key
from pareprop.memory.units import parse_memory

__all__ = [
    "MemoryPlan",
    "BlockCost",
    "set_memory_budget",
    "set_engine",
    "parse_budget",
    "stored_blocks",
    "apply_stored_blocks",
]

Budget = Union[int, float, str]

def parse_budget(budget: Budget) -> Tuple[str, float]:
    """``("fraction", f)`` for a float, or a number from 0 to 1 (or such a string), else
    ``("bytes", n)``: a budget of 0 or 1 bytes means nothing, so 0 and 1 are fractions."""
    if isinstance(budget, bool):
        raise ValueError(f"expected a memory budget (bytes, '12GiB' or a fraction), got {budget!r}")
    small_int = isinstance(budget, int) and budget in (0, 1)
    if isinstance(budget, float) or small_int or (isinstance(budget, str) and _is_fraction(budget)):
        fraction = float(budget)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"a fractional memory budget must lie between 0 (the reversible floor) and 1 "
                f"(what autograd keeps), got {budget!r}; give bytes as an integer or '12GiB'"
            )
        return "fraction", fraction
    return "bytes", float(parse_memory(budget))


def _is_fraction(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return value <= 1.0 and not re.search(r"[eE]", text)


@dataclass
class BlockCost:
    """What one block of one stack keeps when stored, and what storing it saves."""

    stack: str  # the stack's module path in the model ("" for the model itself)
    index: int
    kept_bytes: int  # activations its graph keeps when stored
    input_bytes: int  # its first input, kept too when the block below is recomputed
    cost: float  # its recomputation: seconds, or FLOPs with cost="flops"


@dataclass
class MemoryPlan:
    """The blocks :func:`set_memory_budget` stored, and what that is predicted and measured to
    keep and save. Byte fields count activation memory kept for backward."""

    budget_bytes: int
    floor_bytes: int  # every block recomputed
    full_bytes: int  # every block stored: what autograd keeps
    stored: Dict[str, Tuple[int, ...]]  # stack path -> stored block indices
    engines: Dict[str, str]
    predicted_bytes: int
    measured_bytes: int
    saving: float  # recomputation avoided per step, in cost units
    recompute_total: float  # recomputation of every block, in cost units
    cost_unit: str  # "s" or "FLOP"
    blocks: List[BlockCost] = field(default_factory=list, repr=False)

    @property
    def fraction(self) -> float:
        span = self.full_bytes - self.floor_bytes
        return 1.0 if span <= 0 else (self.measured_bytes - self.floor_bytes) / span

    @property
    def num_stored(self) -> int:
        return sum(len(v) for v in self.stored.values())

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["stored"] = {k: list(v) for k, v in self.stored.items()}
        out["fraction"] = self.fraction
        return out

    def __str__(self) -> str:
        total = sum(1 for _ in self.blocks)
        lines = [
            f"memory budget {_mib(self.budget_bytes)} of activations "
            f"(reversible floor {_mib(self.floor_bytes)}, autograd {_mib(self.full_bytes)})",
            f"stored {self.num_stored} of {total} blocks, kept {_mib(self.measured_bytes)} "
            f"(predicted {_mib(self.predicted_bytes)}, fraction {self.fraction:.2f})",
        ]
        for name, indices in self.stored.items():
            label = name or "(model)"
            lines.append(f"  {label}: engine {self.engines[name]}, stored {list(indices)}")
        if self.cost_unit == "s":
            saved = f"{self.saving * 1e3:.1f} ms of {self.recompute_total * 1e3:.1f} ms"
        else:
            saved = f"{self.saving:.3g} of {self.recompute_total:.3g} FLOP"
        share = self.saving / self.recompute_total if self.recompute_total else 0.0
        lines.append(f"recomputation saved per step: {saved} ({share:.0%})")
        return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _settings(model: nn.Module, engines: Dict[str, str], stored: Dict[str, Sequence[int]]):
    """Run with the given engines and stored blocks; put the model's own back afterwards."""
    stacks = stacks_of(model)
    before = [(s.engine, s.stored_blocks) for _, s in stacks]
    was_training = model.training
    try:
        model.train()
        for name, stack in stacks:
            stack.set_engine(engines[name]).store_blocks(stored.get(name, ()))
        yield
    finally:
        for (_, stack), (engine, kept) in zip(stacks, before):
            stack.set_engine(engine).store_blocks(kept)
            stack.probe = None
        model.train(was_training)


def _forward_bytes(model: nn.Module, inputs: Sequence[Any]) -> int:
    return activation_bytes(model, *inputs)


def _measure_blocks(
    model: nn.Module, inputs: Sequence[Any], cost: str, repeats: int, device: torch.device
) -> Tuple[List[BlockCost], int]:
    """Every block stored: its kept bytes (storages first saved while it runs), its first
    input's bytes, and its cost (median seconds over ``repeats`` forwards, or FLOPs)."""
    stacks = stacks_of(model)
    current: List[Optional[Tuple[str, int]]] = [None]
    owner: Dict[Tuple[str, int], Tuple[str, int]] = {}
    sizes: Dict[Tuple[str, int], int] = {}
    seconds: Dict[Tuple[str, int], List[float]] = {}
    flops: Dict[Tuple[str, int], float] = {}
    inputs_bytes: Dict[Tuple[str, int], int] = {}
    counting = [False]

    def make_probe(name: str):
        @contextlib.contextmanager
        def probe(index: int, x1: torch.Tensor) -> Iterator[None]:
            key = (name, index)
            inputs_bytes[key] = x1.untyped_storage().nbytes()
            current[0] = key
            counter = None
            if cost == "flops" and counting[0]:
                counter = FlopCounterMode(display=False)
                counter.__enter__()
            _sync(device)
            start = time.perf_counter()
            try:
                yield
            finally:
                _sync(device)
                seconds.setdefault(key, []).append(time.perf_counter() - start)
                if counter is not None:
                    counter.__exit__(None, None, None)
                    flops[key] = float(counter.get_total_flops())
                current[0] = None

        return probe

    def pack(t: torch.Tensor) -> torch.Tensor:
        if counting[0] and not is_parameter(t):
            storage = t.untyped_storage()
            address = storage_key(t)
            if storage.nbytes() > 0 and address not in sizes:
                sizes[address] = storage.nbytes()
                owner[address] = current[0]
                alive.append(t)
        return t

    alive: List[torch.Tensor] = []
    for name, stack in stacks:
        stack.probe = make_probe(name)
    for run in range(repeats + 1):  # the first run warms up and is not timed
        counting[0] = run == 1
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        del out
        alive.clear()
        if run == 0:
            seconds.clear()
    blocks = []
    for name, stack in stacks:
        for index in range(len(stack.blocks)):
            key = (name, index)
            kept = sum(n for a, n in sizes.items() if owner[a] == key)
            # A stack that built no graph (frozen, as in a linear probe, with an input that
            # needs no gradient) never reached its probe: it keeps nothing and recomputes
            # nothing, so storing its blocks costs and saves nothing.
            if cost == "flops":
                value = flops.get(key, 0.0)
            else:
                value = statistics.median(seconds.get(key, [0.0]))
            blocks.append(BlockCost(name, index, kept, inputs_bytes.get(key, 0), value))
    outside = sum(n for a, n in sizes.items() if owner[a] is None)
    return _smooth(blocks), outside


def _smooth(blocks: List[BlockCost]) -> List[BlockCost]:
    # Blocks of one stack that keep the same bytes are alike (same shapes, same layers): give
    # them their median cost, so that timing noise does not scatter the stored blocks.
    groups: Dict[Tuple[str, int], List[BlockCost]] = {}
    for b in blocks:
        groups.setdefault((b.stack, b.kept_bytes), []).append(b)
    for group in groups.values():
        median = statistics.median(b.cost for b in group)
        for b in group:
            b.cost = median
    return blocks


def _predict(
    blocks: Sequence[BlockCost], outside: int, depth: Dict[str, int], chosen: set
) -> int:
    """Kept bytes of a stored set: blocks' own bytes, the first input of a stored block whose
    lower neighbour is recomputed, and the two outputs of a stack whose top is recomputed."""
    total = outside
    by_key = {(b.stack, b.index): b for b in blocks}
    for b in blocks:
        key = (b.stack, b.index)
        if key in chosen:
            total += b.kept_bytes
            if b.index > 0 and (b.stack, b.index - 1) not in chosen:
                total += b.input_bytes
    for stack, n in depth.items():
        if (stack, n - 1) not in chosen:
            total += 2 * by_key[(stack, n - 1)].input_bytes
    return total


def _default_engine(current: str, device: torch.device) -> str:
    if current in REVERSIBLE_ENGINES:
        return current
    return "pareprop" if device.type == "cuda" else "reversible"


def _device_of(inputs: Sequence[Any], model: nn.Module) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return next(model.parameters()).device


def set_memory_budget(
    model: nn.Module,
    budget: Budget,
    example_inputs: Union[torch.Tensor, Sequence[Any]],
    engine: Optional[str] = None,
    cost: str = "time",
    repeats: int = 3,
) -> MemoryPlan:
    """Store the blocks that save the most recomputation per byte within ``budget``.

    Args:
        model: any module containing :class:`~pareprop.engine.ReversibleStack` s.
        budget: activation memory kept for backward: bytes (an int, ``"12GiB"``, ``"80GB"``)
            or a fraction between the reversible floor (0) and autograd's need (1).
        example_inputs: a batch the model is measured on, as it will be trained (batch size,
            image size, dtype, device and autocast matter for bytes and for cost).
        engine: ``"reversible"`` or ``"pareprop"`` for the stacks; by default a stack keeps
            its reversible engine, and one on ``autograd`` gets pareprop on CUDA and
            reversible elsewhere. A stack whose every block is stored runs plain autograd.
        cost: ``"time"`` (each block's forward, timed on the model: median of ``repeats``) or
            ``"flops"`` (counted by torch's FlopCounterMode; repeatable, blind to memory-bound
            work such as norms and softmax).
        repeats: timed forwards for ``cost="time"``.

    Returns:
        The :class:`MemoryPlan`, already applied to the model (``print(plan)`` shows it).

    Raises:
        ValueError: a budget below the reversible floor (the message names the floor), a bad
            budget, or a model without reversible stacks.
    """
    _check_options(engine, cost, repeats)
    kind, value = parse_budget(budget)
    stacks = stacks_of(model)
    if not stacks:
        raise ValueError(
            f"{type(model).__name__} has no ReversibleStack: a memory budget chooses which "
            "reversible blocks to store, so there is nothing to choose"
        )
    single = isinstance(example_inputs, torch.Tensor)
    inputs = (example_inputs,) if single else tuple(example_inputs)
    device = _device_of(inputs, model)
    engines = {n: engine or _default_engine(s.engine, device) for n, s in stacks}
    depth = {n: len(s.blocks) for n, s in stacks}
    every = {n: tuple(range(d)) for n, d in depth.items()}

    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # measuring draws masks; the user's RNG stays
        with _settings(model, engines, {}):
            floor = _forward_bytes(model, inputs)
        with _settings(model, engines, every):
            full = _forward_bytes(model, inputs)
            blocks, outside = _measure_blocks(model, inputs, cost, repeats, device)

    budget_bytes = int(floor + value * (full - floor)) if kind == "fraction" else int(value)
    if budget_bytes < floor:
        raise ValueError(
            f"memory budget {_mib(budget_bytes)} ({budget_bytes} bytes) is below the reversible "
            f"floor of {_mib(floor)} ({floor} bytes) for these inputs: with every block "
            "recomputed the model keeps that much; give at least the floor, or a smaller batch"
        )

    ranked = _ranked(blocks)
    chosen = _choose(ranked, outside, depth, budget_bytes, stored_all=budget_bytes >= full)

    def apply(keys: set) -> int:
        _store(stacks, engines, depth, keys)
        return _measure_stored(model, inputs, devices)

    measured = apply(chosen)
    # The prediction is exact for the blocks we know of; should a model keep something it did
    # not show while measured (a tensor shared across blocks), drop the least useful block.
    while measured > budget_bytes and chosen:
        worst = next(b for b in reversed(ranked) if (b.stack, b.index) in chosen)
        chosen = chosen - {(worst.stack, worst.index)}
        measured = apply(chosen)

    stored = {n: s.stored_blocks for n, s in stacks}
    return MemoryPlan(
        budget_bytes=budget_bytes,
        floor_bytes=floor,
        full_bytes=full,
        stored=stored,
        engines={n: s.engine for n, s in stacks},
        predicted_bytes=_predict(blocks, outside, depth, chosen),
        measured_bytes=measured,
        saving=sum(b.cost for b in blocks if (b.stack, b.index) in chosen),
        recompute_total=sum(b.cost for b in blocks),
        cost_unit="s" if cost == "time" else "FLOP",
        blocks=blocks,
    )


def _check_options(engine: Optional[str], cost: str, repeats: int) -> None:
    if cost not in ("time", "flops"):
        raise ValueError(f"cost must be 'time' or 'flops', got {cost!r}")
    if engine is not None and engine not in REVERSIBLE_ENGINES:
        raise ValueError(f"engine must be 'reversible' or 'pareprop' (or None), got {engine!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")


def _ranked(blocks: List[BlockCost]) -> List[BlockCost]:
    """Most time saved per byte first; among equals the later block, so stored runs are
    contiguous at the top of a stack (each run keeps one extra input at its lower end)."""
    order = {(b.stack, b.index): i for i, b in enumerate(blocks)}
    return sorted(
        blocks, key=lambda b: (-(b.cost / max(b.kept_bytes, 1)), -order[(b.stack, b.index)])
    )


def _choose(ranked: List[BlockCost], outside: int, depth: Dict[str, int], budget_bytes: int,
            stored_all: bool) -> set:
    """The (stack, index) keys of the blocks to store: greedily down ``ranked``, each block
    that still fits the budget as predicted; every block when ``stored_all``."""
    if stored_all:
        return {(b.stack, b.index) for b in ranked}
    chosen: set = set()
    for b in ranked:
        trial = chosen | {(b.stack, b.index)}
        if _predict(ranked, outside, depth, trial) <= budget_bytes:
            chosen = trial
    return chosen


def _store(stacks: List[Tuple[str, ReversibleStack]], engines: Dict[str, str],
           depth: Dict[str, int], keys: set) -> None:
    """Store the blocks of ``keys`` (a stack whose every block is stored runs autograd)."""
    stored = {n: tuple(i for i in range(depth[n]) if (n, i) in keys) for n in depth}
    for name, stack in stacks:
        full_stack = len(stored[name]) == depth[name]
        stack.set_engine("autograd" if full_stack else engines[name])
        stack.store_blocks(stored[name])


def _measure_stored(model: nn.Module, inputs: Tuple[Any, ...], devices: List[int]) -> int:
    """What a training forward of ``model`` keeps, as it stores its blocks now; the user's RNG
    and the model's mode are left as found."""
    with torch.random.fork_rng(devices=devices):
        was_training = model.training
        model.train()
        try:
            return _forward_bytes(model, inputs)
        finally:
            model.train(was_training)


def stored_blocks(model: nn.Module) -> Dict[str, List[int]]:
    """``{stack path: stored block indices}`` of the stacks that store any block (JSON-ready:
    checkpoints record it, so a resumed run stores the same blocks without measuring again)."""
    return {n: list(s.stored_blocks) for n, s in stacks_of(model) if s.stored_blocks}


def apply_stored_blocks(model: nn.Module, stored: Dict[str, Sequence[int]]) -> nn.Module:
    """Store exactly the blocks named in ``stored`` (as :func:`stored_blocks` gives them);
    every other block is recomputed."""
    stacks = dict(stacks_of(model))
    unknown = sorted(set(stored) - set(stacks))
    if unknown:
        raise ValueError(
            f"no ReversibleStack named {', '.join(map(repr, unknown))} in "
            f"{type(model).__name__}; its stacks are {', '.join(map(repr, stacks)) or 'none'}"
        )
    for name, stack in stacks.items():
        stack.store_blocks(stored.get(name, ()))
    return model


def set_engine(
    module: nn.Module,
    name: str,
    memory_budget: Optional[Budget] = None,
    example_inputs: Any = None,
    fallback: Optional[bool] = None,
    cuda_graphs: Optional[bool] = None,
) -> nn.Module:
    """Switch every :class:`ReversibleStack` inside ``module`` to engine ``name``
    (:func:`pareprop.engine.set_stack_engine`), or let a memory budget choose:
    ``pareprop.set_engine``.

    ``fallback=False`` makes engine ``"pareprop"`` always run PaReprop instead of keeping Reprop
    where it measures faster (:func:`pareprop.chosen_schedule`).

    ``cuda_graphs=True`` captures each stack's training forward and backward as CUDA graphs
    after a few eager steps and replays them, for small batches where the host, issuing
    kernels, sets the pace (NOTE [ CUDA graphs of a stack ] in pareprop/engine/graphs.py;
    docs/cuda_graphs.md). CUDA only; chunking, FSDP2 sharding, checkpointed blocks,
    debug_reconstruction and ``fallback=True`` are refused. False runs eagerly; None (the
    default) keeps each stack's setting. Under ``"auto"`` the budget measures the blocks
    eagerly first. Its speed is not measured yet (benchmarks/small_batch.py --graphs).

    ``name="auto"`` with a ``memory_budget`` (bytes, ``"12GiB"`` or a fraction from 0 to 1) and
    ``example_inputs`` stores the blocks that fit and recomputes the rest, on pareprop (CUDA) or
    reversible: :func:`set_memory_budget`, whose plan is left in ``module.memory_plan``.
    """
    # NOTE [ engine="auto" sits above the engine ]
    #     The dial measures blocks under the engines, so it builds on them; the engine module
    #     knows nothing of budgets (it imports nothing of pareprop). "auto" is therefore
    #     resolved here, and pareprop.set_engine is this function.
    if name != "auto":
        if memory_budget is not None:
            raise ValueError(f"memory_budget= goes with engine='auto', not {name!r}")
        return engine_lib.set_stack_engine(module, name, fallback, cuda_graphs)
    if memory_budget is None or example_inputs is None:
        raise ValueError(
            "engine='auto' needs memory_budget= (bytes, '12GiB' or a fraction from 0 to 1) "
            "and example_inputs= (a batch to measure the blocks on)"
        )
    stacks = [m for _, m in stacks_of(module)]
    # The dial measures blocks with eager steps: graphs off while it does, then as asked.
    graphs = cuda_graphs if cuda_graphs is not None else any(m.cuda_graphs for m in stacks)
    for m in stacks:
        if m.cuda_graphs:
            m.set_engine(m.engine, cuda_graphs=False)
        if m.engine == "autograd" or fallback is not None:
            m.set_engine("reversible" if m.engine == "autograd" else m.engine, fallback)
    module.memory_plan = set_memory_budget(module, memory_budget, example_inputs)
    if graphs:
        for m in stacks:
            m.set_engine(m.engine, cuda_graphs=True)
    return module
