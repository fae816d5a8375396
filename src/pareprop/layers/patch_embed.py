"""Patch embedding by a strided convolution, and the image-input checks shared by models."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

__all__ = ["PatchEmbed", "check_image", "to_2tuple_int"]


def to_2tuple_int(value: Union[int, Sequence[int]], name: str = "value") -> Tuple[int, int]:
    """``7 -> (7, 7)``; ``[7, 5] -> (7, 5)`` (lists come back from JSON configs)."""
    if isinstance(value, int):
        return (value, value)
    value = tuple(value)
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"expected {name} as an int or a pair of ints, got {value!r}")
    return value  # type: ignore[return-value]


def check_image(
    x: torch.Tensor,
    in_chans: int,
    img_size: Tuple[int, int] | None = None,
    min_size: Tuple[int, int] | None = None,
    multiple_of: int | None = None,
) -> torch.Tensor:
    """Return ``x``; raise ``ValueError`` unless it is a float ``(B, in_chans, H, W)`` batch
    that fits. (Returned so that a traced graph uses the call and keeps the check.)

    Args:
        x: the batch.
        in_chans: channels the model was built for.
        img_size: the only spatial size accepted (models with absolute position embeddings).
        min_size: the smallest spatial size accepted (hierarchical models).
        multiple_of: a number height and width must be multiples of (non-overlapping patches
            of a model that takes any size).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected an image tensor, got {type(x).__name__}")
    want = f"a {img_size[0]}x{img_size[1]} image" if img_size is not None else "an image"
    if not torch.is_floating_point(x):
        raise ValueError(
            f"expected a floating-point image tensor, got dtype {x.dtype} with shape "
            f"{tuple(x.shape)}; convert it first, e.g. x.float() / 255"
        )
    if x.ndim != 4 or x.shape[1] != in_chans:
        raise ValueError(
            f"expected input (B, {in_chans}, H, W), {want} with {in_chans} channels, "
            f"got {tuple(x.shape)}"
        )
    hw = tuple(x.shape[-2:])
    if img_size is not None and hw != tuple(img_size):
        raise ValueError(
            f"expected input {img_size[0]}x{img_size[1]} with {in_chans} channels, got "
            f"{tuple(x.shape)}; resize the images or create the model with img_size={hw}"
        )
    if min_size is not None and (hw[0] < min_size[0] or hw[1] < min_size[1]):
        raise ValueError(
            f"expected input at least {min_size[0]}x{min_size[1]} with {in_chans} channels "
            f"(the model's total stride), got {tuple(x.shape)}"
        )
    if multiple_of is not None and (hw[0] % multiple_of or hw[1] % multiple_of):
        raise ValueError(
            f"expected input height and width multiples of patch_size={multiple_of}, got "
            f"{tuple(x.shape)}"
        )
    return x


class PatchEmbed(nn.Module):
    """Image to tokens by one convolution.

    ViT uses non-overlapping patches (kernel = stride = patch); MViTv2 an overlapping
    convolution (kernel 7, stride 4, padding 3). A kernel of three sides makes it a video
    embedding (Conv3d over ``(B, C, T, H, W)``; the video Rev-MViT-B: kernel 3x7x7, stride
    2x4x4, padding 1x3x3), with ``stride`` and ``padding`` then given per side too. Swin
    normalises the patch tokens (``norm_layer=nn.LayerNorm``).

    Args:
        in_chans: image channels.
        embed_dim: token width.
        kernel_size: convolution kernel.
        stride: convolution stride (the patch size for ViT).
        padding: convolution padding.
        flatten: return ``(B, H*W, C)`` tokens; otherwise channels-last ``(B, H, W, C)``.
        norm_layer: a norm over the token width applied last (``None``: none).
    """

    def __init__(
        self,
        in_chans: int = 3,
        embed_dim: int = 768,
        kernel_size: Union[int, Sequence[int]] = 16,
        stride: Union[int, Sequence[int]] = 16,
        padding: Union[int, Sequence[int]] = 0,
        flatten: bool = True,
        norm_layer: Optional[Callable[[int], nn.Module]] = None,
    ):
        super().__init__()
        if not isinstance(kernel_size, int) and len(tuple(kernel_size)) == 3:
            self.kernel_size, self.stride, self.padding = (
                _to_3tuple_int(v, name)
                for v, name in ((kernel_size, "kernel_size"), (stride, "stride"),
                                (padding, "padding"))
            )
            conv: type = nn.Conv3d
        else:
            self.kernel_size = to_2tuple_int(kernel_size, "kernel_size")
            self.stride = to_2tuple_int(stride, "stride")
            self.padding = to_2tuple_int(padding, "padding")
            conv = nn.Conv2d
        self.flatten = flatten
        self.proj = conv(in_chans, embed_dim, self.kernel_size, self.stride, self.padding)
        self.norm = norm_layer(embed_dim) if norm_layer is not None else None

    def output_size(self, img_size: Tuple[int, ...]) -> Tuple[int, ...]:
        """Token grid ``(H', W')`` (video: ``(T', H', W')``) for an ``img_size`` input."""
        return tuple(  # type: ignore[return-value]
            (s + 2 * p - k) // st + 1
            for s, p, k, st in zip(img_size, self.padding, self.kernel_size, self.stride)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).movedim(1, -1)  # (B, H', W', C) or (B, T', H', W', C)
        if self.flatten:
            x = x.flatten(1, -2)  # (B, N, C)
        if self.norm is not None:
            return self.norm(x)  # a fresh tensor already (NOTE [ Patch tokens are not a view ])
        # NOTE [ Patch tokens are not a view ]
        # The channels-last tokens are a view of the convolution's output. Under FSDP2 the
        # embedding is its own unit, and a unit that returns a view is warned about: FSDP2's
        # pre-backward hook sits on the output, and an in-place op on a view would drop it
        # (and the all-gather of the embedding's weights in backward). A copy into a fresh
        # tensor is what the next op (the position embedding's add, a norm) would have read
        # anyway, value for value; the convolution's output is freed at once instead of when
        # the view dies, so the step's peak does not grow.
        return x.clone(memory_format=torch.contiguous_format)


def _to_3tuple_int(value: Union[int, Sequence[int]], name: str) -> Tuple[int, int, int]:
    if isinstance(value, int):
        return (value, value, value)
    value = tuple(value)
    if len(value) != 3 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"expected {name} as an int or three ints, got {value!r}")
    return value  # type: ignore[return-value]
