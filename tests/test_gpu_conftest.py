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
