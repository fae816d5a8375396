"""MViTv1 pooling attention (Fan et al., "Multiscale Vision Transformers", ICCV 2021), as the
published Rev-MViT-B uses it (Mangalam et al., "Reversible Vision Transformers", CVPR 2022).

Queries, keys and values come from three separate linear maps; keys and values are always
pooled (a depthwise convolution per head dimension, shared by the heads, then LayerNorm over
the head dimension), queries only where the map is downsampled. No relative positions, no
residual pooling, no windows: those are MViTv2's (see :mod:`pareprop.layers.pooling_attention`).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from pareprop.layers.attention import attend

__all__ = ["MultiScaleAttention", "pool_heads"]


def pool_heads(
    x: torch.Tensor, hw: Tuple[int, int], pool: nn.Conv2d, norm: nn.Module
) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """Pool per-head tokens ``(B, heads, H*W, head_dim)`` over their ``hw`` map with ``pool``
    (a depthwise convolution over the head dimension), then ``norm`` the head dimension.

    Returns:
        The pooled tokens ``(B, heads, H'*W', head_dim)`` and ``(H', W')``.
    """
    B, nh, N, hd = x.shape
    x = x.reshape(B * nh, hw[0], hw[1], hd).permute(0, 3, 1, 2)  # (B * heads, hd, H, W)
    x = pool(x)
    H, W = x.shape[-2:]
    x = x.reshape(B, nh, hd, H * W).transpose(2, 3)  # (B, heads, H'*W', hd)
    return norm(x), (H, W)


def _depthwise(head_dim: int, kernel: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(
        head_dim, head_dim, kernel, stride, kernel // 2, groups=head_dim, bias=False
    )


class MultiScaleAttention(nn.Module):
    """Multi-head pooling attention on tokens, ``(B, H*W, dim) -> (B, H'*W', dim)`` with
    ``H' = ceil(H / stride_q)``.

    Args:
        dim: token width (in and out).
        num_heads: heads; must divide ``dim``.
        qkv_bias: bias in the query, key and value maps.
        pool_kernel: odd kernel of the pooling convolutions.
        stride_q: query pooling stride; 1 means no query pooling (and no ``pool_q``).
        stride_kv: key/value pooling stride (keys and values are pooled even at stride 1).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        pool_kernel: int = 3,
        stride_q: int = 1,
        stride_kv: int = 1,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"expected dim divisible by num_heads, got {dim} and {num_heads}")
        if pool_kernel % 2 != 1:
            raise ValueError(f"expected an odd pool_kernel, got {pool_kernel}")
        self.num_heads = num_heads
        self.head_dim = head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.pool_q: nn.Conv2d | None = None
        self.norm_q: nn.LayerNorm | None = None
        if stride_q > 1:
            self.pool_q = _depthwise(head_dim, pool_kernel, stride_q)
            self.norm_q = nn.LayerNorm(head_dim, eps=1e-6)
        self.pool_k = _depthwise(head_dim, pool_kernel, stride_kv)
        self.norm_k = nn.LayerNorm(head_dim, eps=1e-6)
        self.pool_v = _depthwise(head_dim, pool_kernel, stride_kv)
        self.norm_v = nn.LayerNorm(head_dim, eps=1e-6)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, dim) -> (B, heads, N, head_dim)``."""
        B, N, _ = x.shape
        return x.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, hw: Tuple[int, int]
    ) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Returns the output tokens and their map ``(H', W')``."""
        B = x.shape[0]
        q = self.split_heads(self.q(x))  # (B, heads, N, hd)
        k = self.split_heads(self.k(x))
        v = self.split_heads(self.v(x))
        q_hw = hw
        if self.pool_q is not None:
            q, q_hw = pool_heads(q, hw, self.pool_q, self.norm_q)  # (B, heads, Nq, hd)
        k, _ = pool_heads(k, hw, self.pool_k, self.norm_k)  # (B, heads, Nk, hd)
        v, _ = pool_heads(v, hw, self.pool_v, self.norm_v)
        out = attend(q, k, v)  # (B, heads, Nq, hd)
        out = out.transpose(1, 2).reshape(B, -1, self.num_heads * self.head_dim)  # (B, Nq, dim)
        return self.proj(out), q_hw
