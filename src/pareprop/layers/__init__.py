"""Reusable layers. They know nothing about the backward engines."""

from pareprop.layers._config import make_config
from pareprop.layers.attention import Attention, attend
from pareprop.layers.drop import DropPath
from pareprop.layers.mlp import Mlp
from pareprop.layers.patch_embed import PatchEmbed, check_image, to_2tuple_int
from pareprop.layers.pooling_attention import (
    PoolingAttention,
    add_decomposed_rel_pos,
    pooled_size,
    rel_pos_table,
    window_partition,
    window_unpartition,
)

__all__ = [
    "Attention",
    "attend",
    "DropPath",
    "Mlp",
    "PatchEmbed",
    "PoolingAttention",
    "add_decomposed_rel_pos",
    "check_image",
    "make_config",
    "pooled_size",
    "rel_pos_table",
    "to_2tuple_int",
    "window_partition",
    "window_unpartition",
]
