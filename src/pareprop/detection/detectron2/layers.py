"""The layers detectron2's ViT and MViT backbones share, written from its published architecture
(``detectron2/modeling/backbone/utils.py``; Li et al., "Exploring Plain Vision Transformer
Backbones for Object Detection", ECCV 2022, and "MViTv2", CVPR 2022).

Token maps are ``(B, H, W, C)`` throughout, as detectron2 keeps them.

* windows: a map cut into ``w x w`` windows after zero padding at the bottom and right
  (:func:`window_partition`), and put back with the padding dropped
  (:func:`window_unpartition`);
* decomposed relative positions (MViTv2): an attention bias ``q . R_h[i_q - i_k]`` plus
  ``q . R_w[j_q - j_k]`` from one table per axis, resized linearly when the table was made for
  another size, with coordinates stretched when queries and keys differ in size
  (:func:`rel_pos_bias`);
* absolute positions made for the pretraining grid (class-token slot included), resized
  bicubically to the map (:func:`abs_pos`);
* the patch embedding (a convolution, then channels last), a LayerNorm over the channels of a
  ``(B, C, H, W)`` map, and a convolution followed by an optional norm (detectron2's
  ``Conv2d(norm=...)``, whose norm is the submodule ``norm``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ChannelLayerNorm", "ConvNorm", "PatchEmbed", "abs_pos", "attention", "rel_pos_bias",
    "rel_pos_table", "window_partition", "window_unpartition",
]

Tensor = torch.Tensor


def window_partition(x: Tensor, window: int) -> Tuple[Tensor, Tuple[int, int]]:
    """``(B, H, W, C)`` -> ``(B * nW, window, window, C)`` and the padded ``(Hp, Wp)``; the map
    is zero-padded at the bottom and right up to a multiple of ``window``."""
    B, H, W, C = x.shape
    pad_h, pad_w = (-H) % window, (-W) % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window, window, Wp // window, window, C)  # (B, nh, w, nw, w, C)
    return x.transpose(2, 3).reshape(-1, window, window, C), (Hp, Wp)


def window_unpartition(windows: Tensor, window: int, padded: Tuple[int, int],
                       size: Tuple[int, int]) -> Tensor:
    """The inverse of :func:`window_partition`: ``(B * nW, w, w, C)`` -> ``(B, H, W, C)``."""
    (Hp, Wp), (H, W) = padded, size
    B = windows.shape[0] // ((Hp // window) * (Wp // window))
    x = windows.view(B, Hp // window, Wp // window, window, window, -1)  # (B, nh, nw, w, w, C)
    x = x.transpose(2, 3).reshape(B, Hp, Wp, -1)
    if Hp > H or Wp > W:
        x = x[:, :H, :W].contiguous()
    return x


def rel_pos_table(q_size: int, k_size: int, table: Tensor) -> Tensor:
    """``(q_size, k_size, C)``: the table's row for every query-key offset along one axis.

    The table holds ``2 * max(q, k) - 1`` rows for the size it was made for; another size
    resizes it linearly (``align_corners=False``). When queries and keys differ in size, the
    shorter axis's coordinates are stretched to the longer's, so a pooled axis indexes the
    offsets it covers."""
    length = 2 * max(q_size, k_size) - 1
    if table.shape[0] != length:
        table = F.interpolate(table.t().unsqueeze(0), size=length, mode="linear")  # (1, C, L)
        table = table.squeeze(0).t()  # (L, C)
    q_scale, k_scale = max(k_size / q_size, 1.0), max(q_size / k_size, 1.0)
    q_coords = torch.arange(q_size, device=table.device)[:, None] * q_scale
    k_coords = torch.arange(k_size, device=table.device)[None, :] * k_scale
    offsets = (q_coords - k_coords) + (k_size - 1) * k_scale  # (q, k), in [0, length)
    return table[offsets.long()]


def rel_pos_bias(q: Tensor, table_h: Tensor, table_w: Tensor, q_size: Tuple[int, int],
                 k_size: Tuple[int, int]) -> Tensor:
    """Decomposed relative positions as an attention bias ``(N, qh * qw, kh * kw)`` for the
    unscaled queries ``q`` ``(N, qh * qw, C)``."""
    (qh, qw), (kh, kw) = q_size, k_size
    Rh = rel_pos_table(qh, kh, table_h)  # (qh, kh, C)
    Rw = rel_pos_table(qw, kw, table_w)  # (qw, kw, C)
    r_q = q.reshape(q.shape[0], qh, qw, q.shape[-1])  # (N, qh, qw, C)
    rel_h = torch.einsum("nhwc,hkc->nhwk", r_q, Rh)  # (N, qh, qw, kh)
    rel_w = torch.einsum("nhwc,wkc->nhwk", r_q, Rw)  # (N, qh, qw, kw)
    bias = rel_h[..., :, None] + rel_w[..., None, :]  # (N, qh, qw, kh, kw)
    return bias.reshape(q.shape[0], qh * qw, kh * kw)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
              bias: Optional[Tensor] = None) -> Tensor:
    """``softmax(scale * q k^T + bias) v`` for ``(N, L, C)`` queries, keys and values, as
    detectron2 computes it (the queries scaled first, the bias added to the logits)."""
    logits = (q * scale) @ k.transpose(-2, -1)  # (N, Lq, Lk)
    if bias is not None:
        logits = logits + bias
    return logits.softmax(dim=-1) @ v


def abs_pos(table: Tensor, has_cls_token: bool, size: Tuple[int, int]) -> Tensor:
    """``(1, H, W, C)``: absolute positions ``(1, N, C)`` made for a square pretraining grid
    (after a class-token slot, dropped, when ``has_cls_token``), resized bicubically
    (``align_corners=False``) when the map is another size."""
    H, W = size
    if has_cls_token:
        table = table[:, 1:]
    side = int(math.sqrt(table.shape[1]))
    if side * side != table.shape[1]:
        raise ValueError(f"expected a square grid of absolute positions, got {table.shape[1]}")
    if (side, side) == (H, W):
        return table.reshape(1, H, W, -1)
    grid = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)  # (1, C, s, s)
    grid = F.interpolate(grid, size=(H, W), mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1)  # (1, H, W, C)


class PatchEmbed(nn.Module):
    """Images ``(B, 3, H, W)`` to a token map ``(B, H', W', C)`` by one convolution ``proj``."""

    def __init__(self, kernel_size: Tuple[int, int], stride: Tuple[int, int],
                 padding: Tuple[int, int] = (0, 0), in_chans: int = 3, embed_dim: int = 768,
                 device=None, dtype=None):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size, stride=stride, padding=padding,
                              device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).permute(0, 2, 3, 1)  # (B, H, W, C)


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of a ``(B, C, H, W)`` map, computed as detectron2's ``LN``
    (mean and biased variance over dim 1, eps 1e-6)."""

    def __init__(self, channels: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNorm(nn.Conv2d):
    """A convolution followed by ``norm`` (None: none), as detectron2's ``Conv2d(norm=...)``:
    the norm's parameters are named ``<conv>.norm.weight``."""

    def __init__(self, *args, norm: Optional[nn.Module] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = norm

    def forward(self, x: Tensor) -> Tensor:
        x = super().forward(x)
        return x if self.norm is None else self.norm(x)
