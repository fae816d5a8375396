"""Rev-ViT: a Vision Transformer whose blocks form one reversible stack.

Mangalam et al., "Reversible Vision Transformers", CVPR 2022; Zhu & Mangalam, "PaReprop: Fast
Parallelized Reversible Backpropagation", 2023. The blocks are the ViT blocks of Dosovitskiy
et al. (2021) split into the two halves of a reversible coupling: F is LayerNorm + attention,
G is LayerNorm + MLP, and Y1 = X1 + F(X2), Y2 = X2 + G(Y1). The stack starts from two copies of
the patch tokens and ends with the two streams side by side (width 2C), so the head sees
``num_features = 2 * embed_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from timm.models._features import feature_take_indices

from pareprop.chunking import Chunk, Split
from pareprop.engine import ENGINES, ReversibleBlock, ReversibleStack
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.layers import Attention, PatchEmbed, check_image, make_config, to_2tuple_int
from pareprop.layers.drop import DropPath, drop_path
from pareprop.layers.mlp import Mlp
from pareprop.models._base import (
    CIFAR_MEAN,
    CIFAR_STD,
    ReversibleImageModelMixin,
    drop_path_rates,
    init_linears_,
    make_head,
)
from pareprop.models._features import check_output_fmt, join_streams
from pareprop.models._registry import register_model
from pareprop.models.published import PretrainedError, detect_layout

__all__ = ["ViTConfig", "RevViT", "RevViTBlock", "VIT_CONFIGS", "checkpoint_filter_fn"]


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a Rev-ViT; named variants are rows of :data:`VIT_CONFIGS`."""

    img_size: Union[int, Tuple[int, int]] = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_rate: float = 0.0  # dropout before the classifier
    attn_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    engine: str = "reversible"
    # True (the published Rev-ViT): LayerNorm(2C) on every token, then the mean over tokens.
    # False: the mean first, then LayerNorm(2C) (pareprop's placement before the published
    # weights were loadable; kept for checkpoints trained that way).
    norm_before_pool: bool = True
    mean: Tuple[float, ...] = IMAGENET_DEFAULT_MEAN
    std: Tuple[float, ...] = IMAGENET_DEFAULT_STD


def _check_common(cfg: Any) -> None:
    if cfg.engine not in ENGINES:
        raise ValueError(f"expected engine in {ENGINES}, got {cfg.engine!r}")
    if cfg.embed_dim % cfg.num_heads != 0:
        raise ValueError(
            f"expected embed_dim divisible by num_heads, got {cfg.embed_dim} and {cfg.num_heads}"
        )
    if cfg.num_classes < 0:
        raise ValueError(f"expected num_classes >= 0, got {cfg.num_classes}")


class RevViTBlock(ReversibleBlock):
    """One ViT block as a reversible coupling: F = attention branch, G = MLP branch.

    Args:
        dim: token width C of each stream.
        num_heads: attention heads.
        mlp_ratio: hidden width of the MLP over ``dim``.
        qkv_bias: bias in the query/key/value projection.
        attn_drop: dropout on attention weights.
        proj_drop: dropout after the projections.
        drop_path: stochastic-depth rate of both branches.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, proj_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_path1(self.attn(self.norm1(x)))

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_path2(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone, G on each token alone.
    def f_split(self, x: torch.Tensor) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return drop_path(self.drop_path1, self.attn(self.norm1(x), chunk), chunk, dim=0)

    def g_split(self, x: torch.Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return drop_path(self.drop_path2, self.mlp(self.norm2(x), chunk), chunk)


class RevViT(ReversibleImageModelMixin, nn.Module):
    """Reversible Vision Transformer.

    Args:
        cfg: the configuration; see :class:`ViTConfig`.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        cfg = make_config(cfg, img_size=to_2tuple_int(cfg.img_size, "img_size"))
        _check_common(cfg)
        H, W = cfg.img_size
        if H % cfg.patch_size or W % cfg.patch_size:
            raise ValueError(
                f"expected img_size divisible by patch_size={cfg.patch_size}, got {H}x{W}"
            )
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.num_features = 2 * cfg.embed_dim
        # The published evaluation transform: resize to 256 (bicubic), centre crop 224.
        self._set_image_pretrained_cfg(crop_pct=0.875 if H >= 224 else 1.0, fixed_input_size=True)

        self.patch_embed = PatchEmbed(
            cfg.in_chans, cfg.embed_dim, cfg.patch_size, cfg.patch_size, flatten=True
        )
        self.grid_size = self.patch_embed.output_size((H, W))
        num_patches = self.grid_size[0] * self.grid_size[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, cfg.embed_dim))

        dpr = drop_path_rates(cfg.drop_path_rate, cfg.depth)
        blocks = [
            RevViTBlock(
                cfg.embed_dim,
                cfg.num_heads,
                cfg.mlp_ratio,
                cfg.qkv_bias,
                cfg.attn_drop_rate,
                cfg.proj_drop_rate,
                dpr[i],
            )
            for i in range(cfg.depth)
        ]
        self.stack = ReversibleStack(blocks, engine=cfg.engine)
        # One reversible stack: its end is the only feature that costs no memory (NOTE
        # [ Features from stage ends only ] in models/_features.py).
        self.feature_info = [
            {"num_chs": 2 * cfg.embed_dim, "reduction": cfg.patch_size, "module": "stack"}
        ]
        # timm's names: ``norm`` acts on every token, ``fc_norm`` on the pooled features; the
        # one not in use is an identity (NOTE [ Published Rev-ViT head ] below).
        final_norm = nn.LayerNorm(self.num_features, eps=1e-6)
        self.norm = final_norm if cfg.norm_before_pool else nn.Identity()
        self.fc_norm = nn.Identity() if cfg.norm_before_pool else final_norm
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = make_head(self.num_features, cfg.num_classes)
        self._pooled_tokens = _PooledTokens(self)  # not a submodule: it owns no parameters
        self._init_weights()

    def _init_weights(self) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        init_linears_(self.stack)

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's parameter groups (layer-wise learning-rate decay): the stem, each block,
        then the head (timm puts the final norm in the last block's group)."""
        return {
            "stem": r"^pos_embed|^patch_embed",
            "blocks": [(r"^stack\.blocks\.(\d+)", None), (r"^norm|^fc_norm", (99999,))],
        }

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a fresh one for ``num_classes`` (0: no classifier)."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"expected global_pool 'avg' (mean over tokens), got {global_pool!r}")
        self._replace_head(num_classes)
        self.head.to(self.pos_embed.device, self.pos_embed.dtype)

    # -- forward --------------------------------------------------------------------------

    # NOTE [ Published Rev-ViT head ]
    # PySlowFast's Rev-ViT (and mmpretrain's port of it) normalises every token of the 2C-wide
    # stack output with LayerNorm(2C, eps 1e-6) and then averages the tokens; the two do not
    # commute (LayerNorm is not linear), so the published weights only reproduce their logits
    # with this order. As in timm's VisionTransformer, ``forward_features`` ends with ``norm``
    # and ``forward_head`` pools, then applies ``fc_norm`` (an identity here unless
    # ``norm_before_pool=False``).

    def _streams(
        self, x: torch.Tensor, checkpoint_stem: bool = False
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        x = check_image(x, self.cfg.in_chans, img_size=self.cfg.img_size)
        x = maybe_checkpoint(self.patch_embed, x, checkpoint_stem) + self.pos_embed  # (B, N, C)
        return self.stack(x, x)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self._streams(x)  # unpacked: torch.fx's proxies iterate only this way
        return join_streams(x1, x2)  # (B, N, 2C)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` to the normalised output tokens ``(B, N, 2 * embed_dim)``."""
        return self.norm(self._tokens(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, Sequence[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's ``forward_intermediates`` with one feature, the stack's end, as a map.

        ``indices`` selects that one feature (None, 1, ``[0]`` or ``[-1]``); a block inside
        the stack raises, as its output is never kept. ``norm`` applies the final LayerNorm per
        token. ``stop_early`` changes nothing (there is nothing after the stack's end).
        """
        check_output_fmt(output_fmt)
        take, _ = feature_take_indices(1, indices)
        raw = self._tokens(x)  # (B, N, 2C)
        tokens = self.norm(raw)
        final_norm = self.fc_norm if isinstance(self.norm, nn.Identity) else self.norm
        y = final_norm(raw) if norm else raw
        y = y.reshape(y.shape[0], *self.grid_size, y.shape[-1])  # (B, H', W', 2C)
        features = [y.permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else y] * len(
            take
        )
        return features if intermediates_only else (tokens, features)

    def prune_intermediate_layers(
        self,
        indices: Optional[Union[int, Sequence[int]]] = 1,
        prune_norm: bool = False,
        prune_head: bool = True,
    ) -> List[int]:
        """Keeps every block (the one feature is the stack's end); drops the head if asked."""
        take, _ = feature_take_indices(1, indices)
        if prune_head:
            self.reset_classifier(0)
        if prune_norm:
            self.norm = nn.Identity()
            self.fc_norm = nn.Identity()
        return take

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self._classify(x.mean(dim=1), pre_logits)  # (B, 2C) pooled

    def _classify(self, pooled: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.fc_norm(pooled))
        return x if pre_logits else self.head(x)

    # NOTE [ Rev-ViT's head in chunks ]
    # Once the stack's branches are chunked, the head sets the step's peak: LayerNorm over the
    # 2C concatenation of the two streams, in float32 under autocast, for every token. Its
    # forward keeps the concatenation (two stream maps) and its backward makes two more of that
    # size (the pooled gradient spread over the tokens, and LayerNorm's input gradient): six
    # stream maps beside the two streams the stack keeps, 22 GiB of Rev-ViT-B's planned 36 at
    # batch 6520. So with chunking on (under the reversible engines, which chunk), the tokens
    # are normalised and pooled under activation checkpointing, a chunk of samples at a time
    # (NOTE [ Checkpointed blocks in chunks ] in layers/recompute.py), joining the streams
    # inside each chunk's checkpoint: forward keeps nothing but the streams, and backward
    # rebuilds one chunk's maps at a time. The pooled features are those of
    # forward_head(forward_features(x)), by the same operations. The patch embedding runs
    # checkpointed too: it then keeps the images (held by the caller anyway), not autocast's
    # bfloat16 copy of them (0.29 MiB a 224 px image, 2.6 GiB at batch 9241).

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunking = self.stack.chunking
        if chunking is None or self.stack.engine == "autograd" or not torch.is_grad_enabled():
            return self.forward_head(self.forward_features(x))
        x1, x2 = self._streams(x, checkpoint_stem=True)
        pooled = maybe_checkpoint(self._pooled_tokens, (x1, x2), True, chunking,
                                  join=join_streams)  # (B, 2C)
        return self._classify(pooled)

    def checkpoint_filter(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """:func:`checkpoint_filter_fn` on this model (what ``pareprop.load_pretrained`` uses)."""
        return checkpoint_filter_fn(state, self)


class _PooledTokens:
    """The head's token part, ``norm(tokens).mean(1)``, checkpointed in chunks of samples
    (NOTE [ Rev-ViT's head in chunks ]). Holds the model, not its norm, so that a norm
    replaced later (``prune_intermediate_layers``) is the one used."""

    def __init__(self, model: "RevViT"):
        self.model = model

    def parameters(self) -> Any:
        return self.model.norm.parameters()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x).mean(dim=1)  # (B, 2C)

    def split(self, x: torch.Tensor) -> Split:
        return Split.samples(x.shape[0])

    def forward_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return self(x)  # nothing random: a chunk's samples are pooled as the whole batch's


def checkpoint_filter_fn(
    state_dict: Dict[str, torch.Tensor], model: RevViT
) -> Dict[str, torch.Tensor]:
    """Map a published Rev-ViT state dict (PySlowFast's or mmpretrain's) onto ``model``'s names.

    PySlowFast: ``rev_backbone.layers.{i}.F.norm / F.attn.{q,k,v,proj} / G.norm / G.mlp.*``,
    ``norm`` (2C), ``head.projection``. mmpretrain: ``backbone.layers.{i}.ln1 / attn.qkv /
    attn.proj / ln2 / ffn.layers.0.0 / ffn.layers.1``, ``backbone.ln1`` (2C), ``head.fc``,
    and a position embedding that may carry an unused class-token slot first. Separate q, k,
    v maps are stacked into ``qkv`` (same product, one matmul). Keys of no known layout are
    passed through, so that the strict check names them.
    """
    layout = detect_layout(state_dict)
    if layout == "pareprop":
        return state_dict
    if not model.cfg.norm_before_pool:
        raise PretrainedError(
            "the published Rev-ViT normalises every token before the mean: create the model "
            "with norm_before_pool=True (the default) to load its weights"
        )
    if layout == "pyslowfast":
        block = {"F.norm": "norm1", "F.attn": "attn", "G.norm": "norm2", "G.mlp": "mlp"}
        top = {"norm": "norm", "head.projection": "head"}
        prefix = "rev_backbone.layers."
    else:
        block = {"ln1": "norm1", "attn": "attn", "ln2": "norm2",
                 "ffn.layers.0.0": "mlp.fc1", "ffn.layers.1": "mlp.fc2"}
        top = {"backbone.ln1": "norm", "head.fc": "head",
               "backbone.patch_embed.projection": "patch_embed.proj",
               "backbone.pos_embed": "pos_embed"}
        prefix = "backbone.layers."
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key == "backbone.cls_token":
            continue  # mmpretrain keeps a class token the reversible model never uses
        new = key
        if key.startswith(prefix):
            i, rest = key[len(prefix):].split(".", 1)
            for old, ours in block.items():
                if rest.startswith(old + "."):
                    rest = ours + rest[len(old):]
                    break
            new = f"stack.blocks.{i}.{rest}"
            part = rest.split(".")
            if len(part) == 3 and part[0] == "attn" and part[1] in ("q", "k", "v"):
                qkv.setdefault(f"stack.blocks.{i}.attn.qkv.{part[2]}", {})[part[1]] = value
                continue
        else:
            for old, ours in top.items():
                if key.startswith(old + ".") or key == old:
                    new = ours + key[len(old):]
                    break
        out[new] = value
    for key, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise PretrainedError(
                f"incomplete attention in the file: {key} has only {sorted(parts)}"
            )
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    pos = out.get("pos_embed")
    if pos is not None and pos.ndim == 3 and pos.shape[1] == model.pos_embed.shape[1] + 1:
        out["pos_embed"] = pos[:, 1:]  # the class-token slot mmpretrain's conversion adds
    w = out.get("patch_embed.proj.weight")
    if w is not None and w.ndim == 5 and w.shape[2] == 1:
        out["patch_embed.proj.weight"] = w.squeeze(2)  # a 3-D patch convolution of one frame
    return out


# fmt: off
VIT_CONFIGS: Dict[str, ViTConfig] = {
    "rev_vit_tiny_patch16_224": ViTConfig(embed_dim=192, depth=12, num_heads=3),
    "rev_vit_small_patch16_224": ViTConfig(embed_dim=384, depth=12, num_heads=6),
    "rev_vit_base_patch16_224": ViTConfig(embed_dim=768, depth=12, num_heads=12),
    "rev_vit_large_patch16_224": ViTConfig(embed_dim=1024, depth=24, num_heads=16),
    # CIFAR scale (SPEC section 3): 32x32 input, 4x4 patches, 64 tokens.
    "rev_vit_tiny_patch4_32": ViTConfig(
        img_size=32, patch_size=4, num_classes=10, embed_dim=192, depth=6, num_heads=3,
        mean=CIFAR_MEAN, std=CIFAR_STD,
    ),
}
# fmt: on


def _create(name: str, **overrides: Any) -> RevViT:
    return RevViT(make_config(VIT_CONFIGS[name], **overrides))


@register_model
def rev_vit_tiny_patch16_224(**kwargs: Any) -> RevViT:
    return _create("rev_vit_tiny_patch16_224", **kwargs)


@register_model
def rev_vit_small_patch16_224(**kwargs: Any) -> RevViT:
    return _create("rev_vit_small_patch16_224", **kwargs)


@register_model
def rev_vit_base_patch16_224(**kwargs: Any) -> RevViT:
    return _create("rev_vit_base_patch16_224", **kwargs)


@register_model
def rev_vit_large_patch16_224(**kwargs: Any) -> RevViT:
    return _create("rev_vit_large_patch16_224", **kwargs)


@register_model
def rev_vit_tiny_patch4_32(**kwargs: Any) -> RevViT:
    return _create("rev_vit_tiny_patch4_32", **kwargs)
