"""detectron2's MViTv2 backbone (``MViT``), its blocks that keep their shape made reversible.

Li, Wu, Fan, Mangalam, Xiong, Malik, Feichtenhofer, "MViTv2: Improved Multiscale Vision
Transformers for Classification and Detection" (CVPR 2022); detectron2's
``modeling/backbone/mvit.py``. Four stages over a ``(B, H/4, W/4, C)`` token map, the width and
heads doubled and the map halved (queries pooled with stride 2, a max-pooled and projected
shortcut) at the first block of every stage after the first. Every block pools its queries
(3x3 depthwise convolution, stride 1 but at a transition) and its keys and values (adaptive
stride: 4 in the first stage, halved per stage, doubled in the last block of the second and
third), adds the pooled queries back (residual pooling), uses decomposed relative positions,
and attends in windows (56 at stride 4, halved per stage, zero-padded) in every block but the
last of stages 2-4, which attend globally. Each stage's last map, normed (``scale{n}_norm``),
is an output: ``scale2`` .. ``scale5`` at strides 4 .. 32.

A block that keeps its shape (no pooled or projected shortcut) is two pre-norm residual
sub-layers and becomes a coupled block, F(x) = alpha x + drop_path(attn(norm1(x))),
G(y) = alpha y + drop_path(mlp(norm2(y))); each stage's run of them is a reversible stack
behind the stage's transition block, which stays as it is (NOTE [ Runs of blocks that keep
their shape ] in pareprop/convert/stages.py). At (alpha, beta) = (1, 0) it is detectron2's MViT.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import CoupledBlock, drop_path_samples
from pareprop.convert.source import keep_source_names
from pareprop.convert.stages import CoupledRuns
from pareprop.detection.detectron2._backbone import cfg_with, init_weights, pos_embed_table
from pareprop.detection.detectron2.layers import (
    PatchEmbed,
    abs_pos,
    attention,
    rel_pos_bias,
    window_partition,
    window_unpartition,
)
from pareprop.engine import ReversibleStack

__all__ = ["MViT", "MViTCfg", "MultiScaleAttention", "MultiScaleBlock", "mvit_cfg"]

Tensor = torch.Tensor


@dataclass
class MViTCfg:
    """detectron2's ``MViT`` arguments that projects/MViTv2's configurations use (defaults:
    MViTv2-T's, ``norm_layer`` LayerNorm with eps 1e-6)."""

    img_size: int = 224
    patch_kernel: Tuple[int, int] = (7, 7)
    patch_stride: Tuple[int, int] = (4, 4)
    patch_padding: Tuple[int, int] = (3, 3)
    in_chans: int = 3
    embed_dim: int = 96
    depth: int = 10
    num_heads: int = 1
    last_block_indexes: Tuple[int, ...] = (0, 2, 7, 9)
    qkv_pool_kernel: Tuple[int, int] = (3, 3)
    adaptive_kv_stride: int = 4
    adaptive_window_size: int = 56
    residual_pooling: bool = True
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_path_rate: float = 0.2
    norm_eps: float = 1e-6
    use_abs_pos: bool = False
    use_rel_pos: bool = True
    pretrain_img_size: int = 224
    pretrain_use_cls_token: bool = True

    def __post_init__(self) -> None:
        for name in ("patch_kernel", "patch_stride", "patch_padding", "qkv_pool_kernel",
                     "last_block_indexes"):
            setattr(self, name, tuple(int(v) for v in getattr(self, name)))
        last = self.last_block_indexes
        if (len(last) != 4 or list(last) != sorted(set(last)) or last[0] < 0
                or last[-1] != self.depth - 1):
            raise ValueError(
                f"expected 4 increasing last_block_indexes ending at depth - 1 = "
                f"{self.depth - 1}, got {last}")


def _pool(x: Tensor, pool: nn.Module, norm: Optional[nn.Module] = None) -> Tensor:
    """A pooling layer over the map of ``(B, H, W, C)`` tokens, then ``norm``."""
    x = pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B, H', W', C)
    return x if norm is None else norm(x)


class MultiScaleAttention(nn.Module):
    """Pooling attention over a ``(B, H, W, C)`` map, in windows when ``window_size`` > 0."""

    def __init__(self, dim: int, dim_out: int, num_heads: int, qkv_bias: bool = True,
                 norm_eps: float = 1e-6, pool_kernel: Tuple[int, int] = (3, 3),
                 stride_q: int = 1, stride_kv: int = 1, residual_pooling: bool = True,
                 window_size: int = 0, use_rel_pos: bool = True,
                 input_size: Tuple[int, int] = (56, 56), device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_heads = num_heads
        head_dim = dim_out // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim_out * 3, bias=qkv_bias, **kw)
        self.proj = nn.Linear(dim_out, dim_out, **kw)
        padding = [k // 2 for k in pool_kernel]
        for name, stride in (("q", stride_q), ("k", stride_kv), ("v", stride_kv)):
            # One depthwise kernel per head dimension, shared by the heads.
            setattr(self, f"pool_{name}", nn.Conv2d(head_dim, head_dim, pool_kernel,
                                                    stride=stride, padding=padding,
                                                    groups=head_dim, bias=False, **kw))
            setattr(self, f"norm_{name}", nn.LayerNorm(head_dim, eps=norm_eps, **kw))
        self.window_size = window_size
        self.q_win_size = window_size // stride_q if window_size else 0
        self.kv_win_size = window_size // stride_kv if window_size else 0
        self.residual_pooling = residual_pooling
        self.use_rel_pos = use_rel_pos
        if use_rel_pos:
            if input_size[0] != input_size[1]:
                raise ValueError(f"expected a square input_size, got {tuple(input_size)}")
            length = 2 * max(input_size[0] // stride_q, input_size[0] // stride_kv) - 1
            self.rel_pos_h = nn.Parameter(torch.zeros(length, head_dim, **kw))
            self.rel_pos_w = nn.Parameter(torch.zeros(length, head_dim, **kw))

    def forward(self, x: Tensor) -> Tensor:
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H, W, 3, self.num_heads, -1).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.reshape(3, B * self.num_heads, H, W, -1).unbind(0)  # (B nH, H, W, hd)
        q = _pool(q, self.pool_q, self.norm_q)
        k = _pool(k, self.pool_k, self.norm_k)
        v = _pool(v, self.pool_v, self.norm_v)
        pooled_q = q
        if self.window_size:
            q, q_padded = window_partition(q, self.q_win_size)
            k, _ = window_partition(k, self.kv_win_size)
            v, _ = window_partition(v, self.kv_win_size)
            q_hw, kv_hw = (self.q_win_size,) * 2, (self.kv_win_size,) * 2
        else:
            q_hw, kv_hw = tuple(q.shape[1:3]), tuple(k.shape[1:3])
        q = q.reshape(q.shape[0], q_hw[0] * q_hw[1], -1)  # (N, Lq, hd)
        k = k.reshape(k.shape[0], kv_hw[0] * kv_hw[1], -1)
        v = v.reshape(v.shape[0], kv_hw[0] * kv_hw[1], -1)
        bias = (rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, q_hw, kv_hw)
                if self.use_rel_pos else None)
        x = attention(q, k, v, self.scale, bias).view(-1, q_hw[0], q_hw[1], q.shape[-1])
        if self.window_size:
            x = window_unpartition(x, self.q_win_size, q_padded, tuple(pooled_q.shape[1:3]))
        if self.residual_pooling:
            x = x + pooled_q
        H, W = x.shape[1], x.shape[2]
        x = x.view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


class MultiScaleBlock(nn.Module):
    """detectron2's MViT block: ``x, size = block(x, size)`` on ``(B, H, W, C)`` maps.

    ``proj`` (a wider stage) and ``pool_skip`` (pooled queries) are None unless the block
    needs them; a block with neither keeps its shape (:func:`keeps_shape`)."""

    def __init__(self, dim: int, dim_out: int, num_heads: int, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop_path: float = 0.0, norm_eps: float = 1e-6,
                 qkv_pool_kernel: Tuple[int, int] = (3, 3), stride_q: int = 1,
                 stride_kv: int = 1, residual_pooling: bool = True, window_size: int = 0,
                 use_rel_pos: bool = True, input_size: Tuple[int, int] = (56, 56),
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **kw)
        self.attn = MultiScaleAttention(dim, dim_out, num_heads, qkv_bias, norm_eps,
                                        qkv_pool_kernel, stride_q, stride_kv, residual_pooling,
                                        window_size, use_rel_pos, input_size, **kw)
        # One module for both branches, as detectron2's block (two draws a block).
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim_out, eps=norm_eps, **kw)
        self.mlp = Mlp(dim_out, int(dim_out * mlp_ratio), dim_out, **kw)
        self.proj = nn.Linear(dim, dim_out, **kw) if dim != dim_out else None
        self.pool_skip = (nn.MaxPool2d(stride_q + 1, stride_q, (stride_q + 1) // 2)
                          if stride_q > 1 else None)

    def forward(self, x: Tensor, size: Optional[Sequence[int]] = None
                ) -> Tuple[Tensor, Tuple[int, int]]:
        x_norm = self.norm1(x)
        x_block = self.attn(x_norm)
        if self.proj is not None:
            x = self.proj(x_norm)
        if self.pool_skip is not None:
            x = _pool(x, self.pool_skip)
        x = x + self.drop_path(x_block)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x, (x.shape[1], x.shape[2])


def keeps_shape(block: MultiScaleBlock) -> bool:
    """Whether ``block`` is ``x + H1(x)`` then ``x + H2(x)``: no projected or pooled shortcut."""
    return block.proj is None and block.pool_skip is None


_BRANCH_PARTS = ("norm1", "attn", "drop_path", "norm2", "mlp")


class CoupledMultiScaleBlock(CoupledBlock):
    """A :class:`MultiScaleBlock` that keeps its shape, as a coupling with skip scale beta:
    F(x) = alpha x + drop_path(attn(norm1(x))), G(y) = alpha y + drop_path(mlp(norm2(y))).
    Shares the block's modules. ``hw``, the map's size the stage passes, is in ``x``'s shape
    already."""

    def __init__(self, block: MultiScaleBlock):
        super().__init__(**{name: getattr(block, name) for name in _BRANCH_PARTS})

    def f(self, x: Tensor, hw: Tuple[int, int]) -> Tensor:
        return self.alpha * x + self.drop_path(self.attn(self.norm1(x)))

    def g(self, x: Tensor, hw: Tuple[int, int]) -> Tensor:
        return self.alpha * x + self.drop_path(self.mlp(self.norm2(x)))

    # F acts on each sample alone (its pooling and windows are the sample's own); G on each
    # row of tokens alone.
    def f_split(self, x: Tensor, hw: Tuple[int, int]) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: Tensor, chunk: Chunk, hw: Tuple[int, int]) -> Tensor:
        return self.alpha * x + drop_path_samples(self.drop_path, self.attn(self.norm1(x)),
                                                  chunk)

    def g_split(self, x: Tensor, hw: Tuple[int, int]) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: Tensor, chunk: Chunk, hw: Tuple[int, int]) -> Tensor:
        # timm's drop-path draws one value per sample: on a chunk of rows, the whole draw.
        return self.alpha * x + self.drop_path(self.mlp(self.norm2(x)))


def _build_blocks(cfg: MViTCfg, **kw) -> Tuple[List[MultiScaleBlock], List[int], List[int]]:
    """detectron2's blocks for ``cfg``, with each output stage's width and stride."""
    last = cfg.last_block_indexes
    dpr = [x.item() for x in torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu")]
    embed_dim = dim_out = cfg.embed_dim
    num_heads = cfg.num_heads
    stride_kv, window = cfg.adaptive_kv_stride, cfg.adaptive_window_size
    input_size = (cfg.img_size // cfg.patch_stride[0], cfg.img_size // cfg.patch_stride[1])
    stride = cfg.patch_stride[0]
    blocks, widths, strides = [], [], []
    for i in range(cfg.depth):
        # kv pooled twice as much in the (global) last block of the second and third stages;
        # windows everywhere but the last block of stages 2-4; a stage's first block pools
        # queries with the previous stage's window and table sizes.
        block_kv = stride_kv * 2 if i in (last[1], last[2]) else stride_kv
        blocks.append(MultiScaleBlock(
            embed_dim, dim_out, num_heads, cfg.mlp_ratio, cfg.qkv_bias, dpr[i], cfg.norm_eps,
            cfg.qkv_pool_kernel, 2 if i - 1 in last else 1, block_kv, cfg.residual_pooling,
            0 if i in last[1:] else window, cfg.use_rel_pos, input_size, **kw))
        embed_dim = dim_out
        if i in last:
            widths.append(dim_out)
            strides.append(stride)
            dim_out *= 2
            num_heads *= 2
            stride_kv = max(stride_kv // 2, 1)
            stride *= 2
        if i - 1 in last:
            window //= 2
            input_size = (input_size[0] // 2, input_size[1] // 2)
    return blocks, widths, strides


class MViT(nn.Module):
    """detectron2's ``MViT`` with ``out_features`` scale2 .. scale5, each stage's blocks that
    keep their shape a reversible stack.

    ``forward(images)`` returns an ordered dict ``scale2`` .. ``scale5`` of ``(B, C, H, W)``
    maps. The state dict has detectron2's names (``blocks.5.attn.qkv.weight``,
    ``scale3_norm.weight``); parameters are named by the stages' parts
    (``stages.2.parts.1.blocks.0...``).
    """

    def __init__(self, cfg: MViTCfg, engine: str = "reversible", device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg.patch_kernel, cfg.patch_stride, cfg.patch_padding,
                                      cfg.in_chans, cfg.embed_dim, **kw)
        grid = ((cfg.pretrain_img_size // cfg.patch_stride[0])
                * (cfg.pretrain_img_size // cfg.patch_stride[1]))
        self.pos_embed = pos_embed_table(cfg.use_abs_pos, grid, cfg.pretrain_use_cls_token,
                                         cfg.embed_dim, **kw)
        blocks, widths, strides = _build_blocks(cfg, **kw)
        bounds = [0] + [i + 1 for i in cfg.last_block_indexes]
        self.stages = nn.ModuleList(
            CoupledRuns(blocks[a:b], keeps_shape, CoupledMultiScaleBlock, engine,
                        size_keyword="hw")
            for a, b in zip(bounds, bounds[1:]))
        self.out_features = [f"scale{s + 2}" for s in range(4)]
        for name, width in zip(self.out_features, widths):
            self.add_module(f"{name}_norm", nn.LayerNorm(width, eps=cfg.norm_eps, **kw))
        self.out_feature_channels = dict(zip(self.out_features, widths))
        self.out_feature_strides = dict(zip(self.out_features, strides))
        if device is None or torch.device(device).type != "meta":
            # Pooling convolutions keep PyTorch's initialisation, tables stay zero.
            init_weights(self.modules(), self.pos_embed)
        renames = []
        for s, (stage, start) in enumerate(zip(self.stages, bounds)):
            for p, indices in enumerate(stage.source_indices):
                if not isinstance(stage.parts[p], ReversibleStack):
                    renames.append((f"stages.{s}.parts.{p}.", f"blocks.{start + indices[0]}."))
                else:
                    renames += [(f"stages.{s}.parts.{p}.blocks.{j}.", f"blocks.{start + i}.")
                                for j, i in enumerate(indices)]
        keep_source_names(self, renames)

    def stacks(self):
        return [stack for stage in self.stages for stack in stage.stacks()]

    def no_weight_decay(self) -> Set[str]:
        """The absolute and relative position tables (named as ``named_parameters`` names them),
        which detectron2's fine-tuning recipes keep out of weight decay."""
        return {n for n, _ in self.named_parameters()
                if n.endswith(("pos_embed", "rel_pos_h", "rel_pos_w"))}

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        x = self.patch_embed(x)  # (B, H, W, C)
        if self.pos_embed is not None:
            x = x + abs_pos(self.pos_embed, self.cfg.pretrain_use_cls_token, x.shape[1:3])
        size = (x.shape[1], x.shape[2])
        out: Dict[str, Tensor] = OrderedDict()
        for name, stage in zip(self.out_features, self.stages):
            x, size = stage(x, size)
            out[name] = getattr(self, f"{name}_norm")(x).permute(0, 3, 1, 2)  # (B, C, H, W)
        return out


def mvit_cfg(**overrides) -> MViTCfg:
    """A :class:`MViTCfg` with ``overrides`` (unknown names refused in one line)."""
    return cfg_with(MViTCfg, "MViT", overrides)
