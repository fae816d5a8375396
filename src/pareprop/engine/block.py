"""The reversible block: the mathematics (``f`` and ``g``) and the skip scale of its coupling.

Blocks hold only F and G; how backward is done lives in the rest of :mod:`pareprop.engine`.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from pareprop.chunking import Chunk, Split

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


def skip_scale_value(block: nn.Module) -> float:
    """The block's skip scale beta as a Python float (1.0 without one), read without a device
    sync: the value :meth:`ReversibleBlock.set_skip_scale` was given."""
    return getattr(block, "_skip_scale_value", 1.0) if skip_scale(block) is not None else 1.0


def _skip(beta: Optional[Tensor], x: Tensor) -> Tensor:
    return x if beta is None else beta * x


def _unskip(beta: Optional[Tensor], x: Tensor) -> Tensor:
    return x if beta is None else x / beta
