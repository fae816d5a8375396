"""What the engine asks of a stack whose blocks are sharded (:func:`pareprop.distributed.shard`).

The engine runs each block's ``f`` and ``g`` itself, in forward and again in recomputation,
bypassing any wrapper's ``forward``; a sharded stack therefore hands the engine a
:class:`BlockSharding`, and the engine calls it around every block: to gather a block's
parameters before it runs, to release them after, and to hand over a block's parameter
gradients once they are complete. The engine knows nothing else of how the blocks are sharded.
"""

from __future__ import annotations

from typing import Callable, ContextManager, List, Optional, Protocol, runtime_checkable

import torch

__all__ = ["BlockSharding"]


@runtime_checkable
class BlockSharding(Protocol):
    """Block-by-block gathers and gradient hand-over of a sharded :class:`ReversibleStack`."""

    # Enters the engine's lane of a block (a CUDA stream), set by the engine while PaReprop's
    # backward runs, so that a prefetch is issued on the lane that later waits for it; None:
    # one stream.
    prefetch_on: Optional[Callable[[int], ContextManager[None]]]

    def check_inputs(self, x1: torch.Tensor, x2: torch.Tensor) -> None:
        """Refuse stream inputs the sharded engine cannot carry gradients through."""

    def unshard_for_forward(self, index: int) -> None:
        """Gather block ``index``'s parameters before its forward."""

    def reshard_after_forward(self, index: int) -> None:
        """Release block ``index``'s gathered parameters after its forward (when configured)."""

    def gather(self, index: int) -> None:
        """Gather block ``index`` before it is recomputed in backward (and may prefetch the
        block below it)."""

    def reduce(
        self, index: int, params: List[torch.Tensor], grads: List[Optional[torch.Tensor]]
    ) -> None:
        """Block ``index``'s parameter gradients are complete: hand them to the sharding."""
