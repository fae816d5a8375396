"""Pretrained models rewired as dual-residual reversible networks, exactly (docs/convert.md).

One room for every conversion:

* ``source``: :func:`convert`, the one entry point, and what every conversion checks;
* ``block``: the coupled block (alpha in F and G, beta on the coupling) and timm's layers in
  chunks;
* ``coupling``: :func:`set_coupling` and :class:`CouplingSchedule`, which move (alpha, beta);
* ``precision_guard``: stores the blocks a small skip scale cannot rebuild;
* ``weights``: a source's weights from a local file, in its publisher's layout;
* ``timm_pretrained``: timm's pretrained weights of a source, loaded into its converted model;
* ``stages``: a multi-scale source's blocks as runs of reversible stacks and the blocks kept;
* one module per source family: ``vit`` (timm's VisionTransformer), ``swin`` (timm's
  SwinTransformer and SwinTransformerV2), ``torchvision_swin`` (torchvision's 2-D
  SwinTransformer, V1 and V2), ``swin3d`` (torchvision's SwinTransformer3d; the parts of
  torchvision's Swins both share in ``torchvision_swin_base``), ``mvitv2`` (timm's
  MultiScaleVit), ``torchvision_mvit`` (torchvision's video MViT).

Importing the package registers every family with :func:`convert` and every named converted
model (``converted_vit``, ...) with :func:`pareprop.create_model`.
"""

# Imported for their side effect: each family registers its converter and its named model.
from pareprop.convert import (  # noqa: F401
    mvitv2,
    swin,
    swin3d,
    torchvision_mvit,
    torchvision_swin,
    vit,
)
from pareprop.convert.coupling import (
    SCHEDULES,
    CouplingSchedule,
    check_coupling,
    coupling_of,
    set_coupling,
)
from pareprop.convert.mvitv2 import ConvertedMultiScaleVit, load_mvitv2_weights
from pareprop.convert.precision_guard import GuardReport, PrecisionGuard
from pareprop.convert.source import (
    UnsupportedModelError,
    convert,
    converted_model_name,
    converted_model_names,
)
from pareprop.convert.swin import ConvertedSwin
from pareprop.convert.swin3d import ConvertedSwin3d
from pareprop.convert.torchvision_mvit import ConvertedMViT, load_torchvision_mvit_weights
from pareprop.convert.torchvision_swin import ConvertedTorchvisionSwin
from pareprop.convert.vit import ConvertedViT, load_timm_weights

__all__ = [
    "SCHEDULES", "ConvertedMViT", "ConvertedMultiScaleVit", "ConvertedSwin", "ConvertedSwin3d",
    "ConvertedTorchvisionSwin", "ConvertedViT", "CouplingSchedule", "GuardReport",
    "PrecisionGuard", "UnsupportedModelError", "check_coupling",
    "convert", "converted_model_name", "converted_model_names", "coupling_of",
    "load_mvitv2_weights", "load_timm_weights", "load_torchvision_mvit_weights", "set_coupling",
]
