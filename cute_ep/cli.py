"""Helpers shared by the scripts in scripts/ (dispatch_and_combine.py, benchmark.py).

Small collectives on the Runtime's CPU (gloo) group, rank-0 printing, the report of a failed check,
the expert of each received row, and the collective way out of a run after an error every rank got
alike. Importing this module imports torch: scripts that must answer ``--help`` without torch import
it after parsing.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

import torch

from cute_ep.validators.checks import CheckResult, format_summary
from cute_ep.validators.checks import all_gather_objects as all_gather
from cute_ep.validators.checks import broadcast_from_root as broadcast_from_rank0
from cute_ep.validators.reference import global_expert_of_rows

if TYPE_CHECKING:
    from cute_ep.bootstrap.runtime import Runtime

__all__ = [
    "DTYPES",
    "Printer",
    "all_gather",
    "broadcast_from_rank0",
    "expert_ids",
    "launch_rank",
    "leave",
    "print_run_error",
    "report",
]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The --dtype choices of the scripts and their torch dtypes."""


# --------------------------------------------------------------------------------------------------
# small collective helpers (the cpu group is gloo in both backends)
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# printing and reporting
# --------------------------------------------------------------------------------------------------


class Printer:
    """Prints on rank 0 only, flushed (torchrun interleaves the ranks' output)."""

    def __init__(self, rank: int) -> None:
        self.on = rank == 0

    def __call__(self, *lines: str) -> None:
        if self.on:
            for line in lines:
                print(line, flush=True)


def report(result: CheckResult, name: str, group: Any, say: Printer) -> bool:
    """Print the check's line on rank 0 and, if it failed, every failing rank's own message.

    Collective when the check failed (the verdict is the same on every rank). Returns result.passed.
    """
    say(format_summary(result, name))
    if not result.passed:  # the same on every rank, so the gather below is collective-safe
        messages = all_gather(None if result.local_passed else result.message, group)
        for r, m in enumerate(messages):
            if m is not None:
                say(f"    rank {r}: {m}")
    return result.passed


def expert_ids(res: Any, rank: int) -> torch.Tensor | None:
    """Global expert of each received row, from the buffer's own tokens_per_expert (None if they disagree).

    ``res`` is a dispatch result (``tokens_per_expert`` [El] int32, ``num_recv`` int); the result is
    [num_recv] int64.
    """
    tpe = res.tokens_per_expert.to(torch.int64)
    if tpe.numel() == 0 or int(tpe.min()) < 0 or int(tpe.sum()) != res.num_recv:
        return None
    return global_expert_of_rows(tpe, rank)


# --------------------------------------------------------------------------------------------------
# errors and the way out
# --------------------------------------------------------------------------------------------------


def launch_rank() -> str:
    """This process's rank as the launcher names it ($RANK, else $SLURM_PROCID, else "0"), unparsed.

    For messages printed before the launch environment is validated.
    """
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def print_run_error(rank: int, exc: BaseException, show_traceback: bool) -> None:
    """Print a run-time error of this rank to stderr, with the traceback or a hint at --traceback.

    Call it from the ``except`` block that caught ``exc`` (the traceback is the one being handled).
    """
    print(f"rank {rank}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if show_traceback:
        traceback.print_exc()
    else:
        print(f"rank {rank}: (run with --traceback for the traceback)", file=sys.stderr, flush=True)


def leave(runtime: Runtime, exc: BaseException, code: int, *, meet: bool = True) -> int:
    """An error every rank got alike: print it once, meet the others, return ``code``.

    Returning (instead of raising through the Runtime's ``with``) keeps the teardown collective, so
    no rank tears its connections down under another that is still talking.
    """
    if runtime.env.rank == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    if meet:
        runtime.barrier()
    return code
