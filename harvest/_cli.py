"""The command line of ``python -m harvest``, parsed before JAX is imported.

``python -m harvest`` imports the package before it runs ``__main__``, and the
package imports JAX (seconds on a loaded machine). So the package's first
import asks this module (which imports nothing heavy) to parse the command
line when the process is ``python -m harvest``: ``--help``, ``--version`` and
a bad flag or command answer and exit there; only a command goes on to import
JAX and run.
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


def command_line() -> list[str] | None:
    """The arguments after ``-m harvest`` while Python locates ``harvest`` to run it
    (``sys.argv[0]`` is then ``"-m"``); None in any other process."""
    if sys.argv[:1] != ["-m"]:
        return None
    original = list(getattr(sys, "orig_argv", []))
    for at, word in enumerate(original):
        if word == "-m" and original[at + 1 : at + 2] == ["harvest"]:
            return original[at + 2 :]
        if word == "-mharvest":
            return original[at + 1 :]
    return None


def answer_early() -> None:
    """In ``python -m harvest``, parses the command line before JAX is imported:
    argparse answers ``--help``, ``--version`` and a bad argument and exits."""
    argv = command_line()
    if argv is not None:
        parser().parse_args(argv)
