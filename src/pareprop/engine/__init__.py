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

Blocks hold only the mathematics (``f`` and ``g``); everything about backward lives in this
package, one concern a module, each importing only those above it here:

* ``chunk_cost``: how many chunks a branch runs in (:class:`Chunking`) and what a chunk's
  graph costs (the contract blocks implement is :mod:`pareprop.chunking`);
* ``block``: :class:`ReversibleBlock` and the skip scale of its coupling;
* ``fallback``: PaReprop's fallback to Reprop where Reprop measures faster;
* ``sharding``: :class:`BlockSharding`, what the engine asks of a stack whose blocks are
  sharded (:func:`pareprop.distributed.shard`);
* ``replay``: the state forward captures and recomputation replays (RNG, autocast, backend
  switches, module modes, keyword tensors' versions);
* ``plan``: what forward leaves for backward (the plan of a step, blocks' records and graphs);
* ``forward``: the coupling, every call of F and G checked;
* ``rebuild``: recover and grads of one block, whole branches, and stored blocks;
* ``chunked``: the same a chunk at a time, and the chunked forward;
* ``lanes``: PaReprop's two lanes (CUDA streams) and the parameter aliases on them;
* ``backward``: the order of recover and grads in a stack's backward, Reprop's and PaReprop's;
* ``function``: the autograd Function of a stack;
* ``graphs``: a stack's training forward and backward captured as CUDA graphs and replayed
  (``pareprop.set_engine(..., cuda_graphs=True)``, for host-bound small batches);
* ``stack``: :class:`ReversibleStack` and the functions that configure every stack of a model
  (:func:`set_stack_engine`, :func:`set_chunking`, :func:`apply_chunking`, ...),
  :func:`stacks_of`, :func:`engine_of`;
* ``compile``: ``torch.compile`` of every block's branches (:func:`pareprop.compile_blocks`);
* ``recompute``: activation checkpointing of the blocks that are not reversible (timm's
  ``set_grad_checkpointing``), whole or in chunks, measured as the engine measures a branch.
"""

from pareprop.engine.block import ReversibleBlock, skip_scale, skip_scale_value
from pareprop.engine.lanes import MAIN_LANE, SIDE_LANE, current_lane
from pareprop.engine.sharding import BlockSharding
from pareprop.engine.stack import (
    ENGINES,
    ReversibleStack,
    apply_chunking,
    chosen_schedule,
    debug_reconstruction,
    engine_of,
    schedule_reasons,
    set_block_checkpointing,
    set_chunking,
    set_stack_engine,
    stacks_of,
)

__all__ = [
    "ENGINES",
    "ReversibleBlock",
    "ReversibleStack",
    "set_stack_engine",
    "stacks_of",
    "engine_of",
    "set_chunking",
    "apply_chunking",
    "set_block_checkpointing",
    "debug_reconstruction",
    "chosen_schedule",
    "schedule_reasons",
    "skip_scale",
    "skip_scale_value",
    "current_lane",
    "MAIN_LANE",
    "SIDE_LANE",
    "BlockSharding",
]
