"""Config dataclasses with keyword overrides: the one convention of all four model families.

# NOTE [ One config convention ]
# ViT, MViTv2, Swin and the text encoders all build their config as ``make_config(variant,
# **overrides)``: one check, one error (:class:`ConfigError`, a ``ValueError``) that names the
# config class, the unknown names and every valid field, so a typo reads the same whichever
# family it was made in.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, TypeVar

__all__ = ["ConfigError", "make_config", "config_dict"]

C = TypeVar("C")


class ConfigError(ValueError, TypeError):
    """An override names no field of the config; the message lists the valid fields.

    A TypeError too: that is what Python raises for an unexpected keyword argument, and what
    timm's model tests expect of a factory given an unknown one."""


def _is_tuple_field(cls: type, name: str) -> bool:
    hint = typing.get_type_hints(cls).get(name)
    origins = {typing.get_origin(hint)} | {typing.get_origin(a) for a in typing.get_args(hint)}
    return hint is tuple or tuple in origins


def make_config(base: C, **overrides: Any) -> C:
    """``base`` with ``overrides`` applied; unknown names raise :class:`ConfigError`.

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
    return dataclasses.replace(base, **fixed)


def config_dict(cfg: Any) -> Dict[str, Any]:
    """The config as a plain dict (JSON-ready apart from tuples, which JSON writes as lists)."""
    return dataclasses.asdict(cfg)
