"""examples/moe_layer.py on the CPU, launched for real: a plain single process (a world of one) and
torchrun with 2 ranks, both on the reference backend; each rank's line must report equal outputs and
parameter gradients and rank 0 must print PASS."""

from __future__ import annotations

import subprocess

import pytest
import torch.distributed as dist
from _launch import REPO, example_rank_lines, run_single, torchrun

EXAMPLE = REPO / "examples" / "moe_layer.py"
TIMEOUT = 240

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _assert_passed(proc: subprocess.CompletedProcess, world: int) -> None:
    rank_lines, text = example_rank_lines(proc, world)
    assert all("gradients equal" in ln and "MISMATCH" not in ln for ln in rank_lines), text
    assert all("(0 padding rows)" not in ln for ln in rank_lines), text  # the buffer had padding


def test_plain_python_is_a_world_of_one() -> None:
    _assert_passed(run_single(EXAMPLE, "--backend", "reference", timeout=TIMEOUT), world=1)


def test_torchrun_two_ranks_pass() -> None:
    _assert_passed(torchrun(EXAMPLE, 2, "--backend", "reference", timeout=TIMEOUT), world=2)
