"""detectron2's MViTv2 and ViTDet backbones, reversible and exact (docs/detectron2.md).

``from_detectron2(file_or_state_dict, config)`` builds the backbone of detectron2's detector
``config`` (``"mvitv2_t"`` .. ``"mvitv2_h"``: MViT + FPN; ``"vitdet_b"`` .. ``"vitdet_h"``:
ViT + simple feature pyramid at 1024) with its blocks as coupled reversible blocks, loads
detectron2's weights into it (model-zoo pickles read without running code, ImageNet
initialisations), and returns the module detectron2 calls ``model.backbone``: ``forward(images)``
gives an ordered dict ``p2`` .. ``p6`` of ``out_channels`` (256) channels. At the coupling
(1, 0) it starts from, it is detectron2's backbone; :func:`pareprop.set_coupling` and
:class:`pareprop.CouplingSchedule` move it, and a :class:`pareprop.PrecisionGuard` stores the
blocks a small beta cannot rebuild, as for every converted model.

* ``safe_pickle``: the model zoo's pickles, read so that nothing in them runs;
* ``layers``: windows, relative and absolute positions, the patch embedding, channel norms;
* ``vitdet``: ViTDet's ViT; ``mvit``: detectron2's MViT; ``pyramid``: the simple feature
  pyramid and the FPN;
* ``configs``: the named configurations; ``weights``: the files' names onto the modules;
* ``registry``: ``detectron2:NAME`` backbones for :func:`pareprop.detection.create_detector`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from pareprop.convert.coupling import set_coupling
from pareprop.convert.precision_guard import PrecisionGuard
from pareprop.detection.detectron2.configs import (
    CONFIGS,
    Detectron2Config,
    config_names,
    get_config,
)
from pareprop.detection.detectron2.mvit import MViT, mvit_cfg
from pareprop.detection.detectron2.pyramid import FPN, SimpleFeaturePyramid
from pareprop.detection.detectron2.safe_pickle import UnsafePickleError, read_pickle, read_zoo_file
from pareprop.detection.detectron2.vitdet import ViT, vit_cfg
from pareprop.detection.detectron2.weights import Detectron2Weights, load_backbone_weights
from pareprop.engine import ENGINES

# Imported for its side effect: ``create_detector(..., backbone="detectron2:NAME")``.
from pareprop.detection.detectron2 import registry  # noqa: E402,F401  isort: skip

__all__ = [
    "CONFIGS", "Detectron2Config", "Detectron2Weights", "FPN", "MViT", "SimpleFeaturePyramid",
    "UnsafePickleError", "ViT", "build_detectron2_backbone", "config_names", "from_detectron2",
    "read_pickle", "read_zoo_file",
]

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
