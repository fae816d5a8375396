"""A pretrained torchvision Swin Transformer (``swin_t/s/b``) or Swin V2 (``swin_v2_t/s/b``),
ImageNet-1k, rewired as a dual-residual reversible network, exactly.

Swin: Liu et al., ICCV 2021; Swin V2: Liu et al., CVPR 2022. Coupling: Dr2Net (Zhao et al.,
CVPR 2024), docs/convert.md; the blocks and stages as in NOTE [ torchvision's Swin models as
coupled stacks ] in pareprop/convert/torchvision_swin_base.py.

torchvision's 2-D ``SwinTransformer`` keeps everything before the final norm in ``features``:
``features.0`` the stem (patch convolution, channels last, norm), then the stages at the odd
indices and the patch mergings (``PatchMerging``; V2's ``PatchMergingV2`` normalises after its
projection) between them. V1's blocks are pre-norm, V2's post-norm, ``z + sd(norm(H(z)))``:
both are ``z + H(z)``, so both convert. A converted model keeps ``features`` with the same
indices: the stem and mergings torchvision's modules (checkpointed under
``set_grad_checkpointing``), each stage one reversible stack.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
from torchvision.models.swin_transformer import (
    PatchMerging,
    PatchMergingV2,
    ShiftedWindowAttention,
    ShiftedWindowAttentionV2,
    SwinTransformer,
    SwinTransformerBlockV2,
)

from pareprop.convert.coupling import coupling_pair, set_coupling
from pareprop.convert.source import (
    UnsupportedModelError,
    build_source,
    convert,
    converts,
    keep_source_names,
    refuse_grad_checkpointing,
    register_source_names,
)
from pareprop.convert.torchvision_swin_base import TorchvisionSwinFeatures, check_features
from pareprop.convert.weights import check_saved_coupling, load_source_weights
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.models import ReversibleModelMixin, register_model

__all__ = [
    "ConvertedTorchvisionSwin", "TV_SWIN_SOURCES", "build_tv_swin", "check_convertible",
    "converted_tv_swin", "published_name", "weights_data_config",
]


def _stage_indices(features: nn.Sequential) -> range:
    return range(1, len(features), 2)  # the stem at 0, mergings between the stages


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is torchvision's 2-D
    ``SwinTransformer`` itself, of torchvision's blocks, window attention and patch mergings."""
    if type(model) is not SwinTransformer:
        if isinstance(model, SwinTransformer):
            raise UnsupportedModelError(
                f"{type(model).__name__} subclasses torchvision's SwinTransformer and may "
                "change its forward; only SwinTransformer itself is converted exactly"
            )
        raise UnsupportedModelError(
            "expected torchvision's SwinTransformer (swin_t/s/b, swin_v2_t/s/b), got "
            f"{type(model).__name__}"
        )
    check_features(model.features, _stage_indices(model.features),
                   attentions=(ShiftedWindowAttention, ShiftedWindowAttentionV2),
                   mergings=(PatchMerging, PatchMergingV2))
    refuse_grad_checkpointing(model)


@converts(SwinTransformer)
class ConvertedTorchvisionSwin(TorchvisionSwinFeatures, ReversibleModelMixin, nn.Module):
    """torchvision's 2-D ``SwinTransformer`` (V1 or V2) whose stages each run their blocks as
    one reversible stack of coupled blocks; build it with :func:`pareprop.convert`.

    Shares the source's parameters and keeps torchvision's names in its state dict
    (``features.3.1.attn.qkv.weight``), so torchvision's checkpoints load into it and its
    checkpoints load into torchvision's model. Takes images ``(B, 3, H, W)`` of any size, as
    torchvision's model does (windows pad); ``pretrained_cfg`` says what the weights expect.
    """

    _STEM = r"^features\.0\."

    def __init__(self, source: SwinTransformer, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        conv = source.features[0][0]  # the patch convolution
        self.num_classes = source.num_classes
        self.num_features = source.norm.normalized_shape[0]
        self.in_chans = conv.in_channels
        self._convert_features(source.features, _stage_indices(source.features), engine)
        # In torchvision's order, so that the state dict's is torchvision's too.
        self.norm = source.norm
        self.permute = source.permute
        self.avgpool = source.avgpool
        self.flatten = source.flatten
        self.head = source.head
        self.feature_info = [
            {"num_chs": self.num_features // 2 ** (len(self._stage_indices) - 1 - k),
             "reduction": conv.stride[0] * 2 ** k, "module": f"features.{i}"}
            for k, i in enumerate(self._stage_indices)]
        self.pretrained_cfg: Dict[str, Any] = {
            **weights_data_config(published_name(source) or _family_default(source)),
            "num_classes": self.num_classes, "first_conv": "features.0.0",
            "classifier": "head"}
        self.default_cfg = self.pretrained_cfg
        keep_source_names(self, [(f"features.{i}.stack.blocks.", f"features.{i}.")
                                 for i in self._stage_indices])

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        # Checkpointed (set_grad_checkpointing), the stem keeps the images, which the caller
        # holds anyway, not the convolution's output its norm reads.
        return maybe_checkpoint(self.features[0], x, self.grad_checkpointing)  # (B, H, W, C)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.flatten(self.avgpool(self.permute(x)))  # torchvision's: (B, C)
        return x if pre_logits else self.head(x)


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

_V2 = dict(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2)

# torchvision's published configurations (its builders pass them to SwinTransformer and take
# no overrides of them; tests/test_convert_torchvision_swin.py checks this table against them).
TV_SWIN_SOURCES: Dict[str, Dict[str, Any]] = {
    "swin_t": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2],
                   num_heads=[3, 6, 12, 24], window_size=[7, 7], stochastic_depth_prob=0.2),
    "swin_s": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 18, 2],
                   num_heads=[3, 6, 12, 24], window_size=[7, 7], stochastic_depth_prob=0.3),
    "swin_b": dict(patch_size=[4, 4], embed_dim=128, depths=[2, 2, 18, 2],
                   num_heads=[4, 8, 16, 32], window_size=[7, 7], stochastic_depth_prob=0.5),
    "swin_v2_t": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2],
                      num_heads=[3, 6, 12, 24], window_size=[8, 8], stochastic_depth_prob=0.2,
                      **_V2),
    "swin_v2_s": dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 18, 2],
                      num_heads=[3, 6, 12, 24], window_size=[8, 8], stochastic_depth_prob=0.3,
                      **_V2),
    "swin_v2_b": dict(patch_size=[4, 4], embed_dim=128, depths=[2, 2, 18, 2],
                      num_heads=[4, 8, 16, 32], window_size=[8, 8], stochastic_depth_prob=0.5,
                      **_V2),
}

# NOTE [ What torchvision's Swin weights expect ]
# Every weight's transforms are ImageClassification(crop_size, resize_size, bicubic, ImageNet
# mean and std): the shorter side resized to resize_size, the centre crop_size square taken.
# That is timm's eval transform with crop_pct = crop / resize, centre mode, bicubic (timm
# resizes to floor(crop / crop_pct), which is resize_size for every pair here). V1 was trained
# at 224, V2 at 256 (its windows of 8 tile a 64 x 64 patch grid); the (crop, resize) pairs
# differ per size.
_CROP_RESIZE: Dict[str, Sequence[int]] = {
    "swin_t": (224, 232), "swin_s": (224, 246), "swin_b": (224, 238),
    "swin_v2_t": (256, 260), "swin_v2_s": (256, 260), "swin_v2_b": (256, 272),
}


def weights_data_config(source: str, img_size: Optional[int] = None) -> Dict[str, Any]:
    """What torchvision's DEFAULT weights of ``source`` expect, as a timm data config (the
    model's ``pretrained_cfg``); ``img_size`` another crop at the same crop ratio."""
    crop, resize = _CROP_RESIZE[source]
    size = int(img_size) if img_size is not None else crop
    return dict(input_size=(3, size, size), mean=(0.485, 0.456, 0.406),
                std=(0.229, 0.224, 0.225), crop_pct=crop / resize, crop_mode="center",
                interpolation="bicubic")


def _configuration(model: SwinTransformer) -> Dict[str, Any]:
    """The fields of :data:`TV_SWIN_SOURCES` read off a built model."""
    stages = [model.features[i] for i in _stage_indices(model.features)]
    conv = model.features[0][0]
    return dict(patch_size=list(conv.stride), embed_dim=conv.out_channels,
                depths=[len(s) for s in stages], num_heads=[s[0].attn.num_heads for s in stages],
                window_size=list(stages[0][0].attn.window_size),
                v2=type(stages[0][0]) is SwinTransformerBlockV2)


def published_name(model: SwinTransformer) -> Optional[str]:
    """The torchvision builder whose configuration ``model`` has, or None."""
    have = _configuration(model)
    for name, cfg in TV_SWIN_SOURCES.items():
        want = {k: cfg[k] for k in have if k != "v2"}
        if {**want, "v2": "block" in cfg} == have:
            return name
    return None


def _family_default(model: SwinTransformer) -> str:
    # A configuration torchvision does not publish: the preset of its family's smallest model.
    return "swin_v2_t" if _configuration(model)["v2"] else "swin_t"


def build_tv_swin(source: str, **kwargs: Any) -> SwinTransformer:
    """torchvision's ``source`` (``swin_t/s/b``, ``swin_v2_t/s/b``) with random weights;
    ``kwargs`` override its configuration (``depths``, ``embed_dim``, ``num_classes``, ...)."""
    if source not in TV_SWIN_SOURCES:
        raise ValueError(f"expected a torchvision source in {sorted(TV_SWIN_SOURCES)}, got "
                         f"{source!r}")
    return SwinTransformer(**{"num_classes": 1000, **TV_SWIN_SOURCES[source], **kwargs})


@register_model(timm=False)
def converted_tv_swin(
    source: str = "swin_t",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    img_size: Optional[int] = None,
    **torchvision_kwargs: Any,
) -> ConvertedTorchvisionSwin:
    """torchvision's ``source`` Swin (``swin_t``, ``swin_s``, ``swin_b``, ``swin_v2_t``,
    ``swin_v2_s``, ``swin_v2_b``; sizes overridden by ``torchvision_kwargs``), converted.

    ``pretrained_file``: torchvision's weights of the source (its state dict, as
    ``torch.save(model.state_dict())`` or its download writes it), read safely; a head of
    another class count is left out. ``coupling``: (alpha, beta) to start at (recorded by
    :func:`pareprop.set_coupling`, so a checkpoint rebuilds it there). ``tolerance``: of the
    precision guard (None: none). ``img_size``: the images it takes (its ``pretrained_cfg``;
    default the weights' crop, 224 for V1 and 256 for V2; torchvision's model takes any size).
    """
    alpha, beta = coupling_pair(coupling)  # refused before the source is built
    if pretrained_file is not None:  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(pretrained_file, (alpha, beta))
    if img_size is not None and (isinstance(img_size, bool) or not isinstance(img_size, int)
                                 or img_size < 1):
        raise ValueError(f"expected img_size to be a positive integer, got {img_size!r}")
    net = build_source(lambda: build_tv_swin(source, **torchvision_kwargs),
                       f"torchvision's {source}", torchvision_kwargs)
    if pretrained_file is not None:
        load_source_weights(
            net, pretrained_file, head=("head.weight", "head.bias"),
            hint=f"is it torchvision's {source} state dict (give --model-arg sizes of another)?")
    model = convert(net, engine=engine, tolerance=tolerance)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    model.pretrained_cfg.update(weights_data_config(source, img_size))
    return model


# torchvision's names (swin_t, swin_v2_b) are not timm's (swin_tiny_patch4_window7_224,
# swinv2_tiny_window8_256): each name belongs to one family.
register_source_names("converted_tv_swin", "torchvision", TV_SWIN_SOURCES.__contains__,
                      "swin_t/s/b, swin_v2_t/s/b")
