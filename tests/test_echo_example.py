"""examples/echo_training.py on the CPU, launched for real: torchrun with 2 ranks on the reference backend
must pass and print nothing on stderr (torch's FutureWarning for a deprecated collective included)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _launch import REPO, torchrun

EXAMPLE = REPO / "examples" / "echo_training.py"
TIMEOUT = 240

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def test_torchrun_two_ranks_pass_without_a_warning() -> None:
    proc = torchrun(EXAMPLE, 2, "--backend", "reference", "--steps", "3", timeout=TIMEOUT)
    text = f"{proc.stdout}\n{proc.stderr}"[-6000:]
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "PASS", text
    runs = [ln.split(":")[0] for ln in proc.stdout.splitlines() if ln.startswith("[reference] ")]
    assert runs == ["[reference] plain", "[reference] echo "], text
    assert "Warning" not in proc.stderr and "deprecated" not in proc.stderr, text
