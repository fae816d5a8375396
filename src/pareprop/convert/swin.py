"""A pretrained timm Swin Transformer (V1 or V2) rewired as a dual-residual reversible network,
exactly.

Swin: Liu et al., ICCV 2021; Swin V2: Liu et al., CVPR 2022. Coupling: Dr2Net (Zhao et al.,
CVPR 2024), docs/convert.md.

NOTE [ Swin's stages as coupled stacks ]
Every block of a Swin stage keeps its shape: a chain of two residual sub-layers on the
``(B, H, W, C)`` map,

    V1 (pre-norm):   z + drop_path1(attn(norm1(z))),   z + drop_path2(mlp(norm2(z)))
    V2 (post-norm):  z + drop_path1(norm1(attn(z))),   z + drop_path2(norm2(mlp(z)))

where ``attn`` is the block's (shifted-)window attention with its own mask (timm's ``_attn``:
roll, pad, partition, attend, merge, crop, roll back). Post-norm is still ``z + H(z)``, with the
norm inside H, so the coupling of docs/convert.md applies to both: each stage's blocks become
one :class:`~pareprop.engine.ReversibleStack` of :class:`~pareprop.convert.CoupledBlock`, F the
attention sub-layer and G the MLP sub-layer, with alpha in F and G and beta on the coupling.
A stage's stack starts from ``(x, x)``, ``x`` the output of the stage's patch merging, and hands
the next stage ``Y2`` of its last block. Patch merging changes the shape: it stays as timm's
module, before the stack, checkpointed under ``set_grad_checkpointing`` as Rev-Swin's is.

The window masks are the blocks' own (timm keeps them as buffers, or builds them per input
with ``dynamic_img_size``); a converted block holds timm's mask buffer and runs timm's own
``_attn`` on it, so forward and recomputation attend through the same mask.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Set, Tuple, Type

import timm
import torch
import torch.nn as nn
from timm.models import swin_transformer as timm_swin
from timm.models import swin_transformer_v2 as timm_swinv2

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
from pareprop.convert.weights import check_saved_coupling, load_source_weights
from pareprop.engine import ReversibleStack
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.models import ReversibleModelMixin, register_model

__all__ = [
    "ConvertedSwin", "ConvertedSwinBlock", "ConvertedSwinStage", "ConvertedSwinV2Block",
    "MergingInChunks", "unregistered",
    "check_convertible", "converted_swin", "load_swin_weights",
]

# The parts of a timm Swin block that make its two residual branches, in timm's names (so the
# block's parameters keep timm's names).
_BRANCH_PARTS = ("norm1", "attn", "drop_path1", "norm2", "mlp", "drop_path2")
# What timm's block methods (``_attn``, ``get_attn_mask``, ``set_input_size``) read of the
# block besides its modules: its plain attributes (window, shift, resolution, ...), taken whole
# so that the converted block answers the timm release at hand, whichever attributes it keeps.
def _window_attributes(block: nn.Module) -> Dict[str, Any]:
    return {name: value for name, value in vars(block).items()
            if not name.startswith("_") and name != "training"}


class _SwinBlockBase(CoupledBlock):
    """A timm Swin block's two sub-layers as a coupling with skip scale beta; the shared
    modules under timm's names, timm's window mask as a (non-persistent) buffer."""

    def __init__(self, block: nn.Module):
        # In the block's own order (V2 registers attn before norm1), so the state dict's is.
        super().__init__(**{name: module for name, module in block.named_children()
                            if name in _BRANCH_PARTS})
        for name, value in _window_attributes(block).items():
            setattr(self, name, value)
        self.register_buffer("attn_mask", block.attn_mask, persistent=False)

    def _h_attn(self, x: torch.Tensor) -> torch.Tensor:
        """The attention sub-layer H_f before drop-path, on ``(B, H, W, C)``."""
        raise NotImplementedError

    def _h_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP sub-layer H_g before drop-path, on tokens ``(B, N, C)``."""
        raise NotImplementedError

    def f(self, x: torch.Tensor) -> torch.Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum timm computes (1.0 * x is x exactly).
        return self.alpha * x + self.drop_path1(self._h_attn(x))

    def g(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        # timm runs the MLP sub-layer on the flattened tokens (B, H*W, C): so do we.
        h = self.drop_path2(self._h_mlp(x.reshape(B, -1, C)))
        return self.alpha * x + h.reshape(B, H, W, C)

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py; NOTE [ timm's layers
    # in chunks ] in pareprop/convert/block.py): F acts on each sample alone (its windows are
    # consecutive in timm's window order, so a dropout on windows is sliced along dim 0 with
    # nW rows a sample), G on each token alone, cut into bands of rows of the (B, H, W, C) map.
    def f_split(self, x: torch.Tensor) -> Optional[Split]:
        if self.attn.training and fused_attention_dropout(self.attn):
            return None  # SDPA draws its mask inside the kernel: F runs whole
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        with sliced_dropouts(self.attn, chunk, dim=0):
            h = self._h_attn(x)  # (b, H, W, C)
        return self.alpha * x + drop_path_samples(self.drop_path1, h, chunk)

    def g_split(self, x: torch.Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        B, h, W, C = x.shape
        with sliced_dropouts(self.mlp, chunk, dim=1):  # W tokens per row of the map
            y = self._h_mlp(x.reshape(B, -1, C))  # (B, h*W, C)
        # timm's drop-path draws one value per sample: on a band of rows, the whole draw.
        return self.alpha * x + self.drop_path2(y).reshape(B, h, W, C)


class ConvertedSwinBlock(_SwinBlockBase):
    """timm's pre-norm ``SwinTransformerBlock``:
    F(x) = alpha x + drop_path1(attn(norm1(x))), G(y) = alpha y + drop_path2(mlp(norm2(y)))."""

    # timm's own window attention (shift, pad, partition, mask, merge) and mask builder.
    _attn = timm_swin.SwinTransformerBlock._attn
    get_attn_mask = timm_swin.SwinTransformerBlock.get_attn_mask
    # timm's resize: new windows, shifts and mask (ConvertedSwin.set_input_size).
    _calc_window_shift = getattr(timm_swin.SwinTransformerBlock, "_calc_window_shift", None)
    _init_buffers = getattr(timm_swin.SwinTransformerBlock, "_init_buffers", None)
    set_input_size = getattr(timm_swin.SwinTransformerBlock, "set_input_size", None)

    def _h_attn(self, x: torch.Tensor) -> torch.Tensor:
        return self._attn(self.norm1(x))

    def _h_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm2(x))


class ConvertedSwinV2Block(_SwinBlockBase):
    """timm's post-norm ``SwinTransformerV2Block`` (residual ``z + norm(H(z))``):
    F(x) = alpha x + drop_path1(norm1(attn(x))), G(y) = alpha y + drop_path2(norm2(mlp(y)))."""

    _attn = timm_swinv2.SwinTransformerV2Block._attn
    get_attn_mask = timm_swinv2.SwinTransformerV2Block.get_attn_mask
    _calc_window_shift = getattr(timm_swinv2.SwinTransformerV2Block, "_calc_window_shift", None)
    _init_buffers = getattr(timm_swinv2.SwinTransformerV2Block, "_init_buffers", None)
    set_input_size = getattr(timm_swinv2.SwinTransformerV2Block, "set_input_size", None)

    def _h_attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm1(self._attn(x))

    def _h_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.mlp(x))


# Each timm model class: its stage class, its block class, and the converted block.
_FAMILIES: Dict[type, Tuple[type, type, Type[_SwinBlockBase]]] = {
    timm_swin.SwinTransformer: (timm_swin.SwinTransformerStage, timm_swin.SwinTransformerBlock,
                                ConvertedSwinBlock),
    timm_swinv2.SwinTransformerV2: (timm_swinv2.SwinTransformerV2Stage,
                                    timm_swinv2.SwinTransformerV2Block, ConvertedSwinV2Block),
}


class MergingInChunks(nn.Module):
    """A source's patch merging as a block :func:`maybe_checkpoint` checkpoints in chunks of
    samples (NOTE [ Checkpointed blocks in chunks ] in pareprop/engine/recompute.py): merging
    pads, regroups 2x2 neighbours, normalises and projects each sample alone and draws
    nothing, so a chunk of samples merged is that chunk of the merged batch. Recomputed whole,
    the merging of the whole batch (a float32 norm input of 4C channels) set the planned peak
    of converted Swin-T at 80 GiB.

    The owner keeps it unregistered (:func:`unregistered`): the merging keeps its place, and
    its names, in the model."""

    def __init__(self, merging: nn.Module):
        super().__init__()
        self.merging = merging

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merging(x)

    def split(self, x: torch.Tensor) -> Split:
        return Split.samples(x.shape[0])

    def forward_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return self.merging(x)


def unregistered(owner: nn.Module, name: str, module: Optional[nn.Module]) -> None:
    """Set ``owner.name = module`` without making ``module`` a submodule of ``owner`` (no
    state-dict entries, no second path to its parameters); casts and moves reach it through
    the modules it wraps, which are registered where they belong."""
    object.__setattr__(owner, name, module)


class ConvertedSwinStage(nn.Module):
    """A timm Swin stage: its patch merging (None in the first stage), then its blocks as one
    reversible stack from ``(x, x)``; the stage's output is ``Y2`` of the last block."""

    def __init__(self, stage: nn.Module, block: Type[_SwinBlockBase], engine: str):
        super().__init__()
        self.input_resolution = stage.input_resolution
        self.output_resolution = stage.output_resolution
        self.downsample = None if isinstance(stage.downsample, nn.Identity) else stage.downsample
        unregistered(self, "_merging",
                     None if self.downsample is None else MergingInChunks(self.downsample))
        self.stack = ReversibleStack([block(b) for b in stage.blocks], engine=engine)
        self.grad_checkpointing = False  # the merging (ConvertedSwin.set_grad_checkpointing)

    def set_input_size(self, feat_size: Tuple[int, int], window_size: Any,
                       always_partition: Optional[bool] = None) -> None:
        """timm's stage resize: the resolution after the merging, then each block's windows."""
        self.input_resolution = tuple(feat_size)
        self.output_resolution = self.input_resolution if self.downsample is None else \
            tuple((i + 1) // 2 for i in feat_size)
        for block in self.stack.blocks:
            block.set_input_size(feat_size=self.output_resolution, window_size=window_size,
                                 always_partition=always_partition)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = maybe_checkpoint(self._merging, x, self.grad_checkpointing,
                             self.stack.chunking)  # (B, H, W, C)
        _, x = self.stack(x, x)  # z_0 = z_1 = x; the next stage reads z_{2L+1}
        return x


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is timm's
    ``SwinTransformer`` or ``SwinTransformerV2`` itself with timm's stages and blocks."""
    kinds = {cls for cls in _FAMILIES if isinstance(model, cls)}
    if type(model) not in _FAMILIES:
        if kinds:
            raise UnsupportedModelError(
                f"{type(model).__name__} subclasses timm's {kinds.pop().__name__} and may "
                "change its forward; only timm's class itself is converted exactly"
            )
        raise UnsupportedModelError(
            "expected a timm SwinTransformer or SwinTransformerV2 (swin_*, swinv2_*), got "
            f"{type(model).__name__}"
        )
    stage_cls, block_cls, _ = _FAMILIES[type(model)]
    for i, stage in enumerate(model.layers):
        if type(stage) is not stage_cls:
            raise UnsupportedModelError(
                f"stage {i} is a {type(stage).__name__}, not timm's {stage_cls.__name__}"
            )
        for j, block in enumerate(stage.blocks):
            if type(block) is not block_cls:
                raise UnsupportedModelError(
                    f"stage {i} block {j} is a {type(block).__name__}, not timm's "
                    f"{block_cls.__name__} of two residual branches (attention, then MLP)"
                )
    refuse_hooks([(f"stage {i}", s) for i, s in enumerate(model.layers)]
                 + [(f"stage {i} blocks", s.blocks) for i, s in enumerate(model.layers)]
                 + [(f"stage {i} block {j}", b) for i, s in enumerate(model.layers)
                    for j, b in enumerate(s.blocks)],
                 runs="attn, mlp, norm1, ..., and the stages' downsample")
    refuse_grad_checkpointing(model)


# Attributes of timm's Swin models that their feature, intermediate and head methods read.
_PLAIN_ATTRIBUTES = ("num_classes", "in_chans", "global_pool", "output_fmt", "num_layers",
                     "embed_dim", "num_features", "dynamic_img_size")


@converts(timm_swin.SwinTransformer, timm_swinv2.SwinTransformerV2)
class ConvertedSwin(ReversibleModelMixin, nn.Module):
    """A timm ``SwinTransformer`` or ``SwinTransformerV2`` whose stages each run their blocks as
    one reversible stack of coupled blocks; build it with :func:`pareprop.convert`.

    Shares the source model's parameters and keeps timm's names in its state dict
    (``layers.1.blocks.0.attn.qkv.weight``), so timm checkpoints load into it and its
    checkpoints load into timm. Patch embedding, patch merging, final norm, pooling and head
    are timm's modules; features, intermediates and head run timm's own methods.
    """

    # timm's own methods, run on this model's attributes (the same names as timm's): the
    # stages are this model's, the rest is timm's code.
    forward_head = timm_swin.SwinTransformer.forward_head
    forward_intermediates = timm_swin.SwinTransformer.forward_intermediates
    prune_intermediate_layers = timm_swin.SwinTransformer.prune_intermediate_layers

    def __init__(self, source: nn.Module, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        self.source_class = type(source)
        block = _FAMILIES[type(source)][2]
        for name in _PLAIN_ATTRIBUTES:
            setattr(self, name, getattr(source, name))
        # The reference windows timm's set_input_size scales from (timm >= 1.0.20 keeps them).
        for name in ("_ref_window_sizes", "_ref_grid_size"):
            if hasattr(source, name):
                setattr(self, name, getattr(source, name))
        self.patch_embed = source.patch_embed
        self.layers = nn.Sequential(*[ConvertedSwinStage(s, block, engine)
                                      for s in source.layers])
        self.norm = source.norm
        self.head = source.head
        self.feature_info = [dict(info) for info in source.feature_info]
        self.pretrained_cfg: Dict[str, Any] = dict(getattr(source, "pretrained_cfg", {}) or {})
        # What this model takes and predicts, which timm's cfg of the name need not say.
        self.pretrained_cfg.update(input_size=(self.in_chans, *source.patch_embed.img_size),
                                   num_classes=self.num_classes)
        self.default_cfg = self.pretrained_cfg
        self.source_architecture = self.pretrained_cfg.get("architecture", type(source).__name__)
        self.coupling = (1.0, 0.0)
        self.grad_checkpointing = False  # the stem and the mergings (set_grad_checkpointing)
        # beta = 0 cannot be inverted: every block keeps its graph until the coupling moves.
        for stage in self.layers:
            stage.stack.store_blocks(range(len(stage.stack.blocks)))
        keep_source_names(self, [("stack.blocks.", "blocks.")])

    @property
    def depth(self) -> int:
        return sum(len(stage.stack.blocks) for stage in self.layers)

    @property
    def head_hidden_size(self) -> int:
        # timm's: the pooled width (twice it for 'catavgmax'), or the width of the last stage
        # kept by prune_intermediate_layers, which sets it.
        return self.__dict__.get("_head_hidden_size", self.head.num_features)

    @head_hidden_size.setter
    def head_hidden_size(self, value: int) -> None:
        self.__dict__["_head_hidden_size"] = value

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # timm's own rule (V1: relative position tables; V2: the cpb MLP and logit scales),
        # over this model's parameter names.
        return self.source_class.no_weight_decay(self)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's groups for layer decay, with the blocks where the stacks hold them."""
        return dict(
            stem=r"^absolute_pos_embed|patch_embed",
            blocks=r"^layers\.(\d+)" if coarse else [
                (r"^layers\.(\d+)\.downsample", (0,)),
                (r"^layers\.(\d+)\.stack\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        )

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A fresh classifier for ``num_classes`` (0: none); ``global_pool`` as timm's
        (``'avg'``, ``'max'``, ``'catavgmax'``, ``''``...)."""
        ref = self.patch_embed.proj.weight  # (the final norm may be pruned away)
        self.num_classes = num_classes
        self.head.reset(num_classes, pool_type=global_pool, device=ref.device, dtype=ref.dtype)
        if global_pool is not None:
            self.global_pool = global_pool
        self.pretrained_cfg["num_classes"] = num_classes

    def set_input_size(self, img_size: Optional[Tuple[int, int]] = None, **kwargs: Any) -> None:
        """timm's ``set_input_size`` (new image size, patch size, windows): the source class's
        own method on this model's stages, so windows, shifts and masks are timm's. The
        converted model stays exact at (1, 0) at the new size (tested)."""
        resize = getattr(self.source_class, "set_input_size", None)
        if resize is None or ConvertedSwinBlock.set_input_size is None:
            raise NotImplementedError(
                f"this timm release ({timm.__version__}) has no {self.source_class.__name__}"
                ".set_input_size to follow; build the source at the size wanted, then convert it")
        resize(self, img_size=img_size, **kwargs)
        self.pretrained_cfg["input_size"] = (self.in_chans, *self.patch_embed.img_size)

    def example_inputs(self, batch_size: int = 2, device: Any = None,
                       dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor]:
        H, W = self.patch_embed.img_size
        return (torch.randn(batch_size, self.in_chans, H, W, device=device, dtype=dtype),)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images to the final normed map ``(B, H', W', C')``, as timm's ``forward_features``."""
        # Checkpointed (set_grad_checkpointing), the patch embedding keeps the images, which
        # the caller holds anyway, not autocast's copy of them and its norm's float32 input
        # (as Rev-Swin's stem).
        x = maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing)  # (B, H, W, C)
        x = self.layers(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

_FILTERS = {timm_swin.SwinTransformer: timm_swin.checkpoint_filter_fn,
            timm_swinv2.SwinTransformerV2: timm_swinv2.checkpoint_filter_fn}


def load_swin_weights(model: nn.Module, path: str) -> None:
    """Load timm Swin or Swin V2 weights from ``path`` into the timm ``model`` (before
    conversion) through timm's own checkpoint filter (which takes the original Microsoft
    layout too, and resizes relative position tables); see :func:`load_source_weights`."""
    load_source_weights(
        model, path, head=("head.fc.weight", "head.fc.bias"),
        checkpoint_filter=_FILTERS.get(type(model)),
        hint="is it the weights of another Swin (name the source it was trained as, and its "
             "sizes as --model-arg)?",
    )


@register_model(timm=False)
def converted_swin(
    source: str = "swin_tiny_patch4_window7_224",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    **timm_kwargs: Any,
) -> ConvertedSwin:
    """timm's ``source`` Swin or Swin V2 (``timm.create_model(source, **timm_kwargs)``),
    converted.

    ``pretrained_file``: timm weights to start from (see :func:`load_swin_weights`).
    ``coupling``: (alpha, beta) to start at; :func:`pareprop.set_coupling` records a new one
    here, so a checkpoint rebuilds the model at the coupling it was saved at.
    ``tolerance``: of the precision guard (None: no guard).
    """
    alpha, beta = coupling_pair(coupling)  # refused before the source is built
    if pretrained_file is not None:  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(pretrained_file, (alpha, beta))
    swin = build_source(lambda: timm.create_model(source, **timm_kwargs), f"timm's {source}",
                        timm_kwargs)
    if pretrained_file is not None:
        load_swin_weights(swin, pretrained_file)
    model = convert(swin, engine=engine, tolerance=tolerance)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    return model


def _is_timm_swin(name: str) -> bool:
    # swinv2_cr_* is another class (SwinTransformerV2Cr, in its own module): not this family.
    return timm.is_model(name) and timm.models.is_model_in_modules(
        name, ["swin_transformer", "swin_transformer_v2"])


register_source_names("converted_swin", "timm", _is_timm_swin, "swin_*, swinv2_*")

