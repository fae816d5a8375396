"""Rev-MViT-B 16x4: the published reversible multiscale video transformer (Kinetics-400).

Mangalam et al., "Reversible Vision Transformers", CVPR 2022 (Rev-MViT-B 16x4: 34.9M
parameters, Kinetics-400 top-1 78.4 / top-5 93.4 with 1 crop x 5 clips, as published by the
authors); Fan et al., "Multiscale Vision Transformers", ICCV 2021 (pooling attention). This is
the architecture of PySlowFast's ``configs/Kinetics/REV_MVIT_B_16x4_CONV.yaml`` built with no
class token, so that ``REV_MVIT_B_16x4.pyth`` loads as published.

NOTE [ Published Rev-MViT-B 16x4 ]
The yaml sets ``CLS_EMBED_ON: True``, but PySlowFast's reversible model asserts there is no
class token, so the file as published builds only with it off; so built, PySlowFast's own code
counts 34,963,120 parameters, and so does this model. Input ``(B, 3, 16, 224, 224)``: 16 frames
taken every 4th frame. Patch embedding Conv3d 3x7x7, stride 2x4x4, padding 1x3x3 (width 96,
map 8x56x56), then separate spatial (56*56) and temporal (8) position embeddings, added. The
blocks are the image Rev-MViT-B's (:class:`~pareprop.models.rev_mvit.RevMViTv1Block`, in 3-D):
depth 16, transitions at 1, 3 and 14, 3x3x3 depthwise pooling, keys and values pooled with
stride [1, 8, 8] in the first stage and halved with the queries' [1, 2, 2] at every transition,
one qkv map with no bias. What differs from the image model is the transition
(PySlowFast's defaults ``PRE_Q_FUSION: avg``, ``RES_PATH: conv``): it averages the two streams
(2C -> C), and widens C -> 2C inside itself:

    x = (x1 + x2) / 2                       # the previous stack's streams, C each
    shortcut = norm_q(pool_q(res_proj(x)))  # res_proj: Linear C -> 2C; pool_q tied to attn's
    x = shortcut + attn(norm1(x))           # attn: C -> 2C, queries pooled [1, 2, 2]
    x = x + mlp(norm2(x))

The head is the image model's: LayerNorm over the last stack's two streams side by side
(2 x 768) on every token, the mean over tokens, dropout 0.5, a linear classifier. PySlowFast's
head also applies a softmax in eval mode; this model returns logits (see
:func:`pareprop.evaluate.evaluate_clips` for the multi-view average).

As in the image model, a transition's stochastic depth acts on each residual branch (PySlowFast
drops its whole output): evaluation is identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Set, Tuple

import torch
import torch.nn as nn
from timm.layers import trunc_normal_

from pareprop.chunking import Chunk
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.layers import make_config
from pareprop.layers.multiscale_attention import MultiScaleAttention, pool_heads
from pareprop.models._base import ReversibleModelMixin, init_linears_
from pareprop.models._features import StageFeaturesMixin
from pareprop.models._registry import register_model
from pareprop.models._rev_mvit_base import (
    RevMViTFamilyMixin,
    RevMViTStagePlan,
    check_family_config,
    is_pyslowfast,
    plan_stages,
    rename_pyslowfast,
)
from pareprop.models.mvit import MViTTransition
from pareprop.models.published import PretrainedError
from pareprop.models.rev_mvit import RevMViTv1Block  # the same reversible blocks, in 3-D

__all__ = [
    "RevMViTVideoConfig",
    "RevMViTVideo",
    "RevMViTVideoTransition",
    "REV_MVIT_VIDEO_CONFIGS",
    "KINETICS_MEAN",
    "KINETICS_STD",
    "checkpoint_filter_fn",
]

# PySlowFast's DATA.MEAN and DATA.STD, which the Kinetics yaml keeps: on pixels in [0, 1].
KINETICS_MEAN = (0.45, 0.45, 0.45)
KINETICS_STD = (0.225, 0.225, 0.225)

Triple = Tuple[int, int, int]


@dataclass(frozen=True)
class RevMViTVideoConfig:
    """Everything that defines a video Rev-MViT; variants are rows of
    :data:`REV_MVIT_VIDEO_CONFIGS`. Defaults are the published 16x4 model."""

    num_frames: int = 16
    img_size: int = 224
    in_chans: int = 3
    num_classes: int = 400
    embed_dim: int = 96
    depth: int = 16
    num_heads: int = 1
    transition_blocks: Tuple[int, ...] = (1, 3, 14)  # PySlowFast's MVIT.REV.BUFFER_LAYERS
    patch_kernel: Triple = (3, 7, 7)
    patch_stride: Triple = (2, 4, 4)
    patch_padding: Triple = (1, 3, 3)
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    pool_kernel: Triple = (3, 3, 3)
    kv_stride: Triple = (1, 8, 8)  # of the first stage; divided by q_stride at each transition
    q_stride: Triple = (1, 2, 2)  # of every transition
    drop_rate: float = 0.5  # dropout before the classifier (MODEL.DROPOUT_RATE)
    drop_path_rate: float = 0.05
    engine: str = "reversible"
    frame_stride: int = 4  # sampling rate of the clips it was trained on (data, not the model)
    mean: Tuple[float, ...] = KINETICS_MEAN
    std: Tuple[float, ...] = KINETICS_STD


def _triple(value: Any, name: str) -> Triple:
    if isinstance(value, int):
        return (value, value, value)
    value = tuple(value)
    if len(value) != 3 or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"expected {name} as a positive int or three (T, H, W), got {value!r}")
    return value  # type: ignore[return-value]


def _check_config(cfg: RevMViTVideoConfig) -> None:
    check_family_config(cfg)
    # Data, not the model, but the clips of every run and evaluation are sampled by it: a
    # bad value is refused when the model is built, not when a trained run is evaluated.
    stride = cfg.frame_stride
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(
            f"expected frame_stride an int >= 1 (clips take every frame_stride-th frame at "
            f"30 fps), got {stride!r}"
        )
    for name in ("mean", "std"):
        values = getattr(cfg, name)
        if not isinstance(values, (tuple, list)) or len(values) != cfg.in_chans:
            raise ValueError(
                f"expected {name} with one value per channel ({cfg.in_chans}), got {values!r}"
            )


class RevMViTVideoTransition(MViTTransition):
    """The non-reversible block that opens a stage (NOTE [ Published Rev-MViT-B 16x4 ]):
    ``(B, T, H, W, 2 * dim) -> (B, T', H', W', dim_out)``, the input being the previous stack's
    two streams side by side.

    Args:
        dim: width of each incoming stream (after the average).
        dim_out: width out (2 * dim in the published model).
        num_heads: attention heads (doubled from the previous stage).
        q_stride: query (and shortcut) pooling stride.
        kv_stride: key/value pooling stride.
        mlp_ratio: MLP hidden width over ``dim_out``.
        qkv_bias: bias in the qkv map.
        pool_kernel: kernel of the pooling convolutions.
        drop_path: stochastic-depth rate of both residual branches.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int,
        num_heads: int,
        q_stride: Triple,
        kv_stride: Triple,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        pool_kernel: Triple = (3, 3, 3),
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.dim = dim
        self.res_proj = nn.Linear(dim, dim_out)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiScaleAttention(
            dim,
            num_heads,
            qkv_bias,
            pool_kernel,
            q_stride,
            kv_stride,
            dim_out=dim_out,
            separate_qkv=False,
        )
        if self.attn.pool_q is None:
            raise ValueError(f"a transition pools its queries; got q_stride {q_stride}")
        self._init_mlp_branch(dim_out, mlp_ratio, drop_path)

    # In a clip: the stream average, the pooled shortcut, pooling attention and the MLP.
    def forward_chunk(self, x: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
        """The block on ``chunk``'s clips of the batch (``None``: the whole batch)."""
        B, T, H, W, C2 = x.shape
        grid = (T, H, W)
        x = x.reshape(B, -1, C2)  # (B, N, 2C)
        x = (x[..., : self.dim] + x[..., self.dim :]) / 2  # (B, N, C): PRE_Q_FUSION "avg"
        # The shortcut is widened, then pooled by the attention's own query convolution and norm.
        shortcut, q_grid = pool_heads(
            self.attn.split_heads(self.res_proj(x)), grid, self.attn.pool_q, self.attn.norm_q
        )  # (B, heads, N', hd)
        shortcut = shortcut.transpose(1, 2).reshape(B, -1, self.attn.dim_out)  # (B, N', C')
        a, _ = self.attn(self.norm1(x), grid)  # (B, N', C')
        return self._residuals(shortcut, a, chunk).view(B, *q_grid, -1)  # (B, T', H', W', C')


def check_video(x: Any, in_chans: int, clip: Triple) -> torch.Tensor:
    """Return ``x``; raise ``ValueError`` unless it is a float ``(B, in_chans, T, H, W)`` batch
    of the model's clip size."""
    T, H, W = clip
    want = f"(B, {in_chans}, {T}, {H}, {W}): clips of {T} frames at {H}x{W}"
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a video tensor {want}, got {type(x).__name__}")
    if not torch.is_floating_point(x):
        raise ValueError(
            f"expected a floating-point video tensor, got dtype {x.dtype} with shape "
            f"{tuple(x.shape)}; convert it first, e.g. x.float() / 255, then normalise"
        )
    if x.ndim != 5 or tuple(x.shape[1:]) != (in_chans, T, H, W):
        raise ValueError(
            f"expected input {want}, got {tuple(x.shape)}; sample {T} frames, crop to {H}x{W}, "
            f"or create the model with num_frames={x.shape[2] if x.ndim == 5 else T} and "
            f"img_size=... to match"
        )
    return x


class RevMViTVideo(RevMViTFamilyMixin, StageFeaturesMixin, ReversibleModelMixin, nn.Module):
    """The published reversible video MViT (Rev-MViT-B 16x4).

    ``forward_intermediates`` and ``features_only=True`` give one space-time map per stage,
    ``(B, C, T', H', W')`` (NOTE [ Features from stage ends only ] in models/_features.py).

    Args:
        cfg: the configuration; see :class:`RevMViTVideoConfig`.
    """

    def __init__(self, cfg: RevMViTVideoConfig):
        super().__init__()
        cfg = make_config(
            cfg,
            patch_kernel=_triple(cfg.patch_kernel, "patch_kernel"),
            patch_stride=_triple(cfg.patch_stride, "patch_stride"),
            patch_padding=_triple(cfg.patch_padding, "patch_padding"),
            pool_kernel=_triple(cfg.pool_kernel, "pool_kernel"),
            kv_stride=_triple(cfg.kv_stride, "kv_stride"),
            q_stride=_triple(cfg.q_stride, "q_stride"),
            transition_blocks=tuple(cfg.transition_blocks),
        )
        _check_config(cfg)
        self.cfg = cfg
        self.in_chans = cfg.in_chans
        self.clip_size: Triple = (cfg.num_frames, cfg.img_size, cfg.img_size)
        grid = self._init_patch_embed(cfg, self.clip_size, f"clip {self.clip_size}")
        self.grid_size = grid  # (T', H', W')
        self.pos_embed_spatial = nn.Parameter(torch.zeros(1, grid[1] * grid[2], cfg.embed_dim))
        self.pos_embed_temporal = nn.Parameter(torch.zeros(1, grid[0], cfg.embed_dim))
        # Spatial reduction: time is halved by the stem only (q_stride [1, 2, 2]).
        self._build_stages(
            plan_stages(cfg, cfg.q_stride),
            lambda s: cfg.patch_stride[1] * cfg.q_stride[1] ** s,
            map_dims=3,
        )
        self._set_pretrained_cfg(
            (cfg.in_chans, *self.clip_size),
            tuple(cfg.mean),
            tuple(cfg.std),
            fixed_input_size=True,
            crop_pct=1.0,
            crop_mode="center",
            interpolation="bilinear",
            first_conv="patch_embed.proj",
            num_frames=cfg.num_frames,
            frame_stride=cfg.frame_stride,
        )
        self._init_weights()

    def _make_transition(self, p: RevMViTStagePlan, path_rate: float, **common: Any) -> nn.Module:
        # Averages the previous stack's two streams (width_in each), then widens to width.
        return RevMViTVideoTransition(
            p.width_in,
            p.width,
            p.num_heads,
            self.cfg.q_stride,
            p.kv_stride,  # type: ignore[arg-type]
            drop_path=path_rate,
            **common,
        )

    def _make_block(self, p: RevMViTStagePlan, path_rate: float, **common: Any) -> nn.Module:
        return RevMViTv1Block(
            p.width, p.num_heads, p.kv_stride, drop_path=path_rate, separate_qkv=False, **common
        )

    def _init_weights(self) -> None:
        trunc_normal_(self.pos_embed_spatial, std=0.02)
        trunc_normal_(self.pos_embed_temporal, std=0.02)
        init_linears_(self.stages)

    def example_inputs(
        self, batch_size: int = 2, device: Any = None, dtype: torch.dtype = torch.float32
    ) -> Tuple[torch.Tensor]:
        """A random batch of clips ``(B, C, T, H, W)`` of the configured size."""
        return (
            torch.randn(batch_size, self.cfg.in_chans, *self.clip_size, device=device, dtype=dtype),
        )

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed_spatial", "pos_embed_temporal"}

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        x = check_video(x, self.cfg.in_chans, self.clip_size)
        x = maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing)  # (B, T, H, W, C)
        T, H, W = self.grid_size
        pos = self.pos_embed_spatial.view(1, 1, H, W, -1) + self.pos_embed_temporal.view(
            1, T, 1, 1, -1
        )  # (1, T, H, W, C)
        return x + pos

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def checkpoint_filter(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """:func:`checkpoint_filter_fn` on this model (what ``pareprop.load_pretrained`` uses)."""
        return checkpoint_filter_fn(state, self)


_RENAMES = {"F.norm.": "norm1.", "F.attn.": "attn.", "G.norm.": "norm2.", "G.mlp.": "mlp."}


def checkpoint_filter_fn(
    state_dict: Dict[str, torch.Tensor], model: RevMViTVideo
) -> Dict[str, torch.Tensor]:
    """Map PySlowFast's video Rev-MViT state dict onto ``model``'s names.

    ``rev_backbone.layers.{i}`` becomes block ``i``'s module (:meth:`RevMViTVideo.block_paths`);
    inside it ``F.norm -> norm1``, ``F.attn -> attn``, ``G.norm -> norm2``, ``G.mlp -> mlp``
    (``res_proj`` keeps its name); ``head.projection -> head``. Shapes are as published (the
    pooling convolutions are Conv3d here too). Keys of no known layout pass through, so that the
    strict check names them.
    """
    if not is_pyslowfast(state_dict, "Rev-MViT-B 16x4"):
        return state_dict
    if "pos_embed" in state_dict and "pos_embed_spatial" not in state_dict:
        raise PretrainedError(
            "the file has one joint 'pos_embed' and no 'pos_embed_spatial': it is the image "
            "Rev-MViT-B (create 'rev_mvit_base'), not the video model"
        )
    return rename_pyslowfast(state_dict, model.block_paths(), _RENAMES)


def clip_tokens(cfg: RevMViTVideoConfig) -> int:
    """Tokens of the first stage for one clip (8 x 56 x 56 = 25,088 for the published model)."""
    sizes = (cfg.num_frames, cfg.img_size, cfg.img_size)
    return math.prod(
        (s + 2 * p - k) // st + 1
        for s, p, k, st in zip(sizes, cfg.patch_padding, cfg.patch_kernel, cfg.patch_stride)
    )


# fmt: off
REV_MVIT_VIDEO_CONFIGS: Dict[str, RevMViTVideoConfig] = {
    # PySlowFast configs/Kinetics/REV_MVIT_B_16x4_CONV.yaml without its class token (34.96M).
    "rev_mvit_base_16x4": RevMViTVideoConfig(),
}
# fmt: on


@register_model
def rev_mvit_base_16x4(**kwargs: Any) -> RevMViTVideo:
    return RevMViTVideo(make_config(REV_MVIT_VIDEO_CONFIGS["rev_mvit_base_16x4"], **kwargs))
