"""timm's MViTv2 (``MultiScaleVit``: ``mvitv2_tiny`` .. ``mvitv2_huge_cls``) rewired as a
dual-residual reversible network, exactly.

A timm ``MultiScaleBlock`` computes

    x = shortcut(x) + drop_path1(attn(norm1(x), feat_size))
    x = shortcut'(x) + drop_path2(mlp(norm2(x)))

where the shortcut is ``x`` itself unless the block pools its queries (then a max-pool of
``x``: ``shortcut_pool_attn``) or changes the width (then a projection of the normed input:
``shortcut_proj_attn`` with ``expand_attn``, ``shortcut_proj_mlp`` without, as
``mvitv2_large``). A block with neither is two pre-norm residual sub-layers, and becomes

    F(x) = alpha * x + drop_path1(attn(norm1(x), feat_size))      (attention branch)
    G(y) = alpha * y + drop_path2(mlp(norm2(y)))                  (MLP branch)

of the coupling in docs/convert.md; the others (the first block of every stage after the
first, and with ``expand_attn=False`` the last block of every stage but the last) stay timm's
own blocks (NOTE [ Runs of blocks that keep their shape ] in pareprop/convert/stages.py).
Queries are still convolved (stride 1) in a block that keeps its shape: that is inside H.
A class token (``_cls``) is a token like any other to the coupling: the blocks pool around it
as timm does, and the head reads it from the final norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
from timm.models._builder import build_model_with_cfg
from timm.models.mvitv2 import (
    MultiScaleBlock,
    MultiScaleVit,
    MultiScaleVitCfg,
    checkpoint_filter_fn,
    model_cfgs,
)

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import CoupledBlock, drop_path_samples, sliced_dropouts
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
from pareprop.convert.stages import CoupledRuns, pools_nothing
from pareprop.convert.weights import check_saved_coupling, load_classifier_source_weights
from pareprop.engine import ReversibleStack
from pareprop.models import ReversibleModelMixin, register_model

__all__ = [
    "ConvertedMultiScaleBlock", "ConvertedMultiScaleVit", "check_convertible",
    "converted_mvitv2", "keeps_shape", "load_mvitv2_weights",
]

# The parts of a timm MultiScaleBlock that make its two residual branches, in timm's names.
_BRANCH_PARTS = ("norm1", "attn", "drop_path1", "norm2", "mlp", "drop_path2")


def keeps_shape(block: MultiScaleBlock) -> bool:
    """Whether ``block`` is ``x + H1(x)`` then ``x + H2(x)``: no pooled or projected shortcut,
    the same width in and out, queries not strided."""
    return (block.dim == block.dim_out and block.shortcut_proj_attn is None
            and block.shortcut_pool_attn is None and block.shortcut_proj_mlp is None
            and pools_nothing(block.attn.pool_q))


class ConvertedMultiScaleBlock(CoupledBlock):
    """A timm ``MultiScaleBlock`` that keeps its shape, as a coupling with skip scale beta:
    F(x) = alpha x + drop_path1(attn(norm1(x), feat_size)),
    G(y) = alpha y + drop_path2(mlp(norm2(y))). Shares the block's modules (no copy)."""

    def __init__(self, block: MultiScaleBlock):
        super().__init__(**{name: getattr(block, name) for name in _BRANCH_PARTS})

    def f(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum timm computes (1.0 * x is x exactly).
        return self.alpha * x + self.drop_path1(self.attn(self.norm1(x), feat_size)[0])

    def g(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        return self.alpha * x + self.drop_path2(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ timm's layers in chunks ] in pareprop/convert/block.py): F acts
    # on each sample alone (keys and values are pooled over the sample's own map; timm's
    # pooling attention has no dropout of its own), G on each token alone.
    def f_split(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk, feat_size: Tuple[int, int]) -> torch.Tensor:
        with sliced_dropouts(self.attn, chunk, dim=0):
            h = self.attn(self.norm1(x), feat_size)[0]  # (b, N, C)
        return self.alpha * x + drop_path_samples(self.drop_path1, h, chunk)

    def g_split(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk, feat_size: Tuple[int, int]) -> torch.Tensor:
        with sliced_dropouts(self.mlp, chunk, dim=1):
            h = self.mlp(self.norm2(x))  # (B, n, C)
        # timm's drop-path draws one value per sample: on a chunk of tokens, the whole draw.
        return self.alpha * x + self.drop_path2(h)


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is timm's
    ``MultiScaleVit`` itself with timm's ``MultiScaleBlock`` blocks."""
    if type(model) is not MultiScaleVit:
        raise UnsupportedModelError(
            f"{type(model).__name__} subclasses timm's MultiScaleVit and may change its forward; "
            "only MultiScaleVit itself is converted exactly"
        )
    for s, stage in enumerate(model.stages):
        for i, block in enumerate(stage.blocks):
            if type(block) is not MultiScaleBlock:
                raise UnsupportedModelError(
                    f"stages.{s}.blocks.{i} is a {type(block).__name__}, not timm's "
                    "MultiScaleBlock of two residual branches (attention, then MLP)"
                )
    refuse_hooks(
        [(f"stages.{s}", stage) for s, stage in enumerate(model.stages)]
        + [(f"stages.{s}.blocks.{i}", block) for s, stage in enumerate(model.stages)
           for i, block in enumerate(stage.blocks) if keeps_shape(block)],
        runs="attn, mlp, norm1, ... (and the blocks that pool or widen)")
    refuse_grad_checkpointing(model)


# Attributes of timm's MultiScaleVit that its forward, head and feature methods read.
_PLAIN_ATTRIBUTES = ("num_classes", "in_chans", "drop_rate", "global_pool", "depths",
                     "expand_attn", "num_prefix_tokens", "num_features")


@converts(MultiScaleVit)
class ConvertedMultiScaleVit(ReversibleModelMixin, nn.Module):
    """A timm ``MultiScaleVit`` whose blocks that keep their shape form reversible stacks of
    :class:`ConvertedMultiScaleBlock`, stage by stage; build it with :func:`pareprop.convert`.

    ``stages.{s}`` is a :class:`~pareprop.convert.stages.CoupledRuns` with timm's stage call
    ``x, feat_size = stage(x, feat_size)``, so timm's own ``forward_features``,
    ``forward_head`` and multi-scale ``forward_intermediates`` run unchanged. Shares the
    source's parameters and keeps timm's names in its state dict
    (``stages.1.blocks.2.attn.qkv.weight``).
    """

    # timm's own methods, run on this model's attributes (the same names as timm's).
    forward_features = MultiScaleVit.forward_features
    forward_head = MultiScaleVit.forward_head
    forward = MultiScaleVit.forward
    forward_intermediates = MultiScaleVit.forward_intermediates
    prune_intermediate_layers = MultiScaleVit.prune_intermediate_layers
    no_weight_decay = MultiScaleVit.no_weight_decay

    def __init__(self, source: MultiScaleVit, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        for name in _PLAIN_ATTRIBUTES:
            setattr(self, name, getattr(source, name))
        # In timm's order, so that the state dict's order is timm's too.
        self.patch_embed = source.patch_embed
        self.cls_token = source.cls_token
        self.pos_embed = source.pos_embed
        self.stages = nn.ModuleList(
            CoupledRuns(stage.blocks, keeps_shape, ConvertedMultiScaleBlock, engine,
                        size_keyword="feat_size")
            for stage in source.stages)
        self.norm = source.norm
        self.head = source.head
        self.feature_info = list(source.feature_info)
        self.pretrained_cfg: Dict[str, Any] = dict(getattr(source, "pretrained_cfg", {}) or {})
        # What this model takes and predicts, which timm's cfg of the name need not say (a
        # model built with img_size=32 keeps the cfg of its 224-pixel namesake).
        self.pretrained_cfg.update(input_size=(self.in_chans, *_img_size(source)),
                                   num_classes=self.num_classes)
        self.default_cfg = self.pretrained_cfg
        self.source_architecture = self.pretrained_cfg.get("architecture", type(source).__name__)
        self.coupling = (1.0, 0.0)
        # beta = 0 cannot be inverted: every block keeps its graph until the coupling moves.
        for stack in self.stacks():
            stack.store_blocks(range(len(stack.blocks)))
        keep_source_names(self, [pair for s, stage in enumerate(self.stages)
                                 for pair in stage.source_names(f"stages.{s}.",
                                                                f"stages.{s}.blocks.")])

    def stacks(self) -> List[ReversibleStack]:
        """Every reversible stack, in order."""
        return [stack for stage in self.stages for stack in stage.stacks()]

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's groups for layer decay: the stem, each block in depth order (a stack's
        blocks one by one, ``coarse``: whole stages as timm's), then the final norm."""
        stem = r"^cls_token|pos_embed|patch_embed"
        if coarse:
            return dict(stem=stem, blocks=[(r"^stages\.(\d+)", None), (r"^norm", (99999,))])
        return dict(stem=stem, blocks=[(r"^stages\.(\d+)\.parts\.(\d+)\.blocks\.(\d+)", None),
                                       (r"^stages\.(\d+)\.parts\.(\d+)", None),
                                       (r"^norm", (99999,))])

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A fresh classifier for ``num_classes`` (0: none); ``global_pool`` as timm's
        (``'avg'``, ``'token'`` with a class token, ``''``)."""
        if global_pool not in (None, "", "avg", "token"):
            raise ValueError(f"expected global_pool in '', 'avg', 'token', got {global_pool!r}")
        if global_pool == "token" and self.cls_token is None:
            raise ValueError("global_pool='token' needs a class token; this model has none")
        MultiScaleVit.reset_classifier(self, num_classes, global_pool)
        self.pretrained_cfg["num_classes"] = num_classes

    def example_inputs(self, batch_size: int = 2, device: Any = None,
                       dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor]:
        return (torch.randn(batch_size, *self.pretrained_cfg["input_size"], device=device,
                            dtype=dtype),)


def _img_size(source: MultiScaleVit) -> Tuple[int, int]:
    """The image size ``source`` was built for: its first map times the patch stride (and
    the first stage's query stride, 1 in timm's configurations)."""
    first = source.stages[0]
    pool = first.blocks[0].attn.pool_q
    q_stride = (1, 1) if pools_nothing(pool) else pool.stride
    patch_stride = source.patch_embed.proj.stride
    return tuple(n * q * p for n, q, p in zip(first.feat_size, q_stride, patch_stride))


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

@register_model(timm=False)
def converted_mvitv2(
    source: str = "mvitv2_tiny",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    **timm_kwargs: Any,
) -> ConvertedMultiScaleVit:
    """timm's ``source`` MViTv2 (``timm.create_model(source, **timm_kwargs)``), converted.
    Keywords that are fields of timm's ``MultiScaleVitCfg`` (``depths``, ``embed_dim``,
    ``num_heads``, ...) change the source's configuration (timm's factories take none).

    ``pretrained_file``: timm's (or the publishers', which timm's filter maps) weights to start
    from (see :func:`load_mvitv2_weights`). ``coupling``: (alpha, beta) to start at;
    :func:`pareprop.set_coupling` records a new one here, so a checkpoint rebuilds the model at
    the coupling it was saved at. ``tolerance``: of the precision guard (None: no guard).
    """
    alpha, beta = coupling_pair(coupling)  # refused before the source is built
    if pretrained_file is not None:  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(pretrained_file, (alpha, beta))
    fields = {f.name for f in dataclasses.fields(MultiScaleVitCfg)}
    changes = {k: timm_kwargs.pop(k) for k in list(timm_kwargs) if k in fields}
    given = {**timm_kwargs, **changes}
    mvit = build_source(lambda: _build_mvitv2(source, changes, timm_kwargs), f"timm's {source}",
                        given)
    if "img_size" in timm_kwargs:
        _check_runs_at_size(mvit, source, timm_kwargs["img_size"])
    if pretrained_file is not None:
        load_mvitv2_weights(mvit, pretrained_file)
    model = convert(mvit, engine=engine, tolerance=tolerance)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    return model


def _check_runs_at_size(mvit: MultiScaleVit, source: str, img_size: Any) -> None:
    """Refuse an ``img_size`` timm's MViTv2 builds at but cannot run at.

    timm sizes each stage's relative-position tables from ``img_size`` divided down by the
    strides, while its pooling convolutions round up: at a size whose maps do not halve
    evenly (63, or 40 with four stages) the first forward indexes past a table. One forward of
    a single image, without a graph, at the size the model records, finds it when the model is
    built rather than in the first training step; only when ``img_size`` was given."""
    size = _img_size(mvit)
    device = next(mvit.parameters()).device
    if device.type == "meta":
        return  # no values to index: planning builds on the meta device
    training = mvit.training
    try:
        with torch.no_grad():
            mvit.eval()(torch.zeros(1, mvit.patch_embed.proj.in_channels, *size, device=device))
    except (IndexError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"timm's {source} builds at img_size={img_size!r} but cannot run at it ({first}): "
            "give a size whose maps halve evenly at every stage (a multiple of 32, as 224)"
        ) from None
    finally:
        mvit.train(training)


def _build_mvitv2(source: str, changes: Dict[str, Any],
                  timm_kwargs: Dict[str, Any]) -> MultiScaleVit:
    """timm's ``source``, its configuration changed by ``changes`` (``MultiScaleVitCfg``'s
    fields), built with ``timm_kwargs``."""
    if changes:
        arch = source.split(".")[0]
        if arch not in model_cfgs:
            raise ValueError(f"expected a timm MViTv2 source ({', '.join(model_cfgs)}), got "
                             f"{source!r}")
        # timm's own builder, with the configuration changed (tuples: a list from JSON).
        changes = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
        mvit = build_model_with_cfg(
            MultiScaleVit, source, pretrained=False,
            model_cfg=dataclasses.replace(model_cfgs[arch], **changes),
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(out_indices=4, feature_cls="getter"), **timm_kwargs)
        return mvit
    return timm.create_model(source, **timm_kwargs)


register_source_names(
    "converted_mvitv2", "timm",
    lambda name: timm.is_model(name) and timm.models.is_model_in_modules(name, ["mvitv2"]),
    "mvitv2_tiny, mvitv2_small, mvitv2_base, mvitv2_large, mvitv2_*_cls",
)


def load_mvitv2_weights(model: nn.Module, path: str) -> None:
    """Load MViTv2 weights from ``path`` into a timm ``MultiScaleVit`` or its conversion:
    timm's files, or the publishers' (``MViTv2_T_in1k.pyth``: ``model_state``, flat
    ``blocks.i``), through timm's own MViTv2 checkpoint filter (which also resizes relative
    position tables); see :func:`pareprop.convert.weights.load_classifier_source_weights`."""
    load_classifier_source_weights(model, path, checkpoint_filter_fn, "MViTv2")
