"""examples/deep_ep_drop_in.py on the CPU: the DeepEP-API token dispatcher on ``cute_ep.deep_ep`` (reference
backend over gloo), launched for real in both modes as a plain process (a world of one) and under torchrun
with 2 ranks (gloo's workers stalled at every lock, which makes an abort at exit certain if a process group
outlives the run: the example ends without ``os._exit``); a check that can fail (zero tolerance) and a
module that does not import."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _exit_checks import STALL_MS_VAR, stall_preload
from _launch import REPO, assert_argument_error, example_rank_lines, run_single, torchrun

EXAMPLE = REPO / "examples" / "deep_ep_drop_in.py"
TIMEOUT = 180

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.mark.parametrize("mode", ["normal", "low-latency"])
def test_plain_python_is_a_world_of_one(mode: str) -> None:
    lines, text = example_rank_lines(run_single(EXAMPLE, "--mode", mode, timeout=TIMEOUT), world=1)
    assert "[cute_ep.deep_ep, " in lines[0] and "MISMATCH" not in text, text


@pytest.mark.parametrize("mode", ["normal", "low-latency"])
def test_torchrun_two_ranks_pass_and_exit_cleanly(mode: str, tmp_path) -> None:
    preload = stall_preload(tmp_path)  # None without a C compiler: then the plain launch
    stall = {"LD_PRELOAD": preload, STALL_MS_VAR: "2"} if preload else {}
    proc = torchrun(EXAMPLE, 2, "--mode", mode, timeout=TIMEOUT, **stall)
    lines, text = example_rank_lines(proc, world=2)  # exit status 0 included
    assert not any("MISMATCH" in ln for ln in lines), text


def test_the_check_can_fail() -> None:
    """With zero tolerance the bf16 rounding of the rows is a mismatch: FAIL, exit status 1."""
    proc = run_single(EXAMPLE, "--rtol", "0", "--atol", "0", timeout=TIMEOUT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "FAIL" and "MISMATCH" in proc.stdout


def test_a_module_that_does_not_import_is_a_usage_error() -> None:
    proc = run_single(EXAMPLE, "--module", "no_such_deep_ep_module", timeout=TIMEOUT)
    assert_argument_error(proc, "--module no_such_deep_ep_module does not import")
