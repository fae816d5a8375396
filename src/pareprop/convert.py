"""``pareprop.convert``: a pretrained timm ViT as a reversible model, starting exactly from it.

See docs/convert.md and pareprop/models/converted_vit.py for the mathematics.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from pareprop.models.converted_vit import ConvertedViT
from pareprop.precision_guard import PrecisionGuard

__all__ = ["convert"]


def convert(
    model: nn.Module,
    engine: str = "reversible",
    tolerance: Optional[float] = 1e-3,
    guard_every: int = 100,
) -> ConvertedViT:
    """Rewire a timm ``VisionTransformer`` into a dual-residual reversible model.

    The result shares ``model``'s parameters (copy it first to keep the original apart), keeps
    timm's parameter names in its state dict, and starts at (alpha, beta) = (1, 0): its logits
    equal ``model``'s to the bit in float32. Move the coupling with
    :func:`pareprop.set_coupling` or :class:`pareprop.CouplingSchedule`.

    Args:
        model: a timm ``VisionTransformer`` with pre-norm two-branch blocks (vit_*, deit_*,
            class token or not, register tokens, layer scale, any pooling). Anything else
            raises :class:`~pareprop.models.converted_vit.UnsupportedModelError` with the reason.
        engine: the backward engine of the stack.
        tolerance: the precision guard's tolerance on rebuilt inputs (see
            :class:`pareprop.PrecisionGuard`); None attaches no guard (then only beta = 0 is
            stored, and a small beta can give wrong gradients).
        guard_every: the guard measures again after this many training steps.
    """
    converted = ConvertedViT(model, engine=engine).train(model.training)
    if tolerance is not None:
        PrecisionGuard(converted, tolerance=tolerance, every=guard_every)
    return converted
