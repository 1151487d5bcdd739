"""Repeated launches that check how a program ends, not only what it prints: the exit status of every run
and every rank's line, several runs at a time.

Not a test module (the leading underscore keeps pytest from collecting it); the test files import it as
``from _exit_checks import ...`` (see tests/_launch.py for why that works).

What it guards against: gloo's worker threads free the work of a collective a moment after the caller's
wait returned, and freeing a tensor that Python made takes the GIL. A worker that does so while the
interpreter exits is ended by CPython (3.13 and older) and the C++ runtime aborts the process ("terminate
called without an active exception", SIGABRT) after a complete run. ``Runtime.close`` frees its process
groups, which joins those threads first. On a 2-core machine (November 2026, torch 2.13) the abort came
in 2 of 96 launches at 2 ranks and in none of 82 in a world of one. ``STALL_SOURCE`` makes the slow worker
certain: built as a library and preloaded (``stall_preload``), it holds every gloo worker thread for
``CUTE_EP_TEST_STALL_MS`` milliseconds before each mutex lock. With 2 ms, the README step without the fix
in ``Runtime.close`` aborted in 10 of 10 runs in a world of one and 6 of 6 at 2 ranks (both ranks), and
with it in none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from _launch import clean_env, torchrun_cmd

T = TypeVar("T")

STALL_MS_VAR = "CUTE_EP_TEST_STALL_MS"

STALL_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Every pthread_mutex_lock of a gloo worker thread (torch names them pt_gloo_runloop) waits first: a
   worker preempted after it completed a collective, before it let go of the collective's tensors. */
int pthread_mutex_lock(pthread_mutex_t* mutex) {
    static int (*real)(pthread_mutex_t*);
    if (!real) real = (int (*)(pthread_mutex_t*))dlsym(RTLD_NEXT, "pthread_mutex_lock");
    char name[32] = {0};
    if (pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strcmp(name, "pt_gloo_runloop") == 0) {
        const char* ms = getenv("CUTE_EP_TEST_STALL_MS");
        long n = ms ? atol(ms) : 2;
        struct timespec wait = {n / 1000, (n % 1000) * 1000000L};
        nanosleep(&wait, NULL);
    }
    return real(mutex);
}
"""

THREADS_AFTER = """
import os as _os

_names = [open(f"/proc/self/task/{_t}/comm").read().strip() for _t in _os.listdir("/proc/self/task")]
print(f"gloo threads left: {sorted(_n for _n in _names if 'gloo' in _n)}", flush=True)
"""
"""Code to append to a program: prints the gloo threads still running at that point (Linux /proc), as
``gloo threads left: [...]``; after a closed Runtime the list must be empty."""


def exit_env(**extra: str) -> dict[str, str]:
    """``clean_env(**extra)`` without PYTHONUNBUFFERED: output to a pipe is block-buffered, as where the
    abort was reported, and reaches the pipe only if the interpreter's exit flushes it."""
    env = clean_env(**extra)
    env.pop("PYTHONUNBUFFERED", None)
    return env


def repeat(launch: Callable[[int], T], times: int, parallel: int) -> list[T]:
    """``launch(i)`` for i in range(times), ``parallel`` at a time (threads that wait on processes)."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(launch, range(times)))


def run_python(argv: Sequence[str | os.PathLike[str]], *, cwd: Path, timeout: float,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python argv...`` as one process (a world of one), output captured through pipes."""
    return subprocess.run([sys.executable, *map(os.fspath, argv)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env if env is not None else exit_env())


def run_torchrun(script: str | os.PathLike[str], nproc: int, *args: str, cwd: Path, timeout: float,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script args...`` (a free port each time), output captured."""
    return subprocess.run(torchrun_cmd(script, nproc, *args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env if env is not None else exit_env())


def failed_runs(procs: Sequence[subprocess.CompletedProcess], lines_ok: Callable[[str], bool]) -> list[str]:
    """A line per run that did not exit 0 or whose stdout ``lines_ok`` refuses, with its output's tail."""
    bad = []
    for i, proc in enumerate(procs):
        if proc.returncode != 0 or not lines_ok(proc.stdout):
            tail = f"{proc.stdout}\n{proc.stderr}"[-1500:]
            bad.append(f"run {i}: exit {proc.returncode}\n{tail}")
    return bad


def stall_preload(folder: Path) -> str | None:
    """``STALL_SOURCE`` built as ``folder``/stall.so (its path, for LD_PRELOAD), or None without a C
    compiler or on a platform where it does not build."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    src, lib = folder / "stall.c", folder / "stall.so"
    src.write_text(STALL_SOURCE)
    built = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"],
                           capture_output=True, text=True, timeout=120)
    return str(lib) if built.returncode == 0 else None


ZYGOTE = Path(__file__).resolve().parent / "_zygote.py"


def run_forked(script: str | os.PathLike[str], runs: int, world: int, *args: str, cwd: Path, timeout: float,
               parallel: int = 2, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """``runs`` runs of ``script args`` of ``world`` ranks each, every rank a process forked after torch and
    cute_ep are imported (tests/_zygote.py: the imports once, not per run; each process still ends with the
    interpreter's whole exit). One CompletedProcess per run: the worst rank's status (a signal's negative
    number first), the ranks' stdout and stderr one after the other."""
    out = Path(tempfile.mkdtemp(prefix="forked-"))
    subprocess.run([sys.executable, str(ZYGOTE), str(out), str(runs), str(world), str(parallel),
                    os.fspath(script), *args], check=True, timeout=timeout, cwd=cwd,
                   env=env if env is not None else exit_env())
    procs = []
    for run in range(runs):
        codes = [int((out / f"run{run}_rank{r}.status").read_text()) for r in range(world)]
        text = {s: "".join((out / f"run{run}_rank{r}.{s}").read_text() for r in range(world))
                for s in ("out", "err")}
        worst = min(codes) if min(codes) < 0 else max(codes)
        procs.append(subprocess.CompletedProcess(["run", str(run)], worst, text["out"], text["err"]))
    shutil.rmtree(out, ignore_errors=True)
    return procs
