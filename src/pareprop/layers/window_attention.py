"""Window multi-head self-attention with a relative position bias, as in Swin.

Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", ICCV 2021.

Tokens are channels-last, ``(B, H, W, C)``. Attention runs inside non-overlapping
``window x window`` windows; the shifted variant rolls the map by ``shift`` first so that
neighbouring windows exchange information. Sizes that are not multiples of the window are
padded at the bottom and right; :func:`window_mask` keeps real tokens from attending to padding
and to tokens that the roll brought in from the opposite edge.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_

from pareprop.chunking import Chunk, dropout

__all__ = [
    "WindowAttention",
    "window_partition",
    "window_reverse",
    "window_mask",
    "padded_size",
]


def padded_size(size: int, window: int) -> int:
    """``size`` rounded up to a multiple of ``window``."""
    return -(-size // window) * window


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """Split ``(B, H, W, C)`` (H, W multiples of ``window``) into ``(B * nW, window**2, C)``."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C)
    x = x.permute(0, 1, 3, 2, 4, 5)  # (B, H/w, W/w, w, w, C)
    # Explicit sizes, never -1: a batch of 0 leaves nothing to infer it from.
    return x.reshape(B * (H // window) * (W // window), window * window, C)  # (B * nW, N, C)


def window_reverse(windows: torch.Tensor, window: int, H: int, W: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: ``(B * nW, window**2, C)`` -> ``(B, H, W, C)``."""
    C = windows.shape[-1]
    B = windows.shape[0] // ((H // window) * (W // window))
    x = windows.view(B, H // window, W // window, window, window, C)
    x = x.permute(0, 1, 3, 2, 4, 5)  # (B, H/w, w, W/w, w, C)
    return x.reshape(B, H, W, C)


def window_mask(
    H: int, W: int, window: int, shift: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """Which key each query may attend to, per window, for an ``H x W`` map.

    Args:
        H: Height of the map before padding.
        W: Width of the map before padding.
        window: Window side.
        shift: Cyclic shift applied before partitioning (0 for plain windows).
        device: Where to build the mask.

    Returns:
        ``(nW, N, N)`` boolean tensor, True where query i may attend to key j, for the padded,
        rolled and partitioned map; None when every token may attend to its whole window (no
        shift and no padding).
    """
    Hp, Wp = padded_size(H, window), padded_size(W, window)
    if shift == 0 and Hp == H and Wp == W:
        return None
    # NOTE [ region labels ]
    # Label every position of the padded map in its original frame, then move the labels
    # exactly as the features move (roll, partition). Tokens may attend to each other iff they
    # carry the same label. After the roll by -shift, rows [0, shift) wrap to the bottom edge,
    # next to rows they are not adjacent to in the image: they get their own label (same for
    # columns). Padding gets a label of its own, so real tokens never see padding, and a
    # padding query still sees at least itself (no all-masked softmax row, hence no NaN).
    rows = torch.arange(Hp, device=device)
    cols = torch.arange(Wp, device=device)
    labels = (rows < shift).long()[:, None] * 2 + (cols < shift).long()[None, :]  # (Hp, Wp)
    pad = (rows >= H)[:, None] | (cols >= W)[None, :]
    labels = labels.masked_fill(pad, 4)
    if shift > 0:
        labels = torch.roll(labels, shifts=(-shift, -shift), dims=(0, 1))
    labels = window_partition(labels[None, :, :, None], window).squeeze(-1)  # (nW, N)
    return labels[:, :, None] == labels[:, None, :]  # (nW, N, N)


class WindowAttention(nn.Module):
    """Multi-head self-attention within windows, with a learned relative position bias.

    The bias table holds one value per head for each of the ``(2 * window - 1) ** 2`` relative
    offsets between two positions of a window.

    Args:
        dim: Channels in and out.
        num_heads: Attention heads; must divide ``dim``.
        window: Window side (N = window**2 tokens per window).
        qkv_bias: Whether the qkv projection has a bias.
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window: int,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(
                f"expected dim divisible by num_heads, got dim={dim}, heads={num_heads}"
            )
        self.dim = dim
        self.num_heads = num_heads
        self.window = window
        self.scale = (dim // num_heads) ** -0.5

        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window - 1) ** 2, num_heads)
        )
        self.register_buffer(
            "relative_position_index", self._relative_position_index(window), persistent=False
        )
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        trunc_normal_(self.relative_position_bias_table, std=0.02)

    @staticmethod
    def _relative_position_index(window: int) -> torch.Tensor:
        coords = torch.stack(
            torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
        ).flatten(1)  # (2, N)
        rel = coords[:, :, None] - coords[:, None, :]  # (2, N, N), offsets in [-(w-1), w-1]
        rel = rel + (window - 1)  # shift to [0, 2w-2]
        return rel[0] * (2 * window - 1) + rel[1]  # (N, N)

    def relative_position_bias(self) -> torch.Tensor:
        """``(heads, N, N)`` bias added to the attention logits."""
        N = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(N, N, -1).permute(2, 0, 1)  # (heads, N, N)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, chunk: Optional[Chunk] = None
    ) -> torch.Tensor:
        """Attend within windows.

        Args:
            x: ``(B * nW, N, C)`` windows, as made by :func:`window_partition`.
            mask: Optional ``(nW, N, N)`` boolean mask from :func:`window_mask`.
            chunk: ``x`` holds that chunk of the batch's samples (for its dropout masks; NOTE
                [ Exact randomness in chunks ] in pareprop/chunking.py).

        Returns:
            ``(B * nW, N, C)``.
        """
        BnW, N, C = x.shape
        if N != self.window * self.window:
            raise ValueError(f"expected windows of {self.window**2} tokens, got {N}")
        q, k, v = self._heads(self.qkv(x))
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B*nW, heads, N, N)
        attn = attn + self.relative_position_bias().to(attn.dtype)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(BnW // nW, nW, self.num_heads, N, N)
            attn = attn.masked_fill(~mask[None, :, None], float("-inf"))
            attn = attn.view(BnW, self.num_heads, N, N)
        attn = dropout(F.softmax(attn, dim=-1), self.attn_drop.p, self.training, chunk, dim=0)
        x = (attn @ v).transpose(1, 2).reshape(BnW, N, C)  # (B*nW, N, C)
        return dropout(self.proj(x), self.proj_drop.p, self.training, chunk, dim=0)

    def _heads(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        BnW, N, C3 = qkv.shape
        qkv = qkv.view(BnW, N, 3, self.num_heads, C3 // (3 * self.num_heads))
        qkv = qkv.permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # each (B*nW, heads, N, head_dim)
