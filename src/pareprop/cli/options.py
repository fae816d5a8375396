"""What the subcommands' options accept, checked while the command line is parsed.

:class:`Parser` is ``argparse.ArgumentParser`` with one-line errors; the rest are argparse
``type=`` functions shared by ``train``, ``eval``, ``bench`` and ``plan`` (and
:class:`CouplingPair`, an action: one option of two numbers checked together), so a bad value
is refused with the same message by every command that takes it, before anything runs.

NOTE [ One line, exit 2 ]
    Every bad command line ends with exit status 2 and one line on stderr,
    ``pareprop <command>: error: <what was expected, and what was given>``: argparse's own
    errors too, whose usage block would bury the line that matters (``--help`` shows it).
    A ``type=`` function raises ``argparse.ArgumentTypeError``, whose text argparse keeps;
    any other exception's text it replaces with "invalid <function name> value".
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, NoReturn, Optional, Sequence

from pareprop.convert import check_coupling
from pareprop.detection import DETECTOR_ARCHS
from pareprop.devices import device_here

__all__ = [
    "Parser",
    "int_at_least",
    "positive_int",
    "non_negative_int",
    "fraction",
    "device",
    "existing_path",
    "output_folder",
    "CouplingPair",
    "refuse_detectors",
]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (NOTE [ One line, exit 2 ])."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A type: an integer no smaller than ``minimum``, with a message that says so."""
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def fraction(text: str) -> float:
    """A type: a memory budget as a fraction from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"expected a memory budget from 0 (every block recomputed) to 1 (every block "
            f"stored), got {text!r}"
        )
    return value


def device(text: str) -> str:
    """A type: cpu, cuda or cuda:N, on a machine that has it (:func:`pareprop.devices.device_here`).

    The name is returned as given: the commands keep device names as strings.
    """
    try:
        device_here(text, flag="")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def existing_path(text: str) -> str:
    """A type: a file or directory that exists (a weight file, a checkpoint, a data folder)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(
            f"expected an existing file or directory, got {text!r}: the path does not exist"
        )
    return text


def output_folder(text: str) -> str:
    """A type: a folder to write results into, existing or not; refused when a file is in the
    way (os.makedirs would fail after the work is done)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder to write the results into, got ''")
    probe = os.path.abspath(text)
    # The nearest part of the path that exists, up to the root at most (a root that is not
    # there, a missing drive, is its own parent).
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.exists(probe):
        raise argparse.ArgumentTypeError(
            f"expected a folder to write the results into, got {text!r}, whose root {probe!r} "
            "does not exist; give another path"
        )
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(text) else f"is under the file {probe!r}"
        raise argparse.ArgumentTypeError(
            f"expected a folder to write the results into, got {text!r}, which {where}; "
            "give another path"
        )
    return text


class CouplingPair(argparse.Action):
    """An action for ``--coupling ALPHA BETA`` (``nargs=2``): the pair as
    :func:`pareprop.convert.check_coupling` accepts it, stored as a tuple of floats.

    An action, not a ``type=``: a type sees one word at a time, and what is valid (beta >= 0,
    both finite) is said of the pair. An ``argparse.ArgumentError`` raised here becomes the
    one-line ``argument --coupling: ...`` of NOTE [ One line, exit 2 ].
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        words: Sequence[str] = values
        try:
            pair = check_coupling(*words)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, pair)


def refuse_detectors(names: Sequence[str], command: str) -> None:
    """Refuse detector names (``ARCH:BACKBONE``) in one line where ``command`` sweeps
    classifiers only (``bench``: its default run ends with a detector step of its own)."""
    for name in names:
        arch, sep, _ = name.partition(":")
        if sep and arch in DETECTOR_ARCHS:
            raise ValueError(
                f"{name} is a detector; pareprop {command} --models sweeps classifiers (its "
                f"default run ends with a detector step; --no-detector leaves it out). Plan a "
                f"detector with pareprop plan --models {name}, or give its backbone "
                f"({name.split(':', 1)[1]}) here"
            )
