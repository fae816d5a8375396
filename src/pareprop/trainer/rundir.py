"""The run directory of ``pareprop train``: who may write into it, and what a resumed run keeps.

NOTE [ Run directories ]
    A run directory (``--out``) holds one run: ``checkpoints/``, the ``last`` and ``best``
    links, ``metrics.jsonl``, ``config.json`` and with ``--tensorboard`` ``tensorboard/``.
    Saving a checkpoint deletes the checkpoints no link points at, so a second run writing
    into the same directory would delete the first run's best checkpoint and mix both runs'
    metrics. Hence:

    * a new run refuses a directory that holds anything, unless given ``--overwrite``, which
      deletes the previous run's files (only those: other files are left alone);
    * a resumed run continues in its own directory, from that directory's ``last`` checkpoint
      (continuing from an older one there would mix two histories), or in a new directory
      given with ``--out``, under the rules of a new run;
    * while a run writes, it holds an exclusive lock on ``DIR/.lock`` (``fcntl.flock``, let go
      by the kernel when the process dies, however it dies), so a second process is refused
      with a message instead of racing the first.

NOTE [ Resumed configuration ]
    A checkpoint records the configuration of its run. Resuming restores it: the split and the
    data order depend on the seed, the schedule on epochs, batch size and warm-up, the weights
    on the model. An option given with ``--resume`` that contradicts one of :data:`RUN_FIELDS`
    is refused. The others may change and are reported when they do: more epochs (the cosine
    schedule is then rebuilt for the new length), the engine (every engine computes the same
    gradients), ``--compile``, ``--grad-checkpointing`` and the data's location. Options of
    the invocation and the machine are never restored: ``--stop-after-epochs``, ``--max-steps``,
    ``--fsdp``, ``--device``, ``--workers`` and the progress bar.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Iterable, List, Optional, Tuple

__all__ = [
    "RUN_FIELDS",
    "RUN_ENTRIES",
    "RunDirError",
    "RunLock",
    "run_dir_of",
    "check_new_run_dir",
    "clear_run_dir",
    "restore_config",
    "saved_config",
    "continue_metrics",
]

# Options fixed by a run: given with --resume, they must equal the run's own.
RUN_FIELDS = (
    "model", "model_kwargs", "dataset", "augment", "seed", "batch_size", "lr", "weight_decay",
    "warmup_epochs", "label_smoothing", "clip_grad", "grad_accum", "amp", "memory_budget",
    # fine-tuning: the optimizer's parameter groups (layer decay) and the coupling schedule are
    # part of the run's trajectory, and its starting weights are part of what it is
    "pretrained", "pretrained_file", "layer_decay", "convert_from", "coupling_schedule",
    "coupling_steps",
)
# Options of this invocation and machine, never restored: --stop-after-epochs and --max-steps
# cut this invocation short, and a run may resume on other hardware (e.g. without --fsdp).
# The output directory has rules of its own (NOTE [ Run directories ]).
_INVOCATION_FIELDS = (
    "resume", "eval_only", "overwrite", "out", "stop_after_epochs", "max_steps", "progress",
    "workers", "device", "fsdp",
)
# What a run writes into its directory (and all that --overwrite deletes).
RUN_ENTRIES = ("checkpoints", "last", "best", "metrics.jsonl", "config.json", "tensorboard")
LOCK = ".lock"


class RunDirError(ValueError):
    """A run directory cannot be used as asked; the message says why and what to do."""


def run_dir_of(checkpoint_path: str) -> Optional[str]:
    """The run directory holding a checkpoint (``RUN/checkpoints/NAME``), or None."""
    parent = os.path.dirname(os.path.realpath(checkpoint_path))
    if os.path.basename(parent) != "checkpoints":
        return None
    return os.path.dirname(parent)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_new_run_dir(out: str, overwrite: bool) -> None:
    """Refuse ``out`` for a new run when it holds anything (unless ``overwrite``) or cannot be
    a directory."""
    if not out:
        raise RunDirError("expected --out a directory for the run, got ''")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise RunDirError(f"--out {out!r} is an existing file; expected a directory for the run")
    if not os.path.isdir(out):
        parent = os.path.dirname(os.path.abspath(out))
        # Up to the root at most: a root that is not there (a missing drive) is its own parent.
        while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise RunDirError(
                f"cannot create the run directory {out!r}: its root {parent!r} does not exist"
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise RunDirError(
                f"cannot create the run directory {out!r}: {parent!r} is not writable"
            )
        return
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunDirError(f"the run directory {out!r} is not writable")
    held = sorted(e for e in os.listdir(out) if e != LOCK)
    if held and not overwrite:
        what = "a previous run" if set(held) & set(RUN_ENTRIES) else "files"
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise RunDirError(
            f"--out {out!r} already holds {what} ({shown}); a new run would delete its "
            f"checkpoints and mix its metrics. Continue it with --resume {out}, choose another "
            "--out, or pass --overwrite to delete the previous run's files"
        )


def clear_run_dir(out: str) -> List[str]:
    """Delete the files a previous run wrote into ``out`` (:data:`RUN_ENTRIES` only)."""
    removed = []
    # Temporary files of writes a kill cut short (atomic_write's ".NAME.*.tmp", and
    # continue_metrics' "metrics.jsonl.PID.tmp") belong to the run too.
    leftovers = [
        e for e in os.listdir(out)
        if e.endswith(".tmp") and any(e.startswith((f".{n}.", f"{n}.")) for n in RUN_ENTRIES)
    ]
    for name in [*RUN_ENTRIES, *sorted(leftovers)]:
        path = os.path.join(out, name)
        if os.path.islink(path) or os.path.isfile(path):
            os.remove(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        else:
            continue
        removed.append(name)
    return removed


class RunLock:
    """An exclusive lock on ``DIR/.lock`` for the life of a run (see NOTE [ Run directories ])."""

    def __init__(self, out: str):
        self.path = os.path.join(out, LOCK)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        import fcntl  # POSIX only: importing it at the top would break `import pareprop` on Windows

        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(
                f"cannot create the run directory {os.path.dirname(self.path)!r}: {e.strerror}"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"another process (pid {holder}) is writing to {os.path.dirname(self.path)!r}; "
                "wait for it to end, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl  # POSIX only (see acquire)

        try:
            os.remove(self.path)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def saved_config(meta: Dict[str, Any], train_state: Optional[Dict[str, Any]],
                 run_dir: Optional[str]) -> Optional[Dict[str, Any]]:
    """The configuration a checkpoint's run was started with: from its model.json, else from
    its training state (older checkpoints), else from the run's config.json; None if none."""
    if isinstance(meta.get("config"), dict):
        return dict(meta["config"])
    if train_state is not None and isinstance(train_state.get("config"), str):
        return json.loads(train_state["config"])
    if run_dir is not None and os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def restore_config(
    current: Dict[str, Any],
    saved: Dict[str, Any],
    given: Iterable[str],
    fields: Iterable[str],
) -> Tuple[Dict[str, Any], List[str]]:
    """Options of a resumed run: the saved ones, and those ``given`` now where they may change.

    Args:
        current: this invocation's options (every field).
        saved: the run's options, as recorded in its checkpoint.
        given: the options this invocation set explicitly.
        fields: the names of every option.

    Returns:
        The merged options and a list of the changes (``"epochs 3 -> 5"``).

    Raises:
        RunDirError: a given option contradicts one of :data:`RUN_FIELDS`.
    """
    given = set(given)
    merged, changes, conflicts = {}, [], []
    for name in fields:
        if name in _INVOCATION_FIELDS or name not in saved or name in given:
            merged[name] = current[name]
        else:
            merged[name] = saved[name]
        if name in _INVOCATION_FIELDS or name not in saved or name not in given:
            continue
        if _canonical(current[name]) == _canonical(saved[name]):
            continue
        change = f"{name} {_canonical(saved[name])} -> {_canonical(current[name])}"
        (conflicts if name in RUN_FIELDS else changes).append(change)
    if conflicts:
        raise RunDirError(
            f"--resume continues a run with its own options, and these contradict them: "
            f"{'; '.join(conflicts)}. Drop them (the run's are restored), or start a new run"
        )
    return merged, changes


def continue_metrics(
    source: str, target: str, epoch: int, record: Optional[Dict[str, Any]]
) -> None:
    """Write ``target`` (metrics.jsonl) as the history of a run resumed after ``epoch``.

    From ``source`` (the run's metrics.jsonl; the same file when resuming in place) it keeps
    every readable record but epoch records after ``epoch`` or repeated; a line cut short by a
    kill is dropped. The checkpoint's own ``record`` of ``epoch`` is added when the run was
    killed between saving the checkpoint and appending it."""
    records: List[Dict[str, Any]] = []
    seen = set()
    if os.path.isfile(source):
        with open(source, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(r, dict):
                    continue
                if r.get("type") == "epoch":
                    if r.get("epoch") in seen or int(r.get("epoch", 0)) > epoch:
                        continue
                    seen.add(r.get("epoch"))
                records.append(r)
    if record is not None and record.get("type") == "epoch" and epoch not in seen:
        records.append(record)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
