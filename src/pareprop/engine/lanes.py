"""The two lanes of PaReprop's backward: the main stream and a side stream per device.

Which block runs on which lane (:func:`_block_lanes`), the streams behind the lanes
(:class:`_Lanes`; program order on the CPU), and the parameter aliases that keep every autograd
node of a recomputed block on its own lane. The schedule that uses them, and why the main
stream is a lane: NOTE [ PaReprop on two CUDA streams ] in pareprop/engine/backward.py.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from pareprop.engine.plan import _ParamLocation, _Plan

Tensor = torch.Tensor


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

    # The cross-stream waits of the schedule, by name. Each one is needed (NOTE [ Tensor
    # lifetimes across streams ] in schedules.py); the GPU tests' negative controls drop one at
    # a time (tests/conftest.py, PAREPROP_DROP_WAIT) and must then fail.
    WAITS = ("recover-after-recover", "recover-after-grads", "grads-after-grads",
             "bottom-grads-after-grads", "join")

    def wait(self, block_index: int, event: Optional["torch.cuda.Event"], name: str) -> None:
        """Block ``block_index``'s stream waits for ``event`` (one of :attr:`WAITS`)."""
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
