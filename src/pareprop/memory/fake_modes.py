"""Torch function modes that let a model's step run on fake tensors while it is planned."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_linspace", "planning_values"]


class cpu_linspace(TorchFunctionMode):
    # Some builders turn ``torch.linspace(...)`` into Python floats (drop-path rates); on the
    # meta device that has no data. A linspace of a few numbers is made on the CPU instead.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.linspace:
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


# NOTE [ Value checks of text models under FakeTensorMode ]
#     Fake tensors have no values, so a model that validates its token ids
#     (``int(ids.min())``) or looks at its padding mask (``bool(mask.all())``) cannot run on
#     them. While planning, those reductions of integer and boolean tensors (no ``dim``) answer
#     as for valid ids and a mask without padding: ``min``/``max`` give 0, ``all`` True, ``any``
#     False (no invalid entry). Text steps are planned without padding, which is also the most
#     memory a batch of that length can take.
_VALUE_ANSWERS = {torch.Tensor.min: 0, torch.Tensor.max: 0, torch.Tensor.all: True,
                  torch.Tensor.any: False}


class planning_values(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _VALUE_ANSWERS and len(args) == 1 and not kwargs
                and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point()
                and type(args[0]).__name__ == "FakeTensor"):
            return _VALUE_ANSWERS[func]
        return func(*args, **kwargs)
