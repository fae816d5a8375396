"""MViTv2 pooling attention (Li et al., "MViTv2: Improved Multiscale Vision Transformers for
Classification and Detection", CVPR 2022).

Queries, keys and values are each pooled by a depthwise convolution and normalized over the
head dimension; attention may run inside windows; a decomposed relative position bias is added
to the logits; the pooled query is added back to the output (residual pooling).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_

__all__ = [
    "PoolingAttention",
    "window_partition",
    "window_unpartition",
    "rel_pos_table",
    "add_decomposed_rel_pos",
    "pooled_size",
]


def pooled_size(size: int, stride: int) -> int:
    """Length after pooling with an odd kernel, padding kernel // 2 and ``stride``."""
    return math.ceil(size / stride)


def window_partition(x: torch.Tensor, window: int) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """Split ``(B, H, W, C)`` into ``(B * nW, window, window, C)``, zero-padding H and W up to
    a multiple of ``window``. Returns the windows and the padded size ``(Hp, Wp)``."""
    B, H, W, C = x.shape
    pad_h, pad_w = (-H) % window, (-W) % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window, window, Wp // window, window, C)
    nW = (Hp // window) * (Wp // window)  # explicit sizes: a batch of 0 has no -1 to infer
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * nW, window, window, C)  # (B * nW, w, w, C)
    return x, (Hp, Wp)


def window_unpartition(
    windows: torch.Tensor, window: int, padded_hw: Tuple[int, int], hw: Tuple[int, int]
) -> torch.Tensor:
    """Inverse of :func:`window_partition`: ``(B * nW, w, w, C) -> (B, H, W, C)``, cropped."""
    Hp, Wp = padded_hw
    nh, nw = Hp // window, Wp // window
    B, C = windows.shape[0] // (nh * nw), windows.shape[-1]
    x = windows.reshape(B, nh, nw, window, window, C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)  # (B, Hp, Wp, C)
    return x[:, : hw[0], : hw[1]]


def rel_pos_table(table: torch.Tensor, q_size: int, k_size: int) -> torch.Tensor:
    """Relative position embeddings ``(q_size, k_size, dim)`` for one axis.

    ``table`` holds ``2 * max(q_size, k_size) - 1`` rows; a table of another length (learned at
    another resolution) is resized linearly. When q and k differ in size, positions are scaled
    to the finer of the two grids so that equal image offsets share an embedding.
    """
    length = 2 * max(q_size, k_size) - 1
    if table.shape[0] != length:
        resized = F.interpolate(table.t().unsqueeze(0), size=length, mode="linear")
        table = resized.squeeze(0).t()  # (length, dim)
    q_scale = max(k_size / q_size, 1.0)
    k_scale = max(q_size / k_size, 1.0)
    q_pos = torch.arange(q_size, device=table.device)[:, None] * q_scale
    k_pos = torch.arange(k_size, device=table.device)[None, :] * k_scale
    index = (q_pos - k_pos + (k_size - 1) * k_scale).long()  # (q_size, k_size), in [0, length)
    return table[index]


def add_decomposed_rel_pos(
    attn: torch.Tensor,
    q: torch.Tensor,
    rel_pos_h: torch.Tensor,
    rel_pos_w: torch.Tensor,
    q_hw: Tuple[int, int],
    k_hw: Tuple[int, int],
) -> torch.Tensor:
    """Add ``<q_i, R_h[dh]> + <q_i, R_w[dw]>`` to the logits.

    Args:
        attn: logits ``(N, qh * qw, kh * kw)``.
        q: queries ``(N, qh * qw, dim)``.
        rel_pos_h: table for the height axis.
        rel_pos_w: table for the width axis.
        q_hw: query grid.
        k_hw: key grid.
    """
    (qh, qw), (kh, kw) = q_hw, k_hw
    Rh = rel_pos_table(rel_pos_h, qh, kh)  # (qh, kh, dim)
    Rw = rel_pos_table(rel_pos_w, qw, kw)  # (qw, kw, dim)
    N = q.shape[0]
    r_q = q.reshape(N, qh, qw, q.shape[-1])  # (N, qh, qw, dim)
    bias_h = torch.einsum("nhwc,hkc->nhwk", r_q, Rh)  # (N, qh, qw, kh)
    bias_w = torch.einsum("nhwc,wkc->nhwk", r_q, Rw)  # (N, qh, qw, kw)
    attn = attn.view(N, qh, qw, kh, kw)  # (N, qh, qw, kh, kw)
    attn = attn + bias_h[..., :, None] + bias_w[..., None, :]
    return attn.view(N, qh * qw, kh * kw)


class PoolingAttention(nn.Module):
    """Multi-head pooling attention on channels-last maps, ``(B, H, W, dim) ->
    (B, ceil(H / stride_q), ceil(W / stride_q), dim_out)``.

    Args:
        dim: input width.
        dim_out: output width (also the width of q, k and v).
        num_heads: heads; must divide ``dim_out``.
        qkv_bias: bias in the query/key/value projection.
        pool_kernel: odd kernel of the depthwise pooling convolutions.
        stride_q: query pooling stride (the output is downsampled by it).
        stride_kv: key/value pooling stride.
        window_size: attend within windows of this size (in input pixels); 0 for global.
            The map is zero-padded to a multiple of the window and the padded keys are masked
            out. A map that fits inside one window gets global attention.
        use_rel_pos: add the decomposed relative position bias.
        input_size: the expected input map ``(H, W)``; sizes the position tables (other sizes
            still work: the tables are resized).
        residual_pooling: add the pooled query to the attention output.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int,
        num_heads: int,
        qkv_bias: bool = True,
        pool_kernel: int = 3,
        stride_q: int = 1,
        stride_kv: int = 1,
        window_size: int = 0,
        use_rel_pos: bool = True,
        input_size: Tuple[int, int] | None = None,
        residual_pooling: bool = True,
    ):
        super().__init__()
        if dim_out % num_heads != 0:
            raise ValueError(
                f"expected dim_out divisible by num_heads, got dim_out={dim_out}, heads={num_heads}"
            )
        if pool_kernel % 2 != 1:
            raise ValueError(f"expected an odd pool_kernel, got {pool_kernel}")
        if window_size and (window_size % stride_q or window_size % stride_kv):
            raise ValueError(
                f"expected window_size divisible by stride_q={stride_q} and "
                f"stride_kv={stride_kv}, got {window_size}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim = dim_out // num_heads
        self.scale = head_dim**-0.5
        self.stride_q, self.stride_kv = stride_q, stride_kv
        self.window_size = window_size
        self.residual_pooling = residual_pooling

        self.qkv = nn.Linear(dim, 3 * dim_out, bias=qkv_bias)
        # Depthwise over the head dimension, shared by the heads (as in MViTv2).
        pad = pool_kernel // 2
        self.pool_q = nn.Conv2d(
            head_dim, head_dim, pool_kernel, stride_q, pad, groups=head_dim, bias=False
        )
        self.norm_q = nn.LayerNorm(head_dim, eps=1e-6)
        self.pool_k = nn.Conv2d(
            head_dim, head_dim, pool_kernel, stride_kv, pad, groups=head_dim, bias=False
        )
        self.norm_k = nn.LayerNorm(head_dim, eps=1e-6)
        self.pool_v = nn.Conv2d(
            head_dim, head_dim, pool_kernel, stride_kv, pad, groups=head_dim, bias=False
        )
        self.norm_v = nn.LayerNorm(head_dim, eps=1e-6)
        self.proj = nn.Linear(dim_out, dim_out)

        self.rel_pos_h: nn.Parameter | None = None
        self.rel_pos_w: nn.Parameter | None = None
        if use_rel_pos:
            if input_size is None and not window_size:
                raise ValueError("use_rel_pos with global attention needs input_size=(H, W)")
            H, W = input_size if input_size is not None else (window_size, window_size)
            if self._windowed(H, W):
                H = W = window_size
            len_h = 2 * max(pooled_size(H, stride_q), pooled_size(H, stride_kv)) - 1
            len_w = 2 * max(pooled_size(W, stride_q), pooled_size(W, stride_kv)) - 1
            self.rel_pos_h = nn.Parameter(torch.zeros(len_h, head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(len_w, head_dim))
            trunc_normal_(self.rel_pos_h, std=0.02)
            trunc_normal_(self.rel_pos_w, std=0.02)

    def _windowed(self, H: int, W: int) -> bool:
        return self.window_size > 0 and (H > self.window_size or W > self.window_size)

    @staticmethod
    def _pool(x: torch.Tensor, pool: nn.Conv2d, norm: nn.LayerNorm) -> torch.Tensor:
        x = pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B * heads, H', W', head_dim)
        return norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        nh, hd = self.num_heads, self.head_dim
        qkv = self.qkv(x).reshape(B, H, W, 3, nh, hd)
        qkv = qkv.permute(3, 0, 4, 1, 2, 5).reshape(3, B * nh, H, W, hd)
        q, k, v = qkv.unbind(0)  # 3 x (B * heads, H, W, head_dim)
        q = self._pool(q, self.pool_q, self.norm_q)  # (B * heads, Hq, Wq, head_dim)
        k = self._pool(k, self.pool_k, self.norm_k)  # (B * heads, Hk, Wk, head_dim)
        v = self._pool(v, self.pool_v, self.norm_v)
        q_map, k_map = tuple(q.shape[1:3]), tuple(k.shape[1:3])

        windowed = self._windowed(H, W)
        key_padding = None
        if windowed:
            # Pooling runs on the whole map (no seams at window borders); the pooled maps are
            # then cut into windows of window/stride, which tile them in the same number of
            # windows because the window is a multiple of both strides.
            wq = self.window_size // self.stride_q
            wk = self.window_size // self.stride_kv
            q, q_padded = window_partition(q, wq)  # (B * heads * nW, wq, wq, head_dim)
            k, k_padded = window_partition(k, wk)  # (B * heads * nW, wk, wk, head_dim)
            v, _ = window_partition(v, wk)
            if k_padded != k_map:
                ones = k.new_ones(1, *k_map, 1)
                key_padding = window_partition(ones, wk)[0].reshape(-1, wk * wk) == 0  # (nW, wk*wk)
        q_hw, k_hw = tuple(q.shape[1:3]), tuple(k.shape[1:3])
        q = q.reshape(q.shape[0], q_hw[0] * q_hw[1], hd)  # (N, Lq, head_dim)
        k = k.reshape(k.shape[0], k_hw[0] * k_hw[1], hd)  # (N, Lk, head_dim)
        v = v.reshape(v.shape[0], k_hw[0] * k_hw[1], hd)

        attn = (q * self.scale) @ k.transpose(-2, -1)  # (N, Lq, Lk)
        if self.rel_pos_h is not None:
            attn = add_decomposed_rel_pos(attn, q, self.rel_pos_h, self.rel_pos_w, q_hw, k_hw)
        if key_padding is not None:
            nW = key_padding.shape[0]
            attn = attn.view(attn.shape[0] // nW, nW, *attn.shape[1:])  # (B * heads, nW, Lq, Lk)
            attn = attn.masked_fill(key_padding[None, :, None, :], float("-inf"))
            attn = attn.flatten(0, 1)  # (N, Lq, Lk)
        attn = attn.softmax(dim=-1)
        out = attn @ v  # (N, Lq, head_dim)
        if self.residual_pooling:
            out = out + q
        out = out.reshape(out.shape[0], *q_hw, hd)  # (N, qh, qw, head_dim)
        if windowed:
            out = window_unpartition(out, q_hw[0], q_padded, q_map)  # (B * heads, Hq, Wq, hd)
        Hq, Wq = q_map
        out = out.reshape(B, nh, Hq, Wq, hd).permute(0, 2, 3, 1, 4).reshape(B, Hq, Wq, nh * hd)
        return self.proj(out)
