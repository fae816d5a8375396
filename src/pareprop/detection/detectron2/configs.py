"""detectron2's named backbones: projects/MViTv2's ``mvitv2_t`` .. ``mvitv2_h`` (MViT + FPN)
and projects/ViTDet's ``vitdet_b`` .. ``vitdet_h`` (ViT + simple feature pyramid at 1024), as
their configuration files set them (``mask_rcnn_mvitv2_t_3x.py``,
``cascade_mask_rcnn_mvitv2_{s,b}_3x.py``, ``cascade_mask_rcnn_mvitv2_l_in21k_lsj_50ep.py``,
``cascade_mask_rcnn_mvitv2_h_in21k_lsj_3x.py``, ``mask_rcnn_vitdet_{b,l,h}_*.py`` over
``common/models/mask_rcnn_vitdet.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

__all__ = ["CONFIGS", "Detectron2Config", "config_names", "get_config"]


@dataclass(frozen=True)
class Detectron2Config:
    """One named backbone: its family (``"vit"``: ViT + SimpleFeaturePyramid, ``"mvit"``:
    MViT + FPN), the arguments its configuration gives detectron2's ``ViT``/``MViT``, the
    ImageNet initialisation the configuration starts from, and whether it turns detectron2's
    activation checkpointing on."""

    name: str
    family: str
    args: Dict[str, Any] = field(default_factory=dict)
    init_file: str = ""
    act_checkpoint: bool = False


def _range(*spans: Tuple[int, int]) -> Tuple[int, ...]:
    return tuple(i for a, b in spans for i in range(a, b))


_MVIT = "detectron2://ImageNetPretrained/mvitv2/"
_MAE = "detectron2://ImageNetPretrained/MAE/"

CONFIGS: Dict[str, Detectron2Config] = {c.name: c for c in (
    Detectron2Config("mvitv2_t", "mvit", dict(
        embed_dim=96, depth=10, num_heads=1, last_block_indexes=(0, 2, 7, 9),
        drop_path_rate=0.2), _MVIT + "MViTv2_T_in1k.pyth"),
    Detectron2Config("mvitv2_s", "mvit", dict(
        embed_dim=96, depth=16, num_heads=1, last_block_indexes=(0, 2, 13, 15),
        drop_path_rate=0.2), _MVIT + "MViTv2_S_in1k.pyth"),
    Detectron2Config("mvitv2_b", "mvit", dict(
        embed_dim=96, depth=24, num_heads=1, last_block_indexes=(1, 4, 20, 23),
        drop_path_rate=0.4), _MVIT + "MViTv2_B_in1k.pyth"),
    Detectron2Config("mvitv2_l", "mvit", dict(
        embed_dim=144, depth=48, num_heads=2, last_block_indexes=(1, 7, 43, 47),
        drop_path_rate=0.5), _MVIT + "MViTv2_L_in21k.pyth"),
    Detectron2Config("mvitv2_h", "mvit", dict(
        embed_dim=192, depth=80, num_heads=3, last_block_indexes=(3, 11, 71, 79),
        drop_path_rate=0.6), _MVIT + "MViTv2_H_in21k.pyth", act_checkpoint=True),
    Detectron2Config("vitdet_b", "vit", dict(
        embed_dim=768, depth=12, num_heads=12, drop_path_rate=0.1,
        window_block_indexes=(0, 1, 3, 4, 6, 7, 9, 10)), _MAE + "mae_pretrain_vit_base.pth"),
    Detectron2Config("vitdet_l", "vit", dict(
        embed_dim=1024, depth=24, num_heads=16, drop_path_rate=0.4,
        window_block_indexes=_range((0, 5), (6, 11), (12, 17), (18, 23))),
        _MAE + "mae_pretrain_vit_large.pth"),
    Detectron2Config("vitdet_h", "vit", dict(
        embed_dim=1280, depth=32, num_heads=16, drop_path_rate=0.5,
        window_block_indexes=_range((0, 7), (8, 15), (16, 23), (24, 31))),
        _MAE + "mae_pretrain_vit_huge_p14to16.pth"),
)}


def config_names() -> Tuple[str, ...]:
    return tuple(CONFIGS)


def get_config(name: str) -> Detectron2Config:
    """The named configuration, or a one-line error listing the names."""
    if name not in CONFIGS:
        raise ValueError(f"unknown detectron2 backbone {name!r}; expected one of "
                         f"{', '.join(CONFIGS)}")
    return CONFIGS[name]
