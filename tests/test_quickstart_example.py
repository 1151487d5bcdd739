"""examples/quickstart.py on the CPU: launched for real (torchrun with 2 ranks on the reference and the
all-to-all backends, and a plain single process), and its check shown to reject wrong outputs
(imported from the file and called in-process, a world of one without a process group).

On the reference backend every run must also end cleanly, 20 runs in a world of one and 10 at 2 ranks (a few
at a time, output to pipes): exit status 0, PASS, every rank's line. The example ends like any program,
through the interpreter's exit, which gloo's worker threads once aborted in some runs (tests/_exit_checks.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _exit_checks import failed_runs, run_forked
from _launch import REPO, example_rank_lines, torchrun
from torch import Tensor

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.kernels.config import EpConfig
from cute_ep.reference_backend import ReferenceEpBuffer

EXAMPLE = REPO / "examples" / "quickstart.py"
TIMEOUT = 120
PARALLEL = 2  # launches at a time (2 cores: more only queue)
REPEAT_TIMEOUT = 300  # a run among others on a loaded machine

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _assert_passed(proc: subprocess.CompletedProcess, world: int) -> None:
    rank_lines, text = example_rank_lines(proc, world)  # one line per rank from rank 0
    assert not any("MISMATCH" in ln for ln in rank_lines), text


def test_torchrun_two_ranks_pass_on_the_all_to_all_backend() -> None:
    _assert_passed(torchrun(EXAMPLE, 2, "--backend", "a2a", timeout=TIMEOUT), world=2)


def _passed(world: int) -> Callable[[str], bool]:
    """Whether an example's stdout is a passing run of ``world`` ranks: a line per rank, no MISMATCH, PASS."""

    def ok(out: str) -> bool:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        rank_lines = [ln for ln in lines if "rows received" in ln]
        return (bool(lines) and lines[-1] == "PASS" and len(rank_lines) == world
                and not any("MISMATCH" in ln for ln in rank_lines))

    return ok


def test_plain_python_ends_cleanly_20_times_in_a_world_of_one() -> None:
    procs = run_forked(EXAMPLE, 20, 1, "--backend", "reference", cwd=REPO, timeout=REPEAT_TIMEOUT,
                       parallel=PARALLEL)
    bad = failed_runs(procs, _passed(1))
    assert not bad, f"{len(bad)} of 20 runs failed:\n" + "\n".join(bad)


def test_torchrun_two_ranks_end_cleanly_10_times_on_the_reference_backend() -> None:
    procs = run_forked(EXAMPLE, 10, 2, "--backend", "reference", cwd=REPO, timeout=REPEAT_TIMEOUT,
                       parallel=PARALLEL)
    bad = failed_runs(procs, _passed(2))
    assert not bad, f"{len(bad)} of 10 runs failed:\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------
# the example's check, in-process
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example imported from its file (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location("quickstart_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def world_of_one(example: ModuleType) -> SimpleNamespace:
    """A round trip of the example on a ReferenceEpBuffer in a world of one (no process group)."""
    env = DistEnv(rank=0, world_size=1, local_rank=0, physical_local_world_size=1, local_world_size=1)
    runtime = SimpleNamespace(env=env, device=torch.device("cpu"), cpu_group=None)
    args = SimpleNamespace(tokens=16, hidden=64, experts=8, topk=3, dtype="bfloat16", seed=1)
    cfg = EpConfig(world_size=1, local_world_size=1, num_experts=args.experts, topk=args.topk,
                   hidden=args.hidden, dtype=torch.bfloat16, max_tokens=args.tokens)  # fmt: skip
    buf = ReferenceEpBuffer(runtime, cfg)
    x, idx, w = example.make_inputs(0, args, runtime.device)
    out, num_recv = example.round_trip(buf, x, idx, w, 0)
    assert num_recv == args.tokens * args.topk  # every row stays on the only rank
    return SimpleNamespace(buf=buf, x=x, idx=idx, w=w, out=out, num_experts=cfg.num_experts)


def _one_ulp_up(out: Tensor) -> Tensor:
    bad = out.clone()
    bad.view(torch.int16)[3, 5] += 1  # the next bf16 value: the smallest possible error
    return bad


def _one_nan(out: Tensor) -> Tensor:
    bad = out.clone()
    bad[0, 0] = float("nan")
    return bad


def _sign_flipped(out: Tensor) -> Tensor:
    bad = out.clone()
    bad.view(torch.int16)[1, 2] ^= -0x8000  # the sign bit (a 0.0 would become -0.0)
    return bad


WRONG_OUTPUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "one ulp": _one_ulp_up,
    "one NaN": _one_nan,
    "a sign": _sign_flipped,
    "a token missing": lambda out: out[:-1],
    "float32": lambda out: out.float(),
}


def test_check_accepts_the_round_trip(example: ModuleType, world_of_one: SimpleNamespace) -> None:
    r = world_of_one
    assert example.check(r.out, r.x, r.idx, r.w, r.num_experts, None) == (True, 0.0)


@pytest.mark.parametrize("name", list(WRONG_OUTPUTS))
def test_check_rejects_a_wrong_output(example: ModuleType, world_of_one: SimpleNamespace, name: str) -> None:
    r = world_of_one
    ok, diff = example.check(WRONG_OUTPUTS[name](r.out), r.x, r.idx, r.w, r.num_experts, None)
    assert not ok
    if name == "one ulp":
        assert 0 < diff < 0.1


def test_check_rejects_a_wrong_expert(example: ModuleType, world_of_one: SimpleNamespace) -> None:
    """Combining the received rows unchanged (identity expert instead of the toy expert) must fail."""
    r = world_of_one
    res = r.buf.dispatch(r.x, r.idx, r.w)
    y = r.buf.expert_output(res.num_recv)
    y.copy_(res.recv_x)
    out = r.buf.combine(y, res.handle)
    ok, diff = example.check(out, r.x, r.idx, r.w, r.num_experts, None)
    assert not ok and diff > 0
