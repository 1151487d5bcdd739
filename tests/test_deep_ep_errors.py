"""``cute_ep.deep_ep`` given wrong arguments at 2 gloo ranks (reference backend), as a ported DeepEP program
could pass them, on one rank or on every rank: every rank raises ValueError naming the argument and the
value, before any rank waits on another; the Buffer stays usable (the next good calls give the right
results) and ``destroy()`` returns. And a program that keeps its group and Buffer after ``destroy()`` and
``dist.destroy_process_group()`` exits 0, run after run, with gloo's worker threads stalled at every lock
(tests/_exit_checks.py), which made 10 of 10 such runs abort before ``destroy()`` waited for them.

This file is also the 2-rank worker (``worker_results``: every rank writes what it saw to
OUT_DIR/rank{r}.json, the tests assert on it); a case that leaves a rank waiting ends the launch at its
timeout, which fails the test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

E_PER_RANK, HIDDEN, TOKENS, TOPK, M = 4, 256, 12, 2, 16

# --------------------------------------------------------------------------------------------------
# the worker's side
# --------------------------------------------------------------------------------------------------


def _inputs(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(17 + rank)
    experts = E_PER_RANK * world
    idx = torch.rand(TOKENS, experts, generator=g).topk(TOPK, dim=1).indices
    idx[0, 1] = -1  # -1 (no expert) is accepted
    return dict(x=torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16), idx=idx,
                w=torch.rand(TOKENS, TOPK, generator=g), experts=experts)


def _normal(buf: Any, d: dict) -> tuple:
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(d["idx"], d["experts"])
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=d["idx"], topk_weights=d["w"])


def _good_rounds(buf: Any, d: dict) -> list[str]:
    """A normal and a low-latency round trip with good arguments; what came out wrong."""
    wrong = []
    layout = _normal(buf, d)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(d["x"], **layout)
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    dest = layout["is_token_in_rank"].sum(1, keepdim=True)  # 1 or 2 copies: the sum is exact in bf16
    if not torch.equal(out, (d["x"].float() * dest).to(torch.bfloat16)):
        wrong.append("combine")
    if not torch.equal(out_w, torch.where(d["idx"] >= 0, d["w"], torch.zeros(()))):
        wrong.append("combine's weights")
    recv, _, ll_handle, _, _ = buf.low_latency_dispatch(d["x"], d["idx"], M, d["experts"], use_fp8=False)
    got = buf.low_latency_combine(recv, d["idx"], d["w"], ll_handle)[0]
    acc = torch.zeros(TOKENS, HIDDEN)
    for k in range(TOPK):  # k ascending, fp32, one rounding
        acc = torch.where(d["idx"][:, k : k + 1] >= 0, acc + d["w"][:, k : k + 1] * d["x"].float(), acc)
    if not torch.equal(got, acc.to(torch.bfloat16)):
        wrong.append("low_latency_combine")
    return wrong


def _bad_ids(value: int) -> Callable[[Any, dict, bool], None]:
    def call(buf: Any, d: dict, bad: bool) -> None:
        layout = _normal(buf, d)
        if bad:
            layout["topk_idx"] = d["idx"].clone()
            layout["topk_idx"][3, 0] = value
        buf.dispatch(d["x"], **layout)
    return call


def _combine_rows(buf: Any, d: dict, bad: bool) -> None:
    recv_x, _, _, _, handle, _ = buf.dispatch(d["x"], **_normal(buf, d))
    buf.combine(torch.zeros(1000, HIDDEN, dtype=torch.bfloat16) if bad else recv_x, handle)


def _ll_combine_hidden(buf: Any, d: dict, bad: bool) -> None:
    recv, _, handle, _, _ = buf.low_latency_dispatch(d["x"], d["idx"], M, d["experts"], use_fp8=False)
    buf.low_latency_combine(recv[:, :, :128].contiguous() if bad else recv, d["idx"], d["w"], handle)


def _ll_dispatch_ids(buf: Any, d: dict, bad: bool) -> None:
    idx = d["idx"].clone()
    if bad:
        idx[2, 1] = -5
    buf.low_latency_dispatch(d["x"], idx, M, d["experts"], use_fp8=False)


def _dispatch_float64(buf: Any, d: dict, bad: bool) -> None:
    buf.dispatch(d["x"].double() if bad else d["x"], **_normal(buf, d))


def _combine_float64(buf: Any, d: dict, bad: bool) -> None:
    recv_x, _, _, _, handle, _ = buf.dispatch(d["x"], **_normal(buf, d))
    buf.combine(recv_x.double() if bad else recv_x, handle)


CASES: dict[str, tuple[Callable[[Any, dict, bool], None], str, str]] = {
    # name: (the call, with its wrong argument where ``bad``; the argument's name; the wrong value as the
    # messages must show it)
    "dispatch topk_idx = E": (_bad_ids(E_PER_RANK * 2), "topk_idx", "got 8 at [3, 0]"),
    "dispatch topk_idx = -5": (_bad_ids(-5), "topk_idx", "got -5 at [3, 0]"),
    "dispatch topk_idx = 10**6": (_bad_ids(10**6), "topk_idx", "got 1000000 at [3, 0]"),
    "combine x rows": (_combine_rows, "x", f"got [1000, {HIDDEN}]"),
    "low_latency_combine x hidden": (_ll_combine_hidden, "x", f"got [{E_PER_RANK}, {2 * M}, 128]"),
    "low_latency_dispatch topk_idx = -5": (_ll_dispatch_ids, "topk_idx", "-5"),
    "dispatch x float64 on one rank": (_dispatch_float64, "x", "torch.float64"),
    "combine x float64": (_combine_float64, "x", "got torch.float64"),
}
WHERE = {"one": [1], "all": [0, 1]}  # the ranks given the wrong argument
# every case on one rank and on all, but a float64 x on every rank: a valid dispatch (as DeepEP's), whose
# combine is the case "combine x float64"
PAIRS = [(c, w) for c in CASES for w in WHERE if (c, w) != ("dispatch x float64 on one rank", "all")]


def run_cases(group: Any) -> dict:
    """Every case, the wrong argument on rank 1 and then on every rank: what each call raised, and what the
    next good round trip gave; then destroy()."""
    import cute_ep.deep_ep as deep_ep
    from cute_ep.collectives import world_of

    rank, world = world_of(group)
    d = _inputs(rank, world)
    buf = deep_ep.Buffer(group, explicitly_destroy=True)
    seen: dict[str, Any] = {"before": _good_rounds(buf, d)}
    for name, where in PAIRS:
        try:
            CASES[name][0](buf, d, rank in WHERE[where])
            raised, message = None, ""
        except Exception as exc:  # noqa: BLE001 (recorded: the test asserts on it)
            raised, message = type(exc).__name__, str(exc)
        seen[f"{name} / {where}"] = dict(raised=raised, message=message, after=_good_rounds(buf, d))
    buf.destroy()
    seen["destroyed"] = buf.group is None
    return seen


def _worker_results(rt: Any) -> dict:
    return {"rank": rt.env.rank, "seen": run_cases(rt.group)}


# --------------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

KEEP_NAMES = """
import os, socket, sys
import torch
import torch.distributed as dist
import cute_ep.deep_ep as deep_ep

if "RANK" not in os.environ:  # a world of one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo")
group = dist.new_group(list(range(dist.get_world_size())))
sys.path.insert(0, {tests!r})
from test_deep_ep_errors import _good_rounds, _inputs

buffer = deep_ep.Buffer(group, explicitly_destroy=True)
wrong = _good_rounds(buffer, _inputs(dist.get_rank(), dist.get_world_size()))
print(f"rank {{dist.get_rank()}}: {{'wrong ' + str(wrong) if wrong else 'right'}}", flush=True)
buffer.destroy()
dist.destroy_process_group()
# the program ends holding group and buffer
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from _launch import worker_results

    return worker_results(__file__, 2, tmp_path_factory.mktemp("deep_ep_errors"), timeout=150)


@pytest.mark.parametrize(("case", "where"), PAIRS)
def test_every_rank_raises_and_the_buffer_stays_usable(ranks: list[dict], case: str, where: str) -> None:
    _, argument, value = CASES[case]
    for res in ranks:  # rank 0 names rank 1's argument and value where only rank 1's is wrong
        got = res["seen"][f"{case} / {where}"]
        assert got["raised"] == "ValueError", (res["rank"], got)
        assert argument in got["message"] and value in got["message"], (res["rank"], got)
        assert got["after"] == [], (res["rank"], got)  # the good round trip after it was right


def test_good_calls_before_and_destroy_after(ranks: list[dict]) -> None:
    for res in ranks:
        assert res["seen"]["before"] == [], res
        assert res["seen"]["destroyed"] is True, res


def test_messages_say_what_is_accepted(ranks: list[dict]) -> None:
    seen = {r["rank"]: r["seen"] for r in ranks}
    own = seen[1]["dispatch topk_idx = E / one"]["message"]
    assert "must be expert ids in [0, 8) or -1 (no expert)" in own
    assert "rank 1: topk_idx values" in seen[0]["dispatch topk_idx = E / one"]["message"]
    mixed = seen[0]["dispatch x float64 on one rank / one"]["message"]
    assert "x's dtype and hidden size must be the same on every rank" in mixed and "bfloat16" in mixed
    dtype = seen[0]["combine x float64 / all"]["message"]
    assert dtype.startswith("x must be bfloat16, float16 or float32") and "got [" not in dtype  # not a shape


def test_a_program_keeping_its_names_exits_cleanly(tmp_path: Path) -> None:
    """The names kept to the end, gloo's workers stalled 2 ms at every lock: every run exits 0 and prints
    right results (3 runs in a world of one, 2 of 2 ranks; without ``destroy()`` waiting for the workers
    10 of 10 aborted)."""
    from _exit_checks import STALL_MS_VAR, exit_env, failed_runs, run_forked, stall_preload
    from _launch import REPO

    preload = stall_preload(tmp_path)
    if preload is None:
        pytest.skip("no C compiler to build the gloo stall library")
    script = tmp_path / "keep_names.py"
    script.write_text(KEEP_NAMES.format(tests=str(Path(__file__).parent)))
    env = exit_env(LD_PRELOAD=preload, **{STALL_MS_VAR: "2"})
    for world, runs in ((1, 3), (2, 2)):
        procs = run_forked(script, runs, world, cwd=REPO, timeout=240, env=env)
        bad = failed_runs(procs, lambda out, w=world: out.count(": right") == w)
        assert not bad, f"world {world}: {len(bad)} of {runs} runs failed:\n" + "\n".join(bad)


if __name__ == "__main__":
    from _launch import gloo_worker_main  # tests/ is sys.path[0] when run as a script

    sys.exit(gloo_worker_main(_worker_results))
