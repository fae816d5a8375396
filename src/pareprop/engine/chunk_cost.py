"""How many chunks a branch runs in, and what a chunk's graph costs: the engine's half of
chunking (the contract blocks implement, :class:`~pareprop.chunking.Split` and
:class:`~pareprop.chunking.Chunk`, is :mod:`pareprop.chunking`).

* :class:`Chunking`: a fixed chunk count, or a byte cap from which the engine picks the count;
* :func:`graph_bytes` and :func:`linear_cost`: the measured cost of a chunk of one and two
  units, fitted as ``fixed + per_unit * units``;
* :func:`planned_cost`, :func:`structure`: measurements shared while planning;
* :func:`tracing_distinct_chunks`: a plan traces only the chunks that can set a new peak.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from pareprop.chunking import Chunk

__all__ = ["Chunking", "parse_chunking", "parse_bytes", "graph_bytes", "linear_cost",
           "planned_cost", "measuring", "tracing_distinct_chunks", "tracing_distinct",
           "distinct_chunks", "plain", "structure"]

Tensor = torch.Tensor

# NOTE [ Planning a chunked branch from its distinct chunks ]
# A plan (pareprop.plan_memory) traces the step under FakeTensorMode and a storage counter, and
# its time is the number of operators traced: a branch in 64 chunks traces its graph 64 times,
# for no new fact, since the chunks of a branch are alike. What a chunk allocates and frees
# depends on its length and on what the chunks before it left alive: the parameter-gradient
# accumulators the first chunk creates, and the previous chunk's output and input gradient,
# which the loop still holds while the next chunk's graph is built. A chunk's peak is therefore
# fixed by (previous length, length), and it returns to the same memory it started from (its
# output and gradients are written into the streams in place) but for the previous chunk's
# leftovers, which the loop keeps past its end for the last chunk. Every chunk runs the same
# operators on tensors whose sizes do not shrink as the lengths grow, so a chunk whose
# (previous length, length) is no larger in both than another's peaks no higher. ``chunks``
# gives at most two lengths, the longer first, so the second chunk's pair is the largest of
# the loop's, and a plan traces at most three chunks: the first (the accumulators), the second
# (the largest peak of the rest) and, when its length is not the second's, the last (what the
# loop leaves when it ends; traced after the second, whose leftovers are no smaller than those
# it follows in the whole loop, it still peaks no higher than the second). The plan's peak is
# exactly the full trace's (tests/test_memory.py compares every figure on every family, with
# chunks of two lengths). Fake tensors hold no values, so the chunks left out change nothing
# else. The checkpointed blocks of
# pareprop.engine.recompute keep every chunk's output until they are joined, and every chunk's
# input gradient until the last is done, so there the chunks differ by what came before: see
# NOTE [ Planning checkpointed chunks ] in that module.
_DISTINCT_ONLY = [0]  # > 0 while a plan traces only the distinct chunks


@contextlib.contextmanager
def tracing_distinct_chunks():
    """While planning (fake tensors only): branches run only the chunks that can set a new
    peak (NOTE [ Planning a chunked branch from its distinct chunks ])."""
    _DISTINCT_ONLY[0] += 1
    try:
        yield
    finally:
        _DISTINCT_ONLY[0] -= 1


def tracing_distinct() -> bool:
    """Whether a plan is tracing only the distinct chunks (:func:`tracing_distinct_chunks`)."""
    return _DISTINCT_ONLY[0] > 0


def distinct_chunks(pieces: List[Chunk]) -> List[Chunk]:
    """``pieces`` (from :func:`chunks`), or under :func:`tracing_distinct_chunks` their first
    and second chunk and, when its length is not the second's, the last (NOTE [ Planning a
    chunked branch from its distinct chunks ])."""
    if not _DISTINCT_ONLY[0] or len(pieces) <= 2:
        return pieces
    return pieces[:2] + ([pieces[-1]] if pieces[-1].length != pieces[1].length else [])


@dataclass(frozen=True)
class Chunking:
    """A stack's chunking: a fixed chunk ``count`` per branch, or ``max_bytes``, the most a
    chunk's saved activations may take (the engine picks the fewest chunks under it)."""

    count: Optional[int] = None
    max_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.count is None) == (self.max_bytes is None):
            raise ValueError("expected exactly one of chunks= (a count) or max_bytes=")
        if self.count is not None and (
            isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1
        ):
            raise ValueError(f"expected a chunk count >= 1 (a whole number), got {self.count!r}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"expected max_bytes > 0, got {self.max_bytes!r}")

    def count_for(self, size: int, fixed: float = 0.0, per_unit: float = 0.0) -> int:
        """Chunks for a branch of ``size`` units whose chunk of ``u`` units saves
        ``fixed + per_unit * u`` bytes: the fewest within ``max_bytes`` (all ``size`` when
        even one unit is over it)."""
        if self.count is not None:
            return max(1, min(self.count, size))
        room = self.max_bytes - fixed
        if per_unit <= 0:
            return 1
        if room < per_unit:
            return size
        units = max(1, int(room // per_unit))
        return max(1, min(size, math.ceil(size / units)))


def parse_chunking(
    chunks: Optional[int] = None, max_bytes: Union[int, str, None] = None
) -> Optional[Chunking]:
    """A :class:`Chunking` from ``chunks=`` or ``max_bytes=`` (:func:`parse_bytes`); None when
    both are None (whole branches)."""
    if chunks is None and max_bytes is None:
        return None
    if max_bytes is not None:
        max_bytes = parse_bytes(max_bytes)
    return Chunking(count=chunks, max_bytes=max_bytes)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: Union[int, float, str]) -> int:
    """A size in bytes from ``268435456``, ``8e10``, ``"256MiB"``, ``"1.5 GB"`` or ``"2TiB"``:
    the one parser of every size option (``--chunk-bytes``, ``--memory``, memory budgets).

    Raises:
        ValueError: naming the accepted forms, for anything else (NaN, infinity, <= 0 too).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"expected a memory size such as 80GiB, 80GB, 256MiB or 8e10 (bytes), "
                f"got {text!r}"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    size = value * _UNITS[unit]
    if not math.isfinite(size) or size > 2**62:
        raise ValueError(f"expected a memory size below 4 EiB, got {text!r}")
    if int(size) <= 0:
        raise ValueError(f"expected a positive memory size (at least 1 byte), got {text!r}")
    return int(size)


# NOTE [ Measuring a chunk's graph ]
# Chunking by bytes needs what one chunk's graph saves. Both places that chunk (the engine's
# branches, pareprop.engine.recompute's checkpointed blocks) build the graph of a chunk of one
# and of two units under a saved-tensors hook, count each saved storage once, and fit
# ``fixed + per_unit * units``. The hook must hold every saved tensor until the count is done:
# a storage freed in the middle of the measurement (the graph itself keeps nothing, so an MLP's
# first hidden map dies once its activation has run) can hand its address to the next one, and
# two maps of one shape at one address counted once would make the two-unit graph look no
# larger than the one-unit graph. The fit would then read "nothing per unit", and the branch
# would run whole, holding two whole-batch MLP maps (4.5 GiB each for Rev-ViT-B's G at batch
# 4000). A fit that is not increasing is refused in :func:`linear_cost` for the same reason: a
# branch asked to chunk never silently runs whole.
#
# NOTE [ Counting a chunk by storage ]
# What a saved tensor keeps alive is its storage, whole, not its numel: attention's q, k and v
# are views of one qkv storage (a reshape, a permute and an unbind of one projection), and each
# holds all three. A count keyed by storage and shape that took each view's numel would count
# q, k and v, alike in shape, as one third of their storage (the toy attention F of
# tests/test_chunk_cost.py: 12,544 bytes counted against 16,640 held), and ``max_bytes`` would
# be no cap (a Rev-ViT-B F chunk in bf16 under ``max_bytes="1GiB"`` would hold about 1.4 GiB).
# So each storage is counted once, at its ``nbytes``, whatever its views: a chunk's count is
# at least what its graph holds. (Plans do not depend on this count: they trace allocations.)


def graph_bytes(build: Callable[[], Tuple[Tensor, Sequence[Tensor]]],
                free: Iterable[Tensor] = ()) -> int:
    """Bytes kept by the graph that ``build()`` makes: the storages of every tensor saved for
    backward and of the output, each once and whole (NOTE [ Counting a chunk by storage ]),
    leaving out the storages of ``free`` (parameters) and of the leaves ``build`` returns
    beside its output (in the real chunk, views of a stream kept anyway). The graph is never
    differentiated: the hook keeps nothing in it."""
    kept: List[Tensor] = []  # alive until counted: no storage address is reused meanwhile

    def pack(t: Tensor) -> None:
        kept.append(t)
        # Returning ``t`` would let a node hold its own output (attention saves it), a reference
        # cycle that keeps the graph, and the input it was cut from, alive until the collector
        # runs.
        return None

    _MEASURING[0] += 1
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, leaves = build()
        kept.append(out)
        # By storage, whole (NOTE [ Counting a chunk by storage ]); fake tensors have no
        # address, so a storage is told by its C++ object.
        skip = {t.untyped_storage()._cdata for t in (*free, *leaves)}
        held: Dict[int, int] = {}
        for t in kept:
            storage = t.untyped_storage()
            if storage._cdata not in skip:
                held[storage._cdata] = storage.nbytes()
        return sum(held.values())
    finally:
        # The graph's nodes hold ``pack`` (autograd keeps a saved tensor's hooks), ``pack``
        # holds ``kept``, and ``kept`` holds the output and so the nodes: a cycle through C++
        # that the collector cannot see. Emptying ``kept`` breaks it.
        kept.clear()
        _MEASURING[0] -= 1


# NOTE [ Chunk costs while planning ]
# Measuring a chunk's cost builds the graphs of chunks of one and two units (NOTE [ Measuring a
# chunk's graph ]) once per block, branch and input: a stack keeps its measurements from step
# to step, so in training only the first step measures. A plan builds a new model, so each
# plan measured every block again: a fifth of a Rev-Swin-T plan's time, the same graphs each
# time (the auto search plans up to five chunkings of one batch, and a stage's blocks are
# alike). So two things:
#
# * What a step counts leaves the measurement out (``measuring()`` is true inside
#   :func:`graph_bytes`; pareprop.memory's counter leaves out what is made then, and counts
#   what outlives it from its end): a step of training is planned, not the first step, and
#   what a plan counts does not depend on whether it measured.
# * While planning (:func:`tracing_distinct_chunks`, fake tensors) a measurement is kept for
#   the process, keyed by what it depends on: the module's structure (:func:`structure`: its
#   class and settings, its parameters' and buffers' shapes, those of its submodules), the
#   branch, the input's shape, strides, dtype and device, the autocast state, the split and
#   the keyword arguments' structure. Blocks alike share one measurement, and so do plans of
#   one model at one batch. A module whose structure cannot be told (an attribute that is not
#   a plain value, a hook) is measured every time, as before.
#
# Fake tensors hold no values, so equal structures on equal inputs build equal graphs; the
# tests compare every figure of plans with the cache and without it.
_MEASURING = [0]  # > 0 while graph_bytes builds a chunk's graph
_PLANNED_COSTS: Dict[Any, Tuple[float, float]] = {}


def measuring() -> bool:
    """Whether a chunk's cost is being measured (NOTE [ Chunk costs while planning ])."""
    return _MEASURING[0] > 0


def planned_cost(module: Any, key: Any, measure: Callable[[], Tuple[float, float]]
                 ) -> Tuple[float, float]:
    """``measure()``, or while planning the measurement of a module of the same structure on
    the same ``key`` made before (NOTE [ Chunk costs while planning ])."""
    if not _DISTINCT_ONLY[0]:
        return measure()
    shape = structure(module)
    if shape is None or any(part is _NOT_PLAIN for part in key):
        return measure()
    full = (shape, key)
    try:
        return _PLANNED_COSTS[full]
    except KeyError:
        pass
    except TypeError:  # an unhashable key: measured every time
        return measure()
    if len(_PLANNED_COSTS) > 4096:
        _PLANNED_COSTS.clear()
    cost = _PLANNED_COSTS[full] = measure()
    return cost


_NOT_PLAIN = object()
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
          "_forward_hooks_always_called")
_NOT_SETTINGS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                 "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks", *_HOOKS}


def plain(value: Any) -> Any:
    """``value`` as a hashable description of what a computation can depend on: plain values
    as they are, containers of them as tuples, tensors by shape, strides, dtype, device and
    whether they require gradients (their values are not described: for fake tensors only),
    functions defined at a module's top level by name; ``_NOT_PLAIN`` for anything else."""
    if (inspect.isfunction(value) and value.__closure__ is None
            and "<locals>" not in value.__qualname__):
        return ("function", value.__module__, value.__qualname__)
    if isinstance(value, (bool, int, float)):
        return (type(value), value)  # True and 1 are equal, and hash alike
    if value is None or isinstance(value, (str, torch.dtype, torch.device)):
        return value
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type,
                value.requires_grad)
    if isinstance(value, (tuple, list)):
        items = tuple(plain(v) for v in value)
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else (type(value), items)
    if isinstance(value, dict):
        items = tuple((plain(k), plain(v)) for k, v in value.items())
        if any(k is _NOT_PLAIN or v is _NOT_PLAIN for k, v in items):
            return _NOT_PLAIN
        return (dict, items)
    return _NOT_PLAIN


def structure(module: Any) -> Optional[Tuple[Any, ...]]:
    """What a module's computation on a fake tensor can depend on besides its input: for it
    and each submodule, the class, every setting in its ``__dict__`` (plain values only), and
    its parameters and buffers (shape, strides, dtype, device); None when that cannot be told
    (not an ``nn.Module``, a setting that is no plain value, a forward or backward hook)."""
    if not isinstance(module, torch.nn.Module):
        return None
    out = []
    for name, m in module.named_modules(remove_duplicate=False):
        if any(getattr(m, hook, None) for hook in _HOOKS):
            return None
        settings = []
        for key in sorted(vars(m)):
            if key in _NOT_SETTINGS:
                continue
            value = plain(vars(m)[key])
            if value is _NOT_PLAIN:
                return None
            settings.append((key, value))
        tensors = tuple((n, plain(t)) for n, t in (*m._parameters.items(), *m._buffers.items()))
        out.append((name, type(m), tuple(settings), tensors))
    return tuple(out)


def linear_cost(measured: Sequence[int], name: str = "branch") -> Tuple[float, float]:
    """(fixed, per unit) bytes from the graphs of chunks of one and two units (one value: a
    branch of one unit). Raises when two units measured no more than one (NOTE [ Measuring a
    chunk's graph ]): chunking on it would silently run whole."""
    if len(measured) == 1:
        return 0.0, float(max(measured[0], 1))
    one, two = measured
    if two <= one:
        raise RuntimeError(
            f"measuring the chunks of {name}: a chunk of two units saved {two} bytes, one unit "
            f"{one}; expected the larger chunk to save more (a branch whose graph does not grow "
            f"with its input cannot be chunked by bytes; use chunks=N)"
        )
    per_unit = two - one
    return float(max(one - per_unit, 0)), float(per_unit)
