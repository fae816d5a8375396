"""Config dataclasses with keyword overrides: the one convention of all four model families.

# NOTE [ One config convention ]
# ViT, MViTv2, Swin and the text encoders all build their config as ``make_config(variant,
# **overrides)``: one check, one error (:class:`ConfigError`, a ``ValueError``) that names the
# config class, the unknown names and every valid field, so a typo reads the same whichever
# family it was made in.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, TypeVar

__all__ = ["ConfigError", "make_config", "config_dict"]

C = TypeVar("C")


class ConfigError(ValueError, TypeError):
    """An override names no field of the config (the message lists the valid fields) or gives
    one a value of the wrong type or out of range (the message says what was expected).

    A TypeError too: that is what Python raises for an unexpected keyword argument, and what
    timm's model tests expect of a factory given an unknown one."""


def _is_tuple_field(cls: type, name: str) -> bool:
    hint = typing.get_type_hints(cls).get(name)
    origins = {typing.get_origin(hint)} | {typing.get_origin(a) for a in typing.get_args(hint)}
    return hint is tuple or tuple in origins


# Integer fields that count or measure something, so 0 would fail later (a division by zero
# heads, an empty convolution) instead of here. Other integer fields may be 0 (num_classes=0:
# no head; global_stages=0) but not negative.
_POSITIVE = frozenset({
    "img_size", "patch_size", "in_chans", "embed_dim", "depth", "depths", "num_heads", "window",
    "window_size", "patch_kernel", "patch_stride", "pool_kernel", "kv_stride", "vocab_size",
    "max_position_embeddings", "mlp_dim", "example_seq_len",
})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _problem(name: str, value: Any, hint: Any) -> str:
    """What is wrong with ``value`` for a field typed ``hint``, or "" when nothing is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in typing.get_args(hint):
            return ""
        problems = [_problem(name, value, a) for a in args]
        return "" if "" in problems else problems[0]
    if hint is tuple or typing.get_origin(hint) is tuple:
        if not isinstance(value, tuple):
            return "a tuple"
        inner = [a for a in args if a is not Ellipsis] or [Any]
        for item in value:
            problem = _problem(name, item, inner[0])
            if problem:
                return f"a tuple of {problem.split(' ', 1)[-1]}"
        return ""
    if hint is bool:
        return "" if isinstance(value, bool) else "true or false"
    if hint is int:
        if not _is_int(value):
            return "an integer"
        if name in _POSITIVE and value < 1:
            return "a positive integer"
        return "" if value >= 0 else "an integer >= 0"
    if hint is float:
        if not _is_number(value):
            return "a finite number"
        if name.endswith("_rate") and not 0 <= value < 1:
            return "a rate in [0, 1)"
        if name in ("mlp_ratio", "layer_norm_eps") and value <= 0:
            return "a positive number"
        return "" if value >= 0 else "a number >= 0"
    if hint is str:
        return "" if isinstance(value, str) else "a string"
    return ""


def _check_values(cls: type, values: Dict[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        problem = _problem(name, value, hints.get(name, Any))
        if problem:
            raise ConfigError(f"expected {cls.__name__}.{name} to be {problem}, got {value!r}")


def make_config(base: C, **overrides: Any) -> C:
    """``base`` with ``overrides`` applied; unknown names, and values of the wrong type or out of
    range (``depth="4"``, ``num_heads=0``, ``drop_path_rate=1.5``), raise :class:`ConfigError`.

    Lists are accepted for tuple fields, so a config survives a JSON round trip.
    """
    cls = type(base)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} field(s) {', '.join(unknown)}; "
            f"valid fields: {', '.join(names)}"
        )
    fixed = {
        k: tuple(v) if isinstance(v, list) and _is_tuple_field(cls, k) else v
        for k, v in overrides.items()
    }
    _check_values(cls, fixed)
    return dataclasses.replace(base, **fixed)


def config_dict(cfg: Any) -> Dict[str, Any]:
    """The config as a plain dict (JSON-ready apart from tuples, which JSON writes as lists)."""
    return dataclasses.asdict(cfg)
