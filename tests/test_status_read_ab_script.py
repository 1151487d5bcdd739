"""scripts/status_read_ab.py needs GPUs to measure; here: its help and its argument errors (exit 2)."""

from __future__ import annotations

import pytest
from _launch import REPO, assert_argument_error, run_single

SCRIPT = REPO / "scripts" / "status_read_ab.py"


@pytest.mark.parametrize("argv, message", [
    (("--tokens", "1,x"), "--tokens must be a comma-separated list of integers"),
    (("--tokens", "70000"), "need --tokens values <= 65536"),
    (("--num-sms", "0"), "--num-sms must list integers >= 1"),
    (("--iters", "0"), "need --tokens values <= 65536, --num-sms >= 1 and --iters >= 1"),
])
def test_bad_arguments_exit_2_naming_the_constraint(argv, message):
    assert_argument_error(run_single(SCRIPT, *argv, timeout=120), message)


def test_help_names_the_three_variants():
    proc = run_single(SCRIPT, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps the description
    assert "the status mirror against the plain read, with dispatch(sync=False)" in text
