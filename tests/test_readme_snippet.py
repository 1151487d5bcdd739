"""The README's Python step ("Using it from Python") runs as written: as a file in a world of one and under
torchrun with 2 ranks, on the CPU (reference backend), its combine matches the stand-in expert, and every
run ends cleanly: exit status 0 and every rank's line printed, 20 runs in a world of one and 10 at 2 ranks
(a few at a time, each rank a process forked after the imports: tests/_zygote.py), output to files.

Why so many runs: the step once printed its correct result and then aborted in the interpreter's exit
(SIGABRT, "terminate called without an active exception") in some runs; tests/_exit_checks.py explains
the cause and how the last test here makes it certain without the fix.
"""

from __future__ import annotations

import re
import sys

import pytest
from _exit_checks import (
    STALL_MS_VAR,
    THREADS_AFTER,
    exit_env,
    failed_runs,
    run_forked,
    run_python,
    run_torchrun,
    stall_preload,
)
from _launch import REPO

TIMEOUT = 300
PARALLEL = 2  # launches at a time (2 cores: more only queue)


def _snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README has no Python block under 'Using it from Python'"
    return match.group(1)


def _rows(out: str) -> list[tuple[int, int, float]]:
    """Each rank's line, which must be a whole line: two ranks' lines run together count as none."""
    found = re.findall(r"^rank (\d+): (\d+) rows received, largest difference (\S+) \(bf16 rounding\)$", out,
                       re.M)
    return [(int(r), int(n), float(e)) for r, n, e in found]


def _one_rank_ok(out: str) -> bool:
    rows = _rows(out)
    # every (token, k) pair lands on the one rank; the difference is a bf16 rounding of |out| <= 2 * 4.5
    return [(r, n) for r, n, _ in rows] == [(0, 48 * 2)] and rows[0][2] < 0.1


def _two_ranks_ok(out: str) -> bool:
    rows = sorted(_rows(out))
    return ([r for r, _, _ in rows] == [0, 1] and sum(n for _, n, _ in rows) == 2 * 48 * 2
            and all(e < 0.1 for _, _, e in rows))


@pytest.fixture()
def step(tmp_path):
    path = tmp_path / "step.py"
    path.write_text(_snippet())
    return path


def test_the_readme_step_runs_as_written(step):
    """``python step.py`` and ``torchrun --nproc-per-node 2 step.py``, as the README says; under torchrun
    unbuffered too (PYTHONUNBUFFERED=1, as in many containers), where a ``print`` that writes its line and
    its newline apart let the two ranks' lines run together in 18 of 30 launches on a 2-core machine."""
    procs = [run_python([step], cwd=step.parent, timeout=TIMEOUT),
             run_torchrun(step, 2, cwd=step.parent, timeout=TIMEOUT),
             run_torchrun(step, 2, cwd=step.parent, timeout=TIMEOUT, env=exit_env(PYTHONUNBUFFERED="1"))]
    bad = failed_runs(procs[:1], _one_rank_ok) + failed_runs(procs[1:], _two_ranks_ok)
    assert not bad, "\n".join(bad)


def test_the_readme_step_ends_cleanly_20_times_in_a_world_of_one(step):
    procs = run_forked(step, 20, 1, cwd=step.parent, timeout=TIMEOUT, parallel=PARALLEL)
    bad = failed_runs(procs, _one_rank_ok)
    assert not bad, f"{len(bad)} of 20 runs failed:\n" + "\n".join(bad)


def test_the_readme_step_ends_cleanly_10_times_on_two_ranks(step):
    procs = run_forked(step, 10, 2, cwd=step.parent, timeout=TIMEOUT, parallel=PARALLEL)
    bad = failed_runs(procs, _two_ranks_ok)
    assert not bad, f"{len(bad)} of 10 runs failed:\n" + "\n".join(bad)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
@pytest.mark.parametrize("world", [1, 2])
def test_no_gloo_thread_outlives_the_runtime_even_with_stalled_workers(tmp_path, world):
    """After the ``with Runtime`` block (``buf`` still set) no gloo thread runs, and with gloo's workers
    stalled at every lock (tests/_exit_checks.py; where a C compiler builds the stall) the step still ends
    cleanly. Without the fix in ``Runtime.close`` both checks fail."""
    step = tmp_path / "step.py"
    step.write_text(_snippet() + THREADS_AFTER)
    preload = stall_preload(tmp_path)
    env = exit_env(**({"LD_PRELOAD": preload, STALL_MS_VAR: "2"} if preload else {}))
    if world == 1:
        proc = run_python([step], cwd=tmp_path, timeout=TIMEOUT, env=env)
    else:
        proc = run_torchrun(step, 2, cwd=tmp_path, timeout=TIMEOUT, env=env)
    text = f"{proc.stdout}\n{proc.stderr}"[-3000:]
    assert proc.returncode == 0, text
    assert (_one_rank_ok if world == 1 else _two_ranks_ok)(proc.stdout), text
    assert proc.stdout.count("gloo threads left: []") == world, text
