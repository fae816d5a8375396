"""Command-line front ends: ``pareprop train``, ``eval``, ``bench``, ``plan`` and ``demo``.

Each subcommand lives in its own module and exposes ``main(argv) -> int``; this module only
dispatches, importing the chosen subcommand lazily so ``pareprop --help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

_COMMANDS = {
    "train": ("pareprop.cli.train", "train a reversible model (digits, CIFAR, an image folder)"),
    "eval": ("pareprop.cli.eval", "top-1/top-5 of a model (published weights too) on a folder"),
    "bench": ("pareprop.cli.bench", "measure step time and memory of every engine"),
    "plan": ("pareprop.cli.plan", "predict a training step's peak memory and the largest batch"),
    "demo": ("pareprop.cli.demo", "check every engine against autograd on a small stack"),
}


def _usage() -> str:
    lines = ["usage: pareprop <command> [options]", "", "commands:"]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run 'pareprop <command> --help' for the options of a command."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"pareprop: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(_COMMANDS[name][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C while torch and the command load, or before they run
        print(f"pareprop {name}: interrupted", file=sys.stderr)
        return 130
