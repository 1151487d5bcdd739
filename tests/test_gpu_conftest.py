"""tests/gpu/conftest.py on the CPU: a failure is printed when it happens, with its rank, so a GPU launch
that hangs after one rank failed (and is killed by its timeout before pytest's summary) still shows why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from _launch import REPO

HANGS_AFTER_A_FAILURE = '''
import time


def test_fails():
    assert 1 + 1 == 3, "the reason that must reach the log"


def test_then_hangs():
    time.sleep(120)
'''


def test_a_failure_is_printed_before_a_later_hang(tmp_path):
    shutil.copy(REPO / "tests" / "gpu" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hang.py").write_text(HANGS_AFTER_A_FAILURE)
    log = tmp_path / "log.txt"
    env = {**os.environ, "RANK": "3"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                                 str(tmp_path)], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "FAILED" not in log.read_text():
            time.sleep(0.2)
        time.sleep(1.0)  # well inside test_then_hangs
        still_running = proc.poll() is None
        proc.kill()  # what a launcher's timeout does
        proc.wait()
    text = log.read_text()
    assert still_running, text
    assert "[rank 3] FAILED test_hang.py::test_fails (call):" in text, text
    assert "the reason that must reach the log" in text, text
    assert "1 failed" not in text  # no summary came: the line above is all a killed launch leaves


HANGS = '''
import re
import time


def test_passes():
    pass


def test_waits_forever():
    time.sleep(120)  # a stuck collective, seen from Python


def test_spins_holding_the_gil():
    re.match(r"(a+)+$", "a" * 64 + "b")  # C code that never releases the GIL
'''


def _run_hang(tmp_path, test: str, **env_extra: str) -> tuple[int, float, str]:
    shutil.copy(REPO / "tests" / "gpu" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hang.py").write_text(HANGS)
    env = {**os.environ, "RANK": "2", "GPU_TEST_LOG_DIR": str(tmp_path / "logs"), **env_extra}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "test_hang.py::test_passes", f"test_hang.py::{test}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=90, env=env)
    return proc.returncode, time.monotonic() - t0, proc.stderr


def test_the_watchdog_ends_a_hung_test_with_the_rank_the_test_and_where_it_waits(tmp_path):
    rc, took, err = _run_hang(tmp_path, "test_waits_forever", GPU_TEST_WATCHDOG_S="2")
    assert rc == 124, err
    assert took < 30, took  # seconds after the limit, not the 120 s sleep or a launcher's timeout
    assert "[rank 2] WATCHDOG: test_hang.py::test_waits_forever still running after 2 s" in err, err
    assert 'test_hang.py", line 11 in test_waits_forever' in err, err  # where the main thread waits
    assert (tmp_path / "logs" / "rank2.log").exists()  # pytest's own report: this rank's log, not stdout


def test_the_backstop_ends_a_test_that_holds_the_gil(tmp_path):
    rc, took, err = _run_hang(tmp_path, "test_spins_holding_the_gil", GPU_TEST_WATCHDOG_S="1",
                              GPU_TEST_WATCHDOG_BACKSTOP_S="2")
    assert rc != 0 and took < 40, (rc, took, err)
    assert "Timeout (0:00:03)!" in err, err  # faulthandler's dump: the Python watchdog could not run
    assert "in test_spins_holding_the_gil" in err, err


def test_a_kernel_compile_does_not_count_against_the_watchdog(monkeypatch):
    import importlib.util

    import cute_ep.bootstrap.compile as compile_mod

    spec = importlib.util.spec_from_file_location("gpu_conftest", REPO / "tests" / "gpu" / "conftest.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    fired = []
    monkeypatch.setattr(conf, "_fire", lambda *args: fired.append(args))
    monkeypatch.setattr(conf, "BACKSTOP_S", 60.0)
    monkeypatch.setattr(compile_mod, "compile_kernel", lambda *a: time.sleep(1.5) or "compiled")
    conf._count_compiles()
    dog = conf._Watchdog("t::compiles", 0.5)
    conf._Watchdog.current = dog
    dog.arm()
    try:
        assert compile_mod.compile_kernel() == "compiled"  # 1.5 s: three limits long
        assert fired == []
        time.sleep(1.0)  # the limit runs again from the compile's end
        assert [f[0] for f in fired] == ["t::compiles"]
    finally:
        dog.done = True
        dog.disarm()
        conf._Watchdog.current = None


def test_the_watchdog_leaves_tests_outside_its_folder_alone(tmp_path):
    """A run of all of tests/ loads tests/gpu/conftest.py too: its watchdog must not end a slow CPU test."""
    (tmp_path / "gpu").mkdir()
    shutil.copy(REPO / "tests" / "gpu" / "conftest.py", tmp_path / "gpu" / "conftest.py")
    (tmp_path / "gpu" / "test_in_gpu.py").write_text("def test_quick():\n    pass\n")
    (tmp_path / "test_cpu.py").write_text("import time\n\n\ndef test_slow():\n    time.sleep(2.5)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "GPU_TEST_WATCHDOG_S": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout and "WATCHDOG" not in proc.stderr  # the GPU test: no CUDA


def test_the_launch_seed_and_the_watchdog_limit_come_from_the_environment(monkeypatch):
    """GPU_TEST_SEED (default 0) offsets every GPU test's input seeds; it and GPU_TEST_WATCHDOG_S must be
    numbers >= 0, else pytest stops with a usage error naming the variable and its value."""
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("gpu_conftest", REPO / "tests" / "gpu" / "conftest.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    monkeypatch.delenv("GPU_TEST_SEED", raising=False)
    monkeypatch.delenv("GPU_TEST_WATCHDOG_S", raising=False)
    assert conf.launch_seed() == 0 and conf.watchdog_seconds() == 120.0
    monkeypatch.setenv("GPU_TEST_SEED", "123456789")
    monkeypatch.setenv("GPU_TEST_WATCHDOG_S", "0")
    assert conf.launch_seed() == 123456789 and conf.watchdog_seconds() == 0.0
    for name, bad, what in (("GPU_TEST_SEED", "-3", "an integer >= 0"),
                            ("GPU_TEST_SEED", "1.5", "an integer"),
                            ("GPU_TEST_WATCHDOG_S", "soon", "a number of seconds")):
        monkeypatch.setenv(name, bad)
        read = conf.launch_seed if name == "GPU_TEST_SEED" else conf.watchdog_seconds
        with pytest.raises(pytest.UsageError, match=f"{name} must be {what}.*got '{bad}'"):
            read()
