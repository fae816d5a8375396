"""The schedules of a stack's backward, over recover and grads (:mod:`pareprop.engine.rebuild`).

* Reprop's (``reversible``, and every chunked stack): block after block, from the last.
* PaReprop's (``pareprop``): recover(l-1) beside grads(l), on two lanes
  (:mod:`pareprop.engine.lanes`). Under ``pareprop`` a stack may keep Reprop's where it
  measures faster (NOTE [ PaReprop's fallback to Reprop ] in pareprop/engine/fallback.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from pareprop.engine.chunked import _block_chunked
from pareprop.engine.lanes import _aliased, _Lanes, _param_aliases
from pareprop.engine.rebuild import _grads, _recover

Tensor = torch.Tensor


def _backward_in_order(plan, streams, dy1, dy2, param_grads):
    # ``streams`` is the only holder of the current block's outputs, so that a chunked block can
    # release them as soon as it has copied them (NOTE [ Chunked backward ] in chunked.py). The top
    # block's gradients come from autograd: not ours to overwrite. What a chunked block returns is.
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
# waiting lane ] in pareprop/distributed/fsdp.py).
# record_stream stays where no such order exists: the tensors that arrive from the main stream
# (the saved outputs and dY) when the top block runs on the side stream, and those handed back
# to it (dX and parameter gradients), whose last reader is autograd's own later work. That is
# a constant number of tensors per stack, not per block.


def _backward_pareprop(plan, streams, dy1, dy2, param_grads):
    lanes = _Lanes(plan.device, plan.stored)
    prefetch = None
    if plan.sharding is not None:  # NOTE [ FSDP prefetch on the waiting lane ] (distributed/)
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
    # (the stack's outputs) is emptied once the top block is recovered.
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
        # recover(index-1) after recover(index) and grads(index+1).
        x1, x2 = rebuilt.x1, _detached(rebuilt.x2)
        lanes.wait(index - 1, recovered, "recover-after-recover")
        lanes.wait(index - 1, grads_done, "recover-after-grads")
        below = _param_aliases(plan, index - 1)
        with lanes.run_on(index - 1), _aliased(plan, index - 1, below):
            previous = _recover(plan, index - 1, x1, x2)
        del x1, x2
        recovered = lanes.mark(index - 1)
        # grads(index) on this block's lane, after grads(index+1).
        lanes.wait(index, grads_done, "grads-after-grads")
        with lanes.run_on(index), _aliased(plan, index, aliases):
            dy1, dy2 = _grads(plan, index, rebuilt, dy1, dy2, param_grads)
        grads_done = lanes.mark(index)
        rebuilt, aliases = previous, below  # block index's graph is released: two alive at most
    lanes.wait(0, grads_done, "bottom-grads-after-grads")
    with lanes.run_on(0), _aliased(plan, 0, aliases):
        return _grads(plan, 0, rebuilt, dy1, dy2, param_grads)
