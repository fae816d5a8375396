"""Reversible RoBERTa-style text encoder, and a standard (non-reversible) baseline of equal size.

RoBERTa: Liu et al., "RoBERTa: A Robustly Optimized BERT Pretraining Approach", 2019.
Reversible variant: Mangalam et al., "Reversible Vision Transformers", CVPR 2022; Zhu &
Mangalam, "PaReprop: Fast Parallelized Reversible Backpropagation", 2023.

Token and learned position embeddings, embedding LayerNorm and dropout, then one
:class:`~pareprop.engine.ReversibleStack` whose blocks couple F = LayerNorm + self-attention
(the padding mask reaches F as a stack keyword argument, so recomputation masks exactly as the
forward did) and G = LayerNorm + feed-forward (GELU). The two C-wide streams are concatenated,
normalised over 2C, pooled by a masked mean over the real tokens (or the first token with
``global_pool="first"``), and classified by a linear head.

Inputs are ``(input_ids, attention_mask)`` as for Hugging Face encoders: int64 ids ``(B, L)``
and a mask ``(B, L)``, 1 for real tokens, 0 for padding. ``inputs_embeds`` ``(B, L, C)`` can
replace ``input_ids`` (position embeddings are still added), so gradients with respect to the
embeddings can be checked. Position ids count real tokens only, so left and right padding give
real tokens the same positions.

``text_encoder_*`` are the baseline: the same embeddings and head around a stack of torch's
``nn.TransformerEncoderLayer`` (pre-norm, GELU), with optional activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pareprop.chunking import Chunk, Split, dropout
from pareprop.engine import ENGINES, ReversibleBlock, ReversibleStack
from pareprop.layers import make_config
from pareprop.layers.attention import attend
from pareprop.layers.drop import DropPath, drop_path
from pareprop.layers.mlp import Mlp
from pareprop.models._base import (
    ClassifierMixin,
    ReversibleModelMixin,
    drop_path_rates,
    init_weights_,
    make_head,
)
from pareprop.models._registry import register_model

__all__ = [
    "TextConfig",
    "TextEmbeddings",
    "TextSelfAttention",
    "RevTextBlock",
    "RevTextEncoder",
    "TextEncoder",
    "TEXT_VARIANTS",
]

_POOLS = ("mean", "first")


@dataclass
class TextConfig:
    """Everything needed to build a text encoder; named variants live in ``TEXT_VARIANTS``.

    ``drop_rate`` is the hidden dropout (embeddings, attention output, feed-forward, before the
    head). The baseline has one dropout rate per layer (torch's encoder layer), ``drop_rate``,
    and no drop-path.
    """

    vocab_size: int = 50265
    max_position_embeddings: int = 514
    pad_token_id: int = 1
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 2
    drop_rate: float = 0.1
    attn_drop_rate: float = 0.1
    drop_path_rate: float = 0.0
    layer_norm_eps: float = 1e-5
    global_pool: str = "mean"
    reversible: bool = True
    engine: str = "reversible"
    example_seq_len: int = 128  # length of example_inputs (bench, tests), <= max positions

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"expected engine in {ENGINES}, got {self.engine!r}")
        if not self.reversible and self.engine != "autograd":
            raise ValueError(
                f"the non-reversible baseline only runs engine='autograd', got {self.engine!r}; "
                "use a rev_roberta_* model for the reversible engines"
            )
        if not self.reversible and self.drop_path_rate > 0:
            raise ValueError(
                f"the baseline (torch's TransformerEncoderLayer) has no drop-path, "
                f"got drop_path_rate={self.drop_path_rate}"
            )
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"expected embed_dim divisible by num_heads, got {self.embed_dim} and "
                f"{self.num_heads}"
            )
        if self.global_pool not in _POOLS:
            raise ValueError(f"expected global_pool in {_POOLS}, got {self.global_pool!r}")
        if not 1 <= self.example_seq_len <= self.max_position_embeddings:
            raise ValueError(
                f"expected 1 <= example_seq_len <= max_position_embeddings="
                f"{self.max_position_embeddings}, got {self.example_seq_len}"
            )
        if self.depth < 1:
            raise ValueError(f"expected depth >= 1, got {self.depth}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"expected pad_token_id in [0, {self.vocab_size}), got {self.pad_token_id}"
            )



class TextEmbeddings(nn.Module):
    """Token + learned position embeddings, LayerNorm, dropout."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.embed_dim, cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.embed_dim)
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.drop_rate)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        mask: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        # Count real tokens only: a sequence gets the same positions under left or right padding.
        positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L)
        x = x + self.position_embeddings(positions)  # (B, L, C)
        return self.drop(self.norm(x))


class TextSelfAttention(nn.Module):
    """Multi-head self-attention over ``(B, L, C)`` with an optional key mask.

    Args:
        dim: Channels in and out.
        num_heads: Attention heads.
        attn_drop: Dropout on the attention weights.
        proj_drop: Dropout after the output projection.
    """

    def __init__(self, dim: int, num_heads: int, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        chunk: Chunk | None = None,
    ) -> torch.Tensor:
        """``attn_mask``: boolean ``(B, 1, 1, L)``, True for keys that may be attended to.
        ``chunk``: ``x`` is that chunk of the batch (for its dropout masks; NOTE [ Exact
        randomness in chunks ] in pareprop/chunking.py)."""
        B, L, C = x.shape
        qkv = self.qkv(x).view(B, L, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, L, head_dim)
        p = self.attn_drop if self.training else 0.0
        x = attend(q, k, v, attn_mask, dropout_p=p, chunk=chunk)
        x = x.transpose(1, 2).reshape(B, L, C)  # (B, L, C)
        return dropout(self.proj(x), self.proj_drop.p, self.training, chunk, dim=0)


class RevTextBlock(ReversibleBlock):
    """Reversible encoder block: F = LayerNorm + self-attention, G = LayerNorm + feed-forward."""

    def __init__(self, cfg: TextConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        C = cfg.embed_dim
        self.norm1 = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
        self.attn = TextSelfAttention(C, cfg.num_heads, cfg.attn_drop_rate, cfg.drop_rate)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(C, hidden_features=cfg.mlp_dim, act_layer=nn.GELU, drop=cfg.drop_rate)

    def f(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **kwargs: Any):
        return self.drop_path(self.attn(self.norm1(x), attn_mask))

    def g(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.drop_path(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone (with its own key mask), G on each token alone.
    def f_split(self, x: torch.Tensor, **kwargs: Any) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(
        self, x: torch.Tensor, chunk: Chunk, attn_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        if attn_mask is not None:
            attn_mask = chunk.take(attn_mask, 0)  # (b, 1, 1, L): this chunk's samples
        x = self.attn(self.norm1(x), attn_mask, chunk)
        return drop_path(self.drop_path, x, chunk, dim=0)

    def g_split(self, x: torch.Tensor, **kwargs: Any) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk, **kwargs: Any) -> torch.Tensor:
        return drop_path(self.drop_path, self.mlp(self.norm2(x), chunk), chunk)


class _TextModel(ClassifierMixin, nn.Module):
    """Inputs, embeddings, pooling and head shared by the reversible model and the baseline."""

    def __init__(self, cfg: TextConfig, num_features: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.num_features = num_features
        self.embeddings = TextEmbeddings(cfg)
        self.norm = nn.LayerNorm(num_features, eps=cfg.layer_norm_eps)
        self.head_drop = nn.Dropout(cfg.drop_rate)
        # Initialised with everything else by the subclass's apply(self._init_weights).
        self.head = make_head(num_features, cfg.num_classes, init=False)
        # Text has no pixel statistics; mean and std are kept so every model has the same keys.
        self._set_pretrained_cfg(
            (cfg.example_seq_len,),
            None,
            None,
            vocab_size=cfg.vocab_size,
            pad_token_id=cfg.pad_token_id,
        )

    def _init_weights(self, m: nn.Module) -> None:
        """RoBERTa's initialisation: plain (untruncated) normals with std 0.02."""
        init_weights_(m, truncated=False)
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()

    def _check_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """Validate the inputs; returns the boolean mask ``(B, L)``, True for real tokens."""
        cfg = self.cfg
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("expected exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if not torch.is_tensor(input_ids) or input_ids.dtype not in (torch.int64, torch.int32):
                got = input_ids.dtype if torch.is_tensor(input_ids) else type(input_ids).__name__
                raise ValueError(f"expected input_ids of dtype torch.int64, got {got}")
            if input_ids.dim() != 2:
                raise ValueError(
                    f"expected input_ids of shape (B, L), got {tuple(input_ids.shape)}"
                )
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(
                    f"expected token ids in [0, {cfg.vocab_size}), got ids in [{lo}, {hi}]"
                )
            shape = tuple(input_ids.shape)
            device = input_ids.device
        else:
            if (
                not torch.is_tensor(inputs_embeds)
                or not inputs_embeds.is_floating_point()
                or inputs_embeds.dim() != 3
                or inputs_embeds.shape[-1] != cfg.embed_dim
            ):
                got = (
                    f"{inputs_embeds.dtype} {tuple(inputs_embeds.shape)}"
                    if torch.is_tensor(inputs_embeds)
                    else type(inputs_embeds).__name__
                )
                raise ValueError(f"expected float inputs_embeds (B, L, {cfg.embed_dim}), got {got}")
            shape = tuple(inputs_embeds.shape[:2])
            device = inputs_embeds.device
        if shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"expected at most {cfg.max_position_embeddings} tokens per sequence "
                f"(max_position_embeddings), got {shape[1]}; truncate the input"
            )
        if attention_mask is None:
            return torch.ones(shape, dtype=torch.bool, device=device)
        if not torch.is_tensor(attention_mask) or tuple(attention_mask.shape) != shape:
            got = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else attention_mask
            raise ValueError(f"expected attention_mask of shape {shape}, got {got}")
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            raise ValueError(
                f"expected an integer or bool attention_mask (1 real, 0 padding), "
                f"got {attention_mask.dtype}"
            )
        if attention_mask.dtype != torch.bool and bool(
            ((attention_mask != 0) & (attention_mask != 1)).any()
        ):
            raise ValueError("expected attention_mask values 0 (padding) and 1 (real tokens)")
        # A copy, never the caller's tensor (.bool() of a bool tensor is the tensor itself): the
        # reversible engines reuse the mask in backward, and a caller may refill its buffer for
        # the next batch before that (NOTE [ Keyword tensors in recomputation ] in
        # engine/replay.py).
        mask = attention_mask.to(torch.bool, copy=True)
        if not bool(mask.any(dim=1).all()):
            raise ValueError("expected at least one real token (mask 1) in every sequence")
        return mask

    def _encode(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_features(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normalised final token features ``(B, L, num_features)``; padded positions are junk."""
        mask = self._check_inputs(input_ids, attention_mask, inputs_embeds)
        x = self.embeddings(input_ids, mask, inputs_embeds)  # (B, L, C)
        return self.norm(self._encode(x, mask))

    def forward_head(
        self,
        x: torch.Tensor,
        pre_logits: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pool ``(B, L, num_features)`` (masked mean over real tokens, or the first token)."""
        if self.cfg.global_pool == "first":
            x = x[:, 0]
        elif attention_mask is None:
            x = x.mean(dim=1)
        else:
            w = attention_mask.to(x.dtype).unsqueeze(-1)  # (B, L, 1)
            x = (x * w).sum(dim=1) / w.sum(dim=1)  # (B, num_features)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, num_classes)`` from ``input_ids`` (or ``inputs_embeds``) and the mask."""
        x = self.forward_features(input_ids, attention_mask, inputs_embeds)
        return self.forward_head(x, attention_mask=attention_mask)

    def no_weight_decay(self) -> Set[str]:
        return {"embeddings.position_embeddings.weight"}

    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's parameter groups (layer-wise learning-rate decay): the embeddings, each
        block, then the head
        (timm puts the final norm in the last block's group)."""
        return {
            "stem": r"^embeddings",
            "blocks": [(r"^blocks\.blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    def reset_classifier(self, num_classes: int) -> None:
        w = self.norm.weight  # the new head lives where the model lives
        self._replace_head(num_classes, truncated=False, device=w.device, dtype=w.dtype)

    def example_inputs(
        self,
        batch_size: int,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        seq_len: int | None = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Random ``(input_ids, attention_mask)`` (int64) with right padding in most rows.

        Row ``b`` keeps ``L - (b % 4) * L // 8`` real tokens, so a batch of two or more has
        padding. ``dtype`` is accepted for the common signature; ids and mask are integers.
        """
        L = seq_len or self.cfg.example_seq_len
        ids = torch.randint(0, self.cfg.vocab_size, (batch_size, L), device=device)
        lengths = torch.tensor([max(1, L - (b % 4) * (L // 8)) for b in range(batch_size)])
        mask = (torch.arange(L)[None, :] < lengths[:, None]).long().to(device)  # (B, L)
        ids = ids.masked_fill(mask == 0, self.cfg.pad_token_id)
        return ids, mask


class RevTextEncoder(ReversibleModelMixin, _TextModel):
    """Reversible RoBERTa-style encoder for sequence classification (``num_features = 2C``).

    Args:
        cfg: Model configuration; see :class:`TextConfig`.
    """

    _cfg_records_engine = True  # TextConfig is mutable

    def __init__(self, cfg: TextConfig) -> None:
        if not cfg.reversible:
            raise ValueError("RevTextEncoder needs cfg.reversible=True; use TextEncoder")
        super().__init__(cfg, num_features=2 * cfg.embed_dim)
        dpr = drop_path_rates(cfg.drop_path_rate, cfg.depth)
        self.blocks = ReversibleStack(
            [RevTextBlock(cfg, drop_path=dpr[i]) for i in range(cfg.depth)], engine=cfg.engine
        )
        self.apply(self._init_weights)

    def _encode(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The mask goes through the stack as a keyword, so recomputation in backward sees it.
        # None when nothing is padded: SDPA then may pick its fastest kernels.
        kwargs = {} if bool(mask.all()) else {"attn_mask": mask[:, None, None, :]}
        x1, x2 = self.blocks(x, x, **kwargs)
        return torch.cat([x1, x2], dim=-1)  # (B, L, 2C)


class TextEncoder(_TextModel):
    """Standard pre-norm encoder from torch's ``nn.TransformerEncoderLayer`` (the baseline).

    Same embeddings, widths, pooling and head as :class:`RevTextEncoder`, but one residual
    stream (``num_features = C``). ``set_grad_checkpointing()`` recomputes each layer in
    backward (``torch.utils.checkpoint``, non-reentrant): the "checkpointed" baseline.

    Args:
        cfg: Model configuration; ``cfg.reversible`` must be False.
    """

    def __init__(self, cfg: TextConfig) -> None:
        if cfg.reversible:
            raise ValueError("TextEncoder needs cfg.reversible=False; use RevTextEncoder")
        super().__init__(cfg, num_features=cfg.embed_dim)
        self.grad_checkpointing = False
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.embed_dim,
                cfg.num_heads,
                dim_feedforward=cfg.mlp_dim,
                dropout=cfg.drop_rate,
                activation="gelu",
                layer_norm_eps=cfg.layer_norm_eps,
                batch_first=True,
                norm_first=True,
            )
            for _ in range(cfg.depth)
        )
        self.apply(self._init_weights)

    def _encode(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pad = None if bool(mask.all()) else ~mask  # torch's convention: True = ignore
        for layer in self.layers:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, src_key_padding_mask=pad, use_reentrant=False)
            else:
                x = layer(x, src_key_padding_mask=pad)
        return x  # (B, L, C)

    def set_engine(self, name: str) -> TextEncoder:
        """Only ``"autograd"`` exists here: the baseline has no reversible stack."""
        if name != "autograd":
            raise ValueError(
                f"text_encoder_* is the non-reversible baseline and runs engine 'autograd' only, "
                f"got {name!r}; use rev_roberta_* for the reversible engines"
            )
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _init_weights(self, m: nn.Module) -> None:
        super()._init_weights(m)
        if isinstance(m, nn.MultiheadAttention):
            nn.init.normal_(m.in_proj_weight, std=0.02)
            nn.init.zeros_(m.in_proj_bias)


_BASE = dict(embed_dim=768, depth=12, num_heads=12, mlp_dim=3072)
_SMALL = dict(embed_dim=256, depth=4, num_heads=4, mlp_dim=1024)
_BASELINE = dict(reversible=False, engine="autograd")

TEXT_VARIANTS: Dict[str, TextConfig] = {
    "rev_roberta_base": TextConfig(**_BASE),
    "rev_roberta_small": TextConfig(**_SMALL),
    "text_encoder_base": TextConfig(**_BASE, **_BASELINE),
    "text_encoder_small": TextConfig(**_SMALL, **_BASELINE),
}


def _create(name: str, **overrides: Any) -> _TextModel:
    cfg = make_config(TEXT_VARIANTS[name], **overrides)
    return RevTextEncoder(cfg) if cfg.reversible else TextEncoder(cfg)


@register_model(timm=False)
def rev_roberta_base(**kwargs: Any) -> RevTextEncoder:
    return _create("rev_roberta_base", **kwargs)


@register_model(timm=False)
def rev_roberta_small(**kwargs: Any) -> RevTextEncoder:
    return _create("rev_roberta_small", **kwargs)


@register_model(timm=False)
def text_encoder_base(**kwargs: Any) -> TextEncoder:
    return _create("text_encoder_base", **kwargs)


@register_model(timm=False)
def text_encoder_small(**kwargs: Any) -> TextEncoder:
    return _create("text_encoder_small", **kwargs)
