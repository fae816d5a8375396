"""Build detectron2's backbones by configuration name and load detectron2's weights into them:
:func:`from_detectron2` (the package's entry point) and :func:`build_detectron2_backbone`."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from pareprop.convert.coupling import set_coupling
from pareprop.convert.precision_guard import PrecisionGuard
from pareprop.detection.detectron2.configs import get_config
from pareprop.detection.detectron2.mvit import MViT, mvit_cfg
from pareprop.detection.detectron2.pyramid import FPN, SimpleFeaturePyramid
from pareprop.detection.detectron2.vitdet import ViT, vit_cfg
from pareprop.detection.detectron2.weights import load_backbone_weights
from pareprop.engine import ENGINES

__all__ = ["build_detectron2_backbone", "from_detectron2"]

# ImageNet's mean and std on [0, 1] images: detectron2's RGB constants (123.675, 116.28,
# 103.53) and (58.395, 57.12, 57.375) on [0, 255].
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


def build_detectron2_backbone(
    config: str,
    engine: str = "reversible",
    out_channels: int = 256,
    device: Any = None,
    dtype: Optional[torch.dtype] = None,
    **overrides: Any,
) -> nn.Module:
    """The backbone of ``config`` at its initialisation, at the coupling (1, 0), no guard.

    ``overrides``: arguments of detectron2's ``ViT`` or ``MViT`` (``embed_dim``, ``depth``,
    ``num_heads``, ``window_block_indexes``, ``last_block_indexes``, ``img_size``, ...) that
    change the configuration's. On the meta device nothing is allocated or initialised.
    """
    if engine not in ENGINES:
        raise ValueError(f"expected engine in {ENGINES}, got {engine!r}")
    cfg = get_config(config)
    args = {**cfg.args, **overrides}
    kw = dict(device=device, dtype=dtype)
    if cfg.family == "vit":
        model: nn.Module = SimpleFeaturePyramid(ViT(vit_cfg(**args), engine, **kw),
                                                out_channels, **kw)
    else:
        model = FPN(MViT(mvit_cfg(**args), engine, **kw),
                    ("scale2", "scale3", "scale4", "scale5"), out_channels, **kw)
    model.detectron2_config = config
    model.detectron2_args = args
    model.pretrained_cfg = {"mean": _MEAN, "std": _STD, "input_size": (3, 1024, 1024)}
    model.coupling = (1.0, 0.0)
    # beta = 0 cannot be inverted: every block keeps its graph until the coupling moves.
    for stack in model.stacks():
        stack.store_blocks(range(len(stack.blocks)))
    return model


def from_detectron2(
    file_or_state_dict: Union[str, "os.PathLike[str]", Mapping[str, Any], None],
    config: str,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    out_channels: int = 256,
    device: Any = None,
    dtype: Optional[torch.dtype] = None,
    **overrides: Any,
) -> nn.Module:
    """detectron2's ``model.backbone`` of ``config``, reversible, with detectron2's weights.

    Args:
        file_or_state_dict: a model-zoo ``.pkl`` (``{"model": {name: array}}``, read so that
            nothing in it runs), an ImageNet initialisation (``MViTv2_*_in1k.pyth``,
            ``mae_pretrain_vit_*.pth``, read with ``torch.load(weights_only=True)``), a state
            dict in either layout, or None (detectron2's initialisation).
        config: ``"mvitv2_t"`` .. ``"mvitv2_h"``, ``"vitdet_b"`` .. ``"vitdet_h"``.
        engine: the stacks' backward engine.
        coupling: (alpha, beta) to start at; (1, 0) is detectron2's network.
        tolerance: of the precision guard (None: no guard).
        overrides: detectron2's ``ViT``/``MViT`` arguments changed from the configuration's.

    Returns:
        The pyramid (:class:`SimpleFeaturePyramid` or :class:`FPN`) over the reversible body;
        ``load_report`` says what the file gave it, and the zoo's head tensors are in
        ``load_report.heads`` for the detector.
    """
    model = build_detectron2_backbone(config, engine, out_channels, device, dtype, **overrides)
    body = "net." if isinstance(model, SimpleFeaturePyramid) else "bottom_up."
    model.load_report = None
    if file_or_state_dict is not None:
        model.load_report = load_backbone_weights(model, file_or_state_dict, body)
    if tolerance is not None:
        PrecisionGuard(model, tolerance=tolerance)
    alpha, beta = (float(c) for c in coupling)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    return model
