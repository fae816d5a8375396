"""`pareprop train --resume` continues the run it names, and no run deletes another
(docs/training.md, "Resume" and "Run directories")."""

import json
import os
import shutil

import pytest

from pareprop.checkpoint import load_checkpoint
from pareprop.cli.train import main
from pareprop.trainer import TIMING_KEYS, Trainer
from pareprop.trainer.rundir import RunLock

MODEL = "rev_vit_tiny_patch4_32"
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2, num_heads=2)
ARGS = ["--model", MODEL, *[f"--model-arg={k}={v}" for k, v in TINY.items()],
        "--model-arg", "drop_path_rate=0.1", "--batch-size", "256", "--no-progress"]


def _records(out, kind="epoch"):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in records if r["type"] == kind]


def _train(*argv):
    return main([*ARGS, *argv])


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted 3-epoch run with seed 3."""
    out = tmp_path_factory.mktemp("full") / "run"
    assert _train("--epochs", "3", "--seed", "3", "--out", str(out)) == 0
    return out


def test_resume_restores_directory_seed_and_schedule(full, tmp_path, monkeypatch, capsys):
    out = tmp_path / "runA"
    assert _train("--epochs", "3", "--seed", "3", "--stop-after-epochs", "1",
                  "--out", str(out)) == 0
    monkeypatch.chdir(tmp_path)  # the default --out (runs/train) would be here
    assert main(["--resume", str(out / "last"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "epochs 2-3" in err and f"run directory {out}" in err
    assert not (tmp_path / "runs").exists()
    assert _records(out) == _records(full)
    assert load_checkpoint(out / "last").step == load_checkpoint(full / "last").step
    assert json.loads((out / "config.json").read_text())["seed"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--seed", "0"], "seed 3 -> 0"),
    (["--model-arg", "depth=3"], "model_kwargs"),
    (["--memory-budget", "0.5"], "memory_budget null -> \"0.5\""),
    (["--lr", "1e-6"], "lr 0.002 -> 1e-06"),
    (["--layer-decay", "0.75"], "layer_decay null -> 0.75"),
    (["--epochs", "1"], "--epochs 1 is fewer than the 2 epoch(s)"),
])
def test_resume_refuses_options_that_contradict_the_run(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert _train("--epochs", "3", "--seed", "3", "--stop-after-epochs", "2",
                  "--out", str(out)) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["--resume", str(out), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert (out / "metrics.jsonl").read_text() == before


def test_resume_may_train_longer_and_says_so(full, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--epochs", "2", "--seed", "3", "--out", str(out)) == 0
    assert main(["--resume", str(out), "--no-progress", "--epochs", "3"]) == 0
    err = capsys.readouterr().err
    assert "epochs 2 -> 3 (changed for this run)" in err and "cosine schedule" in err
    assert [r["epoch"] for r in _records(out)] == [1, 2, 3]
    # A finished run has nothing left to train: it says so, exits 0 and writes nothing.
    before = (out / "metrics.jsonl").read_text()
    assert main(["--resume", str(out), "--no-progress"]) == 0
    assert "nothing to train" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before


def test_resume_with_other_workers_says_its_draws_differ(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--epochs", "2", "--stop-after-epochs", "1", "--out", str(out)) == 0
    assert main(["--resume", str(out), "--workers", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "saved by a run with --workers 0, resuming with 1" in err


def test_eval_only_scores_with_the_runs_own_split(full, capsys):
    last = _records(full)[-1]
    assert main(["--resume", str(full / "last"), "--eval-only", "--no-progress"]) == 0
    assert _records(full, "eval")[-1]["val_acc"] == last["val_acc"]
    assert main(["--resume", str(full / "last"), "--eval-only", "--seed", "1"]) == 2
    assert "seed 3 -> 1" in capsys.readouterr().err


def test_resume_from_an_older_checkpoint_needs_a_new_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--epochs", "2", "--stop-after-epochs", "1", "--out", str(out)) == 0
    first = os.path.realpath(out / "last")
    shutil.copytree(first, tmp_path / "kept")
    assert main(["--resume", str(out), "--no-progress"]) == 0
    # An older checkpoint still in the run (as 'best' keeps one when a later epoch is worse).
    older = out / "checkpoints" / os.path.basename(first)
    if not older.exists():
        shutil.copytree(tmp_path / "kept", older)
    assert main(["--resume", str(older), "--no-progress"]) == 2
    assert "not the last checkpoint" in capsys.readouterr().err
    fork = tmp_path / "fork"
    assert main(["--resume", str(older), "--out", str(fork), "--no-progress"]) == 0
    assert [r["epoch"] for r in _records(fork)] == [1, 2]  # epoch 1 carried over
    assert len(list((out / "checkpoints").iterdir())) >= 1 and (out / "last").exists()


def test_a_new_run_never_deletes_an_old_one(tmp_path, capsys):
    out = tmp_path / "runA"
    assert _train("--epochs", "2", "--out", str(out)) == 0
    best, metrics = os.path.realpath(out / "best"), (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _train("--epochs", "1", "--lr", "1e-6", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "already holds a previous run" in err and "--overwrite" in err
    assert os.path.realpath(out / "best") == best and os.path.isdir(best)
    assert (out / "metrics.jsonl").read_text() == metrics
    # --overwrite starts afresh: the old run's files are gone, the new run's alone remain.
    (out / "notes.txt").write_text("mine")
    assert _train("--epochs", "1", "--lr", "1e-6", "--out", str(out), "--overwrite") == 0
    assert [r["epoch"] for r in _records(out)] == [1]
    assert len(list((out / "checkpoints").iterdir())) == 1
    assert (out / "notes.txt").read_text() == "mine"


def test_a_second_process_is_kept_out_by_the_lock(tmp_path, capsys):
    out = tmp_path / "run"
    lock = RunLock(str(out)).acquire()
    try:
        assert _train("--epochs", "1", "--out", str(out)) == 2
        assert f"another process (pid {os.getpid()}) is writing" in capsys.readouterr().err
    finally:
        lock.release()
    assert _train("--epochs", "1", "--out", str(out)) == 0


@pytest.mark.parametrize("where", ["file", "/proc/pareprop-run"])
def test_out_that_cannot_be_a_run_directory(tmp_path, capsys, where):
    out = tmp_path / "a_file" if where == "file" else where
    if where == "file":
        out.write_text("x")
    assert _train("--epochs", "1", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "pareprop train: error:" in err and "Traceback" not in err


def test_ctrl_c_says_where_the_last_checkpoint_is(tmp_path, monkeypatch, capsys):
    real = Trainer.train_epoch

    def interrupted(self):
        if self.epoch == 1:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "train_epoch", interrupted)
    out = tmp_path / "run"
    assert _train("--epochs", "3", "--out", str(out)) == 130
    err = capsys.readouterr().err
    # --workers is not restored, and the draws of augmentation depend on it: it is said.
    assert "interrupted in epoch 2" in err and f"--resume {out} --workers 0" in err
    assert "Traceback" not in err and not (out / ".lock").exists()
    monkeypatch.setattr(Trainer, "train_epoch", real)
    assert main(["--resume", str(out), "--no-progress"]) == 0
