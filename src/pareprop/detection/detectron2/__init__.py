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
* ``build``: :func:`from_detectron2` and :func:`build_detectron2_backbone`;
* ``registry``: ``detectron2:NAME`` backbones for :func:`pareprop.detection.create_detector`;
* ``heads``: a model-zoo detector's heads into torchvision's, where they correspond.
"""

from __future__ import annotations

from pareprop.detection.detectron2.build import build_detectron2_backbone, from_detectron2
from pareprop.detection.detectron2.configs import (
    CONFIGS,
    Detectron2Config,
    config_names,
    get_config,
)
from pareprop.detection.detectron2.heads import HeadsReport, load_detectron2_heads
from pareprop.detection.detectron2.mvit import MViT
from pareprop.detection.detectron2.pyramid import FPN, SimpleFeaturePyramid
from pareprop.detection.detectron2.safe_pickle import UnsafePickleError, read_pickle, read_zoo_file
from pareprop.detection.detectron2.vitdet import ViT
from pareprop.detection.detectron2.weights import Detectron2Weights

# Imported for its side effect: ``create_detector(..., backbone="detectron2:NAME")``.
from pareprop.detection.detectron2 import registry  # noqa: E402,F401  isort: skip

__all__ = [
    "CONFIGS", "Detectron2Config", "Detectron2Weights", "FPN", "MViT", "SimpleFeaturePyramid",
    "UnsafePickleError", "ViT", "build_detectron2_backbone", "config_names", "from_detectron2",
    "get_config", "HeadsReport", "load_detectron2_heads", "read_pickle", "read_zoo_file",
]
