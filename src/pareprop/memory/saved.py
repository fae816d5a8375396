"""The bytes autograd keeps for backward: ``activation_bytes``, and the count inside a step."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn

__all__ = ["activation_bytes"]


def is_parameter(t: torch.Tensor) -> bool:
    """True for a parameter or a view of one: saved, it costs no activation memory."""
    # Ops often save a view of a weight (linear saves weight.t()), whose base is the parameter.
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def storage_key(t: torch.Tensor) -> Tuple[str, int]:
    """One key per storage (views of it share it): device and address, for counting bytes.

    A fake tensor (``FakeTensorMode``, as :func:`pareprop.plan_memory` plans) has no address,
    so its storage object's identity stands in; the caller keeps the tensor alive while it
    counts, so neither kind of key is reused by another storage meanwhile.
    """
    # torch's private fake-tensor module, only for isinstance: loaded on first count, not at
    # ``import pareprop``.
    from torch._subclasses.fake_tensor import FakeTensor

    storage = t.untyped_storage()
    if isinstance(t, FakeTensor):
        return (str(t.device), storage._cdata)
    return (str(t.device), storage.data_ptr())


def activation_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes of the tensors that autograd keeps alive for the backward of ``fn(*args)``.

    Every tensor saved for backward while ``fn`` runs is counted once per storage (views of
    one storage count once), so what is reported is what the graph really keeps alive.
    Parameters are left out: they live whether or not a graph holds them. Tensors kept on a
    custom autograd Function's ``ctx`` outside ``save_for_backward`` are not seen.

    Example:
        ``activation_bytes(model, images)``
    """
    saved: Dict[Tuple[str, int], int] = {}
    alive = []  # keeps each counted storage alive, so no address is reused while measuring

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_parameter(t):
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                saved[storage_key(t)] = storage.nbytes()
                alive.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = fn(*args, **kwargs)
    total = sum(saved.values())
    del output
    alive.clear()
    return total
