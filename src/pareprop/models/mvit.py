"""Rev-MViTv2: a multiscale vision transformer built from reversible stacks.

Mangalam et al., "Reversible Vision Transformers", CVPR 2022 (Rev-MViT); Li et al., "MViTv2:
Improved Multiscale Vision Transformers for Classification and Detection", CVPR 2022 (pooling
attention); Zhu & Mangalam, "PaReprop", 2023.

NOTE [ Stage structure ]
``last_block_indexes`` names the last block of each stage. Block ``i`` is a non-reversible
stage-transition block when ``i - 1`` is in that list; every other block is reversible, and
each run of reversible blocks is one :class:`~pareprop.ReversibleStack`. A stack ends with its
two streams side by side, so the width doubles at every stage through the concatenation; the
transition keeps that width, doubles the heads and halves the map (query stride 2, max-pooled
shortcut). Reversible blocks must keep the shape of their input, so they pool only keys and
values. The kv stride and the window halve at every stage; the last ``global_stages`` stages
attend globally.

Inside a stack the tokens are ``(B, H*W, C)`` and the map size reaches F and G as the stack
keyword ``hw=(H, W)``; outside, the model keeps channels-last maps ``(B, H, W, C)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from pareprop.chunking import Chunk, Split
from pareprop.engine import ENGINES, ReversibleBlock, ReversibleStack
from pareprop.engine.chunk_cost import Chunking
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.layers import (
    Mlp,
    PatchEmbed,
    PoolingAttention,
    check_image,
    make_config,
    to_2tuple_int,
)
from pareprop.layers.drop import DropPath, drop_path
from pareprop.models._base import (
    CIFAR_MEAN,
    CIFAR_STD,
    ReversibleImageModelMixin,
    drop_path_rates,
    init_linears_,
    make_head,
    stage_group_matcher,
)
from pareprop.models._features import StageEnd, StageFeaturesMixin, join_streams, stage_map
from pareprop.models._registry import register_model

__all__ = [
    "MViTConfig",
    "RevMViT",
    "RevMViTBlock",
    "MViTTransition",
    "MViTTransitionBlock",
    "MViTStage",
    "MViTStagesMixin",
    "checkpoint_stage_end",
    "MVIT_CONFIGS",
]


@dataclass(frozen=True)
class MViTConfig:
    """Everything that defines a Rev-MViTv2; named variants are rows of :data:`MVIT_CONFIGS`."""

    img_size: Union[int, Tuple[int, int]] = 224
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 96
    depth: int = 16
    num_heads: int = 1
    last_block_indexes: Tuple[int, ...] = (0, 2, 13, 15)
    patch_kernel: int = 7
    patch_stride: int = 4
    patch_padding: int = 3
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    pool_kernel: int = 3
    kv_stride: int = 4  # of the first stage; halves every stage, not below 1
    window_size: int = 56  # of the first stage, in tokens; halves every stage; 0: global
    global_stages: int = 2  # the last stages attend globally
    use_rel_pos: bool = True
    residual_pooling: bool = True
    # > 0: a residual MLP (hidden ratio) fuses the two streams at the start of each transition,
    # as the Rev-MViT reference's "concat_linear" pre-Q fusion; 0 (SPEC section 4): none.
    fusion_mlp_ratio: float = 0.0
    drop_rate: float = 0.0  # dropout before the classifier
    drop_path_rate: float = 0.0
    engine: str = "reversible"
    mean: Tuple[float, ...] = IMAGENET_DEFAULT_MEAN
    std: Tuple[float, ...] = IMAGENET_DEFAULT_STD


@dataclass(frozen=True)
class _StagePlan:
    """Derived layout of one stage (from the config and the expected input size)."""

    index: int
    transition: int | None  # block index of the stage-transition block, if any
    reversible: List[int]  # block indexes of the stage's reversible blocks
    in_width: int  # width entering the stage
    width: int  # width of the stage's blocks (the transition's in and out width)
    num_heads: int
    kv_stride: int
    window: int  # in tokens of the stage's map; 0 for global attention
    in_size: Tuple[int, int]  # map entering the stage
    size: Tuple[int, int]  # map inside the stage


def _plan(cfg: MViTConfig, grid: Tuple[int, int]) -> List[_StagePlan]:
    ends = set(cfg.last_block_indexes)
    groups: List[Tuple[int | None, List[int]]] = [(None, [])]
    for i in range(cfg.depth):
        if i - 1 in ends:
            groups.append((i, []))
        else:
            groups[-1][1].append(i)
    plans, width, size = [], cfg.embed_dim, grid
    for s, (transition, reversible) in enumerate(groups):
        in_size = size
        if transition is not None:
            size = (math.ceil(size[0] / 2), math.ceil(size[1] / 2))
        global_attn = s >= len(groups) - cfg.global_stages
        window = 0 if global_attn else cfg.window_size // 2**s
        plans.append(
            _StagePlan(
                index=s,
                transition=transition,
                reversible=reversible,
                in_width=width,
                width=width,
                num_heads=cfg.num_heads * 2**s,
                kv_stride=max(cfg.kv_stride // 2**s, 1),
                window=window,
                in_size=in_size,
                size=size,
            )
        )
        if reversible:
            width *= 2  # the two streams side by side
    return plans


def _check_config(cfg: MViTConfig) -> None:
    if cfg.engine not in ENGINES:
        raise ValueError(f"expected engine in {ENGINES}, got {cfg.engine!r}")
    if cfg.depth < 1:
        raise ValueError(f"expected depth >= 1, got {cfg.depth}")
    ends = cfg.last_block_indexes
    if list(ends) != sorted(set(ends)) or any(not 0 <= i < cfg.depth for i in ends):
        raise ValueError(
            f"expected last_block_indexes increasing and within range(depth={cfg.depth}), "
            f"got {ends}"
        )
    if cfg.num_classes < 0:
        raise ValueError(f"expected num_classes >= 0, got {cfg.num_classes}")


class RevMViTBlock(ReversibleBlock):
    """A reversible MViTv2 block: F = LayerNorm + pooling attention, G = LayerNorm + MLP.

    Keys and values are pooled, queries are not (stride 1), so F keeps its input's shape as a
    reversible coupling requires. Inputs are token sequences ``(B, H*W, C)`` with
    ``hw=(H, W)`` passed by the stack.

    Args:
        dim: width C of each stream.
        num_heads: attention heads.
        kv_stride: key/value pooling stride.
        window: attention window in tokens (0: global).
        input_size: expected map ``(H, W)`` (sizes the relative position tables).
        mlp_ratio: MLP hidden width over ``dim``.
        qkv_bias: bias in the query/key/value projection.
        pool_kernel: kernel of the pooling convolutions.
        use_rel_pos: decomposed relative position bias.
        residual_pooling: add the pooled query back.
        drop_path: stochastic-depth rate of both branches.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kv_stride: int,
        window: int,
        input_size: Tuple[int, int],
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        pool_kernel: int = 3,
        use_rel_pos: bool = True,
        residual_pooling: bool = True,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = PoolingAttention(
            dim,
            dim,
            num_heads,
            qkv_bias=qkv_bias,
            pool_kernel=pool_kernel,
            stride_q=1,
            stride_kv=kv_stride,
            window_size=window,
            use_rel_pos=use_rel_pos,
            input_size=input_size,
            residual_pooling=residual_pooling,
        )
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def f(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        return self.drop_path1(self._attend(x, hw))

    def _attend(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        x = self.norm1(x).view(B, hw[0], hw[1], C)  # (B, H, W, C)
        return self.attn(x).view(B, N, C)  # (B, H*W, C)

    def g(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        return self.drop_path2(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone (pooling attention has no dropout), G on each token alone.
    def f_split(self, x: torch.Tensor, hw: Tuple[int, int]) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk, hw: Tuple[int, int]) -> torch.Tensor:
        return drop_path(self.drop_path1, self._attend(x, hw), chunk, dim=0)

    def g_split(self, x: torch.Tensor, hw: Tuple[int, int]) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk, hw: Tuple[int, int]) -> torch.Tensor:
        return drop_path(self.drop_path2, self.mlp(self.norm2(x), chunk), chunk)


class MViTTransition(nn.Module):
    """What every MViT stage transition shares (the MViTv2 one here, the published Rev-MViTs'
    in :mod:`pareprop.models.rev_mvit` and :mod:`pareprop.models.rev_mvit_video`): a residual
    attention branch onto a pooled shortcut, then a residual MLP branch, both with stochastic
    depth. A subclass builds ``norm1``, ``attn`` and its shortcut, calls
    :meth:`_init_mlp_branch` last and writes :meth:`forward_chunk` with :meth:`_residuals`.
    """

    def _init_mlp_branch(self, dim: int, mlp_ratio: float, drop_path: float) -> None:
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_chunk(x, None)

    # Checkpointed in chunks of samples (NOTE [ Checkpointed blocks in chunks ] in
    # pareprop/engine/recompute.py): every part of a transition stays inside a sample (each
    # subclass says which parts it has).
    def split(self, x: torch.Tensor) -> Split:
        return Split.samples(x.shape[0])

    def forward_chunk(self, x: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
        """The block on ``chunk``'s samples of the batch (``None``: the whole batch)."""
        raise NotImplementedError

    def _residuals(
        self, shortcut: torch.Tensor, a: torch.Tensor, chunk: Chunk | None
    ) -> torch.Tensor:
        """``shortcut + attention output a``, then the MLP branch; drop paths per sample."""
        x = shortcut + drop_path(self.drop_path1, a, chunk, dim=0)
        return x + drop_path(self.drop_path2, self.mlp(self.norm2(x), chunk, dim=0), chunk, dim=0)


class MViTTransitionBlock(MViTTransition):
    """The non-reversible block that opens a stage: pre-norm residual block whose attention
    pools queries by 2 and whose shortcut is max-pooled to match, ``(B, H, W, C) ->
    (B, ceil(H/2), ceil(W/2), C)``.

    Args:
        dim: width in and out (2C of the previous stage's streams).
        num_heads: attention heads (doubled from the previous stage).
        kv_stride: key/value pooling stride.
        window: attention window in tokens of the input map (0: global).
        input_size: expected input map ``(H, W)``.
        mlp_ratio, qkv_bias, pool_kernel, use_rel_pos, residual_pooling, drop_path: as in
            :class:`RevMViTBlock`.
        fusion_mlp_ratio: hidden ratio of a residual MLP applied to the input first (mixes
            the two streams); 0 for none.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kv_stride: int,
        window: int,
        input_size: Tuple[int, int],
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        pool_kernel: int = 3,
        use_rel_pos: bool = True,
        residual_pooling: bool = True,
        drop_path: float = 0.0,
        fusion_mlp_ratio: float = 0.0,
    ):
        super().__init__()
        self.fuse: nn.Module | None = None
        if fusion_mlp_ratio > 0:
            self.fuse = Mlp(dim, int(dim * fusion_mlp_ratio), act_layer=nn.GELU)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = PoolingAttention(
            dim,
            dim,
            num_heads,
            qkv_bias=qkv_bias,
            pool_kernel=pool_kernel,
            stride_q=2,
            stride_kv=kv_stride,
            window_size=window,
            use_rel_pos=use_rel_pos,
            input_size=input_size,
            residual_pooling=residual_pooling,
        )
        self.pool_skip = nn.MaxPool2d(3, stride=2, padding=1)
        self._init_mlp_branch(dim, mlp_ratio, drop_path)

    # In a sample: LayerNorm, pooling attention, the pooled shortcut and the MLP.
    def forward_chunk(self, x: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
        """The block on ``chunk``'s samples of the batch (``None``: the whole batch)."""
        if self.fuse is not None:
            x = x + self.fuse(x, chunk, dim=0)
        a = self.attn(self.norm1(x))  # (B, H', W', C)
        shortcut = self.pool_skip(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B, H', W', C)
        return self._residuals(shortcut, a, chunk)


def checkpoint_stage_end(
    module: nn.Module,
    x: Union[torch.Tensor, StageEnd],
    enabled: bool,
    chunking: Optional[Chunking] = None,
) -> torch.Tensor:
    """``module(stage_map(x))``, checkpointed when ``enabled`` so that it keeps the streams
    and not their join (NOTE [ Stage ends kept once ])."""
    if isinstance(x, StageEnd):
        return maybe_checkpoint(
            module,
            (x.y1, x.y2),
            enabled,
            chunking,
            join=functools.partial(join_streams, grid=x.grid),
        )
    return maybe_checkpoint(module, x, enabled, chunking)


class MViTStage(nn.Module):
    """An optional transition block, then an optional reversible stack; ``(B, H, W, C) ->
    (B, H', W', C')`` with C' = 2C when the stage has reversible blocks. Video maps
    ``(B, T, H, W, C)`` pass the same way (the stack gets ``hw=(T, H, W)``).

    The models chain :meth:`forward_ends`, which takes and gives :class:`StageEnd` streams
    (NOTE [ Stage ends kept once ]); ``forward`` gives the joined map."""

    def __init__(
        self, transition: nn.Module | None, stack: ReversibleStack | None, map_dims: int = 2
    ):
        super().__init__()
        self.transition = transition
        self.stack = stack
        self.map_dims = map_dims  # 2: images (H, W); 3: videos (T, H, W)
        # The transition under activation checkpointing (RevMViT.set_grad_checkpointing).
        self.grad_checkpointing = False

    def forward(self, x: Union[torch.Tensor, StageEnd]) -> torch.Tensor:
        return stage_map(self.forward_ends(x))

    def forward_ends(self, x: Union[torch.Tensor, StageEnd]) -> Union[torch.Tensor, StageEnd]:
        """A map or the previous stage's end to this stage's end (its map without a stack)."""
        # The transition recomputes in chunks as the stack's branches do (set_chunking).
        chunking = None if self.stack is None else self.stack.chunking
        if self.transition is None:
            x = stage_map(x)
        else:
            x = checkpoint_stage_end(self.transition, x, self.grad_checkpointing, chunking)
        if self.stack is None:
            return x
        # Unpacked to a fixed length, so that torch.fx can trace it.
        if self.map_dims == 3:
            B, T, H, W, C = x.shape
            grid: Tuple[int, ...] = (T, H, W)
        else:
            B, H, W, C = x.shape
            grid = (H, W)
        t = x.flatten(1, -2)  # (B, N, C); flatten, not reshape(B, -1, C): B may be 0
        y1, y2 = self.stack(t, t, hw=grid)
        # The streams are handed on only where the stack keeps them anyway; otherwise (plain
        # autograd, eval) they are joined here and only the joined map lives on.
        end = StageEnd(y1, y2, grid)
        return end if self.stack.keeps_outputs() else stage_map(end)


class MViTStagesMixin:
    """What every MViT shares: the patch embedding, ``forward_features`` (``_stem``, each
    stage's :meth:`MViTStage.forward_ends`, ``_end``) and the classifier reset.

    Each model writes its own ``forward``: torch.fx wraps the input checks named in
    ``pareprop.models._fx`` in the module of the traced ``forward`` only, and that module must
    be the one whose ``_stem`` calls them.
    """

    stages: nn.ModuleList
    norm: nn.LayerNorm
    head: nn.Module

    def _init_patch_embed(self, cfg: Any, size: Tuple[int, ...], what: str) -> Tuple[int, ...]:
        """Set ``patch_embed`` from ``cfg``'s patch fields (channels-last out); return its
        token grid for a ``size`` input (``what`` names that input in the error)."""
        self.patch_embed = PatchEmbed(
            cfg.in_chans,
            cfg.embed_dim,
            cfg.patch_kernel,
            cfg.patch_stride,
            cfg.patch_padding,
            flatten=False,
        )
        grid = self.patch_embed.output_size(size)
        if min(grid) < 1:
            raise ValueError(f"{what} is smaller than the patch embedding")
        return grid

    def _init_head(self, cfg: Any, num_features: int) -> None:
        """The final LayerNorm (where it acts is the model's ``forward_head``), the dropout
        before the classifier and the classifier."""
        self.num_classes = cfg.num_classes
        self.num_features = num_features
        self.norm = nn.LayerNorm(num_features, eps=1e-6)
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = make_head(num_features, cfg.num_classes)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a fresh one for ``num_classes`` (0: no classifier)."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"expected global_pool 'avg' (mean over tokens), got {global_pool!r}")
        self._replace_head(num_classes)  # type: ignore[attr-defined]
        self.head.to(self.norm.weight.device, self.norm.weight.dtype)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs to the last stage's map ``(B, [T',] H', W', num_features)`` (see ``_end``)."""
        x = self._stem(x)  # type: ignore[attr-defined]
        for stage in self.stages:
            x = stage.forward_ends(x)
        return self._end(x)  # type: ignore[attr-defined]


class RevMViT(MViTStagesMixin, StageFeaturesMixin, ReversibleImageModelMixin, nn.Module):
    """Reversible multiscale vision transformer (MViTv2 pooling attention).

    Args:
        cfg: the configuration; see :class:`MViTConfig`.
    """

    def __init__(self, cfg: MViTConfig):
        super().__init__()
        cfg = make_config(cfg, img_size=to_2tuple_int(cfg.img_size, "img_size"))
        _check_config(cfg)
        self.cfg = cfg
        grid = self._init_patch_embed(cfg, cfg.img_size, f"img_size {cfg.img_size}")
        plans = _plan(cfg, grid)
        self.num_stages = len(plans)
        # Smallest input whose map still halves at every transition.
        total_stride = cfg.patch_stride * 2 ** (self.num_stages - 1)
        self.min_size = (total_stride, total_stride)

        dpr = drop_path_rates(cfg.drop_path_rate, cfg.depth)
        common = dict(
            mlp_ratio=cfg.mlp_ratio,
            qkv_bias=cfg.qkv_bias,
            pool_kernel=cfg.pool_kernel,
            use_rel_pos=cfg.use_rel_pos,
            residual_pooling=cfg.residual_pooling,
        )
        stages, self.feature_info = [], []
        width = cfg.embed_dim
        for p in plans:
            self._check_stage(p)
            transition = None
            if p.transition is not None:
                transition = MViTTransitionBlock(
                    p.width,
                    p.num_heads,
                    p.kv_stride,
                    2 * p.window,  # the window measured on the input map
                    p.in_size,
                    drop_path=dpr[p.transition],
                    fusion_mlp_ratio=cfg.fusion_mlp_ratio,
                    **common,
                )
            stack = None
            if p.reversible:
                blocks = [
                    RevMViTBlock(
                        p.width,
                        p.num_heads,
                        p.kv_stride,
                        p.window,
                        p.size,
                        drop_path=dpr[i],
                        **common,
                    )
                    for i in p.reversible
                ]
                stack = ReversibleStack(blocks, engine=cfg.engine)
                width = 2 * p.width
            stages.append(MViTStage(transition, stack))
            reduction = cfg.patch_stride * 2**p.index
            self.feature_info.append(
                {"num_chs": width, "reduction": reduction, "module": f"stages.{p.index}"}
            )
        self.stages = nn.ModuleList(stages)

        self._init_head(cfg, width)
        self._set_image_pretrained_cfg(
            crop_pct=0.9 if cfg.img_size[0] >= 224 else 1.0, fixed_input_size=False
        )
        self._init_weights()

    @staticmethod
    def _check_stage(p: _StagePlan) -> None:
        if p.width % p.num_heads:
            raise ValueError(
                f"stage {p.index}: expected width {p.width} divisible by its {p.num_heads} "
                "heads (heads double every stage); lower num_heads or raise embed_dim"
            )
        w = p.window
        if w and (w % p.kv_stride or p.transition is not None and (2 * w) % (2 * p.kv_stride)):
            raise ValueError(
                f"stage {p.index}: expected a window divisible by the kv stride {p.kv_stride}, "
                f"got {w}; choose window_size a multiple of kv_stride * 2**stage"
            )

    def _init_weights(self) -> None:
        init_linears_(self.stages)

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith(("rel_pos_h", "rel_pos_w"))}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's parameter groups (layer-wise learning-rate decay): the stem, each block in
        depth order (a transition before its stage's stack), then the head
        (timm puts the final norm in the last block's group)."""
        return stage_group_matcher(coarse, r"^patch_embed")

    # -- forward --------------------------------------------------------------------------

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        x = check_image(x, self.cfg.in_chans, min_size=self.min_size)
        # Checkpointed, the stem keeps the images (which the caller holds anyway), not
        # autocast's low-precision copy of them.
        return maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing)  # (B, H, W, C)

    def _end(self, x: Union[torch.Tensor, StageEnd]) -> torch.Tensor:
        return stage_map(x)  # the norm acts on the pooled features, in forward_head

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.norm(x.mean(dim=(1, 2)))  # (B, C)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# fmt: off
MVIT_CONFIGS: Dict[str, MViTConfig] = {
    # The MViTv2-T layout (10 blocks).
    "rev_mvitv2_tiny": MViTConfig(depth=10, last_block_indexes=(0, 2, 7, 9)),
    # Between T and B (no published counterpart): 12 blocks.
    "rev_mvitv2_small": MViTConfig(depth=12, last_block_indexes=(0, 2, 9, 11)),
    # Rev-MViT-B of Mangalam et al. 2022 (39M params, 82.9% ImageNet top-1).
    "rev_mvitv2_base": MViTConfig(depth=16, last_block_indexes=(0, 2, 13, 15)),
    # The MViTv2-B layout (24 blocks): stacks of 2, 2, 15 and 2 blocks.
    "rev_mvitv2_large": MViTConfig(depth=24, last_block_indexes=(1, 4, 20, 23)),
    # CIFAR setting of SPEC section 4.
    "rev_mvitv2_tiny_32": MViTConfig(
        img_size=32, num_classes=10, embed_dim=64, depth=4, num_heads=1,
        last_block_indexes=(0, 2), patch_kernel=3, patch_stride=2, patch_padding=1,
        kv_stride=2, window_size=16, mean=CIFAR_MEAN, std=CIFAR_STD,
    ),
}
# fmt: on


def _create(name: str, **overrides: Any) -> RevMViT:
    return RevMViT(make_config(MVIT_CONFIGS[name], **overrides))


@register_model
def rev_mvitv2_tiny(**kwargs: Any) -> RevMViT:
    return _create("rev_mvitv2_tiny", **kwargs)


@register_model
def rev_mvitv2_small(**kwargs: Any) -> RevMViT:
    return _create("rev_mvitv2_small", **kwargs)


@register_model
def rev_mvitv2_base(**kwargs: Any) -> RevMViT:
    return _create("rev_mvitv2_base", **kwargs)


@register_model
def rev_mvitv2_large(**kwargs: Any) -> RevMViT:
    return _create("rev_mvitv2_large", **kwargs)


@register_model
def rev_mvitv2_tiny_32(**kwargs: Any) -> RevMViT:
    return _create("rev_mvitv2_tiny_32", **kwargs)
