"""examples/moe_layer.py on the CPU, launched for real: a plain single process (a world of one) and
torchrun with 2 ranks, both on the reference backend; each rank's line must report equal outputs and
parameter gradients and rank 0 must print PASS, after saying what is compared with what, why the input
gradient's tolerance is what it is, and what the padding rows are."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch.distributed as dist
from _launch import REPO, example_rank_lines, run_single, torchrun

EXAMPLE = REPO / "examples" / "moe_layer.py"
TIMEOUT = 240

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

RANK_LINE = re.compile(r"rank \d+: (\d+) tokens, (\d+) rows received \+ (\d+) padding rows; output and "
                       r"parameter gradients equal, input gradient off by (\S+) x its largest value "
                       r"\(<= 0\.0469\)$")


def _assert_passed(proc: subprocess.CompletedProcess, world: int) -> None:
    rank_lines, text = example_rank_lines(proc, world)
    assert all("gradients equal" in ln and "MISMATCH" not in ln for ln in rank_lines), text
    padding = [int(RANK_LINE.search(ln).group(3)) if RANK_LINE.search(ln) else None for ln in rank_lines]
    assert all(p is not None and p > 0 for p in padding), text  # the buffer had padding


@pytest.fixture(scope="module")
def world_of_one() -> subprocess.CompletedProcess:
    return run_single(EXAMPLE, "--backend", "reference", timeout=TIMEOUT)


def test_plain_python_is_a_world_of_one(world_of_one) -> None:
    _assert_passed(world_of_one, world=1)


def test_the_output_says_what_is_compared_why_the_tolerance_and_what_padding_rows_are(world_of_one) -> None:
    out = world_of_one.stdout
    assert "against the same layer evaluated densely in torch, on every rank's tokens in one process" in out
    assert ("output and parameter gradients (experts, router, shared expert): equal, the same arithmetic in "
            "the same order") in out
    # the input gradient's tolerance: (K + 2) bf16 epsilons, K = 4 (2**-7 * 6 = 0.0469)
    assert ("input gradient: largest difference <= 0.0469 x its largest value, (K + 2) x the epsilon of "
            "bfloat16 with K = --topk 4") in out
    # the default max_tokens is 64 + 16 = 80; every token may send a row to each of the 4 local experts
    assert ("padding rows: rows of the worst-case receive buffer (320 per rank) that no token filled; "
            "dispatch without a host sync (no --sync) hands the experts the whole buffer: the grouped GEMMs "
            "skip its padding rows, the SwiGLU (--swiglu auto: torch) skips them too") in out
    (line,) = [ln for ln in out.splitlines() if "rows received" in ln]
    tokens, rows, padding, off = RANK_LINE.search(line).groups()
    assert int(rows) + int(padding) == 320 and int(tokens) == 64 and float(off) <= 0.0469, line


def test_torchrun_two_ranks_pass() -> None:
    _assert_passed(torchrun(EXAMPLE, 2, "--backend", "reference", timeout=TIMEOUT), world=2)
