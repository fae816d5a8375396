"""Rev-MViT: the published reversible multiscale vision transformer (MViTv1 pooling attention).

Mangalam et al., "Reversible Vision Transformers", CVPR 2022 (Rev-MViT-B: 39.7M parameters,
82.9% ImageNet-1k top-1 as published by the authors); Fan et al., "Multiscale Vision
Transformers", ICCV 2021 (pooling attention). This is the architecture of PySlowFast's
``configs/ImageNet/REV_MVIT_B_16_CONV.yaml``, so that its weights load as published; it is not
:mod:`pareprop.models.mvit` (Rev-MViTv2: relative positions, residual pooling, windows,
max-pooled shortcuts).

NOTE [ Published Rev-MViT-B ]
Depth 16; blocks 1, 3 and 14 are non-reversible stage transitions, every other block is
reversible and each run of them is one :class:`~pareprop.ReversibleStack` whose two streams
end side by side, so the width doubles at every stage (96, 192, 384, 768) while the head width
stays ``embed_dim / num_heads`` (heads 1, 2, 4, 8). Patch embedding: convolution 7/4/3, then an
absolute position embedding over the 56x56 map. Keys and values are pooled in every block
(stride 4 in the first stage, halved at each transition, not below 1); queries are pooled
(stride 2) only in transitions. A transition (width 2C in and out):

    x = x + MLP(x)                          # 2C -> 4C -> 2C, GELU, no norm: the stream fusion
    shortcut = norm_q(pool_q(x))            # the SAME convolution and norm as its queries
    x = shortcut + attn(norm1(x))
    x = x + mlp(norm2(x))

The head: LayerNorm(2C) on every token, the mean over tokens, a linear classifier.

Differences kept on purpose: PySlowFast applies a transition's stochastic depth to its whole
output (``x = drop_path(x)`` after both residuals); here it acts on each residual branch as
everywhere else in pareprop. Evaluation (no drop path) is identical; only fine-tuning with
``drop_path_rate > 0`` differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_

from pareprop.chunking import Chunk, Split
from pareprop.engine import ReversibleBlock
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.layers import Mlp, check_image, make_config, to_2tuple_int
from pareprop.layers.drop import DropPath, drop_path
from pareprop.layers.multiscale_attention import MultiScaleAttention, pool_heads
from pareprop.models._base import ReversibleImageModelMixin, init_linears_
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

__all__ = [
    "RevMViTv1Config",
    "RevMViTv1",
    "RevMViTv1Block",
    "RevMViTv1Transition",
    "REV_MVIT_CONFIGS",
    "checkpoint_filter_fn",
]


@dataclass(frozen=True)
class RevMViTv1Config:
    """Everything that defines a Rev-MViT (v1); variants are rows of :data:`REV_MVIT_CONFIGS`."""

    img_size: Union[int, Tuple[int, int]] = 224
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 96
    depth: int = 16
    num_heads: int = 1
    transition_blocks: Tuple[int, ...] = (1, 3, 14)  # PySlowFast's MVIT.REV.BUFFER_LAYERS
    patch_kernel: int = 7
    patch_stride: int = 4
    patch_padding: int = 3
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    pool_kernel: int = 3
    kv_stride: int = 4  # of the first stage; halves at every transition, not below 1
    fusion_mlp_ratio: float = 2.0  # PySlowFast's PRE_Q_FUSION "concat_linear_2"
    drop_rate: float = 0.0  # dropout before the classifier
    drop_path_rate: float = 0.0
    engine: str = "reversible"
    mean: Tuple[float, ...] = IMAGENET_DEFAULT_MEAN
    std: Tuple[float, ...] = IMAGENET_DEFAULT_STD


class RevMViTv1Block(ReversibleBlock):
    """Reversible block: F = LayerNorm + pooling attention (keys and values pooled), G =
    LayerNorm + MLP. Tokens ``(B, H*W, C)``; the stack passes ``hw=(H, W)``.

    Args:
        dim: width C of each stream.
        num_heads: attention heads.
        kv_stride: key/value pooling stride.
        mlp_ratio: MLP hidden width over ``dim``.
        qkv_bias: bias in the query, key and value maps.
        pool_kernel: kernel of the pooling convolutions (3 sides for video: the stack then
            passes ``hw=(T, H, W)``).
        drop_path: stochastic-depth rate of both branches.
        separate_qkv: separate q, k and v maps (False: one qkv map, as the video model).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kv_stride: Union[int, Tuple[int, ...]],
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        pool_kernel: Union[int, Tuple[int, ...]] = 3,
        drop_path: float = 0.0,
        separate_qkv: bool = True,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiScaleAttention(
            dim, num_heads, qkv_bias, pool_kernel, 1, kv_stride, separate_qkv=separate_qkv
        )
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def f(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        return self.drop_path1(self.attn(self.norm1(x), hw)[0])

    def g(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        return self.drop_path2(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone (keys and values are pooled over the sample's own token map, and pooling
    # attention has no dropout), G on each token alone. Neither reads the map's layout beyond
    # ``hw``, so the splits hold for a (T, H, W) map of video tokens as for an (H, W) one.
    def f_split(self, x: torch.Tensor, hw: Tuple[int, ...]) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk, hw: Tuple[int, ...]) -> torch.Tensor:
        return drop_path(self.drop_path1, self.attn(self.norm1(x), hw)[0], chunk, dim=0)

    def g_split(self, x: torch.Tensor, hw: Tuple[int, ...]) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk, hw: Tuple[int, ...]) -> torch.Tensor:
        return drop_path(self.drop_path2, self.mlp(self.norm2(x), chunk), chunk)


class RevMViTv1Transition(MViTTransition):
    """The non-reversible block that opens a stage (NOTE [ Published Rev-MViT-B ]):
    ``(B, H, W, C) -> (B, ceil(H/2), ceil(W/2), C)``.

    Args:
        dim: width in and out (2C of the previous stage's streams).
        num_heads: attention heads (doubled from the previous stage).
        kv_stride: key/value pooling stride.
        mlp_ratio, qkv_bias, pool_kernel, drop_path: as in :class:`RevMViTv1Block`.
        fusion_mlp_ratio: hidden ratio of the residual MLP that fuses the two streams first;
            0 for none.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kv_stride: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        pool_kernel: int = 3,
        drop_path: float = 0.0,
        fusion_mlp_ratio: float = 2.0,
    ):
        super().__init__()
        self.fuse: nn.Module | None = None
        if fusion_mlp_ratio > 0:
            self.fuse = Mlp(dim, int(dim * fusion_mlp_ratio), act_layer=nn.GELU)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiScaleAttention(dim, num_heads, qkv_bias, pool_kernel, 2, kv_stride)
        self._init_mlp_branch(dim, mlp_ratio, drop_path)

    # In a sample: the fusion MLP, the pooled shortcut, pooling attention and the MLP.
    def forward_chunk(self, x: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
        """The block on ``chunk``'s samples of the batch (``None``: the whole batch)."""
        B, H, W, C = x.shape
        x = x.reshape(B, H * W, C)  # (B, N, C)
        if self.fuse is not None:
            x = x + self.fuse(x)  # no dropout: the same on a chunk of samples
        # The shortcut is pooled by the attention's own query convolution and norm (tied).
        shortcut, (Hq, Wq) = pool_heads(
            self.attn.split_heads(x), (H, W), self.attn.pool_q, self.attn.norm_q
        )  # (B, heads, N', hd)
        shortcut = shortcut.transpose(1, 2).reshape(B, Hq * Wq, C)  # (B, N', C)
        a, _ = self.attn(self.norm1(x), (H, W))  # (B, N', C)
        return self._residuals(shortcut, a, chunk).view(B, Hq, Wq, C)  # (B, H', W', C)


class RevMViTv1(RevMViTFamilyMixin, StageFeaturesMixin, ReversibleImageModelMixin, nn.Module):
    """The published reversible MViT (Rev-MViT-B).

    Args:
        cfg: the configuration; see :class:`RevMViTv1Config`.
    """

    def __init__(self, cfg: RevMViTv1Config):
        super().__init__()
        cfg = make_config(cfg, img_size=to_2tuple_int(cfg.img_size, "img_size"))
        check_family_config(cfg)
        self.cfg = cfg
        grid = self._init_patch_embed(cfg, cfg.img_size, f"img_size {cfg.img_size}")
        self.grid_size = grid
        self.pos_embed = nn.Parameter(torch.zeros(1, grid[0] * grid[1], cfg.embed_dim))
        self._build_stages(plan_stages(cfg, q_stride=2), lambda s: cfg.patch_stride * 2**s)
        self._set_image_pretrained_cfg(
            crop_pct=0.875 if cfg.img_size[0] >= 224 else 1.0, fixed_input_size=True
        )
        self._init_weights()

    def _make_transition(self, p: RevMViTStagePlan, path_rate: float, **common: Any) -> nn.Module:
        # Width 2C in and out: the previous stack's streams side by side.
        return RevMViTv1Transition(
            p.width,
            p.num_heads,
            p.kv_stride,  # type: ignore[arg-type]
            drop_path=path_rate,
            fusion_mlp_ratio=self.cfg.fusion_mlp_ratio,
            **common,
        )

    def _make_block(self, p: RevMViTStagePlan, path_rate: float, **common: Any) -> nn.Module:
        return RevMViTv1Block(p.width, p.num_heads, p.kv_stride, drop_path=path_rate, **common)

    def _init_weights(self) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        init_linears_(self.stages)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed"}

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        x = check_image(x, self.cfg.in_chans, img_size=self.cfg.img_size)
        x = maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing)  # (B, H, W, C)
        return x + self.pos_embed.view(1, *self.grid_size, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def checkpoint_filter(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """:func:`checkpoint_filter_fn` on this model (what ``pareprop.load_pretrained`` uses)."""
        return checkpoint_filter_fn(state, self)


_RENAMES = {
    "F.norm.": "norm1.",
    "F.attn.": "attn.",
    "G.norm.": "norm2.",
    "G.mlp.": "mlp.",
    "pre_q_fuse.fuse_fn.": "fuse.",
}


def checkpoint_filter_fn(
    state_dict: Dict[str, torch.Tensor], model: RevMViTv1
) -> Dict[str, torch.Tensor]:
    """Map PySlowFast's Rev-MViT state dict onto ``model``'s names.

    ``rev_backbone.layers.{i}`` becomes block ``i``'s module (:meth:`RevMViTv1.block_paths`);
    inside it ``F.norm -> norm1``, ``F.attn -> attn``, ``G.norm -> norm2``, ``G.mlp -> mlp``,
    ``pre_q_fuse.fuse_fn -> fuse``; ``head.projection -> head``. The pooling convolutions are
    stored as Conv3d over one frame, ``(hd, 1, 1, k, k)``, and lose that axis. Keys of no known
    layout are passed through, so that the strict check names them.
    """
    if not is_pyslowfast(state_dict, "Rev-MViT-B"):
        return state_dict
    if "pos_embed_temporal" in state_dict:
        raise PretrainedError(
            "the file has temporal position embeddings ('pos_embed_temporal'): it is the video "
            "Rev-MViT-B 16x4 (create 'rev_mvit_base_16x4'), not the image model"
        )
    return rename_pyslowfast(state_dict, model.block_paths(), _RENAMES, one_frame_convs=True)


# fmt: off
REV_MVIT_CONFIGS: Dict[str, RevMViTv1Config] = {
    # PySlowFast configs/ImageNet/REV_MVIT_B_16_CONV.yaml (39.7M params).
    "rev_mvit_base": RevMViTv1Config(),
}
# fmt: on


def _create(name: str, **overrides: Any) -> RevMViTv1:
    return RevMViTv1(make_config(REV_MVIT_CONFIGS[name], **overrides))


@register_model
def rev_mvit_base(**kwargs: Any) -> RevMViTv1:
    return _create("rev_mvit_base", **kwargs)
