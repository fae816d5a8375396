"""The ``pareprop`` command dispatcher and ``pareprop demo``."""

import subprocess
import sys

import pytest

from pareprop.cli import main


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "bench", "plan", "demo"))


def test_no_command_and_unknown_command_fail_with_usage(capsys):
    assert main([]) == 2
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_demo_checks_every_engine_and_reports_memory(capsys):
    assert main(["demo", "--depth", "2", "--tokens", "4", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    for engine in ("autograd", "reversible", "pareprop"):
        assert engine in out
    # Worst relative errors of the reversible engines are printed in scientific notation.
    errors = [float(line.split()[4]) for line in out.splitlines() if "worst relative" in line]
    assert len(errors) == 2 and max(errors) < 1e-8


def test_demo_rejects_a_zero_depth():
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--depth", "0"])
    assert exc.value.code == 2


@pytest.mark.slow  # a fresh interpreter importing torch
def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "pareprop", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "pareprop <command>" in done.stdout
