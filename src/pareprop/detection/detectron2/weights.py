"""detectron2's weight files onto pareprop's backbone, by name.

Three layouts, told apart by their names:

* the model zoo's detectors (``model_final_*.pkl``): ``backbone.*`` is the backbone under the
  names pareprop's modules keep (``backbone.net.blocks.0.attn.qkv.weight``,
  ``backbone.simfp_2.0.weight``; ``backbone.bottom_up.*``, ``backbone.fpn_lateral2.weight``),
  taken whole: every tensor must be there with its shape. The heads' tensors
  (``proposal_generator.*``, ``roi_heads.*``) are handed back for the detector;
* ImageNet initialisations (MAE's ``mae_pretrain_vit_*.pth``, PySlowFast's
  ``MViTv2_*_in1k.pyth``): a classifier's names (``blocks.0.attn.qkv.weight``,
  ``patch_embed.proj.weight``, ``pos_embed``), which detectron2 matches to the backbone by
  suffix. Here they go under ``net.``/``bottom_up.``; what such a file lacks (the pyramid, the
  relative-position tables MAE has none of, the query pooling that classification MViTv2 has
  only where it strides) stays at its initialisation, as in detectron2, and what the backbone
  does not use (class token, final norm, head) is left out. Both are reported;
* pareprop's own state dict of the backbone (names without ``backbone.``).

NOTE [ Position tables of another size ]
The files' tables are made at the pretraining size: the absolute positions of 224-pixel
images (14 x 14 + a class-token slot for ViT-B/16), relative-position tables for 224 (MViTv2)
or none (MAE). detectron2 keeps them at that size and resizes them in every forward: absolute
positions bicubically to the token map (``get_abs_pos``), relative tables linearly to the
window or map (``get_rel_pos``). pareprop's modules do the same in their forward
(:mod:`.layers`), so the tables load as they are, at the size detectron2 loads them. A table of
another size than the configuration's is refused with its name and both shapes (detectron2
would warn and leave it at its initialisation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Tuple, Union

import numpy as np
import torch
import torch.nn as nn

from pareprop.detection.detectron2.safe_pickle import array_to_tensor, read_zoo_file
from pareprop.models.published import PretrainedError

__all__ = ["Detectron2Weights", "load_backbone_weights", "read_weights"]

StateDict = Dict[str, torch.Tensor]

# What a classifier's file holds that a detection backbone does not use.
_CLASSIFIER_ONLY = ("cls_token", "mask_token", "norm.", "fc_norm.", "head.", "decoder",
                    "mask_token")


@dataclass
class Detectron2Weights:
    """What a file gave the backbone: the layout read (``"zoo"``, ``"imagenet"`` or
    ``"pareprop"``), the names loaded, those left at initialisation, the file's names not used,
    and the zoo's head tensors (for the detector; empty otherwise)."""

    layout: str
    loaded: List[str] = field(default_factory=list)
    left_at_init: List[str] = field(default_factory=list)
    unused: List[str] = field(default_factory=list)
    heads: StateDict = field(default_factory=dict)
    source: str = "a state dict"

    def __str__(self) -> str:
        line = (f"{self.source}: {len(self.loaded)} backbone tensors loaded ({self.layout} "
                f"layout)")
        if self.left_at_init:
            line += f"; {len(self.left_at_init)} left at initialisation, first " \
                    f"{self.left_at_init[0]}"
        if self.unused:
            line += f"; {len(self.unused)} of the file's not used, first {self.unused[0]}"
        return line


def read_weights(file_or_state_dict: Union[str, "os.PathLike[str]", Mapping[str, object]]
                 ) -> Tuple[StateDict, str]:
    """Tensors by name from a file (read safely: :func:`.safe_pickle.read_zoo_file`) or from
    a mapping (bare, or detectron2's ``{"model": {...}}``; numpy arrays become tensors)."""
    if isinstance(file_or_state_dict, (str, os.PathLike)):
        weights, _ = read_zoo_file(file_or_state_dict)
        return weights, repr(os.fspath(file_or_state_dict))
    if not isinstance(file_or_state_dict, Mapping):
        raise TypeError(f"expected a file path or a state dict, got "
                        f"{type(file_or_state_dict).__name__}")
    state = file_or_state_dict
    for key in ("model", "model_state"):
        if isinstance(state.get(key), Mapping):
            state = state[key]
            break
    weights = {}
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            v = array_to_tensor(v)
        if not isinstance(v, torch.Tensor):
            raise PretrainedError(f"the state dict's entry {k!r} is a {type(v).__name__}, "
                                  "not a tensor or an array")
        weights[k] = v
    return weights, "the state dict"


def _layout(weights: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor],
            body: str) -> str:
    if any(k.startswith("backbone.") for k in weights):
        return "zoo"
    if any(k in own for k in weights):
        return "pareprop"
    if any(k.startswith(("blocks.", "patch_embed.")) for k in weights):
        return "imagenet"
    first = next(iter(weights), "nothing")
    raise PretrainedError(
        f"the weights name no detectron2 backbone tensor (first {first!r}); expected the model "
        f"zoo's 'backbone.{body}...', a classifier's 'blocks.0...' or this backbone's names")


def load_backbone_weights(model: nn.Module, file_or_state_dict, body: str) -> Detectron2Weights:
    """Copy detectron2's weights into ``model`` (a pyramid over ``body``: ``"net."`` or
    ``"bottom_up."``), checked whole before anything is copied.

    Raises:
        PretrainedError: unreadable or unsafe, or a tensor missing, unexpected or misshapen
            (one line naming the first).
    """
    weights, source = read_weights(file_or_state_dict)
    own = model.state_dict()
    layout = _layout(weights, own, body)
    heads: StateDict = {}
    unused: List[str] = []
    if layout == "zoo":
        state = {k[len("backbone."):]: v for k, v in weights.items() if k.startswith("backbone.")}
        heads = {k: v for k, v in weights.items() if not k.startswith("backbone.")}
        required = set(own)
    elif layout == "pareprop":
        state, required = dict(weights), set(own)
    else:
        state = {}
        for k, v in weights.items():
            if k.startswith(_CLASSIFIER_ONLY) or body + k not in own:
                unused.append(k)
            else:
                state[body + k] = v
        required = set()
    missing = sorted(required - set(state))
    unexpected = sorted(set(state) - set(own))
    misshapen = [f"{k}: {tuple(v.shape)} in the file, {tuple(own[k].shape)} in the model"
                 for k, v in sorted(state.items()) if k in own and v.shape != own[k].shape]
    for label, names in (("missing", missing), ("unexpected", unexpected),
                         ("misshapen", misshapen)):
        if names:
            raise PretrainedError(
                f"{source} does not fit this detectron2 backbone: {len(names)} {label}, first "
                f"{names[0]} (is it another configuration, or were its sizes changed?)")
    model.load_state_dict(state, strict=False)
    return Detectron2Weights(layout, sorted(state), sorted(set(own) - set(state)),
                             sorted(unused), heads, source)
