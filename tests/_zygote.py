"""Run a Python program many times, each run in a process forked from this one after torch and cute_ep are
imported, so a run costs the program itself and its exit, not the imports (about 2 s a process on a 2-core
machine). Each run's process ends the way a program does (``sys.exit``: the interpreter's whole exit,
atexit handlers, the garbage collector, its threads), which is what the repeated-exit tests check.

    python tests/_zygote.py OUT_DIR RUNS WORLD PARALLEL SCRIPT [ARGS...]

A run of WORLD > 1 forks WORLD processes with the launch variables torchrun would give them (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a free port per run). PARALLEL runs at a
time. Each process writes its output to OUT_DIR/run<i>_rank<r>.out / .err and its exit status to
OUT_DIR/run<i>_rank<r>.status (a negative number: killed by that signal). Not a test module (the leading
underscore keeps pytest from collecting it); tests/_exit_checks.py runs it.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import NoReturn

from _launch import free_port


def import_once() -> None:
    """What every forked process inherits instead of importing it again: torch and the cute_ep modules the
    programs run here use."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import cute_ep  # noqa: F401
    import cute_ep.a2a_backend  # noqa: F401
    import cute_ep.reference_backend  # noqa: F401
    import cute_ep.tools.cli  # noqa: F401


def fork_rank(rank: int, world: int, master: tuple[str, int] | None, outputs: dict[Path, tuple[int, ...]],
              script: str, args: list[str], agent_store: bool = False) -> int:
    """Fork a process that runs ``script args`` as rank ``rank`` of ``world`` and return its pid. In it:
    torchrun's launch variables (none if ``master`` is None: a world of one; with ``agent_store`` also
    TORCHELASTIC_USE_AGENT_STORE, as torchrun sets it: every rank is a client of the store the launcher
    hosts at the master address), each file of ``outputs`` on its file descriptors (one open file per path,
    so output written through several of them stays in order), then ``run_program`` (never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    if master is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        if agent_store:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    for path, fds in outputs.items():
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd in fds:
            os.dup2(target, fd)
        os.close(target)
    run_program(script, args)


def run_program(script: str, args: list[str]) -> NoReturn:
    """Run ``script args`` (or ``-c CODE args``) as ``__main__``, as ``python`` would, then raise SystemExit
    with its status: the caller lets it unwind so the interpreter exits as after any program."""
    if script == "-c":
        source, filename, args = args[0], "<string>", args[1:]
        sys.path[0] = ""
    else:
        source, filename = Path(script).read_text(), script
        sys.path[0] = str(Path(script).resolve().parent)
    sys.argv = [script, *args]
    # The program's module is __main__, as when Python runs a file: its globals (a buffer, a runtime) live
    # until the interpreter's exit, where the exit tests look.
    main_module = types.ModuleType("__main__")
    main_module.__file__ = filename
    sys.modules["__main__"] = main_module
    code: object = 0
    try:
        exec(compile(source, filename, "exec"), main_module.__dict__)
    except SystemExit as exc:
        code = exc.code
    raise SystemExit(code)


def main() -> None:
    out, runs, world, parallel, script, *args = sys.argv[1:]
    out, runs, world, parallel = Path(out), int(runs), int(world), int(parallel)
    out.mkdir(parents=True, exist_ok=True)
    import_once()

    running: dict[int, tuple[int, int]] = {}  # pid -> (run, rank)
    next_run = 0
    while next_run < runs or running:
        while next_run < runs and len({r for r, _ in running.values()}) < parallel:
            master = ("127.0.0.1", free_port()) if world > 1 else None
            for rank in range(world):
                outputs = {out / f"run{next_run}_rank{rank}.{suffix}": (fd,) for fd, suffix in ((1, "out"),
                                                                                               (2, "err"))}
                running[fork_rank(rank, world, master, outputs, script, args)] = (next_run, rank)
            next_run += 1
        pid, status = os.wait()
        run, rank = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        (out / f"run{run}_rank{rank}.status").write_text(str(code))


if __name__ == "__main__":
    main()
