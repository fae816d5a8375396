"""A pretrained torchvision Video Swin Transformer (``swin3d_t/s/b``, Kinetics-400) rewired as
a dual-residual reversible network, exactly.

Video Swin: Liu et al., CVPR 2022. Coupling: Dr2Net (Zhao et al., CVPR 2024), docs/convert.md;
the stages as in NOTE [ Swin's stages as coupled stacks ] in pareprop/convert/swin.py.

torchvision's ``SwinTransformer3d`` keeps its stages and patch mergings side by side in one
``features`` sequence (``features.0`` the first stage's blocks, ``features.1`` a patch merging,
...). Every block is pre-norm on the ``(B, T, H, W, C)`` map,

    z + stochastic_depth(attn(norm1(z))),   z + stochastic_depth(mlp(norm2(z))),

``attn`` torchvision's 3-D (shifted-)window attention, which builds its mask from the input. A
converted model keeps ``features`` with the same indices: each stage a reversible stack of
coupled blocks (F the attention sub-layer, G the MLP sub-layer), each patch merging
torchvision's module, checkpointed under ``set_grad_checkpointing``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
import torchvision
from timm.models._features import feature_take_indices
from torchvision.models.swin_transformer import PatchMerging, SwinTransformerBlock
from torchvision.models.video.swin_transformer import ShiftedWindowAttention3d, SwinTransformer3d
from torchvision.ops import StochasticDepth

from pareprop.chunking import Chunk, Split, whole_shape
from pareprop.convert.block import CoupledBlock, sliced_dropouts
from pareprop.convert.coupling import set_coupling
from pareprop.convert.source import (
    UnsupportedModelError,
    convert,
    converts,
    keep_source_names,
    refuse_grad_checkpointing,
    refuse_hooks,
    register_source_names,
)
from pareprop.convert.swin import MergingInChunks, unregistered
from pareprop.convert.weights import load_source_weights, load_state
from pareprop.engine import ReversibleStack
from pareprop.layers.recompute import maybe_checkpoint
from pareprop.models import ReversibleModelMixin, check_output_fmt, make_head, register_model
from pareprop.models.published import PretrainedError

__all__ = [
    "ConvertedSwin3d", "ConvertedSwin3dBlock", "ConvertedSwin3dStage", "SWIN3D_SOURCES",
    "check_convertible", "converted_swin3d", "load_torchvision_pretrained",
]

_BRANCH_PARTS = ("norm1", "attn", "stochastic_depth", "norm2", "mlp")


def stochastic_depth_samples(module: nn.Module, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """torchvision's row-wise ``StochasticDepth`` on a chunk of samples: the chunk's slice of
    torchvision's draw for the whole batch (``empty((B, 1, ...)).bernoulli_(1 - p)``, divided
    by ``1 - p``)."""
    if not (module.training and module.p > 0.0):
        return x
    keep = 1.0 - module.p
    shape, rows = whole_shape(x, chunk, 0)
    noise = torch.empty([shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    noise.bernoulli_(keep)
    if keep > 0.0:
        noise.div_(keep)
    return x * chunk.take(noise, 0, rows)


class ConvertedSwin3dBlock(CoupledBlock):
    """torchvision's pre-norm ``SwinTransformerBlock`` with 3-D window attention:
    F(x) = alpha x + sd(attn(norm1(x))), G(y) = alpha y + sd(mlp(norm2(y))), ``sd`` the block's
    one stochastic-depth module (one draw per branch, as torchvision's)."""

    def __init__(self, block: SwinTransformerBlock):
        super().__init__(**{name: module for name, module in block.named_children()
                            if name in _BRANCH_PARTS})

    def f(self, x: torch.Tensor) -> torch.Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum torchvision computes.
        return self.alpha * x + self.stochastic_depth(self.attn(self.norm1(x)))

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x + self.stochastic_depth(self.mlp(self.norm2(x)))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each clip
    # alone, G on each token alone (bands of frames of the (B, T, H, W, C) map). torchvision's
    # attention draws its dropouts with F.dropout inside one function, which no slice reaches:
    # with either dropout on, F runs whole (the published models have none).
    def f_split(self, x: torch.Tensor) -> Optional[Split]:
        if self.attn.training and (self.attn.attention_dropout > 0 or self.attn.dropout > 0):
            return None
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        h = self.attn(self.norm1(x))  # (b, T, H, W, C)
        return self.alpha * x + stochastic_depth_samples(self.stochastic_depth, h, chunk)

    def g_split(self, x: torch.Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        with sliced_dropouts(self.mlp, chunk, dim=1):
            h = self.mlp(self.norm2(x))  # (B, t, H, W, C)
        # row-wise stochastic depth draws one value per sample: on a band, the whole draw.
        return self.alpha * x + self.stochastic_depth(h)


class ConvertedSwin3dStage(nn.Module):
    """A torchvision stage (a sequence of blocks) as one reversible stack from ``(x, x)``; its
    output is ``Y2`` of the last block."""

    def __init__(self, blocks: nn.Sequential, engine: str):
        super().__init__()
        self.stack = ReversibleStack([ConvertedSwin3dBlock(b) for b in blocks], engine=engine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, x = self.stack(x, x)  # z_0 = z_1 = x; the next merging reads z_{2L+1}
        return x


def check_convertible(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless ``model`` is torchvision's
    ``SwinTransformer3d`` itself, of torchvision's blocks, 3-D attention and patch merging."""
    if type(model) is not SwinTransformer3d:
        if isinstance(model, SwinTransformer3d):
            raise UnsupportedModelError(
                f"{type(model).__name__} subclasses torchvision's SwinTransformer3d and may "
                "change its forward; only SwinTransformer3d itself is converted exactly"
            )
        raise UnsupportedModelError(
            "expected torchvision's SwinTransformer3d (swin3d_t, swin3d_s, swin3d_b), got "
            f"{type(model).__name__}"
        )
    for i, part in enumerate(model.features):
        if i % 2 == 1:
            if type(part) is not PatchMerging:
                raise UnsupportedModelError(
                    f"features.{i} is a {type(part).__name__}, not torchvision's PatchMerging"
                )
            continue
        for j, block in enumerate(part):
            if type(block) is not SwinTransformerBlock or type(block.attn) is not \
                    ShiftedWindowAttention3d:
                raise UnsupportedModelError(
                    f"features.{i}.{j} is a {type(block).__name__} with "
                    f"{type(getattr(block, 'attn', None)).__name__}, not torchvision's pre-norm "
                    "SwinTransformerBlock with ShiftedWindowAttention3d"
                )
            if not (isinstance(block.stochastic_depth, StochasticDepth)
                    and block.stochastic_depth.mode == "row"):
                raise UnsupportedModelError(
                    f"features.{i}.{j}'s stochastic depth is not torchvision's row-wise one"
                )
    stages = [(i, part) for i, part in enumerate(model.features) if i % 2 == 0]
    refuse_hooks([("model.features", model.features)]
                 + [(f"features.{i}", s) for i, s in stages]
                 + [(f"features.{i}.{j}", b) for i, s in stages for j, b in enumerate(s)],
                 runs="attn, mlp, norm1, ..., and the patch mergings")
    refuse_grad_checkpointing(model)


@converts(SwinTransformer3d)
class ConvertedSwin3d(ReversibleModelMixin, nn.Module):
    """torchvision's ``SwinTransformer3d`` whose stages each run their blocks as one reversible
    stack of coupled blocks; build it with :func:`pareprop.convert`.

    Shares the source's parameters and keeps torchvision's names in its state dict
    (``features.2.1.attn.qkv.weight``), so torchvision's checkpoints load into it and its
    checkpoints load into torchvision's model.
    """

    def __init__(self, source: SwinTransformer3d, engine: str = "reversible"):
        super().__init__()
        check_convertible(source)
        self.num_classes = source.num_classes
        self.num_features = source.num_features
        self.in_chans = source.patch_embed.proj.in_channels
        self.patch_embed = source.patch_embed
        self.pos_drop = source.pos_drop
        self.features = nn.Sequential(*[
            ConvertedSwin3dStage(part, engine) if i % 2 == 0 else part
            for i, part in enumerate(source.features)])
        self.norm = source.norm
        self.avgpool = source.avgpool
        self.head = source.head
        self.grad_checkpointing = False  # the stem and mergings (set_grad_checkpointing)
        for i, part in enumerate(self.features):
            if isinstance(part, PatchMerging):
                unregistered(self, f"_merging{i}", MergingInChunks(part))
        patch = source.patch_embed.tuple_patch_size
        self._stage_indices = list(range(0, len(self.features), 2))
        self.feature_info = [
            {"num_chs": self.num_features // 2 ** (len(self._stage_indices) - 1 - k),
             "reduction": patch[1] * 2 ** k, "module": f"features.{i}"}
            for k, i in enumerate(self._stage_indices)]
        self.pretrained_cfg: Dict[str, Any] = {
            "input_size": (self.in_chans, 32, 224, 224), "num_classes": self.num_classes,
            **_WEIGHTS_DATA, "first_conv": "patch_embed.proj", "classifier": "head"}
        self.default_cfg = self.pretrained_cfg
        self.coupling = (1.0, 0.0)
        for stack in self._stacks():  # beta = 0: every block keeps its graph
            stack.store_blocks(range(len(stack.blocks)))
        keep_source_names(self, [(f"features.{i}.stack.blocks.", f"features.{i}.")
                                 for i in self._stage_indices])

    def _stacks(self) -> List[ReversibleStack]:
        return [self.features[i].stack for i in self._stage_indices]

    @property
    def depth(self) -> int:
        return sum(len(stack.blocks) for stack in self._stacks())

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters() if "relative_position_bias_table" in n}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Groups for layer decay: the stem, then each block of each stage, each patch merging a
        group between the stages it joins, then the final norm."""
        return dict(
            stem=r"^patch_embed",
            blocks=r"^features\.(\d+)" if coarse else [
                (r"^features\.(\d+)\.stack\.blocks\.(\d+)", None),
                (r"^features\.(\d+)\.", None),
                (r"^norm", (99999,)),
            ],
        )

    def load_source_pretrained(self, source: str) -> None:
        """torchvision's published weights of ``source``, for ``--convert-from`` without
        ``--pretrained-file`` (the trainer asks the model; timm's sources go through timm)."""
        load_torchvision_pretrained(self, source)

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A fresh classifier for ``num_classes`` (0: none) after torchvision's mean pooling."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"expected global_pool 'avg' (torchvision's), got {global_pool!r}")
        ref = self.norm.weight
        self.num_classes = num_classes
        self.pretrained_cfg["num_classes"] = num_classes
        self.head = make_head(self.num_features, num_classes, device=ref.device,
                              dtype=ref.dtype).train(self.training)

    def example_inputs(self, batch_size: int = 2, device: Any = None,
                       dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor]:
        C, T, H, W = self.pretrained_cfg["input_size"]
        return (torch.randn(batch_size, C, T, H, W, device=device, dtype=dtype),)

    # -- forward --------------------------------------------------------------------------

    def _run_features(self, x: torch.Tensor, stop: Optional[int] = None,
                      take: Sequence[int] = ()) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        taken = []
        chunking = None
        for i, part in enumerate(self.features[:stop]):
            if isinstance(part, ConvertedSwin3dStage):
                x = part(x)  # (B, T, H, W, C)
                chunking = part.stack.chunking
                if i // 2 in take:
                    taken.append(x)
            else:  # patch merging, in chunks of samples as its stage's stack's branches
                x = maybe_checkpoint(getattr(self, f"_merging{i}"), x, self.grad_checkpointing,
                                     chunking)
        return x, taken

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Clips ``(B, C, T, H, W)`` to the final normed map ``(B, T', H', W', C')``, as
        torchvision's forward before pooling."""
        # Checkpointed (set_grad_checkpointing), the patch embedding keeps the clips, which the
        # caller holds anyway, not its norm's input.
        x = self.pos_drop(maybe_checkpoint(self.patch_embed, x, self.grad_checkpointing))
        x, _ = self._run_features(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.permute(0, 4, 1, 2, 3)  # (B, C, T, H, W)
        x = torch.flatten(self.avgpool(x), 1)
        return x if pre_logits else self.head(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, Sequence[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """One feature a stage end (NOTE [ Features from stage ends only ]): ``(B, C, T, H, W)``
        channels first ("NCHW"), ``(B, T, H, W, C)`` channels last ("NHWC"); ``norm`` applies
        the final norm to the last stage's."""
        check_output_fmt(output_fmt)
        stages = len(self._stage_indices)
        take, max_index = feature_take_indices(stages, indices)
        stop = 2 * max_index + 1 if stop_early else None
        x = self.pos_drop(self.patch_embed(x))
        x, features = self._run_features(x, stop, take)
        if norm and stages - 1 in take:
            features[-1] = self.norm(features[-1])
        if output_fmt == "NCHW":
            features = [f.permute(0, 4, 1, 2, 3).contiguous() for f in features]
        if intermediates_only:
            return features
        return (self.norm(x) if stop is None or max_index == stages - 1 else x), features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# -- a named model, so create_model, checkpoints and the trainer can build one ---------------

# torchvision's published configurations (its swin3d_* builders pass them to SwinTransformer3d
# and take no overrides of them; tests/test_convert_swin3d.py checks this table against them).
SWIN3D_SOURCES: Dict[str, Dict[str, Any]] = {
    "swin3d_t": dict(patch_size=[2, 4, 4], embed_dim=96, depths=[2, 2, 6, 2],
                     num_heads=[3, 6, 12, 24], window_size=[8, 7, 7],
                     stochastic_depth_prob=0.1),
    "swin3d_s": dict(patch_size=[2, 4, 4], embed_dim=96, depths=[2, 2, 18, 2],
                     num_heads=[3, 6, 12, 24], window_size=[8, 7, 7],
                     stochastic_depth_prob=0.1),
    "swin3d_b": dict(patch_size=[2, 4, 4], embed_dim=128, depths=[2, 2, 18, 2],
                     num_heads=[4, 8, 16, 32], window_size=[8, 7, 7],
                     stochastic_depth_prob=0.1),
}

# NOTE [ What torchvision's Video Swin weights expect ]
# Every swin3d_* weight's transforms are VideoClassification(resize_size=(256,),
# crop_size=(224, 224), bilinear, ImageNet mean and std), clips (B, C, T, H, W); torchvision
# evaluates them on 32-frame clips at 15 frames a second (its meta: frame_rate=15,
# clips_per_video=12, clip_len=32), Video Swin's 32x2 sampling (every 2nd frame of 30 fps).
_WEIGHTS_DATA: Dict[str, Any] = dict(
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=224 / 256,
    crop_mode="center", interpolation="bilinear", num_frames=32, frame_stride=2,
    frame_rate=15, clips_per_video=12,
)


def build_swin3d(source: str, **kwargs: Any) -> SwinTransformer3d:
    """torchvision's ``source`` (``swin3d_t/s/b``) with random weights; ``kwargs`` override its
    configuration (``depths``, ``embed_dim``, ``num_classes``, ...)."""
    if source not in SWIN3D_SOURCES:
        raise ValueError(f"expected a torchvision source in {sorted(SWIN3D_SOURCES)}, got "
                         f"{source!r}")
    return SwinTransformer3d(**{"num_classes": 400, **SWIN3D_SOURCES[source], **kwargs})


def load_torchvision_pretrained(model: nn.Module, source: str,
                                weights: str = "DEFAULT") -> None:
    """Load torchvision's published ``weights`` of ``source`` (its download cache) into the
    converted ``model``; a head of another class count is left out (the model keeps its own).

    Raises:
        PretrainedError: the weights cannot be fetched (offline: the message names
            ``--pretrained-file``, a local copy in torchvision's layout) or do not fit.
    """
    published = getattr(torchvision.models.get_model_weights(source), weights)
    try:
        state = published.get_state_dict(progress=True, check_hash=True)
    except (OSError, RuntimeError) as e:  # no network, no cache, a damaged download
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise PretrainedError(
            f"--convert-from {source}: cannot fetch torchvision's {weights} weights "
            f"({type(e).__name__}: {first}); offline, pass a local copy of them (torchvision's "
            "state dict) with --pretrained-file PATH, or start from random weights with "
            "--from-scratch"
        ) from None
    load_state(model, state, head=("head.weight", "head.bias"),
               where=f"torchvision's {source} {weights} weights",
               hint="give --model-arg sizes only with --pretrained-file or --from-scratch")


@register_model(timm=False)
def converted_swin3d(
    source: str = "swin3d_t",
    pretrained_file: Optional[str] = None,
    engine: str = "reversible",
    coupling: Sequence[float] = (1.0, 0.0),
    tolerance: Optional[float] = 1e-3,
    num_frames: int = 32,
    img_size: int = 224,
    **torchvision_kwargs: Any,
) -> ConvertedSwin3d:
    """torchvision's ``source`` Video Swin (``swin3d_t``, ``swin3d_s``, ``swin3d_b``; sizes
    overridden by ``torchvision_kwargs``), converted.

    ``pretrained_file``: torchvision's weights of the source (its state dict, as
    ``torch.save(model.state_dict())`` or its download writes it), read safely; a head of
    another class count is left out. ``coupling``: (alpha, beta) to start at (recorded by
    :func:`pareprop.set_coupling`, so a checkpoint rebuilds it there). ``tolerance``: of the
    precision guard (None: none). ``num_frames`` and ``img_size``: the clips it takes (its
    ``pretrained_cfg``; torchvision's model itself takes any size).
    """
    net = build_swin3d(source, **torchvision_kwargs)
    if pretrained_file is not None:
        load_source_weights(
            net, pretrained_file, head=("head.weight", "head.bias"),
            hint=f"is it torchvision's {source} state dict (give --model-arg sizes of another)?")
    model = convert(net, engine=engine, tolerance=tolerance)
    alpha, beta = (float(c) for c in coupling)
    if (alpha, beta) != (1.0, 0.0):
        set_coupling(model, alpha, beta)
    model.pretrained_cfg.update(input_size=(model.in_chans, int(num_frames), int(img_size),
                                            int(img_size)), num_frames=int(num_frames))
    return model


register_source_names("converted_swin3d", "torchvision", SWIN3D_SOURCES.__contains__,
                      "swin3d_t, swin3d_s, swin3d_b")
