"""scripts/decode_breakdown.py needs GPUs to measure; here: its help and its argument errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys

from _launch import REPO

SCRIPT = REPO / "scripts" / "decode_breakdown.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help_names_what_is_timed():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "Where a dispatch / combine call's GPU time goes" in proc.stdout


def test_bad_tokens_exit_2_naming_the_argument():
    proc = _run("--tokens", "128,zero")
    assert proc.returncode == 2 and "--tokens" in proc.stderr, proc.stderr
