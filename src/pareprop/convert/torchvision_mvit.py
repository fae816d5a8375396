"""torchvision's video MViT (``mvit_v1_b``, ``mvit_v2_s``; Kinetics-400) rewired as a
dual-residual reversible network, exactly.

A torchvision ``MultiscaleBlock`` computes

    x = skip(x) + stochastic_depth(attn(norm1(x), thw))
    x = skip'(x) + stochastic_depth(mlp(norm2(x)))

where the skip is ``x`` itself unless the block pools its queries (``pool_skip``, a max-pool)
or changes the width (``project``: of the normed input, after the attention in MViTv2
(``proj_after_attn``), of the second normed input in MViTv1). A block with neither is two
pre-norm residual sub-layers, and becomes

    F(x) = alpha * x + stochastic_depth(attn(norm1(x), thw))     (attention branch)
    G(y) = alpha * y + stochastic_depth(mlp(norm2(y)))           (MLP branch)

of the coupling in docs/convert.md (one ``stochastic_depth`` module draws for both branches in
torchvision, in the same order here); the others stay torchvision's own blocks (NOTE [ Runs of
blocks that keep their shape ] in pareprop/convert/stages.py). In ``mvit_v1_b`` the width
changes in the block before each pooling one, so its stacks are blocks 4-12 and 15; in
``mvit_v2_s`` blocks 0, 2, 4-13 and 15. The class token is a token like any other to the
coupling (torchvision pools around it), and the head reads it after the final norm.

torchvision's MViT has one ``forward``; ``forward_features`` (clips to the normed tokens,
class token first) and ``forward_head`` (the class token to logits) split it where timm's
models do, and ``forward`` is the two.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
import torchvision
from timm.models._features import feature_take_indices
from torchvision.models.video.mvit import MSBlockConfig, MultiscaleBlock, MViT

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import CoupledBlock, sliced_dropouts, stochastic_depth_samples
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
    set_clip_data,
)
from pareprop.convert.stages import CoupledRuns, pools_nothing
from pareprop.convert.weights import check_saved_coupling, load_classifier_source_weights
from pareprop.engine import ReversibleStack
from pareprop.models import ReversibleModelMixin, check_output_fmt, register_model
from pareprop.models.published import PretrainedError

__all__ = [
    "ConvertedMViT", "ConvertedMultiscaleBlock", "SOURCES", "check_convertible",
    "converted_tv_mvit", "keeps_shape", "load_torchvision_mvit_weights", "published_mvit",
]

# torchvision's MViT models (their Kinetics-400 weights: 16 frames of 224 x 224).
SOURCES = ("mvit_v1_b", "mvit_v2_s")

# The parts of a torchvision MultiscaleBlock that make its two residual branches, in its names.
_BRANCH_PARTS = ("norm1", "norm2", "attn", "mlp", "stochastic_depth")  # its order


def keeps_shape(block: MultiscaleBlock) -> bool:
    """Whether ``block`` is ``x + H1(x)`` then ``x + H2(x)``: no pooled skip, no projection,
    queries not strided."""
    return (block.project is None and block.pool_skip is None
            and (block.attn.pool_q is None or pools_nothing(block.attn.pool_q.pool)))


class ConvertedMultiscaleBlock(CoupledBlock):
    """A torchvision ``MultiscaleBlock`` that keeps its shape, as a coupling with skip scale
    beta: F(x) = alpha x + stochastic_depth(attn(norm1(x), thw)),
    G(y) = alpha y + stochastic_depth(mlp(norm2(y))). Shares the block's modules (no copy)."""

    def __init__(self, block: MultiscaleBlock):
        super().__init__(**{name: getattr(block, name) for name in _BRANCH_PARTS})

    def f(self, x: torch.Tensor, thw: Tuple[int, int, int]) -> torch.Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum torchvision computes.
        return self.alpha * x + self.stochastic_depth(self.attn(self.norm1(x), thw)[0])

    def g(self, x: torch.Tensor, thw: Tuple[int, int, int]) -> torch.Tensor:
        return self.alpha * x + self.stochastic_depth(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ timm's layers in chunks ] in pareprop/convert/block.py): F acts
    # on each sample alone (keys, values and queries are pooled over the sample's own map;
    # torchvision's attention computes its weights without a fused kernel, and its output
    # dropout is an nn.Dropout), G on each token alone.
    def f_split(self, x: torch.Tensor, thw: Tuple[int, int, int]) -> Split:
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk, thw: Tuple[int, int, int]) -> torch.Tensor:
        with sliced_dropouts(self.attn, chunk, dim=0):
            h = self.attn(self.norm1(x), thw)[0]  # (b, N, C)
        return self.alpha * x + stochastic_depth_samples(self.stochastic_depth, h, chunk)

    def g_split(self, x: torch.Tensor, thw: Tuple[int, int, int]) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk, thw: Tuple[int, int, int]) -> torch.Tensor:
        with sliced_dropouts(self.mlp, chunk, dim=1):
            h = self.mlp(self.norm2(x))  # (B, n, C)
        # Stochastic depth draws one value per sample: on a chunk of tokens, the whole draw.
        return self.alpha * x + self.stochastic_depth(h)


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is torchvision's
    ``MViT`` itself with LayerNorm ``MultiscaleBlock`` blocks."""
    if type(model) is not MViT:
        raise UnsupportedModelError(
            f"{type(model).__name__} subclasses torchvision's MViT and may change its forward; "
            "only MViT itself is converted exactly"
        )
    for i, block in enumerate(model.blocks):
        if type(block) is not MultiscaleBlock:
            raise UnsupportedModelError(
                f"blocks.{i} is a {type(block).__name__}, not torchvision's MultiscaleBlock of "
                "two residual branches (attention, then MLP)"
            )
        if block.needs_transposal:
            raise UnsupportedModelError(
                f"blocks.{i} normalises with BatchNorm1d: its running statistics would move "
                "again in every recomputation; build the MViT with LayerNorm (the default)"
            )
    refuse_hooks([(f"blocks.{i}", b) for i, b in enumerate(model.blocks) if keeps_shape(b)],
                 runs="attn, mlp, norm1, ... (and the blocks that pool or widen)")
    refuse_grad_checkpointing(model)


@converts(MViT)
class ConvertedMViT(ReversibleModelMixin, nn.Module):
    """A torchvision ``MViT`` whose blocks that keep their shape form reversible stacks of
    :class:`ConvertedMultiscaleBlock`; build it with :func:`pareprop.convert`.

    ``encoder`` is a :class:`~pareprop.convert.stages.CoupledRuns` over torchvision's
    ``blocks``. Shares the source's parameters and keeps torchvision's names in its state dict
    (``blocks.5.attn.qkv.weight``), so torchvision's checkpoints load into it and its
    checkpoints load into torchvision's ``MViT``. Clips ``(B, 3, T, H, W)`` of the size it was
    built for (torchvision's position embedding and relative positions fix it).
    """

    def __init__(self, source: MViT, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        # In torchvision's order, so that the state dict's order is torchvision's too.
        self.conv_proj = source.conv_proj
        self.pos_encoding = source.pos_encoding
        self.encoder = CoupledRuns(source.blocks, keeps_shape, ConvertedMultiscaleBlock, engine,
                                   size_keyword="thw")
        self.norm = source.norm
        self.head = source.head  # Sequential(Dropout, Linear): torchvision's names head.1.*
        self.in_chans = source.conv_proj.in_channels
        self.num_classes = source.head[1].out_features
        self.num_features = source.norm.normalized_shape[0]
        self.num_prefix_tokens = 1
        enc = source.pos_encoding
        stride = source.conv_proj.stride
        self.clip_size = (enc.temporal_size * stride[0], enc.spatial_size[0] * stride[1],
                          enc.spatial_size[1] * stride[2])
        reduction = stride[1]  # spatial, as the video Rev-MViT's (NOTE [ Features from stage
        for block in source.blocks:  # ends only ] in pareprop/models/_features.py)
            if block.pool_skip is not None:
                reduction *= block.pool_skip.pool.stride[1]
        self.feature_info = [{"num_chs": self.num_features, "module": "norm",
                              "reduction": reduction}]
        self.pretrained_cfg: Dict[str, Any] = {
            "architecture": "MViT",
            "input_size": (self.in_chans, *self.clip_size),
            "num_classes": self.num_classes,
            # The Kinetics-400 weights' transforms (torchvision's VideoClassification preset).
            "mean": (0.45, 0.45, 0.45),
            "std": (0.225, 0.225, 0.225),
            "crop_pct": 224 / 256,
            "interpolation": "bilinear",
            # Clips of num_frames frames, every 4th frame (7.5 fps of 30, as the weights' docs
            # say): what training and pareprop eval read (pareprop.data.video_data_config).
            "num_frames": self.clip_size[0],
            "frame_stride": 4,
            "first_conv": "conv_proj",
            "classifier": "head.1",
        }
        self.default_cfg = self.pretrained_cfg
        self.source_architecture = "MViT"
        self.coupling = (1.0, 0.0)
        # beta = 0 cannot be inverted: every block keeps its graph until the coupling moves.
        for stack in self.stacks():
            stack.store_blocks(range(len(stack.blocks)))
        keep_source_names(self, self.encoder.source_names("encoder.", "blocks."))

    def stacks(self) -> List[ReversibleStack]:
        """Every reversible stack, in order."""
        return self.encoder.stacks()

    def load_source_pretrained(self, source: str) -> None:
        """Load torchvision's Kinetics-400 weights of ``source`` (``mvit_v1_b``, ``mvit_v2_s``:
        its ``DEFAULT`` weights, torchvision's download cache); a classifier of another class
        count is left out (the fresh head stays). ``pareprop train --convert-from`` calls this.

        Raises:
            PretrainedError: they cannot be fetched (offline), or do not fit this model: the
                message names ``--pretrained-file`` and ``--from-scratch``.
        """
        offline = ("pass a local copy of them (torchvision's state dict) with --pretrained-file "
                   "PATH, or start from random weights with --from-scratch")
        try:
            weights = torchvision.models.get_model_weights(source).DEFAULT
            state = weights.get_state_dict(progress=True, check_hash=True)
        except (OSError, RuntimeError, ValueError) as e:  # no network, no cache, bad download
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise PretrainedError(
                f"--convert-from {source}: cannot fetch torchvision's weights "
                f"({type(e).__name__}: {first}); offline, {offline}") from None
        if state["head.1.weight"].shape[0] != self.num_classes:
            state = {k: v for k, v in state.items() if not k.startswith("head.1.")}
        own = self.state_dict()
        wrong = [k for k in own if k not in state and not k.startswith("head.1.")] + [
            k for k, v in state.items() if k not in own or own[k].shape != v.shape]
        if wrong:
            raise PretrainedError(
                f"torchvision's {source} weights do not fit this model (first: {wrong[0]}); "
                f"build it at their size ({weights.meta['min_temporal_size']} frames of "
                f"{weights.meta['min_size']}), or {offline}")
        self.load_state_dict(state, strict=False)

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters()
                if n.startswith("pos_encoding.") or "rel_pos" in n}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's groups for layer decay: the stem, each block in depth order (a stack's
        blocks one by one), then the final norm."""
        return dict(stem=r"^conv_proj|^pos_encoding",
                    blocks=[(r"^encoder\.parts\.(\d+)\.blocks\.(\d+)", None),
                            (r"^encoder\.parts\.(\d+)", None), (r"^norm", (99999,))])

    def get_classifier(self) -> nn.Module:
        return self.head[1]

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A fresh classifier for ``num_classes`` (0: none) after torchvision's dropout; the
        pooling is the class token's (``global_pool`` None or ``'token'``)."""
        if global_pool not in (None, "token"):
            raise ValueError(f"expected global_pool 'token' (the class token), got {global_pool!r}")
        ref = self.norm.weight
        fc = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype) \
            if num_classes > 0 else nn.Identity()
        if num_classes > 0:  # torchvision's initialisation
            nn.init.trunc_normal_(fc.weight, std=0.02)
            nn.init.zeros_(fc.bias)
        self.head[1] = fc.train(self.training)
        self.num_classes = num_classes
        self.pretrained_cfg["num_classes"] = num_classes

    def example_inputs(self, batch_size: int = 2, device: Any = None,
                       dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor]:
        return (torch.randn(batch_size, self.in_chans, *self.clip_size, device=device,
                            dtype=dtype),)

    # -- forward --------------------------------------------------------------------------

    def _tokens(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """torchvision's forward up to the final norm: tokens (class token first), their map."""
        if x.ndim != 5 or tuple(x.shape[1:]) != (self.in_chans, *self.clip_size):
            raise ValueError(
                f"expected clips (B, {self.in_chans}, {', '.join(map(str, self.clip_size))}) "
                f"(the size this MViT was built for), got {tuple(x.shape)}"
            )
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, THW, C)
        x = self.pos_encoding(x)  # the class token first, then the position embedding
        thw = (self.pos_encoding.temporal_size,) + tuple(self.pos_encoding.spatial_size)
        return self.encoder(x, thw)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Clips ``(B, C, T, H, W)`` to the normed tokens ``(B, 1 + T'H'W', C')``."""
        x, _ = self._tokens(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0]  # the class token, as torchvision's head reads it
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, Sequence[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """One feature, the last map (torchvision's MViT has no multi-scale features): the
        tokens after the final norm, class token dropped, ``(B, C, T', H', W')`` channels first
        ("NCHW"), ``(B, T', H', W', C)`` channels last ("NHWC")."""
        check_output_fmt(output_fmt)
        take, _ = feature_take_indices(1, indices)
        tokens, thw = self._tokens(x)
        tokens = self.norm(tokens)  # the final norm is forward_features', so ``norm`` is moot
        y = tokens[:, 1:].reshape(tokens.shape[0], *thw, tokens.shape[-1])
        features = [y.movedim(-1, 1).contiguous() if output_fmt == "NCHW" else y] * len(take)
        return features if intermediates_only else (tokens, features)


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

def published_mvit(
    source: str,
    spatial_size: Sequence[int] = (224, 224),
    temporal_size: int = 16,
    embed_dim: Optional[int] = None,
    max_run: Optional[int] = None,
    **kwargs: Any,
) -> MViT:
    """torchvision's ``source`` (``mvit_v1_b``, ``mvit_v2_s``) with random weights, at its
    published size, or smaller: clips of ``temporal_size`` frames of ``spatial_size``, widths
    scaled so that the first is ``embed_dim`` (heads kept), and every run of blocks that keep
    their shape cut to its first ``max_run`` (such blocks are interchangeable in the sequence:
    same width and map in and out). torchvision's builders fix the size, so the smaller one is
    its ``MViT`` built from the published blocks, read off a build on the meta device.
    ``kwargs``: ``MViT``'s (``num_classes``, ``dropout``, ``stochastic_depth_prob``, ...)."""
    if source not in SOURCES:
        raise ValueError(f"expected source in {', '.join(SOURCES)}, got {source!r}")
    if max_run is not None and (isinstance(max_run, bool) or not isinstance(max_run, int)
                                or max_run < 1):
        # 0 would cut every block that keeps its shape: no reversible stack would be left
        raise ValueError(f"expected max_run to be a positive integer (or unset), got {max_run!r}")
    spatial_size = tuple(int(s) for s in spatial_size)
    if (spatial_size, temporal_size, embed_dim, max_run) == ((224, 224), 16, None, None):
        return torchvision.models.get_model(source, **kwargs)
    with torch.device("meta"):
        full = torchvision.models.get_model(source)
    scale = (embed_dim or full.conv_proj.out_channels) / full.conv_proj.out_channels
    settings, run = [], 0
    for block in full.blocks:
        run = run + 1 if keeps_shape(block) else 0
        if max_run is not None and run > max_run:
            continue
        attn = block.attn

        def pool(p: Optional[nn.Module]) -> Tuple[List[int], List[int]]:
            return ([], []) if p is None else (list(p.pool.kernel_size), list(p.pool.stride))

        (kernel_q, stride_q), (kernel_kv, stride_kv) = pool(attn.pool_q), pool(attn.pool_k)
        settings.append(MSBlockConfig(
            num_heads=attn.num_heads,
            input_channels=int(block.norm1.normalized_shape[0] * scale),
            output_channels=int(block.mlp[-2].out_features * scale),
            kernel_q=kernel_q, kernel_kv=kernel_kv, stride_q=stride_q, stride_kv=stride_kv))
    first = full.blocks[0]
    kwargs.setdefault("stochastic_depth_prob", full.blocks[-1].stochastic_depth.p)
    return MViT(spatial_size=spatial_size, temporal_size=int(temporal_size),
                block_setting=settings, residual_pool=first.attn.residual_pool,
                residual_with_cls_embed=first.attn.residual_with_cls_embed,
                rel_pos_embed=first.attn.rel_pos_h is not None,
                proj_after_attn=first.proj_after_attn, **kwargs)


@register_model(timm=False)
def converted_tv_mvit(
    source: str = "mvit_v2_s",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    num_frames: Optional[int] = None,
    img_size: Optional[int] = None,
    frame_stride: Optional[int] = None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    **tv_kwargs: Any,
) -> ConvertedMViT:
    """torchvision's ``source`` (``mvit_v1_b`` or ``mvit_v2_s``, random weights:
    :func:`published_mvit`, at its published size unless ``tv_kwargs`` say smaller), converted.

    ``pretrained_file``: torchvision's weights (its state-dict layout, e.g.
    ``mvit_v2_s-ae3be167.pth``) to start from; see :func:`load_torchvision_mvit_weights`.
    :meth:`ConvertedMViT.load_source_pretrained` fetches them instead (online).
    ``coupling``, ``tolerance``: as :func:`pareprop.convert.vit.converted_vit`'s.
    ``num_frames`` and ``img_size``: the clips it takes (``T x img_size x img_size``), the
    names every video model shares (``pareprop plan --num-frames``, ``converted_swin3d``);
    the same as ``temporal_size`` and ``spatial_size=(img_size, img_size)``. ``frame_stride``,
    ``mean``, ``std``: the data its clips are sampled and normalised by (default the
    weights': :func:`pareprop.convert.source.set_clip_data`).
    """
    for ours, theirs, value in (("num_frames", "temporal_size", num_frames),
                                ("img_size", "spatial_size", img_size)):
        if value is not None and theirs in tv_kwargs:
            raise ValueError(f"{ours} and {theirs} both set the clip's size: give one")
    for name, value in (("num_frames", num_frames), ("img_size", img_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"expected {name} to be a positive integer, got {value!r}")
    if num_frames is not None:
        tv_kwargs["temporal_size"] = int(num_frames)
    if img_size is not None:
        tv_kwargs["spatial_size"] = (int(img_size), int(img_size))
    alpha, beta = coupling_pair(coupling)  # refused before the source is built
    if pretrained_file is not None:  # NOTE [ The coupling travels with the weights ]
        check_saved_coupling(pretrained_file, (alpha, beta))
    mvit = build_source(lambda: published_mvit(source, **tv_kwargs), f"torchvision's {source}",
                        tv_kwargs)
    if pretrained_file is not None:
        load_torchvision_mvit_weights(mvit, pretrained_file)
    model = convert(mvit, engine=engine, tolerance=tolerance)
    model.source_architecture = model.pretrained_cfg["architecture"] = source
    set_clip_data(model, frame_stride, mean, std)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    return model


register_source_names("converted_tv_mvit", "torchvision", lambda name: name in SOURCES,
                      ", ".join(SOURCES))


def load_torchvision_mvit_weights(model: nn.Module, path: str) -> None:
    """Load torchvision's MViT weights (its state-dict layout, as ``torch.save`` of
    ``mvit_v2_s(weights=...).state_dict()`` or torchvision's download) from ``path`` into a
    torchvision ``MViT`` or its conversion; see
    :func:`pareprop.convert.weights.load_classifier_source_weights`."""
    # torchvision's MViT has no pretrained_cfg to name its classifier, which sits behind the
    # head's dropout: without the name, a file of another class count (Kinetics-400's 400)
    # was refused instead of loaded with a fresh head.
    load_classifier_source_weights(model, path, None, "torchvision MViT", classifier="head.1")
