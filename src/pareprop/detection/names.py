"""Detector names: ``ARCH:BACKBONE`` strings, the detector architectures, and the registry of
backbone builders by name prefix.

A backbone name is resolved by the first rule that takes it: a registered prefix
(``"converted:"``, ``"detectron2:"``, ... via :func:`register_backbone`) hands the rest of the
name to its builder; otherwise the name is a pareprop model of a family with a pyramid
(``rev_mvitv2_*``, ``rev_swin_*``, ``rev_vit_*``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch.nn as nn

__all__ = [
    "DETECTOR_ARCHS",
    "BACKBONE_FAMILIES",
    "BackboneBuilder",
    "backbone_builder",
    "check_arch",
    "parse_detector_name",
    "register_backbone",
    "registered_prefixes",
]

DETECTOR_ARCHS = ("maskrcnn", "fasterrcnn", "retinanet")

# pareprop's own families with a feature pyramid, by model-name prefix.
BACKBONE_FAMILIES = ("rev_mvitv2_", "rev_swin_", "rev_vit_")

# builder(rest_of_name, *, engine, pretrained_backbone, pretrained_file, backbone_args,
#         fpn_channels) -> backbone module (the contract in pareprop.detection.backbones).
BackboneBuilder = Callable[..., nn.Module]

_PREFIXES: Dict[str, BackboneBuilder] = {}


def register_backbone(prefix: str, builder: BackboneBuilder) -> BackboneBuilder:
    """Make ``create_detector(..., backbone="PREFIX:REST")`` call ``builder(REST, **options)``.

    Args:
        prefix: the part before the colon (``"detectron2"``); letters, digits and ``_``.
        builder: called as ``builder(rest, engine=..., pretrained_backbone=...,
            pretrained_file=..., backbone_args=..., fpn_channels=...)``; returns a module with
            ``out_channels`` whose forward maps images ``(B, 3, H, W)`` to an ordered dict of
            maps ``p2``..``p6`` (strides 4..64).

    Returns:
        ``builder``, so this works as a decorator's body.
    """
    if not isinstance(prefix, str) or not prefix.replace("_", "").isalnum():
        raise ValueError(f"expected a backbone prefix of letters, digits and '_', got {prefix!r}")
    if not callable(builder):
        raise ValueError(f"expected a callable backbone builder, got {builder!r}")
    _PREFIXES[prefix] = builder
    return builder


def registered_prefixes() -> Tuple[str, ...]:
    return tuple(sorted(_PREFIXES))


def _accepted() -> str:
    families = ", ".join(f"{f}*" for f in BACKBONE_FAMILIES)
    prefixes = ", ".join(f"{p}:NAME" for p in registered_prefixes())
    return f"{families}, {prefixes}" if prefixes else families


def backbone_builder(name: str) -> Tuple[BackboneBuilder | None, str]:
    """``(builder, rest)`` for a prefixed name, ``(None, name)`` for a pareprop family's model.

    Raises:
        ValueError: the name is neither, listing what is accepted.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"expected a backbone name ({_accepted()}), got {name!r}")
    if ":" in name:
        prefix, rest = name.split(":", 1)
        if prefix in _PREFIXES and rest:
            return _PREFIXES[prefix], rest
        raise ValueError(f"unknown detection backbone {name!r}; expected one of {_accepted()}")
    if name.startswith(BACKBONE_FAMILIES):
        return None, name
    raise ValueError(f"unknown detection backbone {name!r}; expected one of {_accepted()}")


def check_arch(arch: Any) -> str:
    if arch not in DETECTOR_ARCHS:
        raise ValueError(f"unknown detector {arch!r}; expected one of {', '.join(DETECTOR_ARCHS)}")
    return arch


def parse_detector_name(name: str) -> Tuple[str, str]:
    """``"maskrcnn:rev_mvitv2_tiny"`` -> ``("maskrcnn", "rev_mvitv2_tiny")``; the backbone may
    hold colons itself (``"maskrcnn:converted:vit_base_patch16_224"``).

    Raises:
        ValueError: not ``ARCH:BACKBONE`` with a known ARCH.
    """
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(
            f"expected a detector name ARCH:BACKBONE with ARCH one of {', '.join(DETECTOR_ARCHS)} "
            f"(e.g. maskrcnn:rev_mvitv2_tiny), got {name!r}"
        )
    arch, backbone = name.split(":", 1)
    check_arch(arch)
    if not backbone:
        raise ValueError(f"expected a backbone after {arch!r}: in {name!r}")
    return arch, backbone
