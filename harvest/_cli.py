"""The command line of ``python -m harvest``, parsed before JAX is imported.

``python -m harvest`` imports the package, and so JAX (seconds), before it runs
``__main__``: the package's first import has this module (which imports nothing
heavy) answer ``--help``, ``--version`` and a bad argument there, and exit.
"""

from __future__ import annotations

import argparse
import sys

from ._version import __version__


def parser() -> argparse.ArgumentParser:
    """The command line's parser: ``--version``, and ``demo`` (the default)."""
    cli = argparse.ArgumentParser(
        prog="python -m harvest",
        description="harvest: tag any value inside any JAX function, then reap it out or "
        "plant a replacement in. With no command, runs the demo.",
    )
    cli.add_argument("--version", action="version", version=f"harvest {__version__}")
    cli.add_argument(
        "command",
        nargs="?",
        default="demo",
        choices=["demo"],
        help="demo (the default): read a small residual MLP's intermediates with reap, "
        "then patch one layer at a time with plant",
    )
    return cli


def answer_early() -> None:
    """In ``python -m harvest``, parses the command line before JAX is imported:
    argparse answers ``--help``, ``--version`` and a bad argument and exits."""
    if sys.argv[:1] != ["-m"]:  # only while Python locates ``harvest`` to run it
        return
    original = sys.orig_argv
    for at, word in enumerate(original):
        if word == "-m" and original[at + 1 : at + 2] == ["harvest"]:
            parser().parse_args(original[at + 2 :])
            return
        if word == "-mharvest":
            parser().parse_args(original[at + 1 :])
            return
