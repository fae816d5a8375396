"""Read detectron2's model-zoo pickles without running anything they name.

NOTE [ A pickle that runs no code ]
detectron2's model zoo publishes ``model_final_*.pkl``: a plain pickle of
``{"model": {name: numpy array}, "__author__": ...}``. Unpickling calls whatever callables the
file names (``os.system`` as readily as ``numpy.ndarray``), so the file is read by an
``Unpickler`` whose ``find_class`` admits only the few globals numpy's own arrays, dtypes and
scalars are rebuilt from, ``collections.OrderedDict`` and ``_codecs.encode`` (how Python 3
writes a ``bytes`` object at protocol 2 and below). Plain containers, strings and numbers need
no global at all. Anything else stops the read at once, before the callable is called, with
one line naming the global; the file is never read again without the restriction. Arrays of
Python objects are refused as well (their elements were built under the same restriction, but
they are not weights). A ``.pkl`` that is really a torch zip file goes to
``torch.load(weights_only=True)``, whose unpickler makes the same promise for tensors.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from typing import Any, Dict, Tuple, Union

import numpy as np
import torch

from pareprop.models.published import PretrainedError, read_state

__all__ = ["ALLOWED_GLOBALS", "UnsafePickleError", "array_to_tensor", "read_pickle",
           "read_zoo_file"]

PathLike = Union[str, "os.PathLike[str]"]

# (module, name) of every global a numpy-only pickle needs; numpy 1 writes ``numpy.core``,
# numpy 2 ``numpy._core`` (both are accepted and resolved to the installed numpy's).
ALLOWED_GLOBALS = frozenset({
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
})


class UnsafePickleError(PretrainedError):
    """The pickle names a global that is not an array, a dtype, a scalar or a container."""


def _numpy_core():
    return getattr(np, "_core", None) or np.core


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds only numpy arrays, scalars and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"refusing to unpickle the global {module}.{name}: a detectron2 weight file "
                "holds only numpy arrays and plain containers, and loading this one would run "
                "code from the file")
        if module == "numpy":
            return getattr(np, name)
        if module == "collections":
            import collections
            return collections.OrderedDict
        if module == "_codecs":
            import codecs
            return codecs.encode
        core = _numpy_core()
        return getattr(core.numeric if module.endswith("numeric") else core.multiarray, name)


def _check_arrays(obj: Any, where: str) -> None:
    """Refuse arrays of Python objects anywhere in ``obj`` (containers walked)."""
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
        raise UnsafePickleError(f"{where} holds an array of Python objects, not weights")
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_arrays(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_arrays(value, f"{where}[{i}]")


def read_pickle(path: PathLike) -> Any:
    """The object in the pickle at ``path``, built without running anything it names (NOTE [ A
    pickle that runs no code ]); Python 2 pickles are read with detectron2's
    ``encoding="latin1"``.

    Raises:
        UnsafePickleError: the file names a global that is not allowed (nothing was called).
        PretrainedError: the file is missing, truncated or not a pickle.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PretrainedError(f"no weight file at {path!r}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        obj = _ArraysOnly(io.BytesIO(data), encoding="latin1").load()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{path!r}: {e}") from None
    except Exception as e:  # a truncated or foreign file: say so in one line
        raise PretrainedError(
            f"cannot read {path!r} as a pickle ({type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0]})") from None
    _check_arrays(obj, repr(path))
    return obj


def array_to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor of ``array``'s values: its own memory when torch may take it (C-contiguous and
    writable), a copy otherwise (a 0-d array stays 0-d)."""
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = array.copy(order="C")
    return torch.from_numpy(array)


def _as_tensor(value: Any, key: str, path: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return array_to_tensor(value)
    if isinstance(value, (np.generic, int, float)):
        return torch.as_tensor(np.asarray(value))
    raise PretrainedError(f"{path!r}: entry {key!r} is a {type(value).__name__}, not an array")


def read_zoo_file(path: PathLike) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The weights in a detectron2 file and what else it says.

    * ``.pkl`` (the model zoo's ``{"model": {name: array}, "__author__": ...}``, or a bare
      mapping of arrays as Caffe2's ImageNet files): read by :func:`read_pickle`;
    * anything else (``.pth``, ``.pyth``, or a ``.pkl`` that is a torch zip file): a torch
      file read with ``torch.load(weights_only=True)``, its state dict taken out of
      ``model`` (MAE, detectron2's own checkpoints) or ``model_state`` (PySlowFast's ``.pyth``).

    Returns:
        ``(weights, info)``: tensors by name as in the file, and the file's other plain entries
        (``__author__``, ...).
    """
    path = os.fspath(path)
    if path.endswith(".pkl") and not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        obj = read_pickle(path)
        if not isinstance(obj, dict):
            raise PretrainedError(
                f"{path!r} holds a {type(obj).__name__}; expected detectron2's "
                "{'model': {name: array}, ...}")
        info = {k: v for k, v in obj.items() if k != "model" and isinstance(v, (str, int, float))}
        state = obj["model"] if isinstance(obj.get("model"), dict) else obj
        if "blobs" in state and isinstance(state["blobs"], dict):  # Caffe2's detection files
            state = state["blobs"]
        weights = {k: _as_tensor(v, k, path) for k, v in state.items()
                   if not k.endswith("_momentum")}
        return weights, info
    return read_state(path), {}  # torch.load(weights_only=True)
