"""GPU test session: one Runtime (torch.distributed + NVSHMEM) per process, shared by all tests.

Launch (one process per GPU; see scripts/run_gpu_tests.sh for the 1/2/4/virtual-node matrix):
    torchrun --nproc-per-node 4 -m pytest tests/gpu -m gpu -q
    CUTE_EP_LOCAL_WORLD_SIZE=2 torchrun --nproc-per-node 4 -m pytest tests/gpu -m gpu -q  # 2 nodes x 2
Without CUDA the tests here are skipped (CI has no GPU).

Hangs end themselves: every test runs under a watchdog (``GPU_TEST_WATCHDOG_S``, default 120 s per test).
When a test outlives it, the rank prints ``[rank R] WATCHDOG: <test id> ...`` and the Python stack of every
thread (where it waits: a collective, a device synchronize, a status poll), then exits with status 124; its
peers, stuck in the same test, do the same or fail in their next collective. A backstop in C
(``faulthandler``) dumps the stacks and exits 15 s later when the rank's main thread holds the GIL and the
Python watchdog cannot run.

Output: every rank prints failures and watchdog reports on stderr as they happen. Ranks other than 0 send
pytest's own report (stdout) to ``$GPU_TEST_LOG_DIR/rank<R>.log`` (default ``/tmp/cute_ep_gpu_tests``), so a
launch without ``--local-ranks-filter`` shows rank 0's report once and every rank's failures.

Inputs: every test draws its inputs from seeds offset by ``runtime.seed`` (``GPU_TEST_SEED``, default 0;
``scripts/run_gpu_tests.sh`` picks a fresh one per launch and prints it), so repeated launches check fresh
random inputs and a failing launch is reproduced with its printed seed.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
OURS: set[str] = set()
"""Node ids of the tests in this folder: pytest calls the hooks below for every test of the session (a run
of all of tests/ includes the CPU tests), and the watchdog and the rank-tagged failure lines are for these."""


def pytest_collection_modifyitems(config, items):
    OURS.update(item.nodeid for item in items if HERE in Path(str(item.path)).resolve().parents)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run under torchrun on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _rank() -> str:
    return os.environ.get("RANK", "0")


_RANK_LOG = None
"""This rank's pytest report (ranks other than 0; see pytest_configure)."""
_REPORT_FILE = sys.stderr
"""Where the watchdog writes: from pytest_configure on, a copy of the process's stderr taken outside
pytest's capture (what a running test's capture holds is lost when the rank ends)."""


def pytest_configure(config):
    """Keep a handle on the real stderr; ranks other than 0 write pytest's report to their own log."""
    global _REPORT_FILE
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture()
    try:
        _REPORT_FILE = os.fdopen(os.dup(2), "w", buffering=1)
    finally:
        if capman is not None:
            capman.resume_global_capture()
    if _rank() == "0" or "RANK" not in os.environ:
        return
    from _pytest.terminal import TerminalReporter

    folder = Path(os.environ.get("GPU_TEST_LOG_DIR", "/tmp/cute_ep_gpu_tests"))
    folder.mkdir(parents=True, exist_ok=True)
    global _RANK_LOG
    log = _RANK_LOG = open(folder / f"rank{_rank()}.log", "w", buffering=1)  # noqa: SIM115 (the session's)
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.unregister(reporter)
        config.pluginmanager.register(TerminalReporter(config, log), "terminalreporter")



WATCHDOG_EXIT = 124
"""Exit status of a rank whose test outlived the watchdog (the status ``timeout`` gives)."""
BACKSTOP_S = float(os.environ.get("GPU_TEST_WATCHDOG_BACKSTOP_S", 15))
"""Seconds after the watchdog at which faulthandler dumps and exits if the watchdog could not run."""


def _env_number(name: str, default: str, convert: type, what: str) -> float:
    """``convert`` of the variable ``name`` (``default`` when unset or empty), which must be ``what``, >= 0:
    else ``pytest.UsageError`` naming the variable, what it must be and its value."""
    raw = os.environ.get(name, default).strip() or default
    try:
        value = convert(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise pytest.UsageError(f"{name} must be {what}, got {raw!r}")
    return value


def watchdog_seconds() -> float:
    """The per-test limit: ``GPU_TEST_WATCHDOG_S`` (default 120; 0 turns the watchdog off)."""
    return _env_number("GPU_TEST_WATCHDOG_S", "120", float, "a number of seconds >= 0 (0: off)")


class _Watchdog:
    """One test's watchdog. Time spent compiling a kernel module (a fresh host without precompiled objects:
    a minute or more per dtype) does not count: the limit starts again after the compile."""

    compiling = 0  # compiles in progress in this process (see _count_compiles)
    current: _Watchdog | None = None

    def __init__(self, nodeid: str, limit: float) -> None:
        self.nodeid, self.limit, self.started = nodeid, limit, time.monotonic()
        self.timer: threading.Timer | None = None
        self.done = False

    def arm(self) -> None:
        self.timer = threading.Timer(self.limit, self.expire)
        self.timer.daemon = True
        self.timer.start()
        faulthandler.dump_traceback_later(self.limit + BACKSTOP_S, exit=True, file=_REPORT_FILE)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def expire(self) -> None:
        if self.done:
            return
        if _Watchdog.compiling:
            self.arm()  # a compile is running: count from its end instead
            return
        _fire(self.nodeid, self.limit, self.started)


def _count_compiles() -> None:
    """Wrap the kernel compile so the watchdog knows when one runs (and the C backstop does not fire in
    the middle of a long compile that holds the GIL)."""
    from cute_ep.bootstrap import compile as compile_mod

    inner = compile_mod.compile_kernel
    if getattr(inner, "_watchdog_wrapped", False):
        return

    def compile_kernel(*args, **kwargs):
        _Watchdog.compiling += 1
        faulthandler.cancel_dump_traceback_later()
        try:
            return inner(*args, **kwargs)
        finally:
            _Watchdog.compiling -= 1
            dog = _Watchdog.current
            if dog is not None and not dog.done:
                dog.disarm()
                dog.arm()

    compile_kernel._watchdog_wrapped = True
    compile_mod.compile_kernel = compile_kernel


def _fire(nodeid: str, limit: float, started: float) -> None:
    """The watchdog's report: rank, test, how long, every thread's stack; then end the rank."""
    err = _REPORT_FILE
    err.write(f"\n[rank {_rank()}] WATCHDOG: {nodeid} still running after {time.monotonic() - started:.0f} s "
              f"(limit GPU_TEST_WATCHDOG_S={limit:g}); where each thread waits:\n")
    err.flush()
    faulthandler.dump_traceback(file=err, all_threads=True)
    err.write(f"[rank {_rank()}] WATCHDOG: ending this rank (exit {WATCHDOG_EXIT})\n")
    err.flush()
    for stream in (sys.stdout, sys.__stdout__, _RANK_LOG):  # pytest's report so far (os._exit flushes none)
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(WATCHDOG_EXIT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run each GPU test (setup, call, teardown) under the watchdog. pytest calls this hook for every test
    of the session, so the CPU tests (a run of all of tests/) are left alone."""
    limit = watchdog_seconds()
    if limit <= 0 or item.nodeid not in OURS:
        yield
        return
    if torch.cuda.is_available():
        _count_compiles()
    dog = _Watchdog(item.nodeid, limit)
    _Watchdog.current = dog
    dog.arm()
    try:
        yield
    finally:
        dog.done = True
        dog.disarm()
        _Watchdog.current = None


def pytest_runtest_logreport(report):
    """Print a failure as soon as it happens, with its rank. pytest prints failures only in its final
    summary, and a multi-rank launch that hangs after one rank fails (its peers wait in a collective it
    skipped) is killed by its timeout before that summary: the cause was lost."""
    if report.failed and report.nodeid in OURS:
        rank = _rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()


def launch_seed() -> int:
    """The launch's input seed offset: ``GPU_TEST_SEED`` (an integer >= 0, the same on every rank), or 0."""
    return _env_number("GPU_TEST_SEED", "0", int, "an integer >= 0")


@pytest.fixture(scope="session")
def runtime():
    from cute_ep.bootstrap.compile import ModuleRegistry
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime

    env = DistEnv.from_environ()
    # Heap: the largest configuration of the suite plus headroom (sized before NVSHMEM starts).
    rt = Runtime(
        env,
        symmetric_bytes=int(os.environ.get("CUTE_EP_TEST_HEAP_BYTES", 2 << 30)),
        timeout=timedelta(seconds=300),
    ).start()
    rt.registry = ModuleRegistry(device_id=rt.device.index)
    rt.seed = launch_seed()
    rt.add_finalizer(rt.registry.finalize_all)
    try:
        yield rt
    finally:
        rt.close()
