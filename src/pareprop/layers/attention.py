"""Multi-head self-attention over a token sequence (ViT's attention)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from pareprop.chunking import Chunk, dropout

__all__ = ["Attention", "attend"]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    chunk: Optional[Chunk] = None,
) -> torch.Tensor:
    """Softmax attention of ``(B, heads, N, head_dim)`` queries, keys and values.

    ``attn_mask`` is boolean, True where a key may be attended to. Without dropout this is
    the fused kernel, which keeps the (N, N) weights out of memory. With dropout it is the
    explicit softmax, dropout and product: the fused kernels draw their masks in a way that
    depends on the backend they pick, and the backend may depend on whether the inputs
    require grad, which differs between a reversible engine's forward (no grad) and its
    recomputation. nn.Dropout's masks depend only on the generator state, which the engines
    replay exactly. ``chunk``: the inputs are that chunk of the batch, whose dropout mask is
    its slice of the whole batch's (NOTE [ Exact randomness in chunks ] in
    pareprop/chunking.py).
    """
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, heads, N, N)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = dropout(scores.softmax(dim=-1), dropout_p, True, chunk, dim=0)
    return weights @ v  # (B, heads, N, head_dim)


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

    def forward(self, x: torch.Tensor, chunk: Optional[Chunk] = None) -> torch.Tensor:
        """``chunk``: ``x`` is that chunk of the batch (for its dropout masks)."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, N, head_dim)
        x = attend(q, k, v, dropout_p=self.attn_drop if self.training else 0.0, chunk=chunk)
        x = x.transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return dropout(self.proj(x), self.proj_drop.p, self.training, chunk, dim=0)
