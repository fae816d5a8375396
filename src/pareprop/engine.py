"""Reversible blocks, the stacks that run them, and three backward engines.

A reversible block couples two streams of equal shape (SPEC section 1)::

    Y1 = X1 + F(X2)        X2 = Y2 - G(Y1)
    Y2 = X2 + G(Y1)        X1 = Y1 - F(X2)

so a stack of them can rebuild every block's input from its output. The engines:

* ``autograd``: plain PyTorch autograd, every intermediate stored. The reference.
* ``reversible`` (Reprop, Mangalam et al. 2022): forward keeps only the stack's outputs;
  backward walks the blocks from last to first, rebuilding each block's local graphs and
  inputs from its outputs, then backpropagating through them.
* ``pareprop`` (PaReprop, Zhu & Mangalam 2023): the same work, scheduled so that rebuilding
  block l-1 overlaps with the gradients of block l on a second CUDA stream.

Blocks hold only the mathematics (``f`` and ``g``); everything about backward lives here.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pareprop.chunking import Chunk, Chunking, Split, chunks, distinct_chunks, parse_chunking
from pareprop.schedule import ScheduleChoice

__all__ = [
    "ENGINES",
    "ReversibleBlock",
    "ReversibleStack",
    "set_engine",
    "set_chunking",
    "set_block_checkpointing",
    "debug_reconstruction",
    "chosen_schedule",
]

ENGINES = ("autograd", "reversible", "pareprop")

Tensor = torch.Tensor


class ReversibleBlock(nn.Module):
    """Base class of a reversible block: subclasses define ``f`` and ``g``.

    Both map a tensor to one of the same shape, and both receive the keyword arguments given
    to :class:`ReversibleStack` (an attention mask, a spatial size, ...). Rules that keep the
    block invertible and its recomputation exact:

    * use only parameters registered in the block (its own submodules);
    * never modify the input in place;
    * no modules with running statistics (BatchNorm): recomputation would update them twice;
    * randomness (dropout, drop-path) is fine: the engines replay it exactly.

    A block may also declare how F and G split into chunks, so that the reversible engines can
    rebuild and differentiate them a piece at a time (:func:`set_chunking`; NOTE [ Chunked
    branches ] in pareprop/chunking.py): ``f_split`` / ``g_split`` return a
    :class:`~pareprop.chunking.Split` (None: the branch does not split), and ``f_chunk`` /
    ``g_chunk`` compute one :class:`~pareprop.chunking.Chunk` of it.
    """

    def f(self, x: Tensor, **kwargs: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define f(x, **kwargs)")

    def g(self, x: Tensor, **kwargs: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define g(x, **kwargs)")

    def f_split(self, x: Tensor, **kwargs: Any) -> Optional[Split]:
        """How F splits for an input ``x``; None (the default): it does not."""
        return None

    def g_split(self, x: Tensor, **kwargs: Any) -> Optional[Split]:
        """How G splits for an input ``x``; None (the default): it does not."""
        return None

    def f_chunk(self, x: Tensor, chunk: Chunk, **kwargs: Any) -> Tensor:
        """One chunk of F: ``x`` is the chunk's slice of F's input along the split's axis, and
        the result must be the same slice of F's output; random layers take their slice of
        the whole draw (NOTE [ Exact randomness in chunks ] in pareprop/chunking.py)."""
        raise NotImplementedError(f"{type(self).__name__} declares f_split but no f_chunk")

    def g_chunk(self, x: Tensor, chunk: Chunk, **kwargs: Any) -> Tensor:
        """One chunk of G, as :meth:`f_chunk` for F."""
        raise NotImplementedError(f"{type(self).__name__} declares g_split but no g_chunk")

    def forward(self, x1: Tensor, x2: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """The coupling under plain autograd; stacks call ``f`` and ``g`` directly."""
        beta = skip_scale(self)
        y1 = _skip(beta, x1) + self.f(x2, **kwargs)
        y2 = _skip(beta, x2) + self.g(y1, **kwargs)
        return y1, y2

    def set_skip_scale(self, beta: float) -> "ReversibleBlock":
        """Scale the skip connections of the coupling by ``beta``: Y1 = beta * X1 + F(X2),
        Y2 = beta * X2 + G(Y1). See NOTE [ Skip scale of the coupling ]."""
        beta = float(beta)
        if not 0.0 <= beta < float("inf"):
            raise ValueError(f"expected a skip scale beta >= 0, got {beta!r}")
        self._skip_scale_value = beta
        if "skip_scale" in self._buffers:
            with torch.no_grad():
                self.skip_scale.fill_(beta)  # in place: compiled code keeps reading it
        else:
            device = next((p.device for p in self.parameters()), None)
            self.register_buffer(
                "skip_scale", torch.tensor(beta, dtype=torch.float32, device=device),
                persistent=False,
            )
        return self

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        if "skip_scale" in self._buffers:  # float32 and exact through .double() or .half()
            self.skip_scale = torch.full((), self._skip_scale_value, dtype=torch.float32,
                                         device=self.skip_scale.device)
        return self


# NOTE [ Skip scale of the coupling ]
# A block may scale its skip connections by beta (pareprop.convert starts a pretrained network
# at beta = 0 and moves it to beta = 1):
#     Y1 = beta * X1 + F(X2)        X2 = (Y2 - G(Y1)) / beta
#     Y2 = beta * X2 + G(Y1)        X1 = (Y1 - F(X2)) / beta
# and in backward dX1 = beta * dY1', dX2 = beta * dY2 + F'(X2)^T dY1', with dY1' = dY1 +
# G'(Y1)^T dY2. beta is a float32 non-persistent buffer ``skip_scale`` changed in place
# (ReversibleBlock.set_skip_scale), so a new value between steps rebuilds and recompiles
# nothing; a block without the buffer has beta = 1 and runs exactly the unscaled coupling, with
# no extra kernel. The two helpers below are the only places the engines apply it. Rebuilding
# divides by beta, so rounding errors grow like (1 / beta)^(2 per block): the reversible engines
# refuse beta = 0 in a recomputed block, and pareprop.PrecisionGuard stores the blocks whose
# measured reconstruction error is too large (docs/convert.md).


def skip_scale(block: nn.Module) -> Optional[Tensor]:
    """The block's skip scale beta (a 0-dim float32 tensor), or None for beta = 1."""
    return block._buffers.get("skip_scale") if isinstance(block, nn.Module) else None


def _skip(beta: Optional[Tensor], x: Tensor) -> Tensor:
    return x if beta is None else beta * x


def _unskip(beta: Optional[Tensor], x: Tensor) -> Tensor:
    return x if beta is None else x / beta


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


# ---------------------------------------------------------------------------------------------
# NOTE [ Exact replay of randomness ]
# Dropout and drop-path inside F and G must draw in recomputation exactly what they drew in
# forward. Forward captures the CPU generator state (and the CUDA generator state of the
# stack's device) just before each call of F and of G; recomputation restores the matching
# state before calling F or G again. Backward calls G before F, the reverse of forward, which
# is why one state per block would not do. Backward saves the global states on entry and puts
# them back on exit, so after a training step the global RNG is exactly where the autograd
# engine leaves it: forward consumed the same draws, and backward consumed none. Nothing is
# ever reseeded.
# ---------------------------------------------------------------------------------------------


@dataclass
class _RngState:
    cpu: Tensor
    cuda: Optional[Tensor]

    @staticmethod
    def capture(device: torch.device) -> "_RngState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return _RngState(torch.get_rng_state(), cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


# NOTE [ Autocast in recomputation ]
# Backward runs outside the user's autocast region (autocast state is thread-local and the
# autograd engine has its own threads), so recomputation re-enters the autocast state that was
# active at forward: device type, dtype and enabled flag, for the CPU and for the stack's device.


def _has_autocast(device_type: str) -> bool:
    # The meta device (timm builds and runs models there to check shapes) has no autocast.
    check = getattr(torch.amp, "is_autocast_available", None)
    return check(device_type) if check is not None else device_type in ("cpu", "cuda", "xpu")


def _autocast_state(device_type: str) -> Tuple[bool, torch.dtype]:
    if not _has_autocast(device_type):
        return False, torch.get_default_dtype()
    try:  # torch >= 2.4
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except TypeError:  # older signature without a device type
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


@dataclass(frozen=True)
class _AutocastState:
    states: Tuple[Tuple[str, bool, torch.dtype], ...]

    @staticmethod
    def capture(device: torch.device) -> "_AutocastState":
        types = ["cpu"] if device.type == "cpu" or not _has_autocast(device.type) else [
            "cpu", device.type]
        return _AutocastState(tuple((t, *_autocast_state(t)) for t in types))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.states:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


# NOTE [ Backend flags in recomputation ]
# Which SDPA kernels may run, cuDNN's switches and the TF32 / float32 precision settings are
# process-global flags, usually set by a context manager around forward
# (torch.nn.attention.sdpa_kernel, torch.backends.cudnn.flags) that has exited by the time
# backward recomputes. A different kernel gives F and G slightly different values, which
# subtraction then carries into the rebuilt inputs. So forward captures these flags and
# recomputation runs under them, restoring the current ones after each block. Randomness does
# not depend on them: attention dropout is drawn by nn.functional.dropout, never inside a fused
# kernel (pareprop.layers.attend). Not replayed: torch.use_deterministic_algorithms (a process
# setting users do not toggle around one forward) and per-call kernel choices made inside F or
# G themselves, which run again as written.

_SDP_SWITCHES = ("flash_sdp", "mem_efficient_sdp", "math_sdp", "cudnn_sdp")


def _precision_switches() -> List[Tuple[Any, str]]:
    """(owner, attribute) of the TF32 / float32-precision switches this torch has.

    torch >= 2.9 has per-backend ``fp32_precision`` settings and raises when its legacy flags
    are read after the new ones were set, so only one family is read and written."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    if hasattr(cuda.matmul, "fp32_precision"):
        return [(cuda.matmul, "fp32_precision"), (cudnn.conv, "fp32_precision"),
                (cudnn.rnn, "fp32_precision")]
    return [(cuda.matmul, "allow_tf32"), (cudnn, "allow_tf32")]


def _backend_switches() -> Tuple[Tuple[Any, str, Any], ...]:
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    switches: List[Tuple[Any, str, Any]] = [
        (cuda, name, bool(getattr(cuda, f"{name}_enabled")()))
        for name in _SDP_SWITCHES
        if hasattr(cuda, f"{name}_enabled")  # cudnn_sdp is torch >= 2.2
    ]
    switches += [(cudnn, name, getattr(cudnn, name)) for name in ("enabled", "benchmark",
                                                                  "deterministic")]
    switches += [(owner, name, getattr(owner, name)) for owner, name in _precision_switches()]
    return tuple(switches)


def _set_switch(owner: Any, name: str, value: Any) -> None:
    if name in _SDP_SWITCHES:
        getattr(owner, f"enable_{name}")(value)
    else:
        setattr(owner, name, value)


@dataclass(frozen=True)
class _BackendState:
    switches: Tuple[Tuple[Any, str, Any], ...]

    @staticmethod
    def capture() -> "_BackendState":
        return _BackendState(_backend_switches())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        current = _backend_switches()
        changed = [(want, now) for want, now in zip(self.switches, current) if want[2] != now[2]]
        for (owner, name, value), _ in changed:
            _set_switch(owner, name, value)
        try:
            yield
        finally:
            for _, (owner, name, value) in reversed(changed):
                _set_switch(owner, name, value)


# ---------------------------------------------------------------------------------------------
# Forward coupling, shared by every engine.
# ---------------------------------------------------------------------------------------------


def _call_checked(
    block: ReversibleBlock,
    name: str,
    x: Tensor,
    kwargs: Dict[str, Any],
    chunk: Optional[Chunk] = None,
) -> Tensor:
    """``block.f(x)`` or ``block.g(x)`` (``f_chunk`` / ``g_chunk`` with a chunk), checked."""
    call = getattr(block, name) if chunk is None else functools.partial(
        getattr(block, f"{name}_chunk"), chunk=chunk)
    # Traced (whole-model torch.compile) or inference-mode tensors: they have no _version.
    if torch.compiler.is_compiling() or x.is_inference():
        return call(x, **kwargs)
    version = x._version
    out = call(x, **kwargs)
    if x._version != version:
        raise RuntimeError(
            f"{type(block).__name__}.{name} modified its input in place; a reversible block "
            "must leave its input unchanged (use out-of-place ops, e.g. inplace=False)"
        )
    if out.shape != x.shape:
        raise RuntimeError(
            f"{type(block).__name__}.{name} must return a tensor of its input's shape "
            f"{tuple(x.shape)}, got {tuple(out.shape)}"
        )
    return out


# NOTE [ Module modes in recomputation ]
# A module's training flag is part of what its forward computed: dropout and drop-path draw
# only in training mode. A model switched to eval between forward and backward (a validation
# pass in between) must not change what recomputation computes, so forward records the flag of
# every module of each block and recomputation runs under those flags, restoring the current
# ones after the block.


@dataclass(frozen=True)
class _ModeState:
    flags: Tuple[Tuple[nn.Module, bool], ...]

    @staticmethod
    def capture(block: nn.Module) -> "_ModeState":
        return _ModeState(tuple((m, m.training) for m in block.modules()))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        changed = [(m, m.training) for m, want in self.flags if m.training != want]
        for m, now in changed:
            m.training = not now
        try:
            yield
        finally:
            for m, now in changed:
                m.training = now


@dataclass
class _BlockRecord:
    """What forward leaves for one block's recomputation (and for the debug check)."""

    f_rng: Optional[_RngState]  # None for a stored block, which is not recomputed
    g_rng: Optional[_RngState]
    inputs: Optional[Tuple[Tensor, Tensor]] = None
    modes: Optional[_ModeState] = None


def _couple(
    block: ReversibleBlock,
    x1: Tensor,
    x2: Tensor,
    kwargs: Dict[str, Any],
    records: Optional[List[_BlockRecord]] = None,
    keep_inputs: bool = False,
) -> Tuple[Tensor, Tensor]:
    beta = skip_scale(block)
    if records is None:
        y1 = _skip(beta, x1) + _call_checked(block, "f", x2, kwargs)
        return y1, _skip(beta, x2) + _call_checked(block, "g", y1, kwargs)
    f_rng = _RngState.capture(x2.device)
    y1 = _skip(beta, x1) + _call_checked(block, "f", x2, kwargs)
    g_rng = _RngState.capture(x2.device)
    y2 = _skip(beta, x2) + _call_checked(block, "g", y1, kwargs)
    inputs = (x1.clone(), x2.clone()) if keep_inputs else None
    records.append(_BlockRecord(f_rng, g_rng, inputs, _ModeState.capture(block)))
    return y1, y2


# ---------------------------------------------------------------------------------------------
# Backward: recover(l) rebuilds block l's local graphs and inputs; grads(l) backpropagates
# through them. Both engines are schedules of these two steps.
# ---------------------------------------------------------------------------------------------


# NOTE [ Chunked forward ]
# The forward of a chunked stack runs each branch chunk by chunk too, without a graph: its
# whole-branch temporaries (a ViT-B MLP's two 4C-wide hidden maps, qkv and the attention
# output) would otherwise set the step's peak once backward no longer does. Each chunk's
# output is added into its slice of the block's output (Y1 = beta X1 + F(X2), then Y2 = beta
# X2 + G(Y1)), a tensor the stack made. Randomness is drawn as in backward: the branch's
# generator state is restored before every chunk, and each chunk takes its slice of the whole
# draw (NOTE [ Exact randomness in chunks ]), so the generator ends where the whole branch
# leaves it, and backward rebuilds exactly what forward computed, chunk for chunk.


def _couple_chunked(
    plan: "_Plan", index: int, x1: Tensor, x2: Tensor, keep_inputs: bool
) -> Tuple[Tensor, Tensor]:
    """``_couple`` of block ``index`` of a chunked stack, each branch in chunks."""
    block = plan.blocks[index]
    f_rng = _RngState.capture(x2.device)
    y1 = _add_branch(plan, index, "f", x2, x1, f_rng)
    g_rng = _RngState.capture(x2.device)
    y2 = _add_branch(plan, index, "g", y1, x2, g_rng)
    inputs = (x1.clone(), x2.clone()) if keep_inputs else None
    plan.records.append(_BlockRecord(f_rng, g_rng, inputs, _ModeState.capture(block)))
    return y1, y2


def _add_branch(plan: "_Plan", index: int, name: str, x: Tensor, skip: Tensor,
                rng: _RngState) -> Tensor:
    """``beta * skip + branch(x)`` in forward, in chunks where the branch has more than one."""
    block = plan.blocks[index]
    beta = skip_scale(block)
    split, count = _branch_chunking(plan, index, name, x, rng)
    if split is None or count == 1:  # as _couple does it
        rng.restore(plan.device)  # measuring the chunk cost (chunking by bytes) has drawn
        return _skip(beta, skip) + _call_checked(block, name, x, plan.kwargs)
    out = skip.clone() if beta is None else beta * skip
    _run_chunks(plan, index, name, x, split, count, rng, add_into=out)
    return out


@dataclass
class _Plan:
    """Everything a stack's backward needs besides the saved outputs."""

    blocks: Sequence[ReversibleBlock]
    engine: str
    kwargs: Dict[str, Any]
    # Per block: (index into the Function's parameter inputs, parameter) of trainable params.
    block_params: List[List[Tuple[int, Tensor]]]
    # Per block: every parameter as (owning module, attribute, tensor, version) at forward.
    block_locations: List[List["_ParamLocation"]]
    num_params: int
    device: torch.device
    autocast: _AutocastState
    backends: _BackendState
    keywords: "_KeywordVersions"
    # Per block: True when the block keeps its graph from forward (see NOTE [ Stored blocks ]).
    stored: Sequence[bool]
    # Per block: its skip scale at forward as (buffer, version), None for beta = 1 (NOTE
    # [ Skip scale of the coupling ]).
    betas: Sequence[Optional[Tuple[Tensor, int]]] = ()
    debug_tolerance: Optional[float] = None
    records: List[_BlockRecord] = field(default_factory=list)
    # Per block: the graphs a stored block built in forward, until backward consumes them.
    graphs: List[Optional["_Rebuilt"]] = field(default_factory=list)
    # Called around each stored block's forward (pareprop.budget measures blocks with it).
    probe: Optional[Callable[[int, Tensor], contextlib.AbstractContextManager]] = None
    reconstruction_errors: List[Tuple[float, float]] = field(default_factory=list)
    # FSDP2: gathers each block around its forward and recomputation and hands its parameter
    # gradients to FSDP; None when the stack is not sharded (NOTE [ FSDP2 and reversible blocks ]
    # in pareprop/fsdp.py). A sharded stack's block_params are filled in forward, per block.
    sharding: Optional[Any] = None
    # Chunked backward of the recomputed blocks (NOTE [ Chunked backward ]); None: whole branches.
    chunking: Optional[Chunking] = None
    # (block, branch, input shape, dtype, autocast) -> (fixed, per-unit) saved bytes of a chunk.
    chunk_costs: Dict[Any, Tuple[float, float]] = field(default_factory=dict)
    # A chunked stack's outputs, held here (not saved in the Function) until backward takes
    # them, and their versions at forward.
    outputs: Optional[List[Tensor]] = None
    output_versions: Tuple[int, ...] = ()
    # PaReprop with chunks: the block whose X1 the next recover rebuilds (its Y1 is handed
    # down in X1's place; NOTE [ Chunked backward ]).
    pending_x1: Optional[int] = None
    # Under "pareprop": the stack's choice between PaReprop and Reprop (pareprop/schedule.py).
    schedule: Optional[ScheduleChoice] = None


@dataclass
class _ParamLocation:
    module: nn.Module
    name: str
    tensor: Tensor
    version: int


# NOTE [ Keyword tensors in recomputation ]
# Keyword inputs of a stack (attention masks, window masks) are used again, as they are then,
# when backward recomputes F and G. One refilled in place between forward and backward (a
# reused mask buffer; ``mask.bool()`` of a bool tensor is the tensor itself) would make the
# recomputation differ from the forward and the gradients silently wrong. A private copy would
# cost memory on every forward for a rare mistake, so, as for parameters, forward records each
# tensor's version and recomputation refuses a changed one.


def _keyword_tensors(value: Any, key: str) -> Iterator[Tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        yield key, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _keyword_tensors(item, f"{key}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _keyword_tensors(item, f"{key}[{k!r}]")


@dataclass(frozen=True)
class _KeywordVersions:
    versions: Tuple[Tuple[str, Tensor, int], ...]

    @staticmethod
    def capture(kwargs: Dict[str, Any]) -> "_KeywordVersions":
        return _KeywordVersions(tuple(
            (key, t, t._version)
            for name, value in kwargs.items()
            for key, t in _keyword_tensors(value, name)
            if not t.is_inference()  # inference tensors have no version (and cannot change)
        ))

    def check(self, index: int, block: nn.Module) -> None:
        for key, t, version in self.versions:
            if t._version != version:
                raise RuntimeError(
                    f"keyword input {key!r} of the stack was modified in place between forward "
                    f"and backward (a reused buffer refilled?); the reversible engines recompute "
                    f"block {index} ({type(block).__name__}) with it, so its gradients would be "
                    "wrong: pass a new tensor (or a .clone()) to each forward"
                )


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


@dataclass
class _Rebuilt:
    """Block l's local graphs, G(Y1) and F(X2), and its reconstructed inputs."""

    y1: Tensor  # the block's first output, input of G: a leaf (or a leaf's view, if stored)
    g_out: Optional[Tensor]  # None when chunked: grads() rebuilds G chunk by chunk
    x2: Tensor  # the reconstructed second input, input of F: likewise
    f_out: Optional[Tensor]  # likewise
    x1: Optional[Tensor]  # reconstructed first input (no graph); None where nobody needs it


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
    if plan.chunking is not None:
        return _recover_chunked(plan, index, y1, y2)
    block, record = plan.blocks[index], plan.records[index]
    plan.keywords.check(index, block)
    with torch.enable_grad(), plan.autocast.replay(), plan.backends.replay(), \
            record.modes.replay(), _forward_parameters(plan, index):
        y1 = y1.detach().requires_grad_(True)
        record.g_rng.restore(plan.device)
        g_out = _call_checked(block, "g", y1, plan.kwargs)
        beta = _plan_beta(plan, index)
        with torch.no_grad():
            x2 = _unskip(beta, y2 - g_out).requires_grad_(True)
        record.f_rng.restore(plan.device)
        f_out = _call_checked(block, "f", x2, plan.kwargs)
        with torch.no_grad():
            x1 = _unskip(beta, y1 - f_out)
    if record.inputs is not None:
        _check_reconstruction(plan, index, (x1, x2), record.inputs)
    return _Rebuilt(y1, g_out, x2, f_out, x1)


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
) -> _Rebuilt:
    """Forward of a stored block, building the graphs that recover() would rebuild."""
    # F and G take views of the detached inputs, not the leaves themselves: tools that hook
    # module inputs in forward (torch's ModTracker, inside MemTracker and so plan_memory) ask
    # autograd, when our nested autograd.grad runs, whether each input's node will execute,
    # which autograd cannot answer for a leaf. A view costs no memory, and the gradient
    # captured at it is the leaf's.
    with torch.enable_grad():
        x2_in = x2.detach().requires_grad_(True).view_as(x2)
        f_out = _call_checked(block, "f", x2_in, kwargs)
        with torch.no_grad():
            y1 = _skip(skip_scale(block), x1) + f_out
        y1_in = y1.detach().requires_grad_(True).view_as(y1)
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
    if rebuilt.g_out is None:
        return _grads_chunked(plan, index, rebuilt, dy1, dy2, param_grads)
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


# NOTE [ Chunked backward ]
# With chunking on (set_chunking; NOTE [ Chunked branches ] in pareprop/chunking.py) a
# recomputed block's backward runs branch by branch and, inside a branch, chunk by chunk:
#   G: per chunk, restore G's generator state, rebuild the chunk's graph from a leaf (the
#      chunk's slice of Y1: tokens for G, samples for F), subtract its output from its slice
#      of Y2, where X2 = (Y2 - G(Y1)) / beta is being rebuilt, backpropagate the matching part
#      of dY2, add the input gradient into dY1 and the parameter gradients into their sums;
#      the chunk's graph is freed before the next chunk is built.
#   F: the same over X2 (complete by now) with the total dY1 flowing in, subtracting where
#      X1 = (Y1 - F(X2)) / beta is rebuilt, adding the input gradients into dX2 = beta dY2 +
#      dF (beta: NOTE [ Skip scale of the coupling ], 1 for most blocks).
# So one chunk's graph is alive at a time instead of the block's two whole graphs.
#
# What is kept when, under "reversible". A block's backward holds its output streams Y1, Y2,
# their gradients dY1, dY2, and one chunk's graph with its gradients. The rebuilt streams and
# the new gradients take the storage of the old ones, in place:
#   * X2 goes into Y2: G reads Y1 only, and nothing reads Y2 after G's chunks are subtracted;
#   * X1 goes into Y1 once G is done: F reads X2 only;
#   * dY1 + dG goes into dY1, and dY2 + dF into dY2: G's backward has read dY2 by then.
# The floor of a block's backward is therefore one pair of streams and one pair of
# gradients, plus what autograd holds. Not for the top block: its streams are the stack's
# outputs, which the caller may still hold, and its gradients come from autograd, which may
# hand out views of one tensor (after torch.cat) or a tensor a hook kept. So the top block
# writes into copies, and every block below works in place in what the block above returned.
# The copies cost nothing lasting: a chunked stack does not save its outputs in the autograd
# Function but holds detached aliases itself (their versions checked in backward), and the
# top block drops them as soon as they are copied, so they are freed unless the caller holds
# them. The price is that backward can run once: with retain_graph=True a second backward
# raises. What stays is the top block's incoming gradients, which autograd holds until
# backward returns: a block's backward holds two streams, their two gradients, those two, and
# one chunk's graph with its gradients.
#
# Under "pareprop", recover(l-1) runs beside grads(l) (NOTE [ PaReprop on two CUDA streams ]),
# and grads(l) reads block l's Y1 (G's input) and X2 (F's input), so recover cannot rebuild in
# their storage. It rebuilds without a graph, chunk by chunk, into new maps, and grads rebuilds
# each chunk's graph again to backpropagate through it: one more forward of the block than
# without chunks, in exchange for not holding two blocks' whole graphs. To hold as few maps
# as the overlap allows, recover runs half a block late: recover(l-1) rebuilds X1 of block l
# (= Y1 - F(X2), block l's F) and then X2 of block l-1 (Y2 - G(Y1) with Y1, Y2 of block l-1
# being X1, X2 of block l), both independent of grads(l). Block l's X1 is not needed before:
# grads(l) reads Y1 and X2, and only block l-1 reads X1 (as its Y1). So while grads(l) runs,
# four stream maps are alive: block l's Y1 and X2, and the two new ones ("reversible" holds
# two). Where both blocks are recomputed in chunks (and not sharded), the step runs in two
# halves so that Y1 is released once G is done with it, and the top block writes dX2 into X2:
# three maps and no more gradients than "reversible" hold (NOTE [ Chunked PaReprop in half
# steps ]). Elsewhere Y1 stays until grads(l) returns: recover(l-1) reads it on the other lane,
# and freeing it would let grads(l)'s lane reuse memory the other lane may still read (NOTE
# [ Tensor lifetimes across streams ]: a block's streams are freed once their last reader is
# queued, and that is grads(l)). The bottom block's X1 (the stack's input) is never
# rebuilt, nor that of a block below which a stored block sits (the stored block kept its
# inputs), except for debug_reconstruction's check; under FSDP, where only a block and the one
# above are gathered at a time, each recover rebuilds its own X1. The gradients are rebuilt in
# place below the top block, as under "reversible" (the block above, chunked, handed down
# its own tensors), and the stack's outputs are released once the top block is recovered.
# Stored blocks keep their whole graphs from forward.


# NOTE [ Chunked PaReprop in half steps ]
# A PaReprop step of chunked blocks used to hold four stream maps and, at the top block, four
# gradient maps: block l's Y1 and X2 (read by grads(l)), the new X1(l) and X2(l-1) (written by
# recover(l-1)), the stack's incoming dY1, dY2 (autograd holds them until the stack's backward
# returns) and grads(l)'s copies of them, dY1' and dX2. "reversible" holds two streams and
# the same four gradients, so on Rev-Swin-T, whose peak is the top block of the 56x56 stage,
# PaReprop's largest batch was 0.81x Reprop's. Each half of the step reads less than the whole:
#   first half:  recover X1(l) = (copy of Y1(l) - F(X2(l))) / beta   beside   grads of G(Y1(l))
#   barrier:     each lane waits for the other lane's first half; Y1(l) is released
#   second half: recover X2(l-1) = (copy of X2(l) - G(X1(l))) / beta  beside  grads of F(X2(l))
# so three stream maps are alive at a time (Y1, X2, X1 and then X2, X1, X2(l-1)), and the top
# block, whose incoming gradients are autograd's, writes dX2 = beta dY2 + dF into X2(l)'s own
# storage rather than into a copy of dY2: chunk by chunk, each chunk once its graph is
# backpropagated and freed (the chunk's input gradient covers exactly its slice of X2, which no
# later chunk reads), so the top step holds what "reversible" holds. Below the top block the
# gradients were already rebuilt in place; there the step holds one stream map more than
# "reversible" instead of two.
# Why this is safe on two streams (NOTE [ Tensor lifetimes across streams ]):
#   * Y1(l) is read by grads-G(l) on lane l and, once, by recover's copy on lane l-1. It is
#     released on the host after the barrier is queued: every later kernel of either lane runs
#     after both readers, so whichever stream's pool Y1 was allocated from, no kernel that
#     reuses it can run before its readers are done (a tensor that came from the main stream
#     with record_stream is held back by the allocator anyway).
#   * X2(l) is read by recover(l-1) (F over it in the first half, then a copy at the start of the
#     second half) and by grads-F(l)'s chunks. grads-F(l) writes into it only after waiting for
#     the event marked right after that copy (and after the barrier, so after the first half's
#     reads); its own chunks are in stream order on its lane.
#   * The barrier costs little overlap: each recover half is one branch's forward without a
#     graph, shorter than the other lane's half, a branch's forward and backward; the wait for
#     the copy of X2 is one copy.
# The chains of events of the whole steps stay as they were: recover(l-1)'s first half waits for
# recover(l) and grads(l+1), grads(l)'s first half for grads(l+1).


def _branch_chunking(
    plan: _Plan, index: int, name: str, x: Tensor, rng: _RngState
) -> Tuple[Optional[Split], int]:
    """Block ``index``'s split of branch ``name`` for input ``x`` and its chunk count."""
    block = plan.blocks[index]
    split = getattr(block, f"{name}_split")(x, **plan.kwargs)
    if split is None:
        return None, 1
    if not isinstance(split, Split):
        raise TypeError(
            f"{type(block).__name__}.{name}_split must return a pareprop.chunking.Split or None, "
            f"got {type(split).__name__}"
        )
    chunking = plan.chunking
    if chunking.count is not None:
        return split, chunking.count_for(split.size)
    return split, chunking.count_for(split.size, *_chunk_cost(plan, index, name, x, split, rng))


def _chunk_cost(
    plan: _Plan, index: int, name: str, x: Tensor, split: Split, rng: _RngState
) -> Tuple[float, float]:
    """(fixed, per unit) bytes saved by the graph of one chunk of a branch, measured once per
    block, branch, input shape and autocast state on chunks of one and two units."""
    key = (index, name, tuple(x.shape), x.dtype, plan.autocast)
    if key in plan.chunk_costs:
        return plan.chunk_costs[key]
    block = plan.blocks[index]
    skip = {p.untyped_storage()._cdata for p in block.parameters()}
    measured = []
    for units in (1, 2) if split.size >= 2 else (1,):
        chunk = Chunk(0, 2, 0, units, split.size)
        seen: Dict[Tuple[int, Tuple[int, ...]], int] = {}

        def pack(t: Tensor, seen: Dict[Tuple[int, Tuple[int, ...]], int] = seen) -> None:
            ptr = t.untyped_storage()._cdata  # fake tensors (plan_memory) have no address
            if ptr not in skip:
                seen[(ptr, tuple(t.shape))] = t.numel() * t.element_size()
            # Nothing is kept: this graph is never backpropagated. Returning ``t`` would let a
            # node hold its own output (attention saves it), a reference cycle that keeps the
            # graph, and the stream it was cut from, alive until the garbage collector runs.
            return None

        rng.restore(plan.device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # A copy of one or two units, not a view: tools that hook module inputs in forward
            # (torch's ModTracker, inside plan_memory's MemTracker) keep a leaf they saw, and
            # a view would keep the whole stream with it.
            leaf = _chunk_input(x, split, chunk).detach().clone().requires_grad_(True)
            skip.add(leaf.untyped_storage()._cdata)  # in the real chunk, a view of the stream
            out = _call_checked(block, name, leaf, plan.kwargs, chunk)
        measured.append(sum(seen.values()) + out.numel() * out.element_size())
        del out, leaf
    per_unit = measured[-1] - measured[0] if len(measured) == 2 else measured[0]
    cost = (float(max(measured[0] - per_unit, 0)), float(max(per_unit, 1)))
    plan.chunk_costs[key] = cost
    return cost


def _chunk_input(x: Tensor, split: Optional[Split], chunk: Optional[Chunk]) -> Tensor:
    if chunk is None or split is None:
        return x
    return chunk.take(x, split.dim)


def _run_chunks(
    plan: _Plan,
    index: int,
    name: str,
    x: Tensor,
    split: Optional[Split],
    count: int,
    rng: _RngState,
    subtract_from: Optional[Tensor] = None,
    add_into: Optional[Tensor] = None,
    grad_out: Optional[Tensor] = None,
    grad_into: Optional[Tensor] = None,
    param_grads: Optional[List[Optional[Tensor]]] = None,
    sums: Optional[Set[int]] = None,
    grad_base: Optional[Tensor] = None,
    base_scale: Optional[Tensor] = None,
) -> None:
    """Branch ``name`` of block ``index`` on ``x``, chunk by chunk: each chunk's output is
    subtracted from ``subtract_from`` or added into ``add_into``; with ``grad_out`` each chunk
    is backpropagated at once, its input gradient added into ``grad_into`` and its parameter
    gradients into ``param_grads``, and its graph freed before the next chunk. With
    ``grad_base``, each chunk of ``grad_into`` is first set to ``base_scale`` times that chunk
    of ``grad_base``, once the chunk's graph is freed: ``grad_into`` may then be ``x`` itself.
    """
    block = plan.blocks[index]
    owned = plan.block_params[index]
    params = [p for _, p in owned]
    # All chunks, or while planning those that can set a new peak (NOTE [ Planning a chunked
    # branch from its distinct chunks ] in chunking.py).
    pieces = [None] if split is None or count == 1 else distinct_chunks(chunks(split.size, count))
    accumulate = grad_out is not None and len(pieces) > 1
    with _accumulating(plan, index, params) if accumulate else contextlib.nullcontext() as leaves:
        for chunk in pieces:
            rng.restore(plan.device)
            with torch.set_grad_enabled(grad_out is not None):
                leaf = _chunk_input(x, split, chunk).detach()
                if grad_out is not None:
                    leaf.requires_grad_(True)
                out = _call_checked(block, name, leaf, plan.kwargs, chunk)
            if subtract_from is not None:
                with torch.no_grad():
                    _chunk_input(subtract_from, split, chunk).sub_(out)
            if add_into is not None:
                with torch.no_grad():
                    _chunk_input(add_into, split, chunk).add_(out)
            if grad_out is None:
                continue
            part = _chunk_input(grad_out, split, chunk)
            if accumulate:  # parameter gradients accumulate in the leaves' .grad
                if out.requires_grad:
                    torch.autograd.backward(out, part.to(out.dtype), inputs=[leaf, *leaves])
                grad_in, grads = leaf.grad, ()
            else:
                grad_in, *grads = _vjp(out, [leaf, *params], part)
            del out, leaf  # the chunk's graph is gone; its gradients remain
            into = _chunk_input(grad_into, split, chunk)
            if grad_base is not None:  # grad_into starts as base_scale * grad_base, per chunk
                _skip_(base_scale, into.copy_(_chunk_input(grad_base, split, chunk)))
            if grad_in is not None:
                into.add_(grad_in)
            _add_param_grads(owned, grads, param_grads, sums)
        if accumulate:
            _add_param_grads(owned, [t.grad for t in leaves], param_grads, sums)


# NOTE [ Parameter gradients of chunks ]
# torch.autograd.grad hands back every parameter's gradient of a chunk at once, all alive
# together beside the running sums: one block's parameter gradients more than whole branches
# need, which is what sets the peak of a small-batch step. So over several chunks the block's
# parameters are swapped (as NOTE [ Recomputing with the forward's parameters ] swaps them)
# for leaves that alias them, and backward accumulates into the leaves' .grad: each
# parameter's chunk gradient is added in place and freed as soon as it is computed.


@contextlib.contextmanager
def _accumulating(plan: _Plan, index: int, params: List[Tensor]) -> Iterator[List[Tensor]]:
    leaves = {id(p): p.detach().requires_grad_(True) for p in params}
    swapped = []
    try:
        for loc in plan.block_locations[index]:
            current = loc.module._parameters[loc.name]
            if id(current) in leaves:
                swapped.append((loc.module, loc.name, current))
                loc.module._parameters[loc.name] = leaves[id(current)]
        yield [leaves[id(p)] for p in params]
    finally:
        for module, name, current in reversed(swapped):
            module._parameters[name] = current


@_profiled("pareprop::chunked")
def _block_chunked(
    plan: _Plan,
    index: int,
    streams: List[Optional[Tensor]],
    dy1: Tensor,
    dy2: Tensor,
    param_grads: List[Optional[Tensor]],
    in_place: bool,
) -> Tuple[Tensor, Tensor]:
    """Recover and backpropagate block ``index`` chunk by chunk ("reversible"). ``streams``
    holds Y1, Y2 and is left holding X1, X2; returns dX1, dX2. With ``in_place`` everything is
    rebuilt in the storage of Y1, Y2, dY1, dY2; without, into copies, and Y1, Y2 are released
    as soon as they are copied."""
    if plan.sharding is not None:
        plan.sharding.gather(index)
        param_grads = [None] * len(plan.block_params[index])
    record, sums = plan.records[index], set()
    plan.keywords.check(index, plan.blocks[index])
    beta = _plan_beta(plan, index)  # NOTE [ Skip scale of the coupling ]
    x2 = streams[1] if in_place else streams[1].clone()
    streams[1] = None
    dy1_total = dy1 if in_place else dy1.clone()
    with plan.autocast.replay(), plan.backends.replay(), record.modes.replay(), \
            _forward_parameters(plan, index):
        split, count = _branch_chunking(plan, index, "g", streams[0], record.g_rng)
        # Y2 = beta X2 + G(Y1): X2 is rebuilt into Y2, dY2 flows into G, whose input gradient
        # joins dY1.
        _run_chunks(plan, index, "g", streams[0], split, count, record.g_rng, subtract_from=x2,
                    grad_out=dy2, grad_into=dy1_total, param_grads=param_grads, sums=sums)
        _unskip_(beta, x2)
        x1 = streams[0] if in_place else streams[0].clone()
        streams[0] = None
        dx2 = _skip_(beta, dy2 if in_place else dy2.clone())
        split, count = _branch_chunking(plan, index, "f", x2, record.f_rng)
        # Y1 = beta X1 + F(X2): X1 is rebuilt into Y1, the total dY1 flows into F, whose input
        # gradient joins beta dY2.
        _run_chunks(plan, index, "f", x2, split, count, record.f_rng, subtract_from=x1,
                    grad_out=dy1_total, grad_into=dx2, param_grads=param_grads, sums=sums)
        _unskip_(beta, x1)
        _skip_(beta, dy1_total)  # dX1 = beta dY1', once F has read dY1'
    if record.inputs is not None:
        _check_reconstruction(plan, index, (x1, x2), record.inputs)
    if plan.sharding is not None:
        plan.sharding.reduce(index, [p for _, p in plan.block_params[index]], param_grads)
    streams[:] = [x1, x2]
    return dy1_total, dx2


def _recover_chunked(plan: _Plan, index: int, y1: Tensor, y2: Tensor) -> _Rebuilt:
    """PaReprop's recover of a chunked block, without a graph, chunk by chunk, half a block
    late (NOTE [ Chunked backward ]): first X1 of the block above, if it was left pending
    (``y1`` is then that block's Y1), then this block's X2; its X1 is left pending."""
    y1 = _finish_pending(plan, index + 1, y1, y2)
    return _recover_x2(plan, index, y1, y2.clone())


def _finish_pending(plan: _Plan, above: int, y1: Tensor, x2: Tensor) -> Tensor:
    """Block ``above``'s X1 = (Y1 - F(X2)) / beta into a copy of its Y1 ``y1``, if it was left
    pending; else ``y1`` (already that block's X1)."""
    if plan.pending_x1 != above:
        return y1
    x1 = _rebuild_input(plan, above, "f", x2, y1.clone())
    plan.pending_x1 = None
    _check_pending(plan, above, x1, x2)
    return x1


def _recover_x2(plan: _Plan, index: int, y1: Tensor, into: Tensor) -> _Rebuilt:
    """Block ``index``'s X2 rebuilt in ``into`` (a copy of its Y2) from its Y1 ``y1``; its X1
    left pending where the next recover finishes it."""
    plan.keywords.check(index, plan.blocks[index])
    x2 = _rebuild_input(plan, index, "g", y1, into)
    # FSDP gathers at most this block and the one above; below a stored block nothing reads
    # this block's X1 (the stored block kept its inputs); the bottom block's X1 is the stack's
    # input, which nothing reads either. So X1 is left pending only where the next recover
    # finishes it, and otherwise rebuilt now (sharded) or never (debug checks aside).
    if plan.sharding is not None:
        x1 = _rebuild_input(plan, index, "f", x2, y1.clone())
        _check_pending(plan, index, x1, x2)
        return _Rebuilt(y1, None, x2, None, x1)
    if index > 0 and not plan.stored[index - 1]:
        plan.pending_x1 = index
    elif plan.records[index].inputs is not None:  # debug_reconstruction: check X1 all the same
        _check_pending(plan, index, _rebuild_input(plan, index, "f", x2, y1.clone()), x2)
    return _Rebuilt(y1, None, x2, None, y1)


def _rebuild_input(plan: _Plan, index: int, name: str, x: Tensor, into: Tensor) -> Tensor:
    """``into = (into - branch(x)) / beta`` for branch ``name`` of block ``index``, chunk by
    chunk and without a graph: X2 from Y2 (branch G of Y1), X1 from Y1 (branch F of X2)."""
    record = plan.records[index]
    rng = record.f_rng if name == "f" else record.g_rng
    with torch.no_grad(), plan.autocast.replay(), plan.backends.replay(), \
            record.modes.replay(), _forward_parameters(plan, index):
        split, count = _branch_chunking(plan, index, name, x, rng)
        _run_chunks(plan, index, name, x, split, count, rng, subtract_from=into)
    return _unskip_(_plan_beta(plan, index), into)


def _check_pending(plan: _Plan, index: int, x1: Tensor, x2: Tensor) -> None:
    inputs = plan.records[index].inputs
    if inputs is not None:
        _check_reconstruction(plan, index, (x1, x2), inputs)


def _grads_chunked(
    plan: _Plan,
    index: int,
    rebuilt: _Rebuilt,
    dy1: Tensor,
    dy2: Tensor,
    param_grads: List[Optional[Tensor]],
) -> Tuple[Tensor, Tensor]:
    """PaReprop's grads of a chunked block: each chunk's graph rebuilt and backpropagated.
    Below the top block the gradients are rebuilt in place, as under "reversible"."""
    if plan.sharding is not None:
        param_grads = [None] * len(plan.block_params[index])
    sums: Set[int] = set()
    dy1_total = _grads_g_chunked(plan, index, rebuilt.y1, dy1, dy2, param_grads, sums)
    dx1, dx2 = _grads_f_chunked(plan, index, rebuilt.x2, dy1_total, dy2, param_grads, sums)
    if plan.sharding is not None:
        plan.sharding.reduce(index, [p for _, p in plan.block_params[index]], param_grads)
    return dx1, dx2


def _grads_g_chunked(
    plan: _Plan,
    index: int,
    y1: Tensor,
    dy1: Tensor,
    dy2: Tensor,
    param_grads: List[Optional[Tensor]],
    sums: Set[int],
) -> Tensor:
    """G's half of a chunked block's grads: dY2 flows into G(Y1), whose input gradient joins
    dY1 (in place below the top block). Returns the total dY1."""
    record = plan.records[index]
    dy1_total = dy1 if _owns_gradients(plan, index) else dy1.clone()
    with plan.autocast.replay(), plan.backends.replay(), record.modes.replay(), \
            _forward_parameters(plan, index):
        split, count = _branch_chunking(plan, index, "g", y1, record.g_rng)
        _run_chunks(plan, index, "g", y1, split, count, record.g_rng,
                    grad_out=dy2, grad_into=dy1_total, param_grads=param_grads, sums=sums)
    return dy1_total


def _grads_f_chunked(
    plan: _Plan,
    index: int,
    x2: Tensor,
    dy1_total: Tensor,
    dy2: Tensor,
    param_grads: List[Optional[Tensor]],
    sums: Set[int],
    into_x2: bool = False,
) -> Tuple[Tensor, Tensor]:
    """F's half: the total dY1 flows into F(X2), whose input gradient joins beta dY2 (in place
    below the top block). With ``into_x2`` dX2 is written into X2's own storage, chunk by
    chunk once the chunk is backpropagated (NOTE [ Chunked PaReprop in half steps ])."""
    record = plan.records[index]
    beta = _plan_beta(plan, index)
    if into_x2:
        dx2, base = x2, dy2
    else:
        dx2, base = _skip_(beta, dy2 if _owns_gradients(plan, index) else dy2.clone()), None
    with plan.autocast.replay(), plan.backends.replay(), record.modes.replay(), \
            _forward_parameters(plan, index):
        split, count = _branch_chunking(plan, index, "f", x2, record.f_rng)
        _run_chunks(plan, index, "f", x2, split, count, record.f_rng,
                    grad_out=dy1_total, grad_into=dx2, param_grads=param_grads, sums=sums,
                    grad_base=base, base_scale=beta)
    return _skip_(beta, dy1_total), dx2


def _owns_gradients(plan: _Plan, index: int) -> bool:
    """Whether the gradients flowing into block ``index`` are the engine's own, to rebuild in
    place: they are when the block above ran chunked (its gradients are written into copies
    or into what it received), not when they come from autograd (the top block) or from a
    stored block's whole-branch grads, which may hand back what it was given."""
    above = index + 1
    return above < len(plan.blocks) and plan.chunking is not None and not plan.stored[above]


def _skip_(beta: Optional[Tensor], x: Tensor) -> Tensor:
    """``_skip`` in place, on a tensor of ours."""
    return x if beta is None else x.mul_(beta)


def _unskip_(beta: Optional[Tensor], x: Tensor) -> Tensor:
    """``_unskip`` in place, on a tensor of ours."""
    return x if beta is None else x.div_(beta)


# NOTE [ PaReprop on two CUDA streams ]
# recover(l-1) needs only X of block l (from recover(l)); grads(l) needs only dY of block l
# (from grads(l+1)) and block l's rebuilt graphs. So after recover(L), each step l runs
# recover(l-1) and grads(l) at once. Block l's recover and grads share one stream (autograd
# runs a backward kernel on the stream of its forward kernel, so the rebuilt graph fixes it),
# and neighbouring blocks alternate between two lanes: the main stream (the one backward was
# called on, where forward ran) and one side stream. A stored block's graph was built on the
# main stream in forward, so it runs there; the recomputed blocks alternate around the stored
# ones (_block_lanes), so two neighbours share a lane only where both are stored, or in a run
# of recomputed blocks of even length between two stored ones. Neighbours on one lane simply
# run one after the other: no overlap there, and stream order is all the ordering they need.
# Cross-stream dependencies are device events; the host never waits. On the CPU the same
# schedule runs in program order: the bookkeeping (which block recovers, which computes
# gradients, where each gradient goes, which lane each step would run on, two rebuilt graphs
# alive at once) is the same code, tested without a GPU.
#
# Why the main stream is a lane. The caching allocator keeps one pool per stream, and memory
# freed on one stream's pool is not handed to another. Forward filled the main stream's pool,
# so two side streams would leave it idle through backward while each side stream grows its
# own: near capacity, the allocator would have to free its cache with a device sync and try
# again (``num_alloc_retries``) in every step. With the main stream as one lane, half the
# blocks allocate from the pool forward already filled, and the allocator has two pools, not
# three.
#
# NOTE [ Tensor lifetimes across streams ]
# The caching allocator hands a freed block back to the stream that allocated it at once. A
# tensor that another stream still reads must therefore not be reused by its own stream before
# that reader is done. record_stream prevents that, but only by holding the memory until the
# reader's work at free time has run on the device; when the host queues the whole backward
# ahead of the GPU, that is every block's X and dY, and reserved memory grows with depth. So
# between blocks we order lifetimes by events instead. Block l hands block l-1 its rebuilt X
# (read by recover(l-1), and by grads(l-1) through the graph recover(l-1) builds on it), its dY
# and the running parameter-gradient sums (read by grads(l-1)). Each is freed on the host after
# its last reader is queued. Two chains of events order everything queued after that:
#   * recover(k) waits for recover(k+1) (it needs its X) and for grads(k+2), the previous
#     step's gradients: a step starts when the step before it is done;
#   * grads(k) waits for grads(k+1) (it needs its dY) and runs after recover(k) on its lane.
# So every recover and grads queued after a free is ordered after the readers of the block
# above, whichever lanes the blocks are on: recover(k <= l-3) through the first chain (it
# waits for grads(l-1), which follows recover(l-1) on its lane), recover(l-2) and grads(k <=
# l-2) directly, and grads(l-1) is a reader itself, after recover(l-1) on the same lane. Where
# neighbours alternate strictly, the wait for grads(k+2) is on recover(k)'s own lane and costs
# nothing; where they do not (stored blocks), it is what keeps a lane from refilling memory the
# other lane still reads. The same holds for the FSDP prefetch (NOTE [ FSDP prefetch on the
# waiting lane ] in pareprop/fsdp.py).
# record_stream stays where no such order exists: the tensors that arrive from the main stream
# (the saved outputs and dY) when the top block runs on the side stream, and those handed back
# to it (dX and parameter gradients), whose last reader is autograd's own later work. That is
# a constant number of tensors per stack, not per block.
#
# NOTE [ Parameter aliases on the lanes ]
# A parameter of a stack is an input of the engine's autograd Function, so its gradient
# accumulation node (AccumulateGrad) is made on the main stream when forward calls the
# Function, and the Function keeps it alive through backward. Recomputation on the side stream
# would build graphs that end in that node: autograd.grad then captures each parameter gradient
# at a node of another stream, and autograd (torch >= 2.9) warns once ("The AccumulateGrad
# node's stream does not match the stream of the node that produced the incoming gradient").
# The warning is the small part. For each such gradient autograd makes the main stream wait for
# the side stream, and at the end of autograd.grad the side stream wait for the main stream
# (the node's stream is a "leaf stream" of the call); with the main stream as a lane, that
# would make grads(l) on the side stream wait for recover(l-1), queued just before it on the
# main stream: no overlap at all. So every recomputed block rebuilds its graphs with aliases of
# its parameters (``p.detach().requires_grad_()``: same storage and version counter, a new
# leaf whose AccumulateGrad is made on the lane where recover builds the graph) and
# differentiates with respect to them; the engine sums their gradients by parameter slot as
# before and hands them back once, as the Function's gradients, on the main stream. No
# autograd node sees two streams, so the warning cannot arise and autograd adds no waits.
# Stored blocks keep the real parameters (their graphs are the forward's, on the main stream),
# and so do sharded blocks, whose parameters are no inputs of the Function: their
# AccumulateGrad nodes are made in recomputation, on the block's lane.

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}

MAIN_LANE, SIDE_LANE = 0, 1


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:  # created when first needed, never at import
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _block_lanes(stored: Sequence[bool]) -> List[int]:
    """Each block's lane: a stored block on the main lane, the recomputed ones alternating
    around them (the side lane next to a stored block), the top block on the main lane when
    no stored block is above it."""
    depth = len(stored)
    lanes = [MAIN_LANE] * depth
    index = depth - 1
    while index >= 0:
        if stored[index]:
            index -= 1
            continue
        top = index
        while index >= 0 and not stored[index]:
            index -= 1
        bottom = index + 1  # blocks bottom..top are recomputed
        if bottom > 0:  # a stored block below: alternate upwards from it
            for i in range(bottom, top + 1):
                lanes[i] = SIDE_LANE if (i - bottom) % 2 == 0 else MAIN_LANE
        else:  # alternate downwards from the top of the run
            first = SIDE_LANE if top < depth - 1 else MAIN_LANE
            for i in range(top, -1, -1):
                lanes[i] = first if (top - i) % 2 == 0 else 1 - first
    return lanes


_CURRENT = threading.local()


def current_lane() -> Optional[int]:
    """The lane (MAIN_LANE or SIDE_LANE) whose work PaReprop's backward is queueing now, on
    this thread; None outside a block's step. Kept on the CPU too, where both lanes run in
    program order, so tests can check which lane each piece of work is queued on."""
    return getattr(_CURRENT, "lane", None)


class _Lanes:
    """Each block's lane (_block_lanes) and the stream behind it: the main stream, or the side
    stream on CUDA; program order on the CPU, where only the lane ids are kept."""

    def __init__(self, device: torch.device, stored: Sequence[bool]):
        self.lanes = _block_lanes(stored)
        self.enabled = device.type == "cuda"
        if not self.enabled:
            return
        main = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(main)  # inputs of backward come from the main stream
        self.streams = (main, side)

    def lane(self, block_index: int) -> int:
        return self.lanes[block_index]

    def _stream(self, block_index: int) -> "torch.cuda.Stream":
        return self.streams[self.lanes[block_index]]

    @contextlib.contextmanager
    def run_on(self, block_index: int) -> Iterator[None]:
        previous = current_lane()
        _CURRENT.lane = self.lanes[block_index]
        try:
            if self.enabled:
                with torch.cuda.stream(self._stream(block_index)):
                    yield
            else:
                yield
        finally:
            _CURRENT.lane = previous

    @contextlib.contextmanager
    def prefetch_on(self, block_index: int) -> Iterator[None]:
        """Work for block ``block_index`` queued ahead of its step, from the current lane (the
        FSDP prefetch): its stream first waits for the current stream, so what it allocates
        is ordered like the current step's own allocations."""
        if self.enabled:
            stream = self._stream(block_index)
            current = torch.cuda.current_stream(stream.device)
            if current != stream:
                stream.wait_stream(current)
        with self.run_on(block_index):
            yield

    def mark(self, block_index: int) -> Optional["torch.cuda.Event"]:
        """An event at the current end of the block's stream."""
        if not self.enabled:
            return None
        return self._stream(block_index).record_event()

    def wait(self, block_index: int, event: Optional["torch.cuda.Event"]) -> None:
        if self.enabled and event is not None:
            self._stream(block_index).wait_event(event)

    def from_main(self, tensor: Optional[Tensor], block_index: int) -> None:
        """``tensor`` came from the main stream and is read on block_index's stream."""
        if self.enabled and tensor is not None and self.lanes[block_index] != MAIN_LANE:
            tensor.record_stream(self._stream(block_index))

    def to_main(self, tensor: Optional[Tensor]) -> None:
        """``tensor`` goes back to autograd, which reads it on the main stream (a tensor made
        there is left alone by the allocator)."""
        if self.enabled and tensor is not None:
            tensor.record_stream(self.streams[MAIN_LANE])

    def join(self) -> None:
        if self.enabled:
            self.streams[MAIN_LANE].wait_stream(self.streams[SIDE_LANE])


def _param_aliases(plan: _Plan, index: int) -> Optional[Dict[int, Tensor]]:
    """Block ``index``'s trainable parameters by id -> an alias that is a new leaf; None for a
    stored or sharded block (NOTE [ Parameter aliases on the lanes ])."""
    if plan.stored[index] or plan.sharding is not None:
        return None
    return {id(p): p.detach().requires_grad_(True) for _, p in plan.block_params[index]}


@contextlib.contextmanager
def _aliased(plan: _Plan, index: int, aliases: Optional[Dict[int, Tensor]]) -> Iterator[None]:
    """Block ``index`` recomputed and differentiated with ``aliases`` for its parameters:
    recomputation swaps them into the modules (_forward_parameters), grads differentiates with
    respect to them, and their gradients keep the parameters' slots."""
    if aliases is None:
        yield
        return
    params, locations = plan.block_params[index], plan.block_locations[index]
    plan.block_params[index] = [(slot, aliases[id(p)]) for slot, p in params]
    plan.block_locations[index] = [
        _ParamLocation(loc.module, loc.name, aliases.get(id(loc.tensor), loc.tensor), loc.version)
        for loc in locations
    ]
    try:
        yield
    finally:
        plan.block_params[index], plan.block_locations[index] = params, locations


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


def _backward_in_order(plan, streams, dy1, dy2, param_grads):
    # ``streams`` is the only holder of the current block's outputs, so that a chunked block
    # can release them as soon as it has copied them (NOTE [ Chunked backward ]). The top
    # block's gradients come from autograd: not ours to overwrite. What a chunked block
    # returns is.
    owned = False
    for index in reversed(range(len(plan.blocks))):
        if plan.chunking is not None and not plan.stored[index]:
            dy1, dy2 = _block_chunked(plan, index, streams, dy1, dy2, param_grads, owned)
            owned = True
            continue
        owned = False
        rebuilt = _recover(plan, index, *streams)
        dy1, dy2 = _grads(plan, index, rebuilt, dy1, dy2, param_grads)
        streams[:] = [rebuilt.x1, _detached(rebuilt.x2)]
        del rebuilt  # frees block index's graph before the next block builds its own
    return dy1, dy2


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def _backward_pareprop(plan, streams, dy1, dy2, param_grads):
    lanes = _Lanes(plan.device, plan.stored)
    prefetch = None
    if plan.sharding is not None:  # NOTE [ FSDP prefetch on the waiting lane ] (pareprop/fsdp.py)
        prefetch, plan.sharding.prefetch_on = plan.sharding.prefetch_on, lanes.prefetch_on
    try:
        dy1, dy2 = _pareprop_schedule(plan, lanes, streams, dy1, dy2, param_grads)
    finally:  # the main stream must not run ahead of the side stream, even after an error
        lanes.join()
        if plan.sharding is not None:
            plan.sharding.prefetch_on = prefetch
    for t in (dy1, dy2, *param_grads):
        lanes.to_main(t)
    return dy1, dy2


def _pareprop_schedule(plan, lanes, streams, dy1, dy2, param_grads):
    # See NOTE [ Tensor lifetimes across streams ] for the two chains of events. ``streams``
    # (the stack's outputs) is emptied once the top block is recovered: a chunked stack holds
    # them nowhere else, so they are freed once nothing reads them.
    last = len(plan.blocks) - 1
    for t in (*streams, dy1, dy2):
        lanes.from_main(t, last)
    aliases = _param_aliases(plan, last)
    with lanes.run_on(last), _aliased(plan, last, aliases):
        rebuilt = _recover(plan, last, *streams)
    streams.clear()
    recovered = lanes.mark(last)
    grads_done = None  # the top block's dY comes from the main stream, already waited for
    for index in range(last, 0, -1):
        if _half_steps(plan, index):  # NOTE [ Chunked PaReprop in half steps ]
            rebuilt, aliases, dy1, dy2, recovered, grads_done = _half_step_pair(
                plan, lanes, index, rebuilt, dy1, dy2, param_grads, aliases, recovered,
                grads_done)
            continue
        # recover(index-1) after recover(index) and grads(index+1).
        x1, x2 = rebuilt.x1, _detached(rebuilt.x2)
        lanes.wait(index - 1, recovered)
        lanes.wait(index - 1, grads_done)
        below = _param_aliases(plan, index - 1)
        with lanes.run_on(index - 1), _aliased(plan, index - 1, below):
            previous = _recover(plan, index - 1, x1, x2)
        del x1, x2
        recovered = lanes.mark(index - 1)
        # grads(index) on this block's lane, after grads(index+1).
        lanes.wait(index, grads_done)
        with lanes.run_on(index), _aliased(plan, index, aliases):
            dy1, dy2 = _grads(plan, index, rebuilt, dy1, dy2, param_grads)
        grads_done = lanes.mark(index)
        rebuilt, aliases = previous, below  # block index's graph is released: two alive at most
    lanes.wait(0, grads_done)
    with lanes.run_on(0), _aliased(plan, 0, aliases):
        return _grads(plan, 0, rebuilt, dy1, dy2, param_grads)


def _half_steps(plan: _Plan, index: int) -> bool:
    """Whether recover(index-1) and grads(index) run in halves (NOTE [ Chunked PaReprop in half
    steps ]): both blocks recomputed in chunks, unsharded, block index's X1 pending."""
    return (plan.chunking is not None and plan.sharding is None
            and not plan.stored[index] and not plan.stored[index - 1]
            and plan.pending_x1 == index)


def _half_step_pair(plan, lanes, index, rebuilt, dy1, dy2, param_grads, aliases, recovered,
                    grads_done):
    """recover(index-1) beside grads(index), in two halves with a barrier between them."""
    below = index - 1
    below_aliases = _param_aliases(plan, below)
    x2 = _detached(rebuilt.x2)
    # First halves: block index's X1 (reads its Y1 once, in a copy, and its X2) beside
    # G's gradients (reads Y1).
    lanes.wait(below, recovered)
    lanes.wait(below, grads_done)
    with lanes.run_on(below), _aliased(plan, below, below_aliases), \
            torch.profiler.record_function("pareprop::recover"):
        x1 = _finish_pending(plan, index, rebuilt.y1, x2)
    first_recovered = lanes.mark(below)
    lanes.wait(index, grads_done)
    sums: Set[int] = set()
    with lanes.run_on(index), _aliased(plan, index, aliases), \
            torch.profiler.record_function("pareprop::grads"):
        dy1 = _grads_g_chunked(plan, index, rebuilt.y1, dy1, dy2, param_grads, sums)
    g_done = lanes.mark(index)
    # Barrier: both lanes go on after both readers of Y1, which is released here.
    lanes.wait(index, first_recovered)
    lanes.wait(below, g_done)
    rebuilt.y1 = rebuilt.x1 = None
    # Second halves: block index-1's X2 from a copy of block index's X2, beside F's gradients,
    # which write dX2 into that X2 where the incoming gradients are not ours (the top block).
    with lanes.run_on(below), _aliased(plan, below, below_aliases), \
            torch.profiler.record_function("pareprop::recover"):
        into = x2.clone()
        copied = lanes.mark(below)
        previous = _recover_x2(plan, below, x1, into)
    del x1, into
    recovered = lanes.mark(below)
    into_x2 = not _owns_gradients(plan, index) and _same_layout(x2, dy2)
    if into_x2:
        lanes.wait(index, copied)
    with lanes.run_on(index), _aliased(plan, index, aliases), \
            torch.profiler.record_function("pareprop::grads"):
        dy1, dy2 = _grads_f_chunked(plan, index, x2, dy1, dy2, param_grads, sums,
                                    into_x2=into_x2)
    grads_done = lanes.mark(index)
    return previous, below_aliases, dy1, dy2, recovered, grads_done


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _take_outputs(plan: _Plan) -> List[Optional[Tensor]]:
    """A chunked stack's outputs, handed to backward once (NOTE [ Chunked backward ])."""
    if plan.outputs is None:
        raise RuntimeError(
            "backward through a chunked ReversibleStack a second time: its backward releases "
            "the stack's outputs as it goes, so retain_graph=True cannot keep them; turn "
            "chunking off (pareprop.set_chunking(model)) to backpropagate twice"
        )
    outputs, plan.outputs = plan.outputs, None
    for t, version in zip(outputs, plan.output_versions):
        if t._version != version:
            raise RuntimeError(
                "an output of a ReversibleStack was modified in place between forward and "
                "backward; the reversible engines rebuild every block's inputs from it (use "
                "an out-of-place operation on the output)"
            )
    return outputs


class _ReversibleFunction(torch.autograd.Function):
    """Forward without a graph, keeping only the outputs; backward by reconstruction.

    Parameters are inputs of the Function, so their gradients come back from ``backward`` as
    ordinary outputs: ``torch.autograd.grad`` works on them and DistributedDataParallel's hooks
    fire once per parameter, as with plain autograd.
    """

    @staticmethod
    def forward(ctx, plan: _Plan, x1: Tensor, x2: Tensor, *params: Tensor):
        keep = plan.debug_tolerance is not None
        stored = plan.stored
        for index, block in enumerate(plan.blocks):
            sharded = plan.sharding is not None
            if sharded:
                plan.sharding.unshard_for_forward(index)
                plan.block_params[index], plan.block_locations[index] = _block_params(block)
            if stored[index]:
                keep_x1 = index > 0 and not stored[index - 1]
                probe = plan.probe(index, x1) if plan.probe else contextlib.nullcontext()
                with probe:
                    rebuilt = _store(block, x1, x2, plan.kwargs, keep_x1)
                plan.graphs.append(rebuilt)
                plan.records.append(_BlockRecord(None, None))
                x1 = rebuilt.y1.detach()
                x2 = _skip(skip_scale(block), x2) + rebuilt.g_out.detach()
            elif plan.chunking is not None:  # NOTE [ Chunked forward ]
                plan.graphs.append(None)
                x1, x2 = _couple_chunked(plan, index, x1, x2, keep)
            else:
                plan.graphs.append(None)
                x1, x2 = _couple(block, x1, x2, plan.kwargs, plan.records, keep_inputs=keep)
            if sharded:
                plan.sharding.reshard_after_forward(index)
        plan.reconstruction_errors[:] = [(float("nan"), float("nan"))] * len(plan.blocks)
        ctx.plan = plan
        # The top block's outputs are what the reversible engines rebuild from; a stored top
        # block keeps what its backward needs in its own graph. A chunked stack holds them
        # itself, to release them in backward (NOTE [ Chunked backward ]).
        if plan.chunking is not None and not stored[-1]:
            plan.outputs = [x1.detach(), x2.detach()]
            plan.output_versions = (x1._version, x2._version)
        else:
            ctx.save_for_backward(*((x1, x2) if not stored[-1] else ()))
        return x1, x2

    @staticmethod
    def backward(ctx, dy1: Tensor, dy2: Tensor):
        if torch.is_grad_enabled():  # backward(create_graph=True) runs with grad mode on
            raise RuntimeError(
                "the reversible engines do not support double backward (create_graph=True): "
                "they rebuild activations without a graph of the gradients; use "
                "engine='autograd' for higher-order gradients"
            )
        # Saved tensors are freed after the first backward (unless retain_graph=True), so a
        # second backward raises autograd's own "backward through the graph a second time".
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        streams = _take_outputs(plan) if plan.output_versions else list(saved or (None, None))
        param_grads: List[Optional[Tensor]] = [None] * plan.num_params
        entry = _RngState.capture(plan.device)
        schedule, trial = "reversible", None
        if plan.engine == "pareprop":
            schedule, trial = (("pareprop", None) if plan.schedule is None
                               else plan.schedule.begin(plan.device))
        try:
            if schedule == "pareprop":
                dx1, dx2 = _backward_pareprop(plan, streams, dy1, dy2, param_grads)
            else:
                dx1, dx2 = _backward_in_order(plan, streams, dy1, dy2, param_grads)
        finally:
            entry.restore(plan.device)
            if trial is not None:
                plan.schedule.end(trial)
        return (None, dx1, dx2, *param_grads)


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
        # Under "pareprop": PaReprop or Reprop, measured on the first backward passes.
        self._schedule = ScheduleChoice(
            f"a ReversibleStack of {len(self.blocks)} {type(self.blocks[0]).__name__} blocks")
        self.set_engine(engine)
        self._debug_tolerance: Optional[float] = None
        self.last_reconstruction_errors: List[Tuple[float, float]] = []
        self.stored_blocks: Tuple[int, ...] = ()
        self.store_blocks(stored_blocks)
        # Called around each stored block's forward; set only while pareprop.budget measures.
        self._probe: Optional[Callable[[int, Tensor], contextlib.AbstractContextManager]] = None
        # Set by pareprop.fsdp.shard when every block is an FSDP2 unit.
        self._sharding: Optional[Any] = None
        self.chunking: Optional[Chunking] = None
        # Measured chunk costs for chunking by bytes (not state: they depend on the input).
        self._chunk_costs: Dict[Any, Tuple[float, float]] = {}
        # Under autograd: each block in torch.utils.checkpoint (see set_block_checkpointing).
        self.checkpoint_blocks = False

    def set_engine(self, name: str, fallback: Optional[bool] = None) -> "ReversibleStack":
        """Run backward with engine ``name``. Under ``"pareprop"`` the stack measures PaReprop
        against Reprop on its first backward passes on a GPU and keeps the faster
        (:func:`chosen_schedule`); ``fallback=False`` always runs PaReprop, True measures
        again, None (the default) keeps the setting. Setting an engine measures again."""
        _check_engine(name)
        if fallback is not None:
            self._schedule.enabled = bool(fallback)
        self._schedule.reset()
        if name != "autograd":
            found = _running_stat_modules(self.blocks)
            if found:
                raise ValueError(
                    f"engine {name!r} recomputes F and G, which would update the running "
                    f"statistics of {', '.join(found)} twice; use LayerNorm/GroupNorm, "
                    "track_running_stats=False, or engine='autograd'"
                )
        self.engine = name
        return self

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self._schedule.reset()  # another device or dtype: PaReprop and Reprop measured again
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
            self._schedule.reset()  # stored blocks change what PaReprop overlaps
        self.stored_blocks = tuple(sorted(chosen))
        return self

    def set_chunking(
        self, chunks: Optional[int] = None, max_bytes: Union[int, str, None] = None
    ) -> "ReversibleStack":
        """Rebuild and differentiate the recomputed blocks' branches in chunks, under the
        reversible engines: ``chunks`` per branch (at most the split's size), or the fewest
        chunks whose graph saves at most ``max_bytes`` (bytes or "64MiB"; measured once per
        block and input shape). Branches that declare no split run whole; with neither
        argument every branch runs whole again. Gradients are unchanged; see NOTE [ Chunked
        backward ]."""
        # The measured chunk costs stay: they depend on the blocks and the input, not on this.
        self.chunking = parse_chunking(chunks, max_bytes)
        return self

    def debug_reconstruction(self, tolerance: float = 1e-3) -> "ReversibleStack":
        """For the next training step only: keep the forward's block inputs and warn, naming
        the block, when a rebuilt input differs from them by more than ``tolerance`` (relative
        error). The errors are left in ``last_reconstruction_errors`` as (X1, X2) per block."""
        self._debug_tolerance = float(tolerance)
        return self

    def extra_repr(self) -> str:
        stored = f", stored_blocks={list(self.stored_blocks)}" if self.stored_blocks else ""
        chunking = "" if self.chunking is None else (
            f", chunks={self.chunking.count}" if self.chunking.count is not None
            else f", chunk_bytes={self.chunking.max_bytes}")
        ckpt = ", checkpoint_blocks=True" if self.checkpoint_blocks else ""
        return f"engine={self.engine!r}{stored}{chunking}{ckpt}"

    def forward(self, x1: Tensor, x2: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        _check_streams(x1, x2)
        _check_constants(kwargs)
        x1, x2 = _full_precision_streams(x1, x2, self.blocks)
        if self.engine == "autograd" or not self.training or not torch.is_grad_enabled():
            # A sharded block's own call runs FSDP's hooks (gather, and under autograd the
            # backward hooks), as for any FSDP unit.
            run = _call_block if self._sharding is not None else _couple
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
                for block in self.blocks:
                    x1, x2 = checkpoint(run, block, x1, x2, kwargs, use_reentrant=False)
                return x1, x2
            for block in self.blocks:
                x1, x2 = run(block, x1, x2, kwargs)
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
        if self._sharding is not None:
            self._sharding.check_inputs(x1, x2)
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
            probe=self._probe,
            sharding=self._sharding,
            chunking=self.chunking,
            chunk_costs=self._chunk_costs,
            schedule=self._schedule,
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
            if self._sharding is not None:  # gathered and listed in forward, block by block
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


def _plan_beta(plan: _Plan, index: int) -> Optional[Tensor]:
    if not plan.betas or plan.betas[index] is None:
        return None
    beta, version = plan.betas[index]
    if beta._version != version:
        raise RuntimeError(
            f"the skip scale of block {index} ({type(plan.blocks[index]).__name__}) changed "
            "between forward and backward; change it between steps, after backward"
        )
    return beta


def _block_params(
    block: nn.Module, params: Optional[List[Tensor]] = None, slots: Optional[Dict[int, int]] = None
) -> Tuple[List[Tuple[int, Tensor]], List[_ParamLocation]]:
    """A block's trainable parameters as (slot in ``params``, tensor), appending new ones to
    ``params``, and every parameter's location. Without ``params`` the slots are the block's own."""
    params = [] if params is None else params
    slots = {} if slots is None else slots
    owned: Dict[int, Tuple[int, Tensor]] = {}
    locations = []
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            locations.append(_ParamLocation(module, name, p, p._version))
            if not p.requires_grad or id(p) in owned:
                continue
            if id(p) not in slots:
                slots[id(p)] = len(params)
                params.append(p)
            owned[id(p)] = (slots[id(p)], p)
    return list(owned.values()), locations


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


def _check_constants(kwargs: Dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if isinstance(value, Tensor) and value.requires_grad:
            raise ValueError(
                f"keyword input {key!r} requires grad, but keyword inputs of a "
                "ReversibleStack are constants; pass it detached, or make it a stream"
            )


def set_engine(module: nn.Module, name: str, fallback: Optional[bool] = None) -> nn.Module:
    """Switch every :class:`ReversibleStack` inside ``module`` to engine ``name``.

    ``"auto"`` (the blocks that fit a memory budget stored, the rest recomputed) is chosen
    above the engine, by :func:`pareprop.set_engine` (:mod:`pareprop.memory.budget`).
    ``fallback`` (engine ``"pareprop"``): False always runs PaReprop, True lets each stack keep
    Reprop where it measures faster (the default; NOTE [ PaReprop's fallback to Reprop ] in
    pareprop/schedule.py); None keeps each stack's setting.
    """
    if name == "auto":
        raise ValueError(
            "engine 'auto' is chosen by a memory budget: call pareprop.set_engine(model, 'auto', "
            "memory_budget=..., example_inputs=...) or pareprop.set_memory_budget"
        )
    _check_engine(name)
    if fallback is not None and not isinstance(fallback, bool):
        raise TypeError(f"fallback must be True, False or None, got {fallback!r}")
    for path, m in module.named_modules():
        if isinstance(m, ReversibleStack):
            m.set_engine(name, fallback)
            m._schedule.label = _stack_label(path, m)
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
        pareprop/schedule.py); ``"mixed"`` when they settled differently; None when no stack
        uses engine ``"pareprop"``.
    """
    states = set()
    for path, m in module.named_modules():
        if isinstance(m, ReversibleStack) and m.engine == "pareprop":
            device = next((p.device for p in m.parameters()), torch.device("cpu"))
            m._schedule.label = _stack_label(path, m)
            states.add(m._schedule.state(device))
    if not states:
        return None
    if "measuring" in states:
        return "measuring"
    return states.pop() if len(states) == 1 else "mixed"


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
    for m in module.modules():
        if isinstance(m, ReversibleStack):
            m.checkpoint_blocks = bool(enable)
    return module


def set_chunking(
    module: nn.Module, max_bytes: Union[int, str, None] = None, chunks: Optional[int] = None
) -> nn.Module:
    """Chunk the branches of every :class:`ReversibleStack` inside ``module`` in backward
    (:meth:`ReversibleStack.set_chunking`): the fewest chunks whose graph saves at most
    ``max_bytes``, or ``chunks`` per branch; neither turns chunking off. Returns ``module``."""
    parse_chunking(chunks, max_bytes)  # checked once, before any stack changes
    for m in module.modules():
        if isinstance(m, ReversibleStack):
            m.set_chunking(chunks, max_bytes)
    return module


def debug_reconstruction(module: nn.Module, tolerance: float = 1e-3) -> nn.Module:
    """Arm :meth:`ReversibleStack.debug_reconstruction` on every stack inside ``module``."""
    for m in module.modules():
        if isinstance(m, ReversibleStack):
            m.debug_reconstruction(tolerance)
    return module
