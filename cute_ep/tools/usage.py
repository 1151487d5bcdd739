"""Usage errors of the launched scripts: one line ``error: ...`` on stderr and exit status 2, which reaches
the user under any launcher.

Why this needs care: a launcher such as torchrun stops every other rank (SIGTERM) as soon as one rank
exits with a non-zero status, so a rank that leaves without printing can get the rank that would have
printed killed first, and the user sees no message at all. Here every rank that detects an error prints
it before it exits; rank 0 prints at once and the other ranks only after a pause, so that under torchrun
(which checks its workers every 0.1 s) rank 0's line is normally the only one. Each line goes out in one
write (``write_stderr``), so that lines of ranks printing at the same moment never run into each other.

This module imports neither torch nor the GPU stack: scripts report argument errors before they import
those (``--help`` and a bad argument stay fast).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "EXIT_USAGE",
    "REPEAT_DELAY_S",
    "ScriptArgumentParser",
    "UsageError",
    "checked_args",
    "launch_rank",
    "report_usage_error",
    "script_parser",
    "write_stderr",
]

EXIT_USAGE = 2
"""Exit status of a run stopped by a usage, configuration or launch error."""

REPEAT_DELAY_S = 10.0
"""How long a rank other than 0 waits before it prints an error that every rank detects alike: long
enough for a launcher to stop it once rank 0 has printed the error and exited, even with 4 ranks
importing torch on 2 busy cores (2 s was too short there: ranks printed the line three times), short
enough that a launch whose rank 0 never prints shows the error soon."""


class UsageError(ValueError):
    """An argument combination a script cannot run; exit status 2."""


def launch_rank() -> str:
    """This process's rank as the launcher names it ($RANK, else $SLURM_PROCID, else "0"), unparsed.

    For messages printed before the launch environment is validated.
    """
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def write_stderr(text: str) -> None:
    """Write ``text`` (one or more lines; a final newline is added if missing) to stderr in one write.

    ``print`` writes the text and its newline separately, and with unbuffered output (PYTHONUNBUFFERED=1,
    common under launchers) each part is its own write: ranks printing at the same moment then run their
    lines together ("error: a...error: a..." on one line). One write of a whole line to the same pipe or
    terminal is never split by another process's write (up to 4096 bytes on a pipe)."""
    if not text.endswith("\n"):
        text += "\n"
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stand-in without a descriptor (e.g. captured)
        stream.write(text)
        stream.flush()
        return
    stream.flush()  # what was written through the stream before goes first
    data = text.encode(getattr(stream, "encoding", None) or "utf-8", errors="replace")
    while data:
        data = data[os.write(fd, data):]


def report_usage_error(error: BaseException | str, *, alike: bool = True) -> int:
    """Print ``error: <error>`` on stderr (flushed) so that it reaches the user, and return EXIT_USAGE.

    ``alike``: every rank detects the same error before any collective (arguments, configuration). Rank 0
    prints at once; any other rank first waits ``REPEAT_DELAY_S``, so that a launcher that stops it after
    rank 0 exits leaves one line, and then prints the same line itself (rank 0 may have been stopped, or
    may be late). ``alike=False`` (an error that may differ per rank, e.g. of the launch environment):
    every rank prints at once.
    """
    if alike and launch_rank() != "0":
        time.sleep(REPEAT_DELAY_S)
    write_stderr(f"error: {error}")
    return EXIT_USAGE


class ScriptArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose syntax errors (unknown option, invalid choice, a value of the wrong
    type) are one line ``error: ...`` from ``report_usage_error`` (exit status 2), instead of argparse's
    usage block, which every rank of a launch would print."""

    def error(self, message: str) -> NoReturn:
        report_usage_error(f"{message} (see {self.prog} --help)")
        sys.exit(EXIT_USAGE)


def script_parser(doc: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of a script: the first paragraph of its docstring ``doc`` as the description,
    ``epilog`` after the options, every option's default shown in --help, and a syntax error reported as
    one line ``error: ...`` (exit status 2) that reaches the user under a launcher
    (:class:`ScriptArgumentParser`)."""
    return ScriptArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=epilog,
    )


def checked_args(
    parser: argparse.ArgumentParser,
    validate: Callable[[argparse.Namespace], None],
    argv: list[str] | None,
    usage_error: type[Exception] = UsageError,
) -> argparse.Namespace | None:
    """``argv`` (None: ``sys.argv[1:]``) parsed by ``parser`` (argparse exits 2 with its message on bad
    syntax) and checked by ``validate(args)``; None if that raised ``usage_error``, whose message every
    rank prints, rank 0 first (:func:`report_usage_error`; the script then exits ``EXIT_USAGE``)."""
    args = parser.parse_args(argv)
    try:
        validate(args)
    except usage_error as exc:
        report_usage_error(exc)
        return None
    return args
