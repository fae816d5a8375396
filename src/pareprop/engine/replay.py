"""State captured in forward and replayed when backward recomputes a block.

Five kinds, each with its NOTE: the generator states (dropout, drop-path), autocast, the
backend switches (SDPA kernels, cuDNN, TF32), the modules' training flags, and the versions of
the stack's keyword tensors (refused when changed). In a step captured as CUDA graphs the
branches draw from streams of their own instead of restored generator states (NOTE
[ Randomness in CUDA graphs ]). The forward's parameters are checked and
swapped in by :func:`pareprop.engine.rebuild._forward_parameters`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

Tensor = torch.Tensor


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


# NOTE [ Randomness in CUDA graphs ]
# A captured step replays its kernels, not the host code that chose their generator states.
# CUDA's generator refuses get_state and set_state during a capture (CUDAGeneratorImpl's
# current_seed and set_state assert that nothing is capturing), and a replay draws at the
# generator's offset at replay time, which eager code between the forward and the backward
# replays moves on. So under cuda_graphs (NOTE [ CUDA graphs of a stack ] in graphs.py) each
# branch, F or G of each block, draws from a stream of its own: two generator states with one
# seed, the forward one registered with the forward graph and the backward one with the
# backward graph (CUDAGraph.register_generator_state, before capture). Forward switches the
# device's default generator to the branch's forward state around the call
# (Generator.graphsafe_set_state, which only swaps a pointer and is allowed during capture),
# recomputation to its backward state. Before each forward replay the backward state is set to
# the forward state's offset, and a replay advances each state by what its graph drew, the same
# kernels in both: so recomputation draws exactly what forward drew, at every replay, whatever
# ran in between. The seeds are drawn from the CPU generator when the step is captured, so a
# seeded run repeats itself; the masks are not eager's (eager draws from the global stream),
# and the autograd engine under cuda_graphs draws from the same per-branch forward streams, so
# every engine draws the same masks from the same seed. The CPU stand-in of a graph (tests)
# does the same with the CPU generator's state.


class _CpuBranchRng:
    """Per-branch random streams on the CPU generator: the stand-in of :class:`_CudaBranchRng`
    that tests run a captured step with (NOTE [ Randomness in CUDA graphs ])."""

    def __init__(self, seeds: Dict[Tuple[int, str], int]):
        self.forward_states = {k: torch.Generator().manual_seed(s).get_state()
                               for k, s in seeds.items()}
        self.backward_states = dict(self.forward_states)

    def states(self, phase: str) -> List[Any]:
        return []  # nothing to register: the stand-in runs eagerly

    def step_begin(self) -> None:
        self.backward_states = dict(self.forward_states)

    def forward(self, index: int, branch: str) -> contextlib.AbstractContextManager:
        return self._use(self.forward_states, (index, branch))

    def recompute(self, index: int, branch: str) -> contextlib.AbstractContextManager:
        return self._use(self.backward_states, (index, branch))

    @contextlib.contextmanager
    def _use(self, states: Dict[Tuple[int, str], Tensor], key: Tuple[int, str]) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(states[key])
        try:
            yield
        finally:
            states[key] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _CudaBranchRng(_CpuBranchRng):
    """Per-branch random streams of a captured step on a CUDA device: a forward and a backward
    generator state per branch (NOTE [ Randomness in CUDA graphs ])."""

    def __init__(self, device: torch.device, seeds: Dict[Tuple[int, str], int]):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.generator = torch.cuda.default_generators[index]
        self.forward_states = {k: self.generator.clone_state().manual_seed(s)
                               for k, s in seeds.items()}
        self.backward_states = {k: self.generator.clone_state().manual_seed(s)
                                for k, s in seeds.items()}

    def states(self, phase: str) -> List[Any]:
        """The generator states to register with the ``phase`` ("forward" or "backward") graph."""
        return list((self.forward_states if phase == "forward" else self.backward_states).values())

    def step_begin(self) -> None:
        for key, state in self.forward_states.items():
            self.backward_states[key].set_offset(state.get_offset())

    @contextlib.contextmanager
    def _use(self, states: Dict[Tuple[int, str], Any], key: Tuple[int, str]) -> Iterator[None]:
        saved = self.generator.graphsafe_get_state()
        self.generator.graphsafe_set_state(states[key])
        try:
            yield
        finally:
            self.generator.graphsafe_set_state(saved)


# NOTE [ Autocast in recomputation ]
# Backward runs outside the user's autocast region (autocast state is thread-local and the
# autograd engine has its own threads), so recomputation re-enters the autocast state that was
# active at forward: device type, dtype and enabled flag, for the CPU and for the stack's device,
# and whether autocast's weight cache was on. The cache's flag is thread-local too, and not
# among what autograd hands its threads (at::ThreadLocalState), so recomputation on a CUDA
# device thread would see that thread's own (on) and on the CPU the caller's: a stack captured
# as CUDA graphs runs its forward with the cache off, and its compiled F and G, whose guards
# include the flag, would be compiled again when the capture recomputes on another thread than
# the warm-up did (NOTE [ Autocast's weight cache under CUDA graphs ] in graphs.py).


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
    cache: bool = True  # autocast's weight cache on

    @staticmethod
    def capture(device: torch.device) -> "_AutocastState":
        types = ["cpu"] if device.type == "cpu" or not _has_autocast(device.type) else [
            "cpu", device.type]
        return _AutocastState(tuple((t, *_autocast_state(t)) for t in types),
                              torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            cache = torch.is_autocast_cache_enabled()
            if cache != self.cache:
                torch.set_autocast_cache_enabled(self.cache)
                stack.callback(torch.set_autocast_cache_enabled, cache)
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


# NOTE [ Module modes in recomputation ]
# A module's training flag is part of what its forward computed: dropout and drop-path draw
# only in training mode. A model switched to eval between forward and backward (a validation
# pass in between) must not change what recomputation computes, so forward records the flag of
# every module of each block and recomputation runs under those flags, restoring the current
# ones after the block.
#
# NOTE [ Block buffers in recomputation ]
# Buffers are part of it too: a converted block's alpha (ConvertedBlock.set_alpha, which
# pareprop.set_coupling and CouplingSchedule call), a drop-path rate (DropPath.drop_prob, a
# float32 buffer). Their setters write in place, so one called between forward and backward
# would make recomputation compute another function than forward did and the gradients
# silently wrong. As for parameters (NOTE [ Recomputing with the forward's parameters ]),
# forward records each buffer of a recomputed block with its version: recomputation refuses a
# buffer changed in place, and runs with forward's tensor where a buffer was replaced (a cast
# or device move rebuilds them). The skip scale has its own check (``_plan_beta``). Rates kept
# as plain floats (``nn.Dropout.p``, timm's ``DropPath.drop_prob``) are recorded by value and
# refused likewise when changed.


def _block_buffers(block: nn.Module) -> Iterator[Tuple[nn.Module, str, Tensor, int]]:
    for module in block.modules():
        for name, buf in module._buffers.items():
            if buf is None or buf.is_inference():  # an inference tensor has no version
                continue
            if module is block and name == "skip_scale":  # checked by _plan_beta
                continue
            yield module, name, buf, buf._version


def _block_rates(block: nn.Module) -> Iterator[Tuple[nn.Module, str, str, float]]:
    for path, module in block.named_modules():
        attr = "p" if isinstance(module, nn.modules.dropout._DropoutNd) else "drop_prob"
        value = getattr(module, attr, None)
        if isinstance(value, float):
            yield module, f"{path}.{attr}" if path else attr, attr, value


@dataclass(frozen=True)
class _ModeState:
    flags: Tuple[Tuple[nn.Module, bool], ...]
    buffers: Tuple[Tuple[nn.Module, str, Tensor, int], ...] = ()
    rates: Tuple[Tuple[nn.Module, str, str, float], ...] = ()
    label: str = "a block"

    @staticmethod
    def capture(block: nn.Module, index: Optional[int] = None) -> "_ModeState":
        label = type(block).__name__ if index is None else f"{index} ({type(block).__name__})"
        return _ModeState(tuple((m, m.training) for m in block.modules()),
                          tuple(_block_buffers(block)), tuple(_block_rates(block)),
                          f"block {label}")

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        for module, name, attr, value in self.rates:
            if getattr(module, attr) != value:
                raise RuntimeError(
                    f"{name} of {self.label} changed from {value} to {getattr(module, attr)} "
                    "between forward and backward; the reversible engines recompute the block "
                    "with it, so its gradients would be wrong: change it after backward"
                )
        swapped = []
        for module, name, buf, version in self.buffers:  # NOTE [ Block buffers in recomputation ]
            if buf._version != version:
                raise RuntimeError(
                    f"buffer {name!r} of {self.label} was modified in place between forward "
                    "and backward (set_alpha, set_coupling or a drop-path rate changed before "
                    "backward?); the reversible engines recompute the block with it, so its "
                    "gradients would be wrong: change it after backward"
                )
            current = module._buffers.get(name)
            if current is not buf:
                swapped.append((module, name, current))
                module._buffers[name] = buf
        changed = [(m, m.training) for m, want in self.flags if m.training != want]
        for m, now in changed:
            m.training = not now
        try:
            yield
        finally:
            for m, now in changed:
                m.training = now
            for module, name, current in reversed(swapped):
                module._buffers[name] = current


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
