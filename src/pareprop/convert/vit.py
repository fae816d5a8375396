"""A pretrained timm ViT rewired as a dual-residual reversible network, exactly.

Dr2Net (Zhao et al., CVPR 2024) and Re2TAL (Zhao et al., CVPR 2023). A pre-norm ViT is a chain
of residual sub-layers z_{j+1} = z_j + H_j(z_j), H_1 .. H_2L alternating attention and MLP
branches (each with its norm, layer scale and drop-path). The dual-residual coupling keeps two
states and two coefficients,

    z_{j+1} = alpha * z_j + beta * z_{j-1} + H_j(z_j),      z_0 = z_1 = x,

which is timm's network at (alpha, beta) = (1, 0) and Rev-ViT's coupling at (0, 1). Block k of
the stack holds (X1, X2) = (z_{2k-2}, z_{2k-1}) and computes

    Y1 = beta * X1 + F(X2),  F(x) = alpha * x + H_{2k-1}(x)    (attention branch)
    Y2 = beta * X2 + G(Y1),  G(y) = alpha * y + H_{2k}(y)      (MLP branch)

so alpha lives in the blocks and the engines see a coupling with skip scale beta (NOTE
[ Skip scale of the coupling ] in pareprop/engine/block.py). The stack starts from (x, x) and the
head reads Y2 of the last block, z_{2L+1}: timm's final norm, pooling and head stay valid.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import timm
import torch
import torch.nn as nn
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import Block, VisionTransformer, checkpoint_filter_fn

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import (
    CoupledBlock,
    drop_path_samples,
    fused_attention_dropout,
    sliced_dropouts,
)
from pareprop.convert.coupling import coupling_pair, set_coupling
from pareprop.convert.source import (
    UnsupportedModelError,
    build_source,
    convert,
    converts,
    keep_source_names,
    refuse_grad_checkpointing,
    refuse_hooks,
    register_source_names,
)
from pareprop.convert.weights import check_saved_coupling, load_classifier_source_weights
from pareprop.engine import ReversibleStack
from pareprop.models import ReversibleModelMixin, check_output_fmt, make_head, register_model

__all__ = [
    "ConvertedViT", "ConvertedBlock", "check_convertible", "converted_vit", "load_timm_weights",
]

# The parts of a timm Block that make its two residual branches, in timm's names (so the
# block's parameters keep timm's names).
_BRANCH_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")


class ConvertedBlock(CoupledBlock):
    """A timm pre-norm ``Block`` as a coupling with skip scale beta:
    F(x) = alpha x + drop_path1(ls1(attn(norm1(x)))),
    G(y) = alpha y + drop_path2(ls2(mlp(norm2(y)))).

    Shares the timm block's modules (no copy).
    """

    def __init__(self, block: Block):
        super().__init__(**{name: getattr(block, name) for name in _BRANCH_PARTS})

    def f(self, x: torch.Tensor) -> torch.Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum timm computes (1.0 * x is x exactly).
        return self.alpha * x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py; NOTE [ timm's layers
    # in chunks ] in pareprop/convert/block.py): F acts on each sample alone, G on each token alone.
    def f_split(self, x: torch.Tensor) -> Optional[Split]:
        if self.attn.training and fused_attention_dropout(self.attn):
            return None  # SDPA draws its mask inside the kernel: F runs whole
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        with sliced_dropouts(self.attn, chunk, dim=0):
            h = self.ls1(self.attn(self.norm1(x)))  # (b, N, C)
        return self.alpha * x + drop_path_samples(self.drop_path1, h, chunk)

    def g_split(self, x: torch.Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        with sliced_dropouts(self.mlp, chunk, dim=1):
            h = self.ls2(self.mlp(self.norm2(x)))  # (B, n, C)
        # timm's drop-path draws one value per sample: on a chunk of tokens, the whole draw.
        return self.alpha * x + self.drop_path2(h)


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is a timm
    ``VisionTransformer`` whose blocks are all pre-norm two-branch ``Block``s."""
    if type(model) is not VisionTransformer:
        if isinstance(model, VisionTransformer):
            raise UnsupportedModelError(
                f"{type(model).__name__} subclasses timm's VisionTransformer and may change its "
                "forward (a distillation token, a second head); only VisionTransformer itself "
                "is converted exactly"
            )
        raise UnsupportedModelError(
            f"expected a timm VisionTransformer (vit_*, deit_*, ...), got {type(model).__name__}"
        )
    for i, block in enumerate(model.blocks):
        kind = type(block).__name__
        if kind == "ResPostBlock":
            raise UnsupportedModelError(
                f"block {i} is post-norm (ResPostBlock: x + norm(H(x))); the coupling needs "
                "pre-norm residual branches x + H(x)"
            )
        if "Parallel" in kind:
            raise UnsupportedModelError(
                f"block {i} ({kind}) runs its branches in parallel (x + H1(x) + H2(x)); the "
                "coupling needs two residual branches in sequence"
            )
        if type(block) is not Block:
            raise UnsupportedModelError(
                f"block {i} is a {kind}, not timm's pre-norm Block of two residual branches "
                "(attention, then MLP)"
            )
    refuse_hooks([("model.blocks", model.blocks)] + [
        (f"block {i}", b) for i, b in enumerate(model.blocks)],
        runs="attn, mlp, norm1, ...")
    refuse_grad_checkpointing(model)


# Attributes of timm's VisionTransformer that its embedding, pooling and head methods read.
_PLAIN_ATTRIBUTES = (
    "num_classes", "in_chans", "global_pool", "embed_dim", "num_prefix_tokens",
    "num_reg_tokens", "has_class_token", "no_embed_class", "pool_include_prefix",
    "dynamic_img_size",
)
_MODULES = ("patch_embed", "pos_drop", "patch_drop", "norm_pre", "norm", "attn_pool", "fc_norm",
            "head_drop", "head")
_PARAMETERS = ("cls_token", "reg_token", "pos_embed")


@converts(VisionTransformer)
class ConvertedViT(ReversibleModelMixin, nn.Module):
    """A timm ``VisionTransformer`` whose blocks form one reversible stack of
    :class:`ConvertedBlock`; build it with :func:`pareprop.convert`.

    Shares the source model's parameters and keeps timm's parameter names in its state dict
    (``blocks.3.attn.qkv.weight``), so timm checkpoints load into it and its checkpoints load
    into timm. Embedding, pooling and head are timm's own code.
    """

    # timm's own methods, run on this model's attributes (the same names as timm's).
    _pos_embed = VisionTransformer._pos_embed
    pool = VisionTransformer.pool
    forward_head = VisionTransformer.forward_head

    def __init__(self, source: VisionTransformer, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        for name in _PLAIN_ATTRIBUTES:
            setattr(self, name, getattr(source, name))
        for name in _PARAMETERS:
            setattr(self, name, getattr(source, name))
        for name in _MODULES:  # in timm's order, the stack where timm has its blocks
            if name == "norm":
                self.stack = ReversibleStack([ConvertedBlock(b) for b in source.blocks],
                                             engine=engine)
            setattr(self, name, getattr(source, name))
        self.num_features = self.embed_dim  # head_hidden_size: the mixin's property
        self.pretrained_cfg: Dict[str, Any] = dict(getattr(source, "pretrained_cfg", {}) or {})
        # What this model takes and predicts, which timm's cfg of the name need not say (a
        # model built with img_size=8 keeps the cfg of its 224-pixel namesake).
        self.pretrained_cfg.update(input_size=(self.in_chans, *source.patch_embed.img_size),
                                   num_classes=self.num_classes)
        self.default_cfg = self.pretrained_cfg
        self.source_architecture = self.pretrained_cfg.get("architecture", type(source).__name__)
        self.feature_info = [{"num_chs": self.embed_dim, "module": "stack",
                              "reduction": source.feature_info[-1]["reduction"]}]
        self.coupling = (1.0, 0.0)
        # beta = 0 cannot be inverted: every block keeps its graph until the coupling moves
        # (pareprop.set_coupling and the precision guard decide after that).
        self.stack.store_blocks(range(len(self.stack.blocks)))
        keep_source_names(self, [("stack.blocks.", "blocks.")])

    @property
    def depth(self) -> int:
        return len(self.stack.blocks)

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed", "cls_token", "reg_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r"^cls_token|reg_token|pos_embed|patch_embed|norm_pre",
            blocks=[(r"^stack\.blocks\.(\d+)", None), (r"^norm", (99999,))],
        )

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A fresh classifier for ``num_classes`` (0: none); ``global_pool`` as timm's
        (``'token'``, ``'avg'``, ``'avgmax'``, ``'max'``, ``''``; attention pooling stays)."""
        if global_pool is not None:
            if global_pool not in ("", "avg", "avgmax", "max", "token"):
                raise ValueError(
                    "expected global_pool in '', 'avg', 'avgmax', 'max', 'token', got "
                    f"{global_pool!r}"
                )
            if global_pool == "token" and not self.has_class_token:
                raise ValueError("global_pool='token' needs a class token; this model has none")
            if self.attn_pool is not None:
                raise ValueError("this model pools by attention; its pooling cannot be replaced")
            self.global_pool = global_pool
        ref = next(self.parameters())
        self.num_classes = num_classes
        self.pretrained_cfg["num_classes"] = num_classes
        self.head = make_head(self.num_features, num_classes, device=ref.device,
                              dtype=ref.dtype).train(self.training)

    def example_inputs(self, batch_size: int = 2, device: Any = None,
                       dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor]:
        C = self.in_chans
        H, W = self.patch_embed.img_size
        return (torch.randn(batch_size, C, H, W, device=device, dtype=dtype),)

    # -- forward --------------------------------------------------------------------------

    def set_input_size(self, img_size: Optional[Tuple[int, int]] = None,
                       patch_size: Optional[Tuple[int, int]] = None) -> None:
        """timm's resize (a new image or patch size; the position embedding resampled), by
        timm's own method on this model. Like timm's, it makes a new ``pos_embed`` Parameter:
        build the optimizer, and the precision guard's references, after it."""
        VisionTransformer.set_input_size(self, img_size=img_size, patch_size=patch_size)
        self.pretrained_cfg["input_size"] = (self.in_chans, *self.patch_embed.img_size)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images to the final state's tokens, normed as timm's ``forward_features``."""
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        _, x = self.stack(x, x)  # z_0 = z_1 = x; the head reads z_{2L+1}
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, Sequence[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """One feature, the stack's end (a block's output inside the stack is never kept):
        patch tokens after timm's final norm as a map, prefix tokens dropped."""
        check_output_fmt(output_fmt)
        take, _ = feature_take_indices(1, indices)
        tokens = self.forward_features(x)  # timm's final norm applied, so ``norm`` is moot
        y = tokens[:, self.num_prefix_tokens:]
        H, W = self.patch_embed.dynamic_feat_size(x.shape[-2:]) if hasattr(
            self.patch_embed, "dynamic_feat_size") else self.patch_embed.grid_size
        y = y.reshape(y.shape[0], H, W, y.shape[-1])
        features = [y.permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else y] * len(take)
        return features if intermediates_only else (tokens, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

@register_model(timm=False)
def converted_vit(
    source: str = "vit_small_patch16_224",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    **timm_kwargs: Any,
) -> ConvertedViT:
    """timm's ``source`` ViT (``timm.create_model(source, **timm_kwargs)``), converted.

    ``pretrained_file``: timm weights to start from (see :func:`load_timm_weights`).
    ``coupling``: (alpha, beta) to start at; :func:`pareprop.set_coupling` records a new one
    here, so a checkpoint rebuilds the model at the coupling it was saved at.
    ``tolerance``: of the precision guard (None: no guard).
    """
    alpha, beta = coupling_pair(coupling)  # refused before the source is built
    if pretrained_file is not None:  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(pretrained_file, (alpha, beta))
    vit = build_source(lambda: timm.create_model(source, **timm_kwargs), f"timm's {source}",
                       timm_kwargs)
    if pretrained_file is not None:
        load_timm_weights(vit, pretrained_file)
    model = convert(vit, engine=engine, tolerance=tolerance)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    return model


register_source_names(
    "converted_vit", "timm",
    lambda name: timm.is_model(name) and timm.models.is_model_in_modules(
        name, ["vision_transformer", "deit"]),
    "vit_*, deit_*, deit3_*",
)


def load_timm_weights(model: nn.Module, path: str) -> None:
    """Load timm ViT weights from ``path`` into ``model`` (a timm ViT or a converted one)
    through timm's own ViT checkpoint filter (which adapts other layouts and resamples position
    embeddings); see :func:`pareprop.convert.weights.load_classifier_source_weights`.

    Raises:
        PretrainedError: the file is missing, unreadable, unsafe, or does not fit.
    """
    load_classifier_source_weights(model, path, checkpoint_filter_fn, "ViT")
