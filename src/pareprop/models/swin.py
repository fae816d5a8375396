"""Rev-Swin: a reversible Swin Transformer.

Swin: Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows",
ICCV 2021. Reversible variant: Mangalam et al., "Reversible Vision Transformers", CVPR 2022;
Zhu & Mangalam, "PaReprop: Fast Parallelized Reversible Backpropagation", 2023.

Each block is a reversible coupling whose F is (shifted-)window attention and whose G is the
MLP. A stage runs one :class:`~pareprop.engine.ReversibleStack` on two copies of its input;
the window masks reach F as stack keyword arguments, so forward and recomputation use the same
masks. Before each patch merging the two C-wide streams are concatenated and fused back to C
channels by a small MLP (2C -> C). The last stage keeps the 2C-wide concatenation, which is
normalised, averaged over tokens and classified (``num_features = 2 * C_last``).

Sizes that are not multiples of the window are padded (bottom, right), attended with a mask
that hides the padding, and cropped; odd sizes before a patch merging are padded too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Set, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import to_2tuple

from pareprop.chunking import Chunk, Split
from pareprop.engine import ENGINES, ReversibleBlock, ReversibleStack
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.layers import Mlp, PatchEmbed, check_image, make_config
from pareprop.layers.drop import DropPath, drop_path
from pareprop.layers.window_attention import (
    WindowAttention,
    padded_size,
    window_mask,
    window_partition,
    window_reverse,
)
from pareprop.models._base import (
    CIFAR_MEAN,
    CIFAR_STD,
    ReversibleImageModelMixin,
    drop_path_rates,
    init_weights_,
    make_head,
)
from pareprop.models._features import StageFeaturesMixin, join_streams
from pareprop.models._registry import register_model

__all__ = ["SwinConfig", "RevSwinBlock", "RevSwinStage", "RevSwin", "SWIN_VARIANTS"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class SwinConfig:
    """Everything needed to build a :class:`RevSwin`; named variants live in ``SWIN_VARIANTS``.

    ``window`` is the requested window side; a stage whose (configured) resolution is not
    larger than the window uses one window covering the whole map and no shift, as in Swin.
    """

    img_size: Union[int, Tuple[int, int]] = 224
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 96
    depths: Tuple[int, ...] = (2, 2, 6, 2)
    num_heads: Tuple[int, ...] = (3, 6, 12, 24)
    window: int = 7
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_rate: float = 0.0  # before the head
    proj_drop_rate: float = 0.0  # after the attention projection and inside the MLP
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.1
    engine: str = "reversible"
    mean: Tuple[float, ...] = IMAGENET_MEAN
    std: Tuple[float, ...] = IMAGENET_STD

    def __post_init__(self) -> None:
        # JSON turns tuples into lists; accept them so a saved config rebuilds the model.
        self.img_size = to_2tuple(
            tuple(self.img_size) if isinstance(self.img_size, list) else self.img_size
        )
        if len(self.img_size) != 2:
            raise ValueError(f"expected img_size as an int or (H, W), got {self.img_size}")
        self.img_size = tuple(int(s) for s in self.img_size)
        self.depths = tuple(self.depths)
        self.num_heads = tuple(self.num_heads)
        self.mean = tuple(self.mean)
        self.std = tuple(self.std)
        if len(self.depths) != len(self.num_heads):
            raise ValueError(
                f"expected one num_heads entry per stage ({len(self.depths)} stages), "
                f"got depths={self.depths}, num_heads={self.num_heads}"
            )
        if any(d < 1 for d in self.depths):
            raise ValueError(f"expected every stage depth >= 1, got depths={self.depths}")
        if self.engine not in ENGINES:
            raise ValueError(f"expected engine in {ENGINES}, got {self.engine!r}")
        for i, h in enumerate(self.num_heads):
            if (self.embed_dim * 2**i) % h != 0:
                raise ValueError(
                    f"stage {i} has {self.embed_dim * 2**i} channels, not divisible by "
                    f"num_heads[{i}]={h}"
                )
        if self.img_size[0] % self.patch_size or self.img_size[1] % self.patch_size:
            raise ValueError(
                f"expected img_size a multiple of patch_size={self.patch_size}, got {self.img_size}"
            )

    @property
    def depth(self) -> int:
        """Total number of blocks."""
        return sum(self.depths)



def _stage_window(resolution: Tuple[int, int], window: int) -> Tuple[int, int]:
    """(window, shift) for a stage at ``resolution``: one window, no shift, if the map fits."""
    if min(resolution) <= window:
        return min(resolution), 0
    return window, window // 2


class PatchMerging(nn.Module):
    """2x2 neighbouring tokens concatenated (4C), normalised, projected to 2C; odd sizes padded."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        H, W = x.shape[1], x.shape[2]
        x = x.view(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5)  # (B, H/2, W/2, 2, 2, C)
        x = x.reshape(B, H // 2, W // 2, 4 * C)  # (B, H/2, W/2, 4C)
        return self.reduction(self.norm(x))

    # Checkpointed in chunks of samples (NOTE [ Checkpointed blocks in chunks ] in
    # pareprop/engine/recompute.py); nothing random.
    def split(self, x: torch.Tensor) -> Split:
        return Split.samples(x.shape[0])

    def forward_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return self(x)


class StreamFusion(nn.Module):
    """Fuse the two concatenated reversible streams (2C) back to C channels before merging."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2 * dim)
        self.mlp = Mlp(2 * dim, hidden_features=dim, out_features=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))

    # Checkpointed in chunks of rows of the (B, H, W, 2C) map (NOTE [ Checkpointed blocks in
    # chunks ] in pareprop/engine/recompute.py): LayerNorm and MLP act on each token alone.
    def split(self, x: torch.Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def forward_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return self.mlp(self.norm(x), chunk, dim=1)


class RevSwinBlock(ReversibleBlock):
    """Reversible Swin block: F = LayerNorm + (shifted-)window attention, G = LayerNorm + MLP.

    Args:
        dim: Channels of each stream.
        num_heads: Attention heads.
        window: Window side.
        shift: Cyclic shift (0 for plain windows, else normally ``window // 2``).
        mlp_ratio: MLP hidden width over ``dim``.
        qkv_bias: Bias in the qkv projection.
        proj_drop: Dropout after the attention projection and inside the MLP.
        attn_drop: Dropout on attention weights.
        drop_path: Stochastic depth rate of both branches.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window: int,
        shift: int = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 <= shift < window:
            raise ValueError(f"expected 0 <= shift < window={window}, got shift={shift}")
        self.window = window
        self.shift = shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window, qkv_bias, attn_drop, proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden_features=int(dim * mlp_ratio), drop=proj_drop)

    def f(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        shift_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Window attention on ``(B, H, W, C)``; masks from :func:`window_mask`."""
        return self.drop_path(self._attend(x, shift_mask if self.shift > 0 else mask, None))

    def _attend(
        self, x: torch.Tensor, mask: torch.Tensor | None, chunk: Chunk | None
    ) -> torch.Tensor:
        B, H, W, C = x.shape
        w, s = self.window, self.shift
        x = self.norm1(x)
        Hp, Wp = padded_size(H, w), padded_size(W, w)
        x = F.pad(x, (0, 0, 0, Wp - W, 0, Hp - H))  # (B, Hp, Wp, C)
        if s > 0:
            x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        x = self.attn(window_partition(x, w), mask, chunk)  # (B*nW, N, C)
        x = window_reverse(x, w, Hp, Wp)  # (B, Hp, Wp, C)
        if s > 0:
            x = torch.roll(x, shifts=(s, s), dims=(1, 2))
        return x[:, :H, :W, :]

    def g(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.drop_path(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone (its windows), G on each token alone, cut into bands of rows of the
    # (B, H, W, C) map.
    def f_split(self, x: torch.Tensor, **kwargs: Any) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(
        self,
        x: torch.Tensor,
        chunk: Chunk,
        mask: torch.Tensor | None = None,
        shift_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        x = self._attend(x, shift_mask if self.shift > 0 else mask, chunk)
        return drop_path(self.drop_path, x, chunk, dim=0)

    def g_split(self, x: torch.Tensor, **kwargs: Any) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk, **kwargs: Any) -> torch.Tensor:
        return drop_path(self.drop_path, self.mlp(self.norm2(x), chunk), chunk)


class RevSwinStage(nn.Module):
    """Optional patch merging, a reversible stack, and (unless last) the 2C -> C stream fusion.

    Args:
        dim: Channels inside the stage (after merging).
        depth: Reversible blocks.
        num_heads: Attention heads.
        window: Window side for this stage.
        shift: Shift of the odd blocks (0 disables shifting).
        downsample: Whether to start with patch merging (input has ``dim // 2`` channels).
        fuse: Whether to end with :class:`StreamFusion` (else the 2C concatenation is returned).
        drop_path: One stochastic depth rate per block.
        engine: Backward engine of the stack.
        **block_kwargs: Passed to every :class:`RevSwinBlock`.
    """

    def __init__(
        self,
        dim: int,
        depth: int,
        num_heads: int,
        window: int,
        shift: int,
        downsample: bool,
        fuse: bool,
        drop_path: Tuple[float, ...],
        engine: str = "reversible",
        **block_kwargs: Any,
    ) -> None:
        super().__init__()
        self.window = window
        self.shift = shift
        self.downsample = PatchMerging(dim // 2) if downsample else None
        self.blocks = ReversibleStack(
            [
                RevSwinBlock(
                    dim,
                    num_heads,
                    window,
                    shift=0 if i % 2 == 0 else shift,
                    drop_path=drop_path[i],
                    **block_kwargs,
                )
                for i in range(depth)
            ],
            engine=engine,
        )
        self.fuse = StreamFusion(dim) if fuse else None
        # Merging and fusion under activation checkpointing (RevSwin.set_grad_checkpointing).
        self.grad_checkpointing = False
        # Not state: masks depend only on the map size, the window and the shift.
        self._mask_cache: Dict[Tuple[int, int, str], Dict[str, torch.Tensor]] = {}

    def _masks(self, H: int, W: int, device: torch.device) -> Dict[str, torch.Tensor]:
        """Window masks for an ``H x W`` map, built once per size and device."""
        key = (H, W, str(device))
        if key not in self._mask_cache:
            masks = {"mask": window_mask(H, W, self.window, 0, device)}
            if self.shift > 0:
                masks["shift_mask"] = window_mask(H, W, self.window, self.shift, device)
            self._mask_cache[key] = {k: v for k, v in masks.items() if v is not None}
        return self._mask_cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Merging and fusion recompute in chunks as the stack's branches do (set_chunking).
        chunking = self.blocks.chunking
        x = maybe_checkpoint(self.downsample, x, self.grad_checkpointing, chunking)
        # Handed to every block as stack keywords: the engine replays F with exactly these
        # masks when it recomputes in backward.
        x1, x2 = self.blocks(x, x, **self._masks(x.shape[1], x.shape[2], x.device))
        if self.fuse is None:
            return torch.cat([x1, x2], dim=-1)  # (B, H, W, 2C)
        # Joined inside the checkpoint: it keeps the two streams, which the stack keeps anyway,
        # not their concatenation (B, H, W, 2C) beside them.
        return maybe_checkpoint(self.fuse, (x1, x2), self.grad_checkpointing, chunking,
                                join=join_streams)  # (B, H, W, C)


class RevSwin(StageFeaturesMixin, ReversibleImageModelMixin, nn.Module):
    """Reversible Swin Transformer for image classification.

    Args:
        cfg: Model configuration; see :class:`SwinConfig`.
    """

    _cfg_records_engine = True  # SwinConfig is mutable

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        n = len(cfg.depths)
        # Non-overlapping patches, then LayerNorm; channels-last (B, H/p, W/p, C) out.
        self.patch_embed = PatchEmbed(
            cfg.in_chans,
            cfg.embed_dim,
            cfg.patch_size,
            cfg.patch_size,
            flatten=False,
            norm_layer=nn.LayerNorm,
        )
        dpr = drop_path_rates(cfg.drop_path_rate, cfg.depth)
        res = (cfg.img_size[0] // cfg.patch_size, cfg.img_size[1] // cfg.patch_size)
        stages = []
        for i in range(n):
            if i > 0:
                res = (-(-res[0] // 2), -(-res[1] // 2))
            window, shift = _stage_window(res, cfg.window)
            start = sum(cfg.depths[:i])
            stages.append(
                RevSwinStage(
                    dim=cfg.embed_dim * 2**i,
                    depth=cfg.depths[i],
                    num_heads=cfg.num_heads[i],
                    window=window,
                    shift=shift,
                    downsample=i > 0,
                    fuse=i < n - 1,
                    drop_path=tuple(dpr[start : start + cfg.depths[i]]),
                    engine=cfg.engine,
                    mlp_ratio=cfg.mlp_ratio,
                    qkv_bias=cfg.qkv_bias,
                    proj_drop=cfg.proj_drop_rate,
                    attn_drop=cfg.attn_drop_rate,
                )
            )
        self.stages = nn.Sequential(*stages)
        # Stage i ends fused to embed_dim * 2**i channels; the last keeps both streams.
        self.feature_info = [
            {
                "num_chs": cfg.embed_dim * 2**i * (2 if i == n - 1 else 1),
                "reduction": cfg.patch_size * 2**i,
                "module": f"stages.{i}",
            }
            for i in range(n)
        ]
        self.num_features = 2 * cfg.embed_dim * 2 ** (n - 1)
        self.norm = nn.LayerNorm(self.num_features)
        self.head_drop = nn.Dropout(cfg.drop_rate)
        # Initialised with everything else by the apply below.
        self.head = make_head(self.num_features, cfg.num_classes, init=False)
        self._set_image_pretrained_cfg(crop_pct=0.9, fixed_input_size=False)
        self.apply(init_weights_)

    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters() if "relative_position_bias_table" in n}

    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's parameter groups (layer-wise learning-rate decay): the stem, then per stage
        its patch merging, its blocks and its stream fusion, then the head
        (timm puts the final norm in the last block's group)."""
        if coarse:
            return {"stem": r"^patch_embed", "blocks": [(r"^stages\.(\d+)", None),
                                                         (r"^norm", (99999,))]}
        return {
            "stem": r"^patch_embed",
            "blocks": [
                (r"^stages\.(\d+)\.downsample", (-1,)),
                (r"^stages\.(\d+)\.blocks\.blocks\.(\d+)", None),
                (r"^stages\.(\d+)\.fuse", (99998,)),
                (r"^norm", (99999,)),
            ],
        }

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a fresh one for ``num_classes`` (0: no classifier)."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"expected global_pool 'avg' (mean over tokens), got {global_pool!r}")
        w = self.norm.weight  # the new head lives where the model lives
        self._replace_head(num_classes, device=w.device, dtype=w.dtype)

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        x = check_image(x, self.cfg.in_chans, multiple_of=self.cfg.patch_size)
        # Checkpointed, the stem keeps the images (which the caller holds anyway), not
        # autocast's copy of them and its norm's float32 input.
        return maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing)  # (B, H/p, W/p, C)

    def _end(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` -> normalised final tokens ``(B, H', W', num_features)``."""
        x = self.stages(self._stem(x))  # (B, H', W', 2C_last)
        return self._end(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.mean(dim=(1, 2))  # (B, num_features)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _sizes(embed_dim: int, depths: Tuple[int, ...]) -> Dict[str, Any]:
    # Head width 32 at every stage, as in Swin (T: 3/6/12/24 heads, B: 4/8/16/32, L: 6/../48).
    return {
        "embed_dim": embed_dim,
        "depths": depths,
        "num_heads": tuple(embed_dim * 2**i // 32 for i in range(len(depths))),
    }


SWIN_VARIANTS: Dict[str, SwinConfig] = {
    "rev_swin_tiny": SwinConfig(**_sizes(96, (2, 2, 6, 2)), drop_path_rate=0.2),
    "rev_swin_small": SwinConfig(**_sizes(96, (2, 2, 18, 2)), drop_path_rate=0.3),
    "rev_swin_base": SwinConfig(**_sizes(128, (2, 2, 18, 2)), drop_path_rate=0.5),
    "rev_swin_large": SwinConfig(**_sizes(192, (2, 2, 18, 2)), drop_path_rate=0.5),
    "rev_swin_huge": SwinConfig(**_sizes(352, (2, 2, 18, 2)), drop_path_rate=0.5),
    "rev_swin_giant": SwinConfig(**_sizes(512, (2, 2, 42, 2)), drop_path_rate=0.5),
    # CIFAR scale: 32 px, 2 px patches (16x16 tokens), windows of 4; stages at 16, 8, 4, 2.
    "rev_swin_tiny_32": SwinConfig(
        img_size=32,
        patch_size=2,
        window=4,
        num_classes=10,
        **_sizes(96, (2, 2, 6, 2)),
        drop_path_rate=0.1,
        mean=CIFAR_MEAN,
        std=CIFAR_STD,
    ),
}


def _create(name: str, **overrides: Any) -> RevSwin:
    return RevSwin(make_config(SWIN_VARIANTS[name], **overrides))


@register_model
def rev_swin_tiny(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_tiny", **kwargs)


@register_model
def rev_swin_small(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_small", **kwargs)


@register_model
def rev_swin_base(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_base", **kwargs)


@register_model
def rev_swin_large(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_large", **kwargs)


@register_model
def rev_swin_huge(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_huge", **kwargs)


@register_model
def rev_swin_giant(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_giant", **kwargs)


@register_model
def rev_swin_tiny_32(**kwargs: Any) -> RevSwin:
    return _create("rev_swin_tiny_32", **kwargs)
