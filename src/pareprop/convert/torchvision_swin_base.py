"""What the conversions of torchvision's Swin Transformers share: the 2-D ``swin_t/s/b`` and
``swin_v2_t/s/b`` (pareprop/convert/torchvision_swin.py) and the video ``swin3d_t/s/b``
(pareprop/convert/swin3d.py).

Swin: Liu et al., ICCV 2021; Swin V2: Liu et al., CVPR 2022; Video Swin: Liu et al., CVPR 2022.
Coupling: Dr2Net (Zhao et al., CVPR 2024), docs/convert.md; the stages as in NOTE [ Swin's
stages as coupled stacks ] in pareprop/convert/swin.py.

NOTE [ torchvision's Swin models as coupled stacks ]
torchvision keeps a Swin's stages and patch mergings side by side in one ``features``
sequence; each stage is a sequence of blocks, each block two residual sub-layers on the map
(``(B, H, W, C)``, or ``(B, T, H, W, C)`` for video) with one row-wise ``stochastic_depth``
module drawing for both:

    SwinTransformerBlock (pre-norm):     z + sd(attn(norm1(z))),   z + sd(mlp(norm2(z)))
    SwinTransformerBlockV2 (post-norm):  z + sd(norm1(attn(z))),   z + sd(norm2(mlp(z)))

``attn`` torchvision's (shifted-)window attention, which builds its mask from its input. A
converted model keeps ``features`` with torchvision's indices: each stage one reversible stack
of coupled blocks from ``(x, x)`` (F the attention sub-layer, G the MLP sub-layer), handing the
next part ``Y2`` of its last block; every other part (the 2-D stem, the patch mergings)
torchvision's module, checkpointed under ``set_grad_checkpointing``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.nn as nn
import torchvision
from timm.models._features import feature_take_indices
from torchvision.models.swin_transformer import SwinTransformerBlock, SwinTransformerBlockV2
from torchvision.ops import StochasticDepth

from pareprop.chunking import Chunk, Split
from pareprop.convert.block import CoupledBlock, sliced_dropouts, stochastic_depth_samples
from pareprop.convert.source import UnsupportedModelError, refuse_hooks
from pareprop.convert.swin import MergingInChunks, unregistered
from pareprop.convert.weights import load_state
from pareprop.engine import ReversibleStack
from pareprop.engine.recompute import maybe_checkpoint
from pareprop.models import check_output_fmt, make_head
from pareprop.models.published import PretrainedError

__all__ = [
    "ConvertedTorchvisionSwinBlock", "ConvertedTorchvisionSwinStage",
    "ConvertedTorchvisionSwinV2Block", "TorchvisionSwinFeatures", "check_features",
    "load_torchvision_pretrained",
]

_BRANCH_PARTS = ("norm1", "attn", "stochastic_depth", "norm2", "mlp")


class _TorchvisionSwinBlockBase(CoupledBlock):
    """A torchvision Swin block's two sub-layers as a coupling with skip scale beta:
    F(x) = alpha x + sd(H_attn(x)), G(y) = alpha y + sd(H_mlp(y)), ``sd`` the block's one
    stochastic-depth module (one draw per branch, as torchvision's). Shares the block's modules
    under torchvision's names."""

    def __init__(self, block: SwinTransformerBlock):
        super().__init__(**{name: module for name, module in block.named_children()
                            if name in _BRANCH_PARTS})

    def _h_attn(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _h_mlp(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def f(self, x: torch.Tensor) -> torch.Tensor:
        # alpha * x + H(x): at alpha = 1 the very sum torchvision computes.
        return self.alpha * x + self.stochastic_depth(self._h_attn(x))

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x + self.stochastic_depth(self._h_mlp(x))

    # Chunked branches (NOTE [ Chunked branches ] in pareprop/chunking.py): F acts on each
    # sample alone (its windows are its own), G on each token alone (bands of rows of the 2-D
    # map, of frames of the video map). torchvision's attention draws its dropouts with
    # F.dropout inside one function, which no slice reaches: with either dropout on, F runs
    # whole (the published models have none).
    def f_split(self, x: torch.Tensor) -> Optional[Split]:
        if self.attn.training and (self.attn.attention_dropout > 0 or self.attn.dropout > 0):
            return None
        return Split.samples(x.shape[0])

    def f_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        h = self._h_attn(x)  # (b, ..., C)
        return self.alpha * x + stochastic_depth_samples(self.stochastic_depth, h, chunk)

    def g_split(self, x: torch.Tensor) -> Split:
        return Split.tokens(x.shape[1])

    def g_chunk(self, x: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        with sliced_dropouts(self.mlp, chunk, dim=1):
            h = self._h_mlp(x)  # (B, rows, ..., C)
        # row-wise stochastic depth draws one value per sample: on a band, the whole draw.
        return self.alpha * x + self.stochastic_depth(h)


class ConvertedTorchvisionSwinBlock(_TorchvisionSwinBlockBase):
    """torchvision's pre-norm ``SwinTransformerBlock`` (2-D or 3-D attention):
    F(x) = alpha x + sd(attn(norm1(x))), G(y) = alpha y + sd(mlp(norm2(y)))."""

    def _h_attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm1(x))

    def _h_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm2(x))


class ConvertedTorchvisionSwinV2Block(_TorchvisionSwinBlockBase):
    """torchvision's post-norm ``SwinTransformerBlockV2`` (residual ``z + norm(H(z))``):
    F(x) = alpha x + sd(norm1(attn(x))), G(y) = alpha y + sd(norm2(mlp(y)))."""

    def _h_attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm1(self.attn(x))

    def _h_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.mlp(x))


# torchvision's block classes, exactly (SwinTransformerBlockV2 subclasses SwinTransformerBlock
# and changes where the norms sit), to the converted block.
_BLOCKS: Dict[type, Type[_TorchvisionSwinBlockBase]] = {
    SwinTransformerBlock: ConvertedTorchvisionSwinBlock,
    SwinTransformerBlockV2: ConvertedTorchvisionSwinV2Block,
}


class ConvertedTorchvisionSwinStage(nn.Module):
    """A torchvision stage (a sequence of blocks) as one reversible stack from ``(x, x)``; its
    output is ``Y2`` of the last block."""

    def __init__(self, blocks: nn.Sequential, engine: str):
        super().__init__()
        self.stack = ReversibleStack([_BLOCKS[type(b)](b) for b in blocks], engine=engine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, x = self.stack(x, x)  # z_0 = z_1 = x; the next part reads z_{2L+1}
        return x


def check_features(features: nn.Sequential, stage_indices: Sequence[int],
                   attentions: Sequence[type], mergings: Sequence[type]) -> None:
    """Raise :class:`UnsupportedModelError`, saying why, unless every stage of ``features``
    (at ``stage_indices``) holds torchvision's blocks with one of the ``attentions`` and a
    row-wise stochastic depth, every part between two stages is one of the ``mergings``,
    nothing in ``features`` keeps running statistics, and no hook sits where it would not
    run."""
    stages = [(i, features[i]) for i in stage_indices]
    for i, part in enumerate(features):
        if i in stage_indices:
            continue
        if i > stage_indices[0] and type(part) not in mergings:
            names = " or ".join(m.__name__ for m in mergings)
            raise UnsupportedModelError(
                f"features.{i} is a {type(part).__name__}, not torchvision's {names}")
    for i, stage in stages:
        if type(stage) is not nn.Sequential:
            raise UnsupportedModelError(
                f"features.{i} is a {type(stage).__name__}, not a stage (torchvision's "
                "nn.Sequential of blocks)")
        for j, block in enumerate(stage):
            if type(block) not in _BLOCKS or type(block.attn) not in attentions:
                names = " or ".join(a.__name__ for a in attentions)
                raise UnsupportedModelError(
                    f"features.{i}.{j} is a {type(block).__name__} with "
                    f"{type(getattr(block, 'attn', None)).__name__}, not torchvision's "
                    f"SwinTransformerBlock (pre-norm) or SwinTransformerBlockV2 (post-norm) "
                    f"with {names}"
                )
            if not (isinstance(block.stochastic_depth, StochasticDepth)
                    and block.stochastic_depth.mode == "row"):
                raise UnsupportedModelError(
                    f"features.{i}.{j}'s stochastic depth is not torchvision's row-wise one"
                )
    for name, module in features.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            raise UnsupportedModelError(
                f"features.{name} is a {type(module).__name__}: its running statistics would "
                "move again in every recomputation; build the model with LayerNorm "
                "(torchvision's default)"
            )
    refuse_hooks([("model.features", features)]
                 + [(f"features.{i}", s) for i, s in stages]
                 + [(f"features.{i}.{j}", b) for i, s in stages for j, b in enumerate(s)],
                 runs="attn, mlp, norm1, ..., and the patch mergings")


class TorchvisionSwinFeatures:
    """The model methods the converted torchvision Swins share (a mixin before
    ``ReversibleModelMixin``). The model sets ``features`` (stages converted by
    :meth:`_convert_features`), ``norm``, ``avgpool``, ``head``, ``num_features``,
    ``pretrained_cfg`` and ``_STEM`` (the stem's names, for layer decay), and defines
    ``_embed`` (inputs to the first stage's map)."""

    _STEM = ""

    def _convert_features(self, features: nn.Sequential, stage_indices: Sequence[int],
                          engine: str) -> None:
        self._stage_indices = list(stage_indices)
        self.features = nn.Sequential(*[
            ConvertedTorchvisionSwinStage(part, engine) if i in self._stage_indices else part
            for i, part in enumerate(features)])
        for i, part in enumerate(self.features):
            if i > self._stage_indices[0] and i not in self._stage_indices:
                unregistered(self, f"_merging{i}", MergingInChunks(part))
        self.grad_checkpointing = False  # the stem and mergings (set_grad_checkpointing)
        self.coupling = (1.0, 0.0)
        for stack in self._stacks():  # beta = 0: every block keeps its graph
            stack.store_blocks(range(len(stack.blocks)))

    def _stacks(self) -> List[ReversibleStack]:
        return [self.features[i].stack for i in self._stage_indices]

    @property
    def depth(self) -> int:
        return sum(len(stack.blocks) for stack in self._stacks())

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # torchvision's recipe (--transformer-embedding-decay) exempts the relative position
        # tables; V2 has none (its positions come from an MLP).
        return {n for n, _ in self.named_parameters() if "relative_position_bias_table" in n}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Groups for layer decay: the stem, then each block of each stage, each patch merging a
        group between the stages it joins, then the final norm."""
        return dict(
            stem=self._STEM,
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
        size = self.pretrained_cfg["input_size"]  # (C, H, W) or (C, T, H, W)
        return (torch.randn(batch_size, *size, device=device, dtype=dtype),)

    # -- forward --------------------------------------------------------------------------

    def _run_features(self, x: torch.Tensor, stop: Optional[int] = None,
                      take: Sequence[int] = ()) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The parts of ``features`` after the stem, up to ``stop``; the ends of the stages
        numbered in ``take``."""
        taken = []
        chunking = None
        start = self._stage_indices[0]
        for i, part in enumerate(self.features[:stop]):
            if i < start:
                continue  # the stem (_embed)
            if i in self._stage_indices:
                x = part(x)  # (B, ..., C)
                chunking = part.stack.chunking
                if self._stage_indices.index(i) in take:
                    taken.append(x)
            else:  # patch merging, in chunks of samples as its stage's stack's branches
                x = maybe_checkpoint(getattr(self, f"_merging{i}"), x, self.grad_checkpointing,
                                     chunking)
        return x, taken

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs to the final normed map ``(B, ..., H', W', C')``, as torchvision's forward
        before pooling."""
        x, _ = self._run_features(self._embed(x))
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = torch.flatten(self.avgpool(x.movedim(-1, 1)), 1)  # channels first, as torchvision
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
        """One feature a stage end (NOTE [ Features from stage ends only ]): channels first
        ("NCHW": ``(B, C, H, W)``, ``(B, C, T, H, W)``), or channels last ("NHWC", the map as
        torchvision keeps it); ``norm`` applies the final norm to the last stage's."""
        check_output_fmt(output_fmt)
        stages = len(self._stage_indices)
        take, max_index = feature_take_indices(stages, indices)
        stop = self._stage_indices[max_index] + 1 if stop_early else None
        x, features = self._run_features(self._embed(x), stop, take)
        if norm and stages - 1 in take:
            features[-1] = self.norm(features[-1])
        if output_fmt == "NCHW":
            features = [f.movedim(-1, 1).contiguous() for f in features]
        if intermediates_only:
            return features
        return (self.norm(x) if stop is None or max_index == stages - 1 else x), features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


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
