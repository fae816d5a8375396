"""Multi-scale features for dense tasks: timm's ``forward_intermediates`` over stage outputs.

# NOTE [ Features from stage ends only ]
# A reversible stack keeps no inner activations: backward rebuilds them from the stack's
# output. The output of a stage (its stack's end, fused for the next stage) is kept anyway,
# because the next stage's first layer saves it as its input, so returning it as a feature
# costs no memory beyond the tensor the caller holds. Block-level intermediates would mean
# storing what the engines exist to not store, so the hierarchical models (Rev-MViTv2, Rev-Swin)
# offer one feature per stage (strides 4, 8, 16, 32 with a stride-4 stem) and Rev-ViT offers
# the end of its single stack. The video Rev-MViT offers its stages' space-time maps the same
# way: ``(B, C, T, H, W)`` channels first ("NCHW"), ``(B, T, H, W, C)`` channels last ("NHWC");
# its ``reduction`` is the spatial one (time is halved once, by the stem).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.models._features import FeatureGetterNet, feature_take_indices

__all__ = [
    "StageEnd",
    "StageFeatureNet",
    "StageFeaturesMixin",
    "check_output_fmt",
    "join_streams",
    "stage_map",
]

Indices = Optional[Union[int, Sequence[int]]]


class StageEnd(NamedTuple):
    """A stage's end as its stack leaves it: two streams ``(B, N, C)`` over a map ``grid``.

    NOTE [ Stage ends kept once ]
    The engines keep a stack's two output streams for backward, and a checkpointed transition
    keeps its input. Were that input the streams' concatenation, every stage end would be kept
    twice: in the video model's first stage (25,088 tokens a clip) 18.4 MiB a clip beside the
    streams' own 18.4, half of everything kept. So stages hand each other the streams, and the
    next transition joins them inside its checkpoint (maybe_checkpoint's ``join``), keeping
    only the streams; the joined map is made where a caller needs it (:func:`stage_map`: a
    feature, the last norm, the head). Only where the stack keeps its streams anyway
    (``ReversibleStack.keeps_outputs``): under plain autograd a stack's outputs are not kept,
    and handing them on would keep two maps where the joined one is kept now."""

    y1: torch.Tensor
    y2: torch.Tensor
    grid: Tuple[int, ...]  # (H, W) or (T, H, W)


def join_streams(
    y1: torch.Tensor, y2: torch.Tensor, grid: Optional[Tuple[int, ...]] = None
) -> torch.Tensor:
    """Two streams ``(B, N, C)`` side by side as the map ``(B, *grid, 2C)``; without
    ``grid``, two streams of any shape side by side on their last axis."""
    if grid is None:
        return torch.cat([y1, y2], dim=-1)  # (..., 2C)
    # B and C from the streams, not -1: B may be 0.
    return torch.cat([y1, y2], dim=-1).view(y1.shape[0], *grid, 2 * y1.shape[-1])


def stage_map(x: Union[torch.Tensor, StageEnd]) -> torch.Tensor:
    """A stage's output as a channels-last map (a :class:`StageEnd` joined)."""
    return join_streams(*x) if isinstance(x, StageEnd) else x


def check_output_fmt(output_fmt: str) -> None:
    if output_fmt not in ("NCHW", "NHWC"):
        raise ValueError(f"expected output_fmt 'NCHW' or 'NHWC', got {output_fmt!r}")


class StageFeaturesMixin:
    """``forward_intermediates`` and ``prune_intermediate_layers`` for models whose
    ``stages`` map ``(B, H, W, C)`` to ``(B, H', W', C')`` (or video maps ``(B, T, H, W, C)``
    to ``(B, T', H', W', C')``: channels first is then ``(B, C, T', H', W')``).

    The model sets ``stages``, ``norm``, ``feature_info`` (one dict per stage) and defines
    ``_stem`` (input check and patch embedding) and ``_end`` (what ``forward_features`` does
    after the last stage).
    """

    stages: Union[nn.Sequential, nn.ModuleList]
    norm: nn.Module
    feature_info: List[Dict[str, Any]]
    num_features: int
    # forward_features gives channels-last maps (B, H, W, C): timm reads the channel axis of
    # non-standard models from these.
    feature_dim = -1
    output_fmt = "NHWC"

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _end(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Indices = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Stage outputs as timm defines them.

        Args:
            x: images ``(B, C, H, W)`` (clips ``(B, C, T, H, W)`` for a video model).
            indices: stages to return: the last n if an int, all if None, else these indices.
            norm: apply the final norm to the last stage's output.
            stop_early: run no stage after the last one asked for.
            output_fmt: ``"NCHW"`` (timm's default: channels first) or ``"NHWC"`` (channels
                last, as the stages compute them).
            intermediates_only: return only the list of features.

        Returns:
            The features, or ``(forward_features output, features)``.
        """
        check_output_fmt(output_fmt)
        take, max_index = feature_take_indices(len(self.stages), indices)
        last = len(self.stages) - 1
        x = self._stem(x)
        features = []
        for i, stage in enumerate(self.stages):
            if stop_early and i > max_index:
                break
            # Stages that hand on their streams (NOTE [ Stage ends kept once ]) are chained
            # so; a feature is the joined map.
            x = stage.forward_ends(x) if hasattr(stage, "forward_ends") else stage(x)
            if i in take:
                y = stage_map(x)
                y = self.norm(y) if norm and i == last else y
                features.append(y.movedim(-1, 1).contiguous() if output_fmt == "NCHW" else y)
        if intermediates_only:
            return features
        return (self._end(x) if i == last else stage_map(x)), features

    def prune_intermediate_layers(
        self, indices: Indices = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> List[int]:
        """Drop the stages after the last of ``indices`` (and the head, the norm if asked or
        if it no longer fits); returns the stage indices kept, as ``forward_intermediates``
        takes them."""
        take, max_index = feature_take_indices(len(self.stages), indices)
        if prune_head:
            self.reset_classifier(0)  # type: ignore[attr-defined]
        if prune_norm or max_index < len(self.stages) - 1:
            self.norm = nn.Identity()
        self.stages = self.stages[: max_index + 1]
        self.feature_info = self.feature_info[: max_index + 1]
        self.num_features = self.feature_info[-1]["num_chs"]
        return take


class StageFeatureNet(FeatureGetterNet):
    """timm's ``FeatureGetterNet`` (what ``features_only=True`` returns), plus the backbone's
    ``set_grad_checkpointing``: timm's other feature nets have one, and detection and
    segmentation pipelines call it on the backbone."""

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.model.set_grad_checkpointing(enable)
