"""Multi-head self-attention over a token sequence (ViT's attention)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Attention"]


class Attention(nn.Module):
    """Multi-head self-attention, ``(B, N, C) -> (B, N, C)``.

    Args:
        dim: token width.
        num_heads: heads; must divide ``dim``.
        qkv_bias: bias in the query/key/value projection.
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after the output projection.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(
                f"expected dim divisible by num_heads, got dim={dim}, heads={num_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, N, head_dim)
        # The fused kernel keeps the (N, N) weights out of memory; its dropout draws from the
        # global generator, which the reversible engines replay in recomputation.
        x = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0.0
        )
        x = x.transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return self.proj_drop(self.proj(x))
