"""What the published image and video Rev-MViTs share: the stage plan, the model's scaffolding
(stages of a transition and a reversible stack, the per-token norm and mean-pooled head) and
the renaming of PySlowFast's ``rev_backbone.layers.{i}`` weights.

Mangalam et al., "Reversible Vision Transformers", CVPR 2022. The 2-D model
(:mod:`pareprop.models.rev_mvit`) and the 3-D one (:mod:`pareprop.models.rev_mvit_video`) differ
only in their stem, their transition block, their blocks' qkv maps and the pooling strides'
rank; each supplies those and inherits the rest from :class:`RevMViTFamilyMixin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

from pareprop.engine import ENGINES, ReversibleStack
from pareprop.models._base import drop_path_rates, stage_group_matcher
from pareprop.models._features import StageEnd
from pareprop.models.mvit import MViTStage, MViTStagesMixin, checkpoint_stage_end
from pareprop.models.published import PretrainedError, detect_layout

__all__ = [
    "RevMViTStagePlan",
    "RevMViTFamilyMixin",
    "block_paths",
    "check_family_config",
    "is_pyslowfast",
    "plan_stages",
    "rename_pyslowfast",
]

Stride = Union[int, Tuple[int, ...]]


def check_family_config(cfg: Any) -> None:
    """Check the fields every Rev-MViT has: ``engine``, ``num_classes``, ``transition_blocks``."""
    if cfg.engine not in ENGINES:
        raise ValueError(f"expected engine in {ENGINES}, got {cfg.engine!r}")
    if cfg.num_classes < 0:
        raise ValueError(f"expected num_classes >= 0, got {cfg.num_classes}")
    check_transition_blocks(tuple(cfg.transition_blocks), cfg.depth)


def check_transition_blocks(transition_blocks: Tuple[int, ...], depth: int) -> None:
    """Raise ``ValueError`` unless every stage keeps at least one reversible block: the first
    stage before the first transition, every later one after its transition."""
    t = transition_blocks
    starts, ends = [0, *t], [*t, depth]
    ok = list(t) == sorted(set(t)) and all(1 <= i < depth for i in t)
    if not ok or any(e - s < (1 if s == 0 else 2) for s, e in zip(starts, ends)):
        raise ValueError(
            f"expected transition_blocks increasing in 1..depth-1 with at least one "
            f"reversible block after each (depth={depth}), got {t}"
        )


@dataclass(frozen=True)
class RevMViTStagePlan:
    """Derived layout of one stage: its transition block (if any) and reversible blocks."""

    transition: int | None
    reversible: List[int]
    width_in: int  # of each of the previous stack's streams (= width in the first stage)
    width: int  # of each of this stage's streams (2 * width_in after a transition)
    num_heads: int
    kv_stride: Stride


def _divide(kv: Stride, q: Stride) -> Stride:
    if isinstance(kv, int):
        return max(kv // q, 1)  # type: ignore[operator]
    return tuple(max(k // s, 1) for k, s in zip(kv, q))  # type: ignore[arg-type]


def plan_stages(cfg: Any, q_stride: Stride) -> List[RevMViTStagePlan]:
    """The stages of ``cfg``: widths and heads double at every transition, the key/value
    stride is divided by the queries' ``q_stride`` (not below 1)."""
    t = cfg.transition_blocks
    starts, ends = [0, *t], [*t, cfg.depth]
    plans, width, kv = [], cfg.embed_dim, cfg.kv_stride
    for s, (a, b) in enumerate(zip(starts, ends)):
        width_in = width
        if s > 0:
            width *= 2  # the previous stack's two streams side by side, or widened inside
            kv = _divide(kv, q_stride)
        plans.append(
            RevMViTStagePlan(
                transition=a if s > 0 else None,
                reversible=list(range(a + (s > 0), b)),
                width_in=width_in,
                width=width,
                num_heads=cfg.num_heads * 2**s,
                kv_stride=kv,
            )
        )
    return plans


def block_paths(plans: List[RevMViTStagePlan]) -> List[str]:
    """Module path of block ``i`` (PySlowFast's ``rev_backbone.layers.{i}``), in order."""
    paths: Dict[int, str] = {}
    for s, p in enumerate(plans):
        if p.transition is not None:
            paths[p.transition] = f"stages.{s}.transition"
        for j, i in enumerate(p.reversible):
            paths[i] = f"stages.{s}.stack.blocks.{j}"
    return [paths[i] for i in sorted(paths)]


def is_pyslowfast(state_dict: Mapping[str, torch.Tensor], what: str) -> bool:
    """True for PySlowFast's layout, False for pareprop's own; raise for any other."""
    layout = detect_layout(state_dict)
    if layout == "pareprop":
        return False
    if layout != "pyslowfast":
        raise PretrainedError(
            f"{what} weights are published by PySlowFast only; got a {layout} file"
        )
    return True


def rename_pyslowfast(
    state_dict: Mapping[str, torch.Tensor],
    paths: List[str],
    renames: Mapping[str, str],
    one_frame_convs: bool = False,
) -> Dict[str, torch.Tensor]:
    """``rev_backbone.layers.{i}.<old>...`` to ``paths[i].<renames[old]>...`` and
    ``head.projection`` to ``head``; other keys pass through, so that the strict check names
    them. ``one_frame_convs``: Conv3d weights over one frame ``(o, i, 1, k, k)`` lose that axis
    (the image model's pooling convolutions are Conv2d)."""
    prefix = "rev_backbone.layers."
    out: Dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        new = key
        if key.startswith(prefix):
            i, rest = key[len(prefix) :].split(".", 1)
            if not i.isdigit() or int(i) >= len(paths):
                raise PretrainedError(
                    f"the file has block {i} ({key!r}) but the model has {len(paths)} blocks; "
                    "create it with the file's depth"
                )
            for old, ours in renames.items():
                if rest.startswith(old):
                    rest = ours + rest[len(old) :]
                    break
            new = f"{paths[int(i)]}.{rest}"
        elif key.startswith("head.projection."):
            new = "head." + key[len("head.projection.") :]
        if one_frame_convs and value.ndim == 5 and value.shape[2] == 1:
            value = value.squeeze(2)  # Conv3d over one frame -> Conv2d
        out[new] = value
    return out


class RevMViTFamilyMixin(MViTStagesMixin):
    """The stages and head of a published Rev-MViT; the model supplies its stem
    (``_stem``), its transitions (``_make_transition``) and its blocks (``_make_block``).

    NOTE [ Rev-MViT stages and head ]
    Each stage is a :class:`~pareprop.models.mvit.MViTStage`: the transition (none in the first
    stage), then one :class:`~pareprop.ReversibleStack`. The head takes the last stack's two
    streams side by side, a LayerNorm on every token (as published, before the mean), the mean
    over the map's tokens, dropout and a linear classifier.
    """

    cfg: Any
    stages: nn.ModuleList
    norm: nn.LayerNorm
    head: nn.Module
    grad_checkpointing: bool

    def _make_transition(self, p: RevMViTStagePlan, path_rate: float, **common: Any) -> nn.Module:
        """Stage ``p``'s transition, with drop-path rate ``path_rate`` (``common``: the
        config's ``mlp_ratio``, ``qkv_bias`` and ``pool_kernel``)."""
        raise NotImplementedError

    def _make_block(self, p: RevMViTStagePlan, path_rate: float, **common: Any) -> nn.Module:
        """One of stage ``p``'s reversible blocks (arguments as :meth:`_make_transition`)."""
        raise NotImplementedError

    def _build_stages(
        self,
        plans: List[RevMViTStagePlan],
        reduction: Callable[[int], int],
        map_dims: int = 2,
    ) -> None:
        """Build ``stages`` and ``feature_info`` (``reduction(s)``: stage ``s``'s stride)."""
        cfg = self.cfg
        self.num_stages = len(plans)
        dpr = drop_path_rates(cfg.drop_path_rate, cfg.depth)
        common = dict(mlp_ratio=cfg.mlp_ratio, qkv_bias=cfg.qkv_bias, pool_kernel=cfg.pool_kernel)
        stages, self.feature_info = [], []
        for s, p in enumerate(plans):
            if p.width % p.num_heads:
                raise ValueError(
                    f"stage {s}: expected width {p.width} divisible by its {p.num_heads} heads "
                    "(heads double every stage); lower num_heads or raise embed_dim"
                )
            transition: Optional[nn.Module] = None
            if p.transition is not None:
                transition = self._make_transition(p, dpr[p.transition], **common)
            blocks = [self._make_block(p, dpr[i], **common) for i in p.reversible]
            stack = ReversibleStack(blocks, engine=cfg.engine)
            stages.append(MViTStage(transition, stack, map_dims=map_dims))
            self.feature_info.append(
                {"num_chs": 2 * p.width, "reduction": reduction(s), "module": f"stages.{s}"}
            )
        self.stages = nn.ModuleList(stages)
        self._block_paths = block_paths(plans)

        self._init_head(cfg, 2 * plans[-1].width)  # its norm on every token, before the mean

    def block_paths(self) -> List[str]:
        """Module path of block ``i`` (PySlowFast's ``rev_backbone.layers.{i}``), in order."""
        return list(self._block_paths)

    # -- timm model interface -------------------------------------------------------------

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's parameter groups (for layer-wise learning-rate decay): the stem, then each
        block in depth order (a transition before its stage's stack), then the head."""
        return stage_group_matcher(coarse, r"^pos_embed|^patch_embed")

    # -- forward --------------------------------------------------------------------------

    def _end(self, x: Union[torch.Tensor, StageEnd]) -> torch.Tensor:
        # Per token, as published (before the mean).
        return checkpoint_stage_end(self.norm, x, self.grad_checkpointing)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(x.flatten(1, -2).mean(dim=1))  # (B, F)
        return x if pre_logits else self.head(x)
