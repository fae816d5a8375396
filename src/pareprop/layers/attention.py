"""Multi-head self-attention over a token sequence (ViT's attention)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pareprop.chunking import Chunk, dropout

__all__ = ["Attention", "attend", "head_rows", "head_columns"]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    heads: Optional[Chunk] = None,
) -> torch.Tensor:
    """Softmax attention of ``(B, heads, N, head_dim)`` queries, keys and values.

    ``attn_mask`` is boolean, True where a key may be attended to. Without dropout this is
    the fused kernel, which keeps the (N, N) weights out of memory. With dropout it is the
    explicit softmax, dropout and product: the fused kernels draw their masks in a way that
    depends on the backend they pick, and the backend may depend on whether the inputs
    require grad, which differs between a reversible engine's forward (no grad) and its
    recomputation. nn.Dropout's masks depend only on the generator state, which the engines
    replay exactly. ``heads``: the queries, keys and values are these heads of all of them;
    the dropout mask is then their slice of the mask for all heads.
    """
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, heads, N, N)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = dropout(scores.softmax(dim=-1), dropout_p, True, heads, dim=1)
    return weights @ v  # (B, heads, N, head_dim)


def head_rows(
    linear: nn.Linear, groups: int, num_heads: int, heads: Chunk
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Weight rows and bias of a projection whose output is ``groups`` blocks (q, k, v) of
    ``num_heads`` heads each, restricted to ``heads`` in every block."""
    w = linear.weight.unflatten(0, (groups, num_heads, -1))[:, heads.start:heads.stop]
    b = linear.bias
    if b is not None:
        b = b.unflatten(0, (groups, num_heads, -1))[:, heads.start:heads.stop].flatten()
    return w.flatten(0, 2), b


def head_columns(proj: nn.Linear, x: torch.Tensor, num_heads: int, heads: Chunk) -> torch.Tensor:
    """``heads``'s share of ``proj`` applied to all heads: ``x`` holds those heads' features,
    the weight's matching columns multiply them, and the bias joins the first chunk only, so
    the chunks' results sum to ``proj`` of all heads."""
    w = proj.weight.unflatten(1, (num_heads, -1))[:, heads.start:heads.stop].flatten(1)
    return F.linear(x, w, proj.bias if heads.first else None)


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

    def forward(self, x: torch.Tensor, heads: Optional[Chunk] = None) -> torch.Tensor:
        """``heads``: compute only these heads' share of the output (the shares of a chunked
        branch sum to the whole output; NOTE [ Chunked branches ] in pareprop/chunking.py)."""
        B, N, C = x.shape
        if heads is None:
            h, qkv = self.num_heads, self.qkv(x)
        else:
            h, qkv = heads.length, F.linear(x, *head_rows(self.qkv, 3, self.num_heads, heads))
        q, k, v = qkv.reshape(B, N, 3, h, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        # 3 x (B, h, N, head_dim)
        x = attend(q, k, v, dropout_p=self.attn_drop if self.training else 0.0, heads=heads)
        x = x.transpose(1, 2).reshape(B, N, h * self.head_dim)  # (B, N, h * head_dim)
        x = self.proj(x) if heads is None else head_columns(self.proj, x, self.num_heads, heads)
        return self.proj_drop(x)
