"""The coupled block every converted family builds on, and timm's layers run a chunk at a time.

A pretrained block whose shape does not change is a chain of residual sub-layers
``z + H(z)``. :class:`CoupledBlock` holds two of them as the coupling's F and G with the
residual's coefficient alpha folded in (docs/convert.md, "The coupling"):

    F(x) = alpha * x + H_f(x),    G(y) = alpha * y + H_g(y),

and the skip scale beta on the coupling itself (NOTE [ Skip scale of the coupling ] in
pareprop/engine/block.py). A family's block says what H_f and H_g are, in the source's own
modules, under the source's attribute names (so its parameters keep the source's names).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn as nn
from timm.layers import DropPath as TimmDropPath
from torchvision.ops import StochasticDepth

from pareprop.chunking import Chunk, dropout, whole_shape
from pareprop.engine import ReversibleBlock

__all__ = ["CoupledBlock", "drop_path_samples", "fused_attention_dropout", "sample_draws",
           "sliced_dropouts", "stochastic_depth_samples"]


class CoupledBlock(ReversibleBlock):
    """A reversible block with the residual coefficient alpha of a converted coupling.

    Starts at (alpha, beta) = (1, 0), where ``Y1 = F(X2)`` and ``Y2 = G(Y1)`` are the source's
    two residual updates with the same rounding (``1.0 * x`` is ``x`` exactly). Subclasses
    compute ``self.alpha * x + H(x)`` in their ``f`` and ``g``.
    """

    def __init__(self, **parts: nn.Module) -> None:
        """``parts``: the source block's modules that make H_f and H_g, under the source's
        attribute names (shared, not copied)."""
        super().__init__()
        for name, module in parts.items():
            setattr(self, name, module)
        device = next((p.device for p in self.parameters()), None)
        self._alpha_value = 1.0
        self.register_buffer("alpha", torch.tensor(1.0, device=device), persistent=False)
        self.set_skip_scale(0.0)

    def set_alpha(self, alpha: float) -> "CoupledBlock":
        """The coefficient of the residual skip inside F and G (1: the source's residual)."""
        alpha = float(alpha)
        if not -float("inf") < alpha < float("inf"):
            raise ValueError(f"expected a finite alpha, got {alpha!r}")
        self._alpha_value = alpha
        with torch.no_grad():
            self.alpha.fill_(alpha)  # in place, as the skip scale: nothing recompiles
        return self

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        # float32 whatever the model's dtype, so 0.3 is float32's 0.3 in a float64 model too.
        self.alpha = torch.full((), self._alpha_value, dtype=torch.float32,
                                device=self.alpha.device)
        return self


# NOTE [ timm's layers in chunks ]
# A converted block runs the source's own modules, which know nothing of chunks. Three things
# make a chunk draw exactly what the whole branch drew (NOTE [ Exact randomness in chunks ] in
# pareprop/chunking.py):
# * every ``nn.Dropout`` inside the attention and MLP runs, for the chunk only, as
#   :func:`pareprop.chunking.dropout`, the chunk's slice of the whole tensor's mask (an
#   instance ``forward`` shadows the class's while the chunk runs, as compile_blocks shadows
#   F and G);
# * timm's drop-path draws one value per sample: the same on a chunk of tokens, and the
#   chunk's slice of the whole batch's draw on a chunk of samples (``drop_path_samples``,
#   timm's draw for the whole batch);
# * fused attention (``F.scaled_dot_product_attention``) with dropout on the attention weights
#   draws inside the kernel, which no slice reproduces: F then runs whole (G still chunks).
#   timm's default models have no attention dropout; ``attn.fused_attn = False`` lets F chunk.


def fused_attention_dropout(attn: nn.Module) -> bool:
    """Whether ``attn`` draws its attention dropout inside a fused kernel."""
    drop = getattr(attn, "attn_drop", None)
    return bool(getattr(attn, "fused_attn", False)) and getattr(drop, "p", 0.0) > 0.0


@contextlib.contextmanager
def sliced_dropouts(module: nn.Module, chunk: Chunk, dim: int) -> Iterator[None]:
    """While inside, every active ``nn.Dropout`` of ``module`` draws the chunk's slice (along
    ``dim``) of the mask the whole tensor would draw."""
    drops = [m for m in module.modules()
             if isinstance(m, nn.Dropout) and m.training and m.p > 0.0]
    for m in drops:
        m.forward = functools.partial(dropout, p=m.p, training=True, chunk=chunk, dim=dim)
    try:
        yield
    finally:
        for m in drops:
            del m.forward


def drop_path_samples(module: nn.Module, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """timm's drop-path on a chunk of samples: the chunk's slice of timm's draw for the whole
    batch (``x.new_empty((B, 1, ...)).bernoulli_(keep)``, scaled by ``1 / keep``)."""
    if not (isinstance(module, TimmDropPath) and module.training and module.drop_prob > 0.0):
        return module(x)  # nn.Identity, or a drop-path that draws nothing
    keep = 1.0 - module.drop_prob
    shape, rows = whole_shape(x, chunk, 0)
    mask = x.new_empty((shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    if keep > 0.0 and module.scale_by_keep:
        mask.div_(keep)
    return x * chunk.take(mask, 0, rows)


def stochastic_depth_samples(module: StochasticDepth, x: torch.Tensor,
                             chunk: Chunk) -> torch.Tensor:
    """torchvision's row-wise stochastic depth on a chunk of samples: the chunk's slice of
    torchvision's draw for the whole batch (``torch.empty((B, 1, ...)).bernoulli_(survival)``,
    divided by the survival rate). The torchvision families' ``drop_path_samples``."""
    if not (module.training and module.p > 0.0 and module.mode == "row"):
        return module(x)  # draws nothing, or one value for the whole batch ("batch")
    survival = 1.0 - module.p
    shape, rows = whole_shape(x, chunk, 0)
    noise = torch.empty([shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    noise.bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return x * chunk.take(noise, 0, rows)


@contextlib.contextmanager
def sample_draws(module: nn.Module, chunk: Chunk) -> Iterator[None]:
    """While inside, the drop-path layers (timm's ``DropPath``, torchvision's row-wise
    ``StochasticDepth``) and dropouts of ``module`` (a source block kept as it is) draw
    ``chunk``'s slice of the samples' draw of the whole batch."""
    paths = []
    for m in module.modules():
        if isinstance(m, TimmDropPath) and m.training and m.drop_prob > 0.0:
            paths.append((m, drop_path_samples))
        elif isinstance(m, StochasticDepth) and m.training and m.p > 0.0 and m.mode == "row":
            paths.append((m, stochastic_depth_samples))  # "batch" mode draws alike on a chunk
    for m, on_samples in paths:
        m.forward = functools.partial(on_samples, m, chunk=chunk)
    try:
        with sliced_dropouts(module, chunk, dim=0):
            yield
    finally:
        for m, _ in paths:
            del m.forward
