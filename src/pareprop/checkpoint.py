"""Checkpoints that rebuild the model by name, resume exactly, and never half-exist.

A checkpoint is a directory::

    model.safetensors   the weights (safetensors: loading runs no code)
    model.json          format marker, model name and kwargs (``pareprop.model_spec``), epoch,
                        step, metrics, and the SHA-256 of the two other files
    state.pt            optimizer, scheduler, scaler, RNG and loop state, for resuming; written
                        with ``torch.save`` and read back with ``weights_only=True``

A training run keeps them under ``OUT/checkpoints/`` and points the names ``OUT/last`` and
``OUT/best`` at them with symbolic links.

NOTE [ Atomic checkpoints ]
    Every file is written to a temporary name in its final directory, flushed with fsync and
    moved into place with ``os.replace``. A new checkpoint is assembled in a hidden temporary
    directory, renamed to its final name, and only then do ``last``/``best`` switch to it (a
    new link renamed over the old one, which POSIX makes atomic). A process killed at any
    point therefore leaves ``last`` pointing at a complete checkpoint: the previous one or the
    new one, never a mix. Checkpoints no name points at any more are deleted afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional, Union

import torch
import torch.nn as nn

from pareprop.engine import ReversibleStack
from pareprop.memory.budget import apply_stored_blocks, stored_blocks
from pareprop.models import create_model, model_spec

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "load_model",
    "is_detector_spec",
    "atomic_write",
    "rng_state",
    "set_rng_state",
]

FORMAT = "pareprop-checkpoint"
VERSION = 1
WEIGHTS, META, STATE = "model.safetensors", "model.json", "state.pt"

PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, or not a pareprop checkpoint."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``meta`` is model.json, ``train_state`` is state.pt (or ``None``)."""

    path: str
    meta: Dict[str, Any]
    state_dict: Dict[str, torch.Tensor]
    train_state: Optional[Dict[str, Any]] = field(default=None, repr=False)

    @property
    def epoch(self) -> int:
        return int(self.meta["epoch"])

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def _fsync_dir(path: PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[str], None]) -> None:
    """Write ``path`` by calling ``write(tmp_path)``, fsync, then ``os.replace`` into place.

    The temporary file lives in the same directory (a rename across file systems is not
    atomic); it is removed if ``write`` or the rename fails, and ``path`` is then untouched.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(folder)


def _sha256(path: PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> Dict[str, Any]:
    """Every RNG a training step may draw from (python, numpy, torch CPU and CUDA), in a form
    ``torch.load(weights_only=True)`` accepts (tensors, lists, numbers)."""
    import numpy as np

    np_state = np.random.get_state()
    state: Dict[str, Any] = {
        "python": _to_lists(random.getstate()),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype("int64")),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import numpy as np

    random.setstate(_to_tuples(state["python"]))
    s = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            s["keys"].numpy().astype("uint32"),
            s["pos"],
            s["has_gauss"],
            s["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _unwrap(model: nn.Module) -> nn.Module:
    # DistributedDataParallel and torch.compile wrap the model; the spec lives on the inner one.
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def save_checkpoint(
    out_dir: PathLike,
    model: nn.Module,
    *,
    epoch: int,
    step: int,
    metrics: Optional[Dict[str, Any]] = None,
    train_state: Optional[Dict[str, Any]] = None,
    tags: Iterable[str] = ("last",),
    extra: Optional[Dict[str, Any]] = None,
    state_dict: Optional[Dict[str, torch.Tensor]] = None,
) -> str:
    """Save a checkpoint under ``out_dir/checkpoints/`` and point each tag (``out_dir/last``,
    ``out_dir/best``) at it, atomically (see the note at the top of this module).

    Args:
        out_dir: the run directory.
        model: a model made by ``pareprop.create_model`` (DDP-wrapped is fine).
        epoch: epochs completed.
        step: optimizer steps completed.
        metrics: JSON-serialisable numbers stored in model.json.
        train_state: what resuming needs (optimizer, scheduler, ... state dicts); tensors,
            numbers, strings, lists and dicts only. ``None`` writes weights only.
        tags: names to point at the new checkpoint.
        extra: more JSON-serialisable fields for model.json (e.g. the run's config).
        state_dict: the weights to write instead of ``model``'s own, e.g. the whole weights of
            a sharded model (``pareprop.distributed.full_state_dict``), whose own are shards.

    Returns:
        The path of the new checkpoint directory.
    """
    from safetensors.torch import save_file, save_model

    model = _unwrap(model)
    spec = _spec_of(model)
    out_dir = os.fspath(out_dir)
    root = os.path.join(out_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"epoch{epoch:04d}-step{step:08d}"
    final = os.path.join(root, name)
    n = 1
    while os.path.exists(final):
        final = os.path.join(root, f"{name}.{n}")
        n += 1

    tmp_dir = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root)
    try:
        weights = os.path.join(tmp_dir, WEIGHTS)
        header = {"format": FORMAT, "model": spec["name"]}
        # A detector's coupling is its backbone's (NOTE [ A detector acts as a classifier
        # does ] in detection/factory.py).
        kwargs = spec["detector"]["backbone_args"] if is_detector_spec(spec) else spec["kwargs"]
        if "coupling" in kwargs:  # NOTE [ The coupling travels with the weights ]
            header["coupling"] = json.dumps([float(c) for c in kwargs["coupling"]])
        if state_dict is None:
            atomic_write(weights, lambda p: save_model(model, p, metadata=header))
        else:
            atomic_write(weights, lambda p: save_file(state_dict, p, metadata=header))
        files = {"weights": WEIGHTS}
        digests = {WEIGHTS: _sha256(weights)}
        if train_state is not None:
            state = os.path.join(tmp_dir, STATE)
            atomic_write(state, lambda p: torch.save({"format": FORMAT, **train_state}, p))
            files["state"] = STATE
            digests[STATE] = _sha256(state)
        stored = stored_blocks(model)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "model": {**spec, "stored_blocks": stored} if stored else spec,
            "epoch": int(epoch),
            "step": int(step),
            "metrics": dict(metrics or {}),
            "files": files,
            "sha256": digests,
            **(extra or {}),
        }
        text = json.dumps(meta, indent=2, sort_keys=True)
        atomic_write(os.path.join(tmp_dir, META), lambda p: _write_text(p, text))
        os.replace(tmp_dir, final)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _fsync_dir(root)
    for tag in tags:
        _point(os.path.join(out_dir, tag), os.path.relpath(final, out_dir))
    _prune(out_dir, root)
    return final


# NOTE [ Detector checkpoints ]
#     A detector is torchvision's own class, not a registered pareprop model, so it has no
#     ``model_name``; it records how to rebuild it in ``detector.pareprop_spec`` (plain JSON:
#     arch, backbone, classes, backbone and head options). model.json keeps that spec under
#     ``model.detector`` with the engine its reversible stacks run now, and
#     ``pareprop.evaluate_detection.load_detector`` rebuilds it with
#     ``pareprop.detection.detector_from_spec`` (a layer above this module), then loads the
#     safetensors weights with :func:`load_weights`: as for a classifier, loading a checkpoint
#     never executes code from it. ``load_model`` refuses a detector's checkpoint, naming
#     ``load_detector``.


def _spec_of(model: nn.Module) -> Dict[str, Any]:
    """model.json's ``model``: a registered model's spec, or a detector's (NOTE [ Detector
    checkpoints ])."""
    detector = getattr(model, "pareprop_spec", None)
    if detector is None:
        return model_spec(model)
    name = f"{detector['arch']}:{detector['backbone']}"
    # The engine its stacks run now (set_engine after creation changes it).
    engines = {m.engine for m in model.modules() if isinstance(m, ReversibleStack)}
    return {"name": name, "detector": json.loads(json.dumps(detector)),
            "engine": engines.pop() if len(engines) == 1 else None}


def is_detector_spec(spec: Any) -> bool:
    """Whether model.json's ``model`` describes a detector (NOTE [ Detector checkpoints ])."""
    return isinstance(spec, dict) and isinstance(spec.get("detector"), dict)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _point(link: str, target: str) -> None:
    """Make ``link`` a symbolic link to ``target`` by renaming a new link over it."""
    folder = os.path.dirname(link)
    tmp = os.path.join(folder, f".{os.path.basename(link)}.{os.getpid()}.tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.remove(tmp)
        raise
    _fsync_dir(folder)


def _prune(out_dir: str, root: str) -> None:
    """Delete checkpoints no tag points at (and temporary directories of killed saves)."""
    keep = set()
    for entry in os.scandir(out_dir):
        if entry.is_symlink():
            keep.add(os.path.realpath(entry.path))
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and os.path.realpath(entry.path) not in keep:
            if entry.name.startswith(".") and not entry.name.endswith(".tmp"):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)


def _resolve(path: PathLike) -> str:
    """The checkpoint directory for a directory, a link to one, or a file inside one."""
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) in (WEIGHTS, META, STATE):
        path = os.path.dirname(path)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, META)):
        # A run directory: resume from its last checkpoint.
        if os.path.exists(os.path.join(path, "last", META)):
            return os.path.realpath(os.path.join(path, "last"))
        if os.path.exists(os.path.join(path, "config.json")):
            raise CheckpointError(
                f"run directory {path!r} has no complete checkpoint yet (no 'last'; the run "
                "stopped before its first save): start it again, with --overwrite to replace "
                "what it left"
            )
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path!r}")
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path!r} is not a pareprop checkpoint: expected a directory holding {META}, "
            f"{WEIGHTS} and {STATE} (or a run directory with a 'last' checkpoint)"
        )
    if not os.path.exists(os.path.join(path, META)):
        raise CheckpointError(f"{path!r} is not a pareprop checkpoint: it has no {META}")
    return os.path.realpath(path)


def load_checkpoint(
    path: PathLike, map_location: Any = "cpu", train_state: bool = True
) -> Checkpoint:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: the checkpoint directory, a link to it (``OUT/last``), a file in it, or a run
            directory (its ``last`` checkpoint).
        map_location: where tensors go.
        train_state: also read state.pt (needed to resume, not to evaluate).

    Raises:
        CheckpointError: the files are missing, corrupted (checksum, unreadable), or were not
            written by pareprop.
    """
    from safetensors.torch import load_file

    folder = _resolve(path)
    meta_path = os.path.join(folder, META)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path!r} is corrupted or not JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f'{meta_path!r} is not a pareprop checkpoint (no "format": "{FORMAT}" field)'
        )
    if int(meta.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{folder!r} has checkpoint format version {meta['version']}; this pareprop reads "
            f"up to {VERSION}: upgrade pareprop"
        )
    for fname, digest in meta.get("sha256", {}).items():
        fpath = os.path.join(folder, fname)
        if not os.path.exists(fpath):
            raise CheckpointError(f"checkpoint {folder!r} is incomplete: {fname} is missing")
        if _sha256(fpath) != digest:
            raise CheckpointError(
                f"checkpoint {folder!r} is corrupted: {fname} does not match its SHA-256 "
                f"in {META}; use another checkpoint (e.g. 'best' instead of 'last')"
            )
    try:
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        state_dict = load_file(os.path.join(folder, WEIGHTS), device=str(device))
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise CheckpointError(f"cannot read the weights of {folder!r}: {e}") from e
    state = None
    if train_state and "state" in meta.get("files", {}):
        state_path = os.path.join(folder, STATE)
        try:
            state = torch.load(state_path, map_location=map_location, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"cannot read the training state {state_path!r}: {e}") from e
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{state_path!r} is not a pareprop training state")
    _keep_earlier_vit_head(meta, state_dict)
    _rebuild_without_initial_weights(meta)
    return Checkpoint(path=folder, meta=meta, state_dict=state_dict, train_state=state)


def _keep_earlier_vit_head(meta: Dict[str, Any], state_dict: Dict[str, torch.Tensor]) -> None:
    """A Rev-ViT saved before the published head (LayerNorm after the mean, ``fc_norm``) is
    rebuilt with ``norm_before_pool=False``, which is what its weights were trained for."""
    spec = meta.get("model")
    if not isinstance(spec, dict) or not isinstance(spec.get("kwargs"), dict):
        return
    if "fc_norm.weight" in state_dict and "norm.weight" not in state_dict:
        if str(spec.get("name", "")).startswith("rev_vit"):
            spec["kwargs"].setdefault("norm_before_pool", False)


# NOTE [ A checkpoint needs no initial weight file ]
#     A converted model started from a local file (``--convert-from NAME --pretrained-file
#     PATH``) is created with ``pretrained_file=PATH``, and so its spec in model.json names
#     that file. The checkpoint's own weights replace every tensor the file gave, so rebuilding
#     from the spec must not read it again: it may be gone or moved by then (``pareprop eval``
#     of a run once failed with "no weight file" when it was), and reading it is wasted time.
#     The run's config in model.json still records where training started.


def _rebuild_without_initial_weights(meta: Dict[str, Any]) -> None:
    """Drop ``pretrained_file`` from the spec the model is rebuilt from (NOTE [ A checkpoint
    needs no initial weight file ])."""
    spec = meta.get("model")
    if isinstance(spec, dict) and isinstance(spec.get("kwargs"), dict):
        spec["kwargs"].pop("pretrained_file", None)


def load_model(path: PathLike, map_location: Any = "cpu", **overrides: Any) -> nn.Module:
    """Rebuild the model a checkpoint was saved from (``create_model(name, **kwargs)``) and
    load its weights. ``overrides`` change config fields that do not touch the weights'
    shapes (e.g. ``engine="autograd"``, ``drop_path_rate=0.0``). The run's data config
    (``data_config`` in model.json) goes into the model's ``pretrained_cfg``."""
    ckpt = load_checkpoint(path, map_location=map_location, train_state=False)
    spec = ckpt.meta["model"]
    if is_detector_spec(spec):
        raise CheckpointError(
            f"{ckpt.path!r} holds the detector {spec['name']}: load it with "
            "pareprop.evaluate_detection.load_detector (NOTE [ Detector checkpoints ])"
        )
    model = create_model(spec["name"], **{**spec["kwargs"], **overrides})
    load_weights(model, ckpt)
    data_config = ckpt.meta.get("data_config")
    if isinstance(data_config, dict) and isinstance(getattr(model, "pretrained_cfg", None), dict):
        _check_data_overrides(overrides, model.pretrained_cfg, data_config, ckpt.path)
        # The transform the run validated with; timm's resolve_data_config (pareprop eval)
        # reads it from here (NOTE [ One data config ] in pareprop/data/config.py).
        model.pretrained_cfg.update(
            {k: tuple(v) if isinstance(v, list) else v for k, v in data_config.items()}
        )
    return model


# Model arguments that set a field of the data config (NOTE [ One data config ] in
# pareprop/data/config.py), and the field.
_DATA_ARGS = {"img_size": "input_size", "in_chans": "input_size", "num_frames": "input_size",
              "frame_stride": "frame_stride", "mean": "mean", "std": "std"}


def _check_data_overrides(overrides: Dict[str, Any], own: Dict[str, Any],
                          saved: Dict[str, Any], path: str) -> None:
    """Refuse an override that would give the model another data config than its run's (the
    saved one replaces the model's own, so the override would silently not count)."""
    for arg, key in _DATA_ARGS.items():
        if arg not in overrides or key not in saved or key not in own:
            continue
        mine = [float(v) for v in own[key]] if isinstance(own[key], (list, tuple)) else own[key]
        theirs = ([float(v) for v in saved[key]] if isinstance(saved[key], (list, tuple))
                  else saved[key])
        if mine != theirs:
            raise ValueError(
                f"{arg}={overrides[arg]!r} contradicts the data config of {path!r}, whose run "
                f"trained and validated with {key} {saved[key]!r}: drop it (the run's config "
                f"is used), or train a run with it"
            )


def load_weights(model: nn.Module, ckpt: Checkpoint) -> None:
    """Copy ``ckpt``'s weights into ``model`` (strict), with an error naming any mismatch, and
    store the blocks the checkpoint's model stored (``pareprop.set_memory_budget``)."""
    model = _unwrap(model)
    own = model.state_dict()
    missing = sorted(set(own) - set(ckpt.state_dict))
    # save_model drops aliases of shared tensors, so a missing key may be a tied weight.
    missing = [k for k in missing if not _is_alias(own, k, ckpt.state_dict)]
    unexpected = sorted(set(ckpt.state_dict) - set(own))
    bad = [k for k in ckpt.state_dict if k in own and own[k].shape != ckpt.state_dict[k].shape]
    if missing or unexpected or bad:
        shapes = [(k, tuple(ckpt.state_dict[k].shape), tuple(own[k].shape)) for k in bad[:5]]
        raise CheckpointError(
            f"checkpoint {ckpt.path!r} does not fit {type(model).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"shape mismatch {shapes}"
        )
    model.load_state_dict(ckpt.state_dict, strict=False)
    # The memory budget's choice travels with the weights: the same blocks stay stored.
    apply_stored_blocks(model, ckpt.meta["model"].get("stored_blocks", {}))


def _is_alias(own: Dict[str, torch.Tensor], key: str, saved: Dict[str, torch.Tensor]) -> bool:
    t = own[key]
    return any(
        k in saved and v.data_ptr() == t.data_ptr() and v.shape == t.shape
        for k, v in own.items()
        if k != key
    )
