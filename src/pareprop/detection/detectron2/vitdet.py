"""ViTDet's plain ViT backbone (detectron2's ``ViT``), its blocks made a reversible stack.

Li, Mao, Girshick, He, "Exploring Plain Vision Transformer Backbones for Object Detection"
(ECCV 2022); detectron2's ``modeling/backbone/vit.py``. A ViT over a ``(B, H/16, W/16, C)``
token map: absolute positions made at the pretraining size (224) resized to the map, blocks
with window attention (windows of 14, zero-padded) or global attention, both with decomposed
relative positions, and no final norm. Each block is two pre-norm residual sub-layers

    x = x + drop_path(attn(norm1(x)))        (in windows or global)
    x = x + drop_path(mlp(norm2(x)))

and becomes a coupled block of the dual-residual coupling (docs/convert.md, "The coupling"):
F(x) = alpha x + drop_path(attn(norm1(x))), G(y) = alpha y + drop_path(mlp(norm2(y))); the
whole depth is one :class:`~pareprop.ReversibleStack` started from (x, x) whose ``Y2`` is the
map the pyramid reads. At (alpha, beta) = (1, 0) it is detectron2's ViT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Set, Tuple

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import CoupledBlock, drop_path_samples
from pareprop.convert.source import keep_source_names
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

__all__ = ["Attention", "ViT", "ViTBlock", "ViTCfg", "vit_cfg"]

Tensor = torch.Tensor


@dataclass
class ViTCfg:
    """detectron2's ``ViT`` arguments that its ViTDet configurations use (the defaults:
    ViT-B at 1024, windows of 14 in every block but 2, 5, 8, 11)."""

    img_size: int = 1024
    patch_size: int = 16
    in_chans: int = 3
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_path_rate: float = 0.1
    norm_eps: float = 1e-6
    use_abs_pos: bool = True
    use_rel_pos: bool = True
    window_size: int = 14
    window_block_indexes: Tuple[int, ...] = (0, 1, 3, 4, 6, 7, 9, 10)
    pretrain_img_size: int = 224
    pretrain_use_cls_token: bool = True

    def __post_init__(self) -> None:
        self.window_block_indexes = tuple(int(i) for i in self.window_block_indexes)
        bad = [i for i in self.window_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"expected window_block_indexes in [0, {self.depth}), got {bad}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"expected embed_dim divisible by num_heads, got {self.embed_dim} "
                             f"and {self.num_heads}")


class Attention(nn.Module):
    """Multi-head attention over a ``(B, H, W, C)`` map (a window or the whole map), with
    decomposed relative positions whose tables are made for ``input_size``."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True,
                 use_rel_pos: bool = True, input_size: Tuple[int, int] = (14, 14),
                 device=None, dtype=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, device=device, dtype=dtype)
        self.proj = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.use_rel_pos = use_rel_pos
        if use_rel_pos:  # zero-initialised, as detectron2's configurations leave them
            self.rel_pos_h = nn.Parameter(
                torch.zeros(2 * input_size[0] - 1, head_dim, device=device, dtype=dtype))
            self.rel_pos_w = nn.Parameter(
                torch.zeros(2 * input_size[1] - 1, head_dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)  # (B nH, HW, hd)
        bias = (rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, (H, W), (H, W))
                if self.use_rel_pos else None)
        x = attention(q, k, v, self.scale, bias)  # (B nH, HW, hd)
        x = x.view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


class ViTBlock(CoupledBlock):
    """A ViTDet block as a coupling with skip scale beta:
    F(x) = alpha x + drop_path(attn(norm1(x))) (in windows when ``window_size`` > 0),
    G(y) = alpha y + drop_path(mlp(norm2(y))). Parameters under detectron2's names."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop_path: float = 0.0, norm_eps: float = 1e-6,
                 use_rel_pos: bool = True, window_size: int = 0,
                 input_size: Tuple[int, int] = (64, 64), device=None, dtype=None):
        kw = dict(device=device, dtype=dtype)
        super().__init__(
            norm1=nn.LayerNorm(dim, eps=norm_eps, **kw),
            attn=Attention(dim, num_heads, qkv_bias, use_rel_pos,
                           input_size if window_size == 0 else (window_size, window_size), **kw),
            # One module for both branches, as detectron2's block (two draws a block).
            drop_path=DropPath(drop_path) if drop_path > 0.0 else nn.Identity(),
            norm2=nn.LayerNorm(dim, eps=norm_eps, **kw),
            mlp=Mlp(dim, int(dim * mlp_ratio), **kw),
        )
        self.window_size = window_size

    def _attend(self, x: Tensor) -> Tensor:
        x = self.norm1(x)
        if self.window_size == 0:
            return self.attn(x)
        H, W = x.shape[1], x.shape[2]
        windows, padded = window_partition(x, self.window_size)  # (B nW, w, w, C)
        return window_unpartition(self.attn(windows), self.window_size, padded, (H, W))

    def f(self, x: Tensor) -> Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum detectron2 computes (1.0 * x is x).
        return self.alpha * x + self.drop_path(self._attend(x))

    def g(self, x: Tensor) -> Tensor:
        return self.alpha * x + self.drop_path(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone (its windows are the sample's own), G on each row of tokens alone.
    def f_split(self, x: Tensor) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: Tensor, chunk: Chunk) -> Tensor:
        return self.alpha * x + drop_path_samples(self.drop_path, self._attend(x), chunk)

    def g_split(self, x: Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: Tensor, chunk: Chunk) -> Tensor:
        # timm's drop-path draws one value per sample: on a chunk of rows, the whole draw.
        return self.alpha * x + self.drop_path(self.mlp(self.norm2(x)))


class ViT(nn.Module):
    """detectron2's ``ViT`` (``out_feature="last_feat"``), its blocks one reversible stack.

    ``forward(images)`` returns the last map ``(B, C, H/16, W/16)``. The state dict has
    detectron2's names (``blocks.3.attn.qkv.weight``); parameters are named by the stack
    (``stack.blocks.3...``).
    """

    def __init__(self, cfg: ViTCfg, engine: str = "reversible", device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embed = PatchEmbed((p, p), (p, p), in_chans=cfg.in_chans,
                                      embed_dim=cfg.embed_dim, **kw)
        grid = cfg.pretrain_img_size // p
        self.pos_embed = pos_embed_table(cfg.use_abs_pos, grid * grid,
                                         cfg.pretrain_use_cls_token, cfg.embed_dim, **kw)
        # detectron2's stochastic depth rule, float32 steps as torch.linspace makes them.
        dpr = [x.item() for x in torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu")]
        size = (cfg.img_size // p, cfg.img_size // p)
        self.stack = ReversibleStack([
            ViTBlock(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio, cfg.qkv_bias, dpr[i],
                     cfg.norm_eps, cfg.use_rel_pos,
                     cfg.window_size if i in cfg.window_block_indexes else 0, size, **kw)
            for i in range(cfg.depth)], engine=engine)
        self.out_channels = cfg.embed_dim
        self.stride = p
        if device is None or torch.device(device).type != "meta":
            # The relative-position tables stay zero.
            init_weights(self.stack.modules(), self.pos_embed)
        keep_source_names(self, [("stack.blocks.", "blocks.")])

    def no_weight_decay(self) -> Set[str]:
        """The absolute and relative position tables (named as ``named_parameters`` names them),
        which detectron2's fine-tuning recipes keep out of weight decay."""
        return {n for n, _ in self.named_parameters()
                if n.endswith(("pos_embed", "rel_pos_h", "rel_pos_w"))}

    @property
    def blocks(self) -> Sequence[ViTBlock]:
        return self.stack.blocks

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)  # (B, H, W, C)
        if self.pos_embed is not None:
            x = x + abs_pos(self.pos_embed, self.cfg.pretrain_use_cls_token, x.shape[1:3])
        _, x = self.stack(x, x)  # z_0 = z_1 = x; the pyramid reads z_{2L+1}
        return x.permute(0, 3, 1, 2)  # (B, C, H, W)


def vit_cfg(**overrides) -> ViTCfg:
    """A :class:`ViTCfg` with ``overrides`` (unknown names refused in one line)."""
    return cfg_with(ViTCfg, "ViT", overrides)
