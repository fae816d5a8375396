"""MViTv1 pooling attention (Fan et al., "Multiscale Vision Transformers", ICCV 2021), as the
published Rev-MViT-B uses it (Mangalam et al., "Reversible Vision Transformers", CVPR 2022).

Queries, keys and values come from three separate linear maps; keys and values are always
pooled (a depthwise convolution per head dimension, shared by the heads, then LayerNorm over
the head dimension), queries only where the map is downsampled. No relative positions, no
residual pooling, no windows: those are MViTv2's (see :mod:`pareprop.layers.pooling_attention`).

One layer serves images and videos: the map is ``(H, W)`` or ``(T, H, W)``, and the pooling
convolutions are 2-D or 3-D to match (the kernel's length decides).
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import torch
import torch.fx
import torch.nn as nn

from pareprop.layers.attention import attend

__all__ = ["MultiScaleAttention", "pool_heads", "pooling_input"]

Size = Union[int, Sequence[int]]


# NOTE [ CPU bf16 depthwise Conv3d ]
#     pool_heads hands its convolution a channels-last view (``movedim`` of the heads' tokens,
#     no copy). On the CPU, torch's bfloat16 weight gradient of a depthwise Conv3d is wrong for
#     such an input at small maps (relative error 1 to 1e23 against float64: it reads memory it
#     never wrote), which stops bf16 video training with an infinite gradient norm; a
#     contiguous input gives the right gradient. So on the CPU in bfloat16 (and only there)
#     the input is copied contiguous. Elsewhere the copy is not free: on CUDA a channels-last
#     5-D input is what sends a depthwise convolution to cuDNN (a contiguous one goes to
#     torch's own depthwise kernel, "5-D contiguous depthwise is not supported yet" in
#     aten/src/ATen/native/Convolution.cpp), and float32 and float16 are right on the CPU. On
#     the CPU the copy costs one pass over the map and, where the convolution keeps its input
#     for backward, the copy's memory (planned: +0.7% kept activations for rev_mvit_base_16x4
#     under autograd at 8x64x64, none under the reversible engine there). The planner traces
#     CUDA plans on fake CPU tensors, so a bf16 plan counts the copy too (docs/memory.md).
#     tests/test_video_model.py::test_cpu_bf16_pooling_weight_gradient_matches_float64.
def pooling_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the pooling convolution should see it (NOTE [ CPU bf16 depthwise Conv3d ]):
    contiguous for a 3-D map in bfloat16 on the CPU, else unchanged."""
    if x.dim() == 5 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return x.contiguous()
    return x


# It branches on the device and dtype, which torch.fx's proxies lack: traced (timm's and
# torchvision's feature extraction) it stays one call in the graph, decided when the traced
# module runs. fx.wrap, not timm's notrace list: pool_heads is called from other modules'
# forwards, where the tracer patches no global names of this module.
torch.fx.wrap("pooling_input")


def pool_heads(
    x: torch.Tensor, hw: Tuple[int, ...], pool: nn.Module, norm: nn.Module
) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """Pool per-head tokens ``(B, heads, N, head_dim)`` over their map ``hw`` (``(H, W)`` or
    ``(T, H, W)``, N its product) with ``pool`` (a depthwise convolution over the head
    dimension, 2-D or 3-D to match), then ``norm`` the head dimension.

    Returns:
        The pooled tokens ``(B, heads, N', head_dim)`` and the pooled map.
    """
    B, nh, N, hd = x.shape
    x = x.reshape(B * nh, *hw, hd).movedim(-1, 1)  # (B * heads, hd, *map), channels last
    x = pool(pooling_input(x))
    # Unpacked to a fixed length (not tuple(x.shape[2:])), so that torch.fx can trace it.
    if len(hw) == 3:
        T, H, W = x.shape[-3:]
        grid: Tuple[int, ...] = (T, H, W)
    else:
        H, W = x.shape[-2:]
        grid = (H, W)
    x = x.reshape(B, nh, hd, math.prod(grid)).transpose(2, 3)  # (B, heads, N', hd)
    return norm(x), grid


def _tuple(value: Size, dims: int, name: str) -> Tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dims
    value = tuple(value)
    if len(value) != dims:
        raise ValueError(f"expected {name} as an int or {dims} ints, got {value!r}")
    return value


def _depthwise(head_dim: int, kernel: Tuple[int, ...], stride: Size) -> nn.Module:
    """Depthwise pooling convolution, 2-D or 3-D as ``kernel`` has 2 or 3 entries."""
    conv = nn.Conv3d if len(kernel) == 3 else nn.Conv2d
    stride = _tuple(stride, len(kernel), "stride")
    padding = tuple(k // 2 for k in kernel)
    return conv(head_dim, head_dim, kernel, stride, padding, groups=head_dim, bias=False)


class MultiScaleAttention(nn.Module):
    """Multi-head pooling attention on tokens, ``(B, N, dim) -> (B, N', dim_out)`` over a map
    ``(H, W)`` or ``(T, H, W)`` (N its product), each side pooled to ``ceil(side / stride_q)``.

    Args:
        dim: input token width.
        num_heads: heads; must divide ``dim_out``.
        qkv_bias: bias in the query, key and value maps.
        pool_kernel: odd kernel of the pooling convolutions: an int (2-D maps) or one per map
            axis (3 entries: 3-D maps, as in video models).
        stride_q: query pooling stride, an int or one per axis; 1 everywhere means no query
            pooling (and no ``pool_q``).
        stride_kv: key/value pooling stride (keys and values are pooled even at stride 1).
        dim_out: output width, also that of q, k and v (default ``dim``).
        separate_qkv: three linear maps ``q``, ``k``, ``v`` (the image Rev-MViT-B); else one
            map ``qkv`` to all three (PySlowFast's default, the video Rev-MViT-B).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        pool_kernel: Size = 3,
        stride_q: Size = 1,
        stride_kv: Size = 1,
        dim_out: int | None = None,
        separate_qkv: bool = True,
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        if dim_out % num_heads:
            raise ValueError(
                f"expected dim_out divisible by num_heads, got {dim_out} and {num_heads}"
            )
        kernel = (pool_kernel,) * 2 if isinstance(pool_kernel, int) else tuple(pool_kernel)
        if len(kernel) not in (2, 3) or any(k % 2 != 1 for k in kernel):
            raise ValueError(f"expected an odd pool_kernel (2 or 3 sides), got {pool_kernel}")
        self.num_heads = num_heads
        self.dim_out = dim_out
        self.head_dim = head_dim = dim_out // num_heads
        self.q: nn.Linear | None = None
        self.k: nn.Linear | None = None
        self.v: nn.Linear | None = None
        self.qkv: nn.Linear | None = None
        if separate_qkv:
            self.q = nn.Linear(dim, dim_out, bias=qkv_bias)
            self.k = nn.Linear(dim, dim_out, bias=qkv_bias)
            self.v = nn.Linear(dim, dim_out, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * dim_out, bias=qkv_bias)
        self.proj = nn.Linear(dim_out, dim_out)
        self.pool_q: nn.Module | None = None
        self.norm_q: nn.LayerNorm | None = None
        if math.prod(_tuple(stride_q, len(kernel), "stride_q")) > 1:
            self.pool_q = _depthwise(head_dim, kernel, stride_q)
            self.norm_q = nn.LayerNorm(head_dim, eps=1e-6)
        self.pool_k = _depthwise(head_dim, kernel, stride_kv)
        self.norm_k = nn.LayerNorm(head_dim, eps=1e-6)
        self.pool_v = _depthwise(head_dim, kernel, stride_kv)
        self.norm_v = nn.LayerNorm(head_dim, eps=1e-6)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, dim_out) -> (B, heads, N, head_dim)``."""
        B, N, _ = x.shape
        return x.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, hw: Tuple[int, ...]
    ) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """Returns the output tokens and their map (``(H', W')`` or ``(T', H', W')``)."""
        B = x.shape[0]
        if self.qkv is not None:
            qkv = self.qkv(x).reshape(B, x.shape[1], 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, N, hd)
        else:
            q = self.split_heads(self.q(x))  # (B, heads, N, hd)
            k = self.split_heads(self.k(x))
            v = self.split_heads(self.v(x))
        q_hw = tuple(hw)
        if self.pool_q is not None:
            q, q_hw = pool_heads(q, hw, self.pool_q, self.norm_q)  # (B, heads, Nq, hd)
        k, _ = pool_heads(k, hw, self.pool_k, self.norm_k)  # (B, heads, Nk, hd)
        v, _ = pool_heads(v, hw, self.pool_v, self.norm_v)
        out = attend(q, k, v)  # (B, heads, Nq, hd)
        out = out.transpose(1, 2).reshape(B, -1, self.dim_out)  # (B, Nq, dim_out)
        return self.proj(out), q_hw
