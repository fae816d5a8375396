"""The run directory of a run: which one it writes, refusing a used one, and claiming it.

A new run refuses an ``--out`` that holds anything (``--overwrite`` clears it); a resumed run
continues in its checkpoint's run directory, or in a new ``--out``, with the options it was
saved with (NOTE [ Resumed configuration ] and NOTE [ Run directories ] in
pareprop/trainer/rundir.py). Process 0 decides and writes; every process fails when it refuses.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterable, Optional, Tuple

import torch

from pareprop import checkpoint as ckpt_lib
from pareprop import distributed as dist_lib
from pareprop.checkpoint import atomic_write
from pareprop.trainer import rundir
from pareprop.trainer.config import TrainConfig


class RunDirectory:
    """Opening a run (its configuration, the checkpoint it resumes) and claiming its directory.

    Part of :class:`~pareprop.trainer.Trainer`; reads its ``dist``, ``cfg`` and ``resume``, and
    sets ``_source_run``, ``_in_place`` and ``_lock``.
    """

    def _open_run(
        self, cfg: TrainConfig, given: Optional[Iterable[str]]
    ) -> Tuple[TrainConfig, Optional[ckpt_lib.Checkpoint]]:
        """The run's configuration, and its checkpoint when resuming (NOTE [ Resumed
        configuration ] in trainer/rundir.py); refuses an output directory a new run may not
        write into (NOTE [ Run directories ])."""
        given = _given_fields(cfg) if given is None else set(given)
        # Where the resumed checkpoint's run lives, and whether this run continues there.
        self._source_run: Optional[str] = None
        self._in_place = False
        if cfg.resume is None:
            if cfg.eval_only:
                raise ValueError("--eval-only needs a checkpoint to evaluate: pass --resume PATH")
            self._check_new_run_dir(cfg)
            return cfg, None
        ck = ckpt_lib.load_checkpoint(cfg.resume, train_state=not cfg.eval_only)
        run_dir = self._source_run = rundir.run_dir_of(ck.path)
        saved = rundir.saved_config(ck.meta, ck.train_state, run_dir)
        if saved is not None:
            merged, changes = rundir.restore_config(
                dataclasses.asdict(cfg), saved, given, TrainConfig.fields()
            )
            cfg = TrainConfig.from_dict(merged)
            for change in changes:
                self._log(f"resume: {change} (changed for this run)")
        if cfg.eval_only:
            if "out" not in given and run_dir is not None:
                cfg.out = run_dir
            return cfg, ck
        if "out" in given and not (run_dir and os.path.realpath(cfg.out) == run_dir):
            # Continued in a new directory: the rules of a new run.
            self._check_new_run_dir(cfg)
            self._log(f"resume: continuing {ck.path} in the new run directory {cfg.out}")
        elif run_dir is None:
            raise rundir.RunDirError(
                f"{ck.path!r} is not inside a run directory (RUN/checkpoints/NAME), so there is "
                "no run to continue in place: pass --out DIR to continue it in a new directory"
            )
        else:
            cfg.out = saved["out"] if saved and _is_dir(saved.get("out"), run_dir) else run_dir
            _check_is_last(ck, cfg.out)
            self._in_place = True
        if cfg.epochs < ck.epoch:
            raise rundir.RunDirError(
                f"--epochs {cfg.epochs} is fewer than the {ck.epoch} epoch(s) {ck.path!r} has "
                f"done: nothing to train. Pass --epochs above {ck.epoch} to train longer, or "
                "--eval-only to evaluate it"
            )
        return cfg, ck

    def _check_new_run_dir(self, cfg: TrainConfig) -> None:
        self._on_first_process(lambda: rundir.check_new_run_dir(cfg.out, cfg.overwrite), cfg.out)

    def _on_first_process(self, action: Callable[[], None], out: str) -> None:
        """Run ``action`` on process 0; if it refuses the run directory, every process fails."""
        error: Optional[Exception] = None
        if self.dist.rank == 0:
            try:
                action()
            except rundir.RunDirError as e:
                error = e
        failed = dist_lib.all_reduce(torch.tensor([float(error is not None)]), self.dist, "max")
        if error is not None:
            raise error
        if failed.item() > 0:
            raise rundir.RunDirError(f"process 0 refused the run directory {out!r}")

    def _claim_run_dir(self) -> None:
        """Lock the run directory and make it this run's (NOTE [ Run directories ]): a new one
        checked again under the lock (and cleared with --overwrite), a resumed one given the
        metrics of the epochs its checkpoint holds; then write config.json."""
        cfg, ck = self.cfg, self.resume

        def claim() -> None:
            self._lock = rundir.RunLock(cfg.out).acquire()
            if self._source_run is not None and self._in_place:
                _check_is_last(ck, cfg.out)
            else:
                rundir.check_new_run_dir(cfg.out, cfg.overwrite)
                removed = rundir.clear_run_dir(cfg.out) if cfg.overwrite else []
                if removed:
                    self._log(f"--overwrite: deleted {', '.join(removed)} of {cfg.out}")
            if ck is not None:
                rundir.continue_metrics(
                    os.path.join(self._source_run or "", "metrics.jsonl"),
                    os.path.join(cfg.out, "metrics.jsonl"),
                    ck.epoch,
                    ck.meta.get("metrics") or None,
                )
            _write_json(os.path.join(cfg.out, "config.json"), dataclasses.asdict(cfg))

        self._on_first_process(claim, cfg.out)

    def _release_run_dir(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _write_json(path: str, value: Any) -> None:
    """Write ``path`` atomically: a kill leaves the old file or the new one, never half."""
    text = json.dumps(value, indent=2)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def _given_fields(cfg: TrainConfig) -> set:
    """The options of ``cfg`` that differ from the defaults (taken as given explicitly)."""
    default = TrainConfig()
    return {
        name for name in TrainConfig.fields()
        if json.dumps(getattr(cfg, name), sort_keys=True, default=str)
        != json.dumps(getattr(default, name), sort_keys=True, default=str)
    }


def _is_dir(path: Optional[str], run_dir: str) -> bool:
    return isinstance(path, str) and os.path.realpath(path) == run_dir


def _check_is_last(ck: ckpt_lib.Checkpoint, out: str) -> None:
    last = os.path.join(out, "last")
    if os.path.realpath(last) != ck.path:
        raise rundir.RunDirError(
            f"{ck.path!r} is not the last checkpoint of its run ({last} is "
            f"{os.path.realpath(last)!r}): continuing from it in {out!r} would mix two "
            f"histories. Resume {last}, or continue this one in a new directory with --out"
        )

