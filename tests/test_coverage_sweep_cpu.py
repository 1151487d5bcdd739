"""The coverage sweep (``cute_ep.validators.sweep``, run on GPUs by tests/gpu/test_coverage_sweep.py)
proven on the CPU: the table covers what it promises and configures in every launch shape of the GPU
tests, its inputs are what the cases say, and the runner, over ``ReferenceEpBuffer`` (the torch
references on gloo), passes every case in a world of one (in process) and of two ranks, with the same
report on every rank. The checks can fail: results tampered with after the dispatch (a received row, an
FP8 scale, a rank-layout weight, the tokens per expert) or the combine (one element of the reduced
combine) fail the case on every rank, naming the field, without a hang.

This file is also the two ranks' worker (``python -m torch.distributed.run --nproc-per-node 2
tests/test_coverage_sweep_cpu.py OUT_DIR``): every rank runs every case and the tampered ones and writes
its reports to OUT_DIR/rank{r}.json; the tests assert on them.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cute_ep.bootstrap.dist_env import possible_route_classes
from cute_ep.kernels.config import LAYOUT_SMEM_INTS, MAX_TOPK
from cute_ep.reference import reference_layout
from cute_ep.validators import sweep
from cute_ep.validators.checks import route_counts_of

WORLD = 2
SEED = 20261127
"""The two-rank launch's seed offset (the GPU launches draw one per launch: GPU_TEST_SEED)."""
LAUNCH_WORLDS = (1, 2, 4, 8, 16)
"""The world sizes of scripts/run_gpu_tests.sh's launches (16: "double" on an 8-GPU host)."""

# name: (case id, what is tampered with, on which rank, the failed check, text its message must hold)
TAMPERED = {
    "row": ("k64-expert-pull-bf16-fp8-h256-e64", "row", 1, "dispatch", "field recv_x differs"),
    "fp8-scale": ("k9-expert-pull-bf16-fp8-h1152-e288", "scale", 0, "dispatch", "field recv_x differs"),
    "rank-weight": ("k64-rank-reduced-bf16-fp8-h256-e64", "weight", 1, "rank dispatch",
                    "field recv_topk_weights differs"),
    "tokens-per-expert": ("k16-expert-reduced-bf16-h1000-e128-hot_first-kernel", "tpe", 0, "layout",
                          "tokens_per_expert[0]"),
    "reduced-output": ("k2-expert-reduced-bf16-h8-e64", "combine", 1, "combine reduced", "expected"),
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the worker's side (every rank of a gloo world)
# --------------------------------------------------------------------------------------------------


def _reference_factory(rt: Any, tamper: tuple[str, int] | None = None):
    """cfg -> a ReferenceEpBuffer on ``rt``, or with ``tamper`` = (what, rank) one whose results are
    tampered with on that rank, in the first call that received rows there."""
    from cute_ep.reference_backend import ReferenceEpBuffer

    class Tampering(ReferenceEpBuffer):
        tampered = False

        def dispatch(self, *args: Any, **kw: Any):
            res = super().dispatch(*args, **kw)
            what, on = tamper
            if self.rank != on or self.tampered or res.num_recv == 0 or what == "combine":
                return res
            if what == "row":
                res.recv_x[0, 5] = res.recv_x[0, 5] * 2 + 1
            elif what == "scale":
                res.recv_scales[0, 0] = res.recv_scales[0, 0] * 2
            elif what == "weight":
                k = int(torch.nonzero(res.recv_topk_idx[0] >= 0)[0])
                res.recv_topk_weights[0, k] += 0.5
            elif what == "tpe":
                res.tokens_per_expert[0] += 1
            type(self).tampered = True
            return res

        def combine(self, y: Any, handle: Any, algorithm: str | None = None):
            out = super().combine(y, handle, algorithm)
            what, on = tamper
            mine = what == "combine" and self.rank == on and not self.tampered
            if mine and algorithm == "reduced" and out.numel():
                out[0, 0] = out[0, 0] * 2 + 1
                type(self).tampered = True
            return out

    if tamper is None:
        return lambda cfg: ReferenceEpBuffer(rt, cfg), None
    Tampering.tampered = False
    return lambda cfg: Tampering(rt, cfg), Tampering


def _context(rt: Any) -> sweep.SweepContext:
    env = rt.env
    device = rt.device if rt.device is not None else torch.device("cpu")
    return sweep.SweepContext(env.rank, env.world_size, env.local_world_size, rt.cpu_group, device, SEED)


def _report(rep: sweep.CaseReport) -> dict:
    return {"failures": rep.failures,
            "calls": [[c.label, c.tokens, c.num_recv, c.checks] for c in rep.calls]}  # fmt: skip


def _worker(rt: Any) -> dict:
    ctx = _context(rt)
    by_id = {c.id: c for c in sweep.CASES}
    cases, times = {}, {}
    for case in sweep.CASES:
        start = time.perf_counter()
        make, _ = _reference_factory(rt)
        cases[case.id] = _report(sweep.run_case(make, case, ctx))
        times[case.id] = time.perf_counter() - start
    tampered = {}
    for name, (case_id, what, on, _, _) in TAMPERED.items():
        make, cls = _reference_factory(rt, (what, on))
        rep = sweep.run_case(make, by_id[case_id], ctx)
        tampered[name] = {**_report(rep), "tampered_here": bool(cls.tampered)}
    return {"rank": ctx.rank, "cases": cases, "times": times, "tampered": tampered}


# --------------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from _launch import worker_results

    return worker_results(__file__, WORLD, tmp_path_factory.mktemp("sweep2"), timeout=180)


needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process tests run on small tensors: one torch thread (a second one only adds waits on a busy
    machine; the launched ranks get OMP_NUM_THREADS=1 from tests/_launch.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_table_covers_the_issue():
    cases = sweep.CASES
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), Counter(ids).most_common(3)
    assert len(cases) <= 20
    for k in (1, 2, 8, 9, 16, 32, 33, 64):
        for layout in ("expert", "rank"):
            assert any(c.topk == k and c.layout == layout for c in cases), (k, layout)
    for combine in ("pull", "reduced"):
        assert sum(c.topk > 8 and c.combine == combine for c in cases) >= 2, combine
    for k in (9, 33, 64):
        assert any(c.topk == k and c.fp8 for c in cases), k
    for layout in ("expert", "rank"):
        assert any(c.fp8 and c.layout == layout and c.topk > 8 for c in cases), layout
    sixteen_bytes = {(c.dtype, c.hidden) for c in cases if c.hidden * c.dtype.itemsize == 16}
    assert sixteen_bytes == {(torch.float32, 4), (torch.bfloat16, 8)}
    assert 2 <= sum(c.hidden == 7168 for c in cases) <= 3
    assert any(c.hidden & (c.hidden - 1) for c in cases)  # not a power of two
    assert any(c.hidden & (c.hidden - 1) and c.fp8 for c in cases)
    assert sum(c.num_experts == 288 for c in cases) >= 4
    assert all(0 in c.tokens for c in cases)  # a rank without tokens in every case
    assert all(c.max_tokens <= 64 for c in cases if c.max_tokens != 128)
    assert any(c.routing == "hot_set" and c.topk == 1 for c in cases)  # all tokens on one expert
    for routing in ("hot_set", "hot_first"):
        for layout in ("expert", "rank"):
            assert any(c.routing == routing and c.layout == layout for c in cases), (routing, layout)
    assert {call.algorithm for c in cases for call in c.calls} == {None, "per_pair", "put_warp"}
    assert any(call.algorithm for c in cases if c.topk > 32 for call in c.calls)
    assert any(not c.fold for c in cases) and all(c.topk <= MAX_TOPK for c in cases)


def test_every_case_configures_in_every_launch_shape():
    """EpConfig accepts every case at every world size and node split of the launches, the FP8 calls have
    a hidden size FP8 takes, and no case is skipped: every rank runs all of them."""
    assert sweep.world_sizes_of(sweep.CASES, LAUNCH_WORLDS) == {r: [] for r in LAUNCH_WORLDS}
    for case in sweep.CASES:
        assert case.combine in sweep.COMBINES[case.layout], case.id
        for world in LAUNCH_WORLDS:
            for local in {1, 2, world // 2 or 1, world}:
                if world % local:
                    continue
                cfg = sweep.case_config(case, world, local, num_sms=16)
                assert cfg.topk == case.topk and cfg.max_tokens == case.max_tokens
                assert cfg.combine_algorithm == ("reduced" if case.combine == "reduced" else "pull")
                assert (cfg.layout_in_dispatch == 0) == (not case.fold)
                if case.fp8:
                    cfg.check_fp8()
                if case.layout == "rank":
                    assert 2 * cfg.num_experts + world <= LAYOUT_SMEM_INTS
                # the GPU tests' symmetric heap is 2 GiB a rank (tests/gpu/conftest.py)
                assert cfg.symmetric_bytes() < 600 * 2**20, (case.id, world, local)


@pytest.mark.parametrize("seed", [0, 1, 987654321])
def test_coverage_cases_reach_every_route_class(seed):
    """The cases that require coverage send pairs over every route class their launch allows, in every
    call of every launch shape (their inputs are a function of the case, the call, the rank and the
    launch's seed offset: checked here, for a few offsets, instead of on the GPUs)."""
    for case in (c for c in sweep.CASES if c.coverage):
        for world in LAUNCH_WORLDS:
            for call in range(len(case.calls)):
                idxs = [sweep.case_inputs(case, r, world, call, seed=seed)[1] for r in range(world)]
                layout = reference_layout(idxs, case.num_experts)
                for local in {1, 2, world // 2 or 1, world}:
                    if world % local == 0:
                        counts = route_counts_of(layout, local)
                        missing = [c for c in possible_route_classes(world, local) if not counts[c]]
                        assert not missing, (case.id, world, local, call, missing)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_inputs(world):
    """Ids distinct in every token and in range, the hot routings' shared experts the same on every rank,
    inputs a function of (case, call, rank), and the world never empty as a whole."""
    for case in sweep.CASES:
        for call in range(len(case.calls)):
            counts = [sweep.tokens_of(case, r, world, call) for r in range(world)]
            assert any(counts) and max(counts) <= case.max_tokens, (case.id, counts)
            firsts, sets = set(), set()
            for rank in range(world):
                x, idx, w = sweep.case_inputs(case, rank, world, call)
                assert x.shape == (counts[rank], case.hidden) and x.dtype == case.dtype
                assert idx.shape == w.shape == (counts[rank], case.topk) and w.dtype == torch.float32
                if idx.numel():
                    assert int(idx.min()) >= -1 and int(idx.max()) < case.num_experts
                    ids = idx.sort(dim=1).values
                    assert not ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any(), case.id
                    firsts |= set(idx[:, 0].tolist())
                    sets |= {tuple(sorted(row)) for row in idx.tolist()}
                again = sweep.case_inputs(case, rank, world, call)
                assert all(torch.equal(a, b) for a, b in zip((x, idx, w), again, strict=True))
            if case.routing == "hot_first":
                assert len(firsts) == 1, case.id
            if case.routing == "hot_set":
                assert len(sets) == 1, case.id
    a = sweep.case_inputs(sweep.CASES[0], 0, 2, 0)[0]
    b = sweep.case_inputs(sweep.CASES[0], 0, 2, 1)[0]
    assert a.shape != b.shape or not torch.equal(a, b)  # fresh inputs every call


def test_world_of_one_in_process():
    """Every case on ReferenceEpBuffer in a world of one, without a process group."""
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")
    from _worlds import world_of_one

    from cute_ep.reference_backend import ReferenceEpBuffer

    rt = world_of_one()
    ctx = sweep.SweepContext(0, 1, 1, None, torch.device("cpu"))
    for case in sweep.CASES:
        rep = sweep.run_case(lambda cfg: ReferenceEpBuffer(rt, cfg), case, ctx)
        assert rep.passed, rep.text()
        assert [c.label for c in rep.calls] == [c.label for c in case.calls]


@needs_gloo
def test_every_case_passes_on_two_ranks(ranks):
    for res in ranks:
        assert res["cases"].keys() == {c.id for c in sweep.CASES}
        for case in sweep.CASES:
            rep = res["cases"][case.id]
            assert rep["failures"] == [], (res["rank"], case.id, rep["failures"])
            assert [c[0] for c in rep["calls"]] == [c.label for c in case.calls]
            checks = [c[3] for c in rep["calls"]]
            if case.layout == "rank":
                want = ["rank dispatch", "rank combine"]
            else:
                want = ["layout", "dispatch", *(f"combine {a}" for a in sweep.combines_of(case))]
            assert checks == [want] * len(case.calls), (case.id, checks)
    # every call received rows somewhere, and the rank without tokens had none to send
    for case in sweep.CASES:
        for call in range(len(case.calls)):
            tokens = [res["cases"][case.id]["calls"][call][1] for res in ranks]
            assert tokens == [sweep.tokens_of(case, r, WORLD, call) for r in range(WORLD)]
            x, _, _ = sweep.case_inputs(case, 0, WORLD, call, seed=SEED)
            assert x.shape[0] == tokens[0]
            assert sum(res["cases"][case.id]["calls"][call][2] for res in ranks) > 0, case.id
    print("\n" + "\n".join(f"{k}: {v:.2f} s" for k, v in ranks[0]["times"].items()))


@needs_gloo
@pytest.mark.parametrize("name", list(TAMPERED))
def test_tampered_results_fail_on_every_rank(ranks, name):
    _, _, on, check, text = TAMPERED[name]
    reports = [res["tampered"][name] for res in ranks]
    assert [r["tampered_here"] for r in reports] == [r == on for r in range(WORLD)]
    assert all(r["failures"] == reports[0]["failures"] for r in reports)  # one report everywhere
    failures = reports[0]["failures"]
    assert failures, name
    named = [f for f in failures if f.startswith(f"rank {on}: call ") and f" {check}: " in f and text in f]
    assert named, failures
    assert all(f.startswith(f"rank {on}: ") for f in failures), failures  # only the tampered rank's own
    # the calls after the tampered one ran and passed: the case went on without a hang
    assert len(reports[0]["calls"]) == len(next(c for c in sweep.CASES if c.id == TAMPERED[name][0]).calls)


def test_tokens_per_expert_tamper_is_survived_in_process():
    """A result whose counts cannot give the expert outputs: the runner fills y with NaN and reports it
    instead of raising (in a world of one)."""
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")
    from _worlds import world_of_one

    rt = world_of_one()
    ctx = sweep.SweepContext(0, 1, 1, None, torch.device("cpu"))
    case = next(c for c in sweep.CASES if c.id == TAMPERED["tokens-per-expert"][0])
    make, cls = _reference_factory(rt, ("tpe", 0))
    rep = sweep.run_case(make, case, ctx)
    assert cls.tampered and not rep.passed
    assert any("cannot compute the expert outputs" in f for f in rep.failures), rep.failures
    assert any(" layout: " in f and "tokens_per_expert[0]" in f for f in rep.failures), rep.failures


def test_an_invalid_case_is_refused_before_any_buffer():
    bad = sweep.SweepCase(4, "expert", "pull", torch.bfloat16, 200, 64, (8, 0, 8, 8),
                          calls=(sweep.Call("scatter", fp8=True),))
    ctx = sweep.SweepContext(0, 1, 1, None, torch.device("cpu"))
    made = []
    with pytest.raises(ValueError, match="not a valid case"):
        sweep.run_case(lambda cfg: made.append(cfg), bad, ctx, cfg=SimpleNamespace())
    assert made == []
    rank_pull = sweep.SweepCase(33, "rank", "pull", torch.bfloat16, 256, 64, (8, 0, 8, 8))
    with pytest.raises(ValueError, match="combines of 'rank'"):
        sweep.run_case(lambda cfg: made.append(cfg), rank_pull, ctx, cfg=SimpleNamespace())


if __name__ == "__main__":
    from _launch import gloo_worker_main  # tests/ is sys.path[0] when run as a script

    sys.exit(gloo_worker_main(_worker))
