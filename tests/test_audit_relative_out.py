"""A relative ``--out`` (train's default ``runs/train``, plan's ``plan_results``) is checked like
an absolute one, and the walk up to the nearest existing folder ends at the root whatever the
file system says: it once walked ``"" -> ""`` forever on a relative path, stalling the suite."""

import argparse
import os
import threading

import pytest

from pareprop.cli.options import output_folder
from pareprop.trainer.rundir import RunDirError, check_new_run_dir


def _within(seconds, fn, *args):
    """``fn(*args)``'s exception (None if it returned), failing if it runs past ``seconds``."""
    outcome = []

    def run():
        try:
            fn(*args)
            outcome.append(None)
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__}{args} still running after {seconds} s"
    return outcome[0]


def test_a_relative_out_is_accepted_where_it_can_be_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _within(10, check_new_run_dir, os.path.join("runs", "train"), False) is None
    assert _within(10, output_folder, os.path.join("plan", "results")) is None
    (tmp_path / "a_file").write_text("")
    error = _within(10, output_folder, os.path.join("a_file", "results"))
    assert isinstance(error, argparse.ArgumentTypeError) and "is under the file" in str(error)


def test_the_walk_up_ends_at_a_root_that_does_not_exist(monkeypatch):
    # A drive that is not there (Z:\ on Windows): dirname of the root is the root itself.
    for name in ("exists", "isdir"):
        monkeypatch.setattr(os.path, name, lambda path: False)
    error = _within(10, check_new_run_dir, os.path.join("runs", "train"), False)
    assert isinstance(error, RunDirError) and "does not exist" in str(error)
    error = _within(10, output_folder, os.path.join("plan", "results"))
    assert isinstance(error, argparse.ArgumentTypeError) and "does not exist" in str(error)


def test_an_empty_out_is_refused():
    # Refused at once: the run was set up (model, data) and then failed to make ''.
    with pytest.raises(RunDirError, match="expected --out a directory"):
        check_new_run_dir("", False)
