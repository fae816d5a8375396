"""Fault injection: a training run killed (SIGKILL) at chosen and random points, checkpoint
writes included, resumes from its last complete checkpoint, loses no earlier checkpoint, and
ends with the metrics and weights of a run that was never killed.

The runs are forked children of the test process (no second import of torch per run), each
running ``pareprop train`` and, where a point is chosen, killing itself on the n-th call of one
step of ``save_checkpoint`` (see NOTE [ Atomic checkpoints ] in pareprop/checkpoint.py).
"""

import json
import multiprocessing
import os
import random
import signal
import sys
import time

import pytest
import torch

from pareprop import checkpoint as ckpt_lib
from pareprop.trainer import TIMING_KEYS

pytestmark = [  # slow: forked training runs killed and resumed (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="forks and SIGKILLs itself"),
]

TINY = dict(img_size=8, patch_size=4, in_chans=1, embed_dim=8, depth=2, num_heads=1,
            drop_path_rate=0.1)
RUN = ["--epochs", "3", "--batch-size", "512", "--no-progress",
       *[f"--model-arg={k}={v}" for k, v in TINY.items()]]


def _child(argv, kill_at, pause_at=None):
    torch.set_num_threads(1)
    for point, act in ((kill_at, lambda: os.kill(os.getpid(), signal.SIGKILL)),
                       (pause_at, lambda: time.sleep(4))):
        if point is None:
            continue
        name, n = point
        real, calls = getattr(ckpt_lib, name), [0]

        def on_call_n(*args, real=real, calls=calls, n=n, act=act, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                act()
            return real(*args, **kwargs)

        setattr(ckpt_lib, name, on_call_n)
    from pareprop.cli.train import main

    os._exit(main(argv))


def _run(argv, kill_at=None, kill_after_s=None):
    """Exit code of ``pareprop train argv`` in a forked child (-9: killed)."""
    child = multiprocessing.get_context("fork").Process(target=_child, args=(argv, kill_at))
    child.start()
    child.join(kill_after_s)
    if child.is_alive():
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    child.join(300)
    return child.exitcode


def _epochs(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in records if r["type"] == "epoch"]


def _tags(out):
    """(epoch of last, {tag: checkpoint path}) after verifying every tagged checkpoint."""
    paths = {}
    for tag in ("last", "best"):
        if os.path.lexists(os.path.join(out, tag)):
            ck = ckpt_lib.load_checkpoint(os.path.join(out, tag))  # verifies the SHA-256s
            paths[tag] = ck.path
    last = ckpt_lib.load_checkpoint(paths["last"]).epoch if "last" in paths else 0
    return last, paths


def test_killed_runs_resume_to_the_uninterrupted_result(tmp_path):
    reference, out = str(tmp_path / "reference"), str(tmp_path / "run")
    assert _run(RUN + ["--out", reference]) == 0

    # Killed while writing epoch 1's first file: no checkpoint yet, so --resume says to start
    # again and a new run needs --overwrite for what the dead one left.
    assert _run(RUN + ["--out", out], kill_at=("atomic_write", 1)) == -signal.SIGKILL
    assert _tags(out) == (0, {})
    assert _run(["--resume", out, "--no-progress"]) == 2
    assert _run(RUN + ["--out", out]) == 2
    steps = [
        # (argv, kill point): each leaves a different half-done save behind.
        (RUN + ["--out", out, "--overwrite"], ("atomic_write", 5)),  # epoch 2: state.pt
        (["--resume", out, "--no-progress"], ("_point", 1)),  # epoch 2 renamed, not linked
        (["--resume", out, "--no-progress"], ("_prune", 1)),  # linked, metrics not appended
    ]
    before = 0
    for argv, kill_at in steps:
        assert _run(argv, kill_at=kill_at) == -signal.SIGKILL, kill_at
        last, paths = _tags(out)
        assert last >= before and "last" in paths, kill_at  # nothing earlier was lost
        before = last
    assert before == 2
    # Then at random moments, until the run finishes.
    rng = random.Random(26)
    for _ in range(6):
        code = _run(["--resume", out, "--no-progress"], kill_after_s=rng.uniform(0.5, 4.0))
        last, _ = _tags(out)
        assert last >= before
        before = last
        if code == 0:
            break
        assert code == -signal.SIGKILL
    else:
        assert _run(["--resume", out, "--no-progress"]) == 0
    assert _tags(out)[0] == 3

    assert _epochs(out) == _epochs(reference)
    mine, theirs = ckpt_lib.load_checkpoint(out), ckpt_lib.load_checkpoint(reference)
    assert mine.step == theirs.step
    for name, tensor in theirs.state_dict.items():
        assert torch.equal(mine.state_dict[name], tensor), name
    # Only the tagged checkpoints remain: the half-written ones were cleaned up.
    kept = {os.path.realpath(os.path.join(out, t)) for t in ("last", "best")}
    left = os.listdir(os.path.join(out, "checkpoints"))
    assert {os.path.realpath(os.path.join(out, "checkpoints", n)) for n in left} == kept


def test_a_second_process_is_refused_while_a_run_writes(tmp_path, capsys):
    from pareprop.cli.train import main

    out = str(tmp_path / "run")
    # The first run pauses inside its first save, holding its run directory.
    first = multiprocessing.get_context("fork").Process(
        target=_child, args=(RUN + ["--out", out], None, ("_prune", 1)))
    first.start()
    deadline = time.monotonic() + 120
    while not os.path.lexists(os.path.join(out, "last")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.is_alive()
    assert main(["--resume", out, "--no-progress"]) == 2
    assert main(RUN + ["--out", out, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count(f"another process (pid {first.pid}) is writing") == 2, err
    first.join(300)
    assert first.exitcode == 0
    assert [r["epoch"] for r in _epochs(out)] == [1, 2, 3]
