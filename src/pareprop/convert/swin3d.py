"""A pretrained torchvision Video Swin Transformer (``swin3d_t/s/b``, Kinetics-400) rewired as
a dual-residual reversible network, exactly.

Video Swin: Liu et al., CVPR 2022. Coupling: Dr2Net (Zhao et al., CVPR 2024), docs/convert.md;
the stages as in NOTE [ Swin's stages as coupled stacks ] in pareprop/convert/swin.py.

torchvision's ``SwinTransformer3d`` keeps its stages and patch mergings side by side in one
``features`` sequence (``features.0`` the first stage's blocks, ``features.1`` a patch merging,
...). Every block is pre-norm on the ``(B, T, H, W, C)`` map,

    z + stochastic_depth(attn(norm1(z))),   z + stochastic_depth(mlp(norm2(z))),

``attn`` torchvision's 3-D (shifted-)window attention, which builds its mask from the input. A
converted model keeps ``features`` with the same indices: each stage a reversible stack of
coupled blocks (F the attention sub-layer, G the MLP sub-layer), each patch merging
torchvision's module, checkpointed under ``set_grad_checkpointing``. The blocks, stages and
model methods are those of torchvision's 2-D Swin (pareprop/convert/torchvision_swin_base.py);
this module adds the video stem, the checks and the named model.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
from torchvision.models.swin_transformer import PatchMerging
from torchvision.models.video.swin_transformer import ShiftedWindowAttention3d, SwinTransformer3d

from pareprop.convert.coupling import coupling_pair, set_coupling
from pareprop.convert.source import (
    UnsupportedModelError,
    build_source,
    convert,
    converts,
    keep_source_names,
    refuse_grad_checkpointing,
    register_source_names,
    set_clip_data,
)
from pareprop.convert.torchvision_swin_base import (
    ConvertedTorchvisionSwinBlock,
    ConvertedTorchvisionSwinStage,
    TorchvisionSwinFeatures,
    check_features,
    load_torchvision_pretrained,
)
from pareprop.convert.weights import check_saved_coupling, load_source_weights
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.models import ReversibleModelMixin, register_model

__all__ = [
    "ConvertedSwin3d", "ConvertedSwin3dBlock", "ConvertedSwin3dStage", "SWIN3D_SOURCES",
    "check_convertible", "converted_swin3d", "load_torchvision_pretrained",
]

# The block and stage are torchvision's 2-D ones with 3-D attention: shared with the 2-D
# conversion (pareprop/convert/torchvision_swin_base.py), under their earlier names here.
ConvertedSwin3dBlock = ConvertedTorchvisionSwinBlock
ConvertedSwin3dStage = ConvertedTorchvisionSwinStage


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is torchvision's
    ``SwinTransformer3d`` itself, of torchvision's blocks, 3-D attention and patch merging."""
    if type(model) is not SwinTransformer3d:
        if isinstance(model, SwinTransformer3d):
            raise UnsupportedModelError(
                f"{type(model).__name__} subclasses torchvision's SwinTransformer3d and may "
                "change its forward; only SwinTransformer3d itself is converted exactly"
            )
        raise UnsupportedModelError(
            "expected torchvision's SwinTransformer3d (swin3d_t, swin3d_s, swin3d_b), got "
            f"{type(model).__name__}"
        )
    check_features(model.features, range(0, len(model.features), 2),
                   attentions=(ShiftedWindowAttention3d,), mergings=(PatchMerging,))
    refuse_grad_checkpointing(model)


@converts(SwinTransformer3d)
class ConvertedSwin3d(TorchvisionSwinFeatures, ReversibleModelMixin, nn.Module):
    """torchvision's ``SwinTransformer3d`` whose stages each run their blocks as one reversible
    stack of coupled blocks; build it with :func:`pareprop.convert`.

    Shares the source's parameters and keeps torchvision's names in its state dict
    (``features.2.1.attn.qkv.weight``), so torchvision's checkpoints load into it and its
    checkpoints load into torchvision's model.
    """

    _STEM = r"^patch_embed"

    def __init__(self, source: SwinTransformer3d, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        self.num_classes = source.num_classes
        self.num_features = source.num_features
        self.in_chans = source.patch_embed.proj.in_channels
        self.patch_embed = source.patch_embed
        self.pos_drop = source.pos_drop
        self._convert_features(source.features, range(0, len(source.features), 2), engine)
        self.norm = source.norm
        self.avgpool = source.avgpool
        self.head = source.head
        patch = source.patch_embed.tuple_patch_size
        self.feature_info = [
            {"num_chs": self.num_features // 2 ** (len(self._stage_indices) - 1 - k),
             "reduction": patch[1] * 2 ** k, "module": f"features.{i}"}
            for k, i in enumerate(self._stage_indices)]
        self.pretrained_cfg: Dict[str, Any] = {
            "input_size": (self.in_chans, 32, 224, 224), "num_classes": self.num_classes,
            **_WEIGHTS_DATA, "first_conv": "patch_embed.proj", "classifier": "head"}
        self.default_cfg = self.pretrained_cfg
        keep_source_names(self, [(f"features.{i}.stack.blocks.", f"features.{i}.")
                                 for i in self._stage_indices])

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        # Checkpointed (set_grad_checkpointing), the patch embedding keeps the clips, which the
        # caller holds anyway, not its norm's input.
        return self.pos_drop(maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing))


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

# torchvision's published configurations (its swin3d_* builders pass them to SwinTransformer3d
# and take no overrides of them; tests/test_convert_swin3d.py checks this table against them).
SWIN3D_SOURCES: Dict[str, Dict[str, Any]] = {
    "swin3d_t": dict(patch_size=[2, 4, 4], embed_dim=96, depths=[2, 2, 6, 2],
                     num_heads=[3, 6, 12, 24], window_size=[8, 7, 7],
                     stochastic_depth_prob=0.1),
    "swin3d_s": dict(patch_size=[2, 4, 4], embed_dim=96, depths=[2, 2, 18, 2],
                     num_heads=[3, 6, 12, 24], window_size=[8, 7, 7],
                     stochastic_depth_prob=0.1),
    "swin3d_b": dict(patch_size=[2, 4, 4], embed_dim=128, depths=[2, 2, 18, 2],
                     num_heads=[4, 8, 16, 32], window_size=[8, 7, 7],
                     stochastic_depth_prob=0.1),
}

# NOTE [ What torchvision's Video Swin weights expect ]
# Every swin3d_* weight's transforms are VideoClassification(resize_size=(256,),
# crop_size=(224, 224), bilinear, ImageNet mean and std), clips (B, C, T, H, W); torchvision
# evaluates them on 32-frame clips at 15 frames a second (its meta: frame_rate=15,
# clips_per_video=12, clip_len=32), Video Swin's 32x2 sampling (every 2nd frame of 30 fps).
_WEIGHTS_DATA: Dict[str, Any] = dict(
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=224 / 256,
    crop_mode="center", interpolation="bilinear", num_frames=32, frame_stride=2,
    frame_rate=15, clips_per_video=12,
)


def build_swin3d(source: str, **kwargs: Any) -> SwinTransformer3d:
    """torchvision's ``source`` (``swin3d_t/s/b``) with random weights; ``kwargs`` override its
    configuration (``depths``, ``embed_dim``, ``num_classes``, ...)."""
    if source not in SWIN3D_SOURCES:
        raise ValueError(f"expected a torchvision source in {sorted(SWIN3D_SOURCES)}, got "
                         f"{source!r}")
    return SwinTransformer3d(**{"num_classes": 400, **SWIN3D_SOURCES[source], **kwargs})


@register_model(timm=False)
def converted_swin3d(
    source: str = "swin3d_t",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    num_frames: int = 32,
    img_size: int = 224,
    frame_stride: Optional[int] = None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    **torchvision_kwargs: Any,
) -> ConvertedSwin3d:
    """torchvision's ``source`` Video Swin (``swin3d_t``, ``swin3d_s``, ``swin3d_b``; sizes
    overridden by ``torchvision_kwargs``), converted.

    ``pretrained_file``: torchvision's weights of the source (its state dict, as
    ``torch.save(model.state_dict())`` or its download writes it), read safely; a head of
    another class count is left out. ``coupling``: (alpha, beta) to start at (recorded by
    :func:`pareprop.set_coupling`, so a checkpoint rebuilds it there). ``tolerance``: of the
    precision guard (None: none). ``num_frames`` and ``img_size``: the clips it takes (its
    ``pretrained_cfg``; torchvision's model itself takes any size). ``frame_stride``,
    ``mean``, ``std``: the data its clips are sampled and normalised by (default the
    weights': :func:`pareprop.convert.source.set_clip_data`).
    """
    alpha, beta = coupling_pair(coupling)  # refused before the source is built
    if pretrained_file is not None:  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(pretrained_file, (alpha, beta))
    for name, value in (("num_frames", num_frames), ("img_size", img_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {name} to be a positive integer, got {value!r}")
    net = build_source(lambda: build_swin3d(source, **torchvision_kwargs),
                       f"torchvision's {source}", torchvision_kwargs)
    if pretrained_file is not None:
        load_source_weights(
            net, pretrained_file, head=("head.weight", "head.bias"),
            hint=f"is it torchvision's {source} state dict (give --model-arg sizes of another)?")
    model = convert(net, engine=engine, tolerance=tolerance)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    model.pretrained_cfg.update(input_size=(model.in_chans, int(num_frames), int(img_size),
                                            int(img_size)), num_frames=int(num_frames))
    set_clip_data(model, frame_stride, mean, std)
    return model


register_source_names("converted_swin3d", "torchvision", SWIN3D_SOURCES.__contains__,
                      "swin3d_t, swin3d_s, swin3d_b")
