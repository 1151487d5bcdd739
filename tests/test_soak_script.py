"""scripts/soak.py on the CPU (backend "reference": torch references over gloo).

The script is launched for real: under torchrun with 2 ranks (the same seed twice: identical digests;
another seed: another digest) and with 4 ranks (2 virtual nodes of 2, so every route class occurs,
and the flat host without stragglers: the same digest, since it covers data only), and as a single
process (a world of one) for the argument errors, for results corrupted on purpose (counted, the soak
goes on, exit 1) and for a ``PeerTimeout`` (the soak stops at once, exit 1). With --layouts expert,rank
the soak runs on both CPU backends in worlds of 1 and 2 (0 wrong rows per layout, one digest), also
with --fp8 (FP8 in both layouts), and a stand-in backend that corrupts rank-layout results shows those
counted. The plan (token counts, modes, layouts, routings), the wrong-row counts and the rank-layout
checks on tampered results are also tested in-process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _launch import RANK0_OF_FOUR, REPO, assert_argument_error, forkrun, run_single

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.fp8 import dequantize_fp8
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.checks import check_rank_combine, check_rank_dispatch

SCRIPT = REPO / "scripts" / "soak.py"
TIMEOUT = 120
ROUTE_CLASSES = ("self", "same_node", "other_node_same_local_rank", "other_node_other_local_rank")
SIZES = ["--backend", "reference", "--max-tokens", "16", "--hidden", "64", "--num-experts", "8"]
SIZES += ["--topk", "2"]
SOAK = [*SIZES, "--iters", "24", "--straggler-prob", "0.5", "--max-straggle-us", "300"]
SOAK += ["--report-every", "10"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return forkrun(SCRIPT, nproc, *args, timeout=TIMEOUT)


def _single(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_single(SCRIPT, *args, timeout=TIMEOUT, **env)


def _text(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-6000:]


def _summary(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """The summary's counts (rank 0's stdout)."""
    out = proc.stdout
    counts = {}
    for key in ("failed iterations", "layout failures", "wrong dispatch rows", "wrong combine rows",
                "straggles injected"):  # fmt: skip
        m = re.search(rf"{key}: (\d+)", out)
        assert m, f"no {key!r} in:\n{_text(proc)}"
        counts[key] = int(m.group(1))
    m = re.search(r"iterations run: (\d+) of (\d+)", out)
    assert m, _text(proc)
    counts["iterations run"], counts["iterations"] = int(m.group(1)), int(m.group(2))
    return counts


def _digest(proc: subprocess.CompletedProcess) -> str:
    m = re.search(r"^  digest: ([0-9a-f]{64}) \(sha256 over (\d+) scatter iterations", proc.stdout, re.M)
    assert m, _text(proc)
    return m.group(1)


def _pairs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("  pairs: "))
    return {k: int(v) for k, v in (item.split("=") for item in line.split("[")[0].split()[1:])}


def _per_layout(proc: subprocess.CompletedProcess) -> dict[str, dict[str, int]]:
    """The summary's per-layout lines (rank 0's stdout), by layout."""
    pattern = (
        r"^  (expert|rank) layout: (\d+) iterations, (\d+) failed; wrong rows: dispatch (\d+) "
        r"\(of (\d+) received\), combine (\d+) \(of (\d+) tokens\)$"
    )
    keys = ("iterations", "failed", "wrong dispatch rows", "rows received", "wrong combine rows", "tokens")
    return {
        m.group(1): dict(zip(keys, map(int, m.groups()[1:]), strict=True))
        for m in re.finditer(pattern, proc.stdout, re.M)
    }


def _assert_passed(proc: subprocess.CompletedProcess) -> dict[str, int]:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{_text(proc)}"
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    assert "PASS" in lines[-2:], _text(proc)
    assert "FAIL" not in proc.stdout and "Traceback" not in proc.stderr, _text(proc)
    counts = _summary(proc)
    assert counts["iterations run"] == counts["iterations"], _text(proc)
    for key in ("failed iterations", "layout failures", "wrong dispatch rows", "wrong combine rows"):
        assert counts[key] == 0, (key, _text(proc))
    return counts


# --------------------------------------------------------------------------------------------------
# under torchrun
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, object]:
    """Seed 11 twice (the first with --out-json), seed 12 once; 2 ranks."""
    path = tmp_path_factory.mktemp("soak") / "out" / "soak.json"
    return {
        "json": path,
        "a": _torchrun(2, *SOAK, "--seed", "11", "--out-json", str(path)),
        "a_again": _torchrun(2, *SOAK, "--seed", "11"),
        "b": _torchrun(2, *SOAK, "--seed", "12"),
    }


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, subprocess.CompletedProcess]:
    """Seed 5 on 2 virtual nodes of 2 with stragglers, and on one flat node without."""
    return {
        "virtual": _torchrun(4, *SOAK, "--seed", "5", "--num-experts", "16", "--local-world-size", "2"),
        "flat": _torchrun(4, *SOAK, "--seed", "5", "--num-experts", "16", "--straggler-prob", "0"),
    }


def test_two_ranks_pass_with_stragglers_and_ragged_tokens(two_ranks):
    proc = two_ranks["a"]
    counts = _assert_passed(proc)
    assert counts["iterations run"] == 24 and counts["straggles injected"] > 0
    out = proc.stdout
    assert "world 2 = 1 node(s) x 2" in out
    assert "never re-zeroed or re-poisoned" in out
    assert "[10/24] failed iterations 0, wrong rows: dispatch 0, combine 0" in out
    assert "[20/24]" in out and "[24/24]" not in out  # progress lines only between iterations

    report = json.loads(two_ranks["json"].read_text())
    assert f"summary written to {two_ranks['json']}" in out
    assert report["passed"] is True and report["error"] is None
    assert report["iterations_run"] == 24 and report["failed_iterations"] == 0
    assert report["wrong_dispatch_rows"] == 0 and report["wrong_combine_rows"] == 0
    assert report["digest"] == _digest(proc) and report["digest_iterations"] == 12  # scatter: every other
    assert len(report["rank_digests"]) == 2 and report["straggles"] == counts["straggles injected"]
    assert report["rows_received"] > 0 and report["config"]["modes"] == ["scatter", "atomic"]
    assert "git_sha" in report and "torch" in report["versions"]


def test_same_seed_gives_the_same_digest_and_another_seed_another(two_ranks):
    a, again, b = (two_ranks[k] for k in ("a", "a_again", "b"))
    for proc in (again, b):
        _assert_passed(proc)
    assert _digest(a) == _digest(again)
    assert _digest(a) != _digest(b)


def test_four_ranks_as_two_virtual_nodes_exercise_every_route_class(four_ranks):
    proc = four_ranks["virtual"]
    counts = _assert_passed(proc)
    assert counts["straggles injected"] > 0
    assert "world 4 = 2 node(s) x 2 (virtual nodes)" in proc.stdout
    pairs = _pairs(proc)
    assert set(pairs) == set(ROUTE_CLASSES) and all(v > 0 for v in pairs.values()), pairs
    assert "never exercised" not in proc.stdout


def test_digest_depends_on_the_data_only(four_ranks):
    # Same seed and sizes: neither the (virtual) topology nor the stragglers change a byte.
    flat = four_ranks["flat"]
    counts = _assert_passed(flat)
    assert counts["straggles injected"] == 0 and "world 4 = 1 node(s) x 4" in flat.stdout
    assert _digest(flat) == _digest(four_ranks["virtual"])


# --------------------------------------------------------------------------------------------------
# single process: argument errors, wrong results, a peer timeout
# --------------------------------------------------------------------------------------------------


def test_capacity_drops_and_fp8_under_soak_match_across_backends(tmp_path):
    """Capacity drops (counted and checked every iteration) with FP8 dispatch: both backends pass, drop
    the same rows and give the same digest (which covers the packed rows)."""
    args = ["--max-tokens", "16", "--hidden", "128", "--num-experts", "8", "--topk", "2", "--iters", "12",
            "--straggler-prob", "0.3", "--max-straggle-us", "200", "--seed", "4",
            "--routings", "skewed,uniform", "--capacity-factor", "0.75", "--fp8"]  # fmt: skip
    ref = _torchrun(2, "--backend", "reference", *args, "--out-json", str(tmp_path / "ref.json"))
    a2a = _torchrun(2, "--backend", "a2a", *args, "--out-json", str(tmp_path / "a2a.json"))
    _assert_passed(ref)
    _assert_passed(a2a)
    s_ref, s_a2a = (json.loads((tmp_path / f).read_text()) for f in ("ref.json", "a2a.json"))
    assert s_ref["rows_dropped"] > 0 and s_ref["rows_dropped"] == s_a2a["rows_dropped"]
    assert s_ref["config"]["fp8"] and s_ref["config"]["expert_capacity"] == 6  # ceil(0.75 * 2*16*2/8)
    assert f"rows dropped beyond expert capacity 6: {s_ref['rows_dropped']}" in ref.stdout
    assert "capacity: FAIL" not in ref.stdout + a2a.stdout
    assert _digest(ref) == _digest(a2a)


LAYOUTS_SOAK = [*SOAK[2:], "--iters", "8", "--seed", "21", "--layouts", "expert,rank"]  # 4 of each layout


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory) -> dict[tuple[int, str], tuple[subprocess.CompletedProcess, dict]]:
    """--layouts expert,rank on both CPU backends, in a world of one and of two: (proc, JSON summary)."""
    out = tmp_path_factory.mktemp("layouts")
    runs = {}
    for world in (1, 2):
        for backend in ("reference", "a2a"):
            path = out / f"{backend}{world}.json"
            args = ["--backend", backend, *LAYOUTS_SOAK, "--out-json", str(path)]
            proc = _single(*args) if world == 1 else _torchrun(2, *args)
            runs[world, backend] = proc, (json.loads(path.read_text()) if path.exists() else {})
    return runs


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", ["reference", "a2a"])
def test_both_layouts_alternate_with_zero_wrong_rows_per_layout(both_layouts, world, backend):
    proc, report = both_layouts[world, backend]
    counts = _assert_passed(proc)
    assert counts["iterations run"] == 8 and counts["straggles injected"] > 0
    assert "layouts expert,rank (alternating)" in proc.stdout
    per_layout = _per_layout(proc)
    assert set(per_layout) == {"expert", "rank"}, _text(proc)
    for name, c in per_layout.items():
        assert c["iterations"] == 4 and c["failed"] == 0, (name, c)
        assert c["wrong dispatch rows"] == 0 and c["wrong combine rows"] == 0, (name, c)
        assert c["rows received"] > 0 and c["tokens"] > 0, (name, c)
    assert report["config"]["layouts"] == ["expert", "rank"]
    assert report["wrong_dispatch_rows"] == 0 and report["wrong_combine_rows"] == 0  # the old keys stay
    for name in ("expert", "rank"):
        j, c = report["per_layout"][name], per_layout[name]
        assert (j["iterations"], j["failed_iterations"]) == (4, 0)
        assert (j["wrong_dispatch_rows"], j["wrong_combine_rows"]) == (0, 0)
        assert (j["rows_received"], j["tokens_combined"]) == (c["rows received"], c["tokens"])
    assert report["rows_received"] == sum(c["rows_received"] for c in report["per_layout"].values())
    # 2 of the 4 iterations of each layout run in scatter mode: the digest covers both layouts
    assert report["digest_iterations"] == 4


def test_fp8_in_both_layouts_passes_on_both_backends_with_one_digest(tmp_path):
    """--fp8 with --layouts expert,rank: the rank-layout iterations dispatch FP8 too, checked byte for byte
    (check_rank_dispatch(fp8=True)); both backends pass with the same digest (covering the e4m3 rows and
    their scales), and it differs from the digest of the same soak without FP8."""
    args = [*LAYOUTS_SOAK, "--hidden", "128", "--fp8"]
    runs = {}
    for backend in ("reference", "a2a"):
        path = tmp_path / f"{backend}.json"
        runs[backend] = _torchrun(2, "--backend", backend, *args, "--out-json", str(path)), path
    for proc, path in runs.values():
        _assert_passed(proc)
        per_layout = _per_layout(proc)
        assert per_layout["rank"]["iterations"] == 4 and per_layout["rank"]["rows received"] > 0, _text(proc)
        assert json.loads(path.read_text())["config"]["fp8"] is True
    assert _digest(runs["reference"][0]) == _digest(runs["a2a"][0])
    plain = _torchrun(2, "--backend", "reference", *LAYOUTS_SOAK, "--hidden", "128")
    _assert_passed(plain)
    assert _digest(plain) != _digest(runs["reference"][0])


@pytest.mark.parametrize("world", [1, 2])
def test_both_layouts_give_one_digest_on_both_backends(both_layouts, world):
    ref, a2a = (both_layouts[world, b][0] for b in ("reference", "a2a"))
    assert _digest(ref) == _digest(a2a)


def test_expert_layout_alone_is_the_default_and_prints_no_per_layout_lines(two_ranks):
    proc = two_ranks["a"]
    assert _per_layout(proc) == {} and "layouts" not in proc.stdout
    report = json.loads(two_ranks["json"].read_text())
    assert report["config"]["layouts"] == ["expert"] and list(report["per_layout"]) == ["expert"]
    assert report["per_layout"]["expert"]["iterations"] == 24


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        (["--topk", "9"], "topk must be in [1, min(num_experts=8, 64)], got 9"),
        (["--routings", "uniform,hot"], "--routings must be a comma-separated list of"),
        (["--straggler-prob", "1.5"], "--straggler-prob must be in [0, 1], got 1.5"),
        (["--fp8"], "--fp8 needs --hidden to be a multiple of 128, got 64"),
        (["--capacity-factor", "-1"], "--capacity-factor must be a finite number >= 0, got -1.0"),
        (["--layouts", "expert,token"], "--layouts must be a comma-separated list of ['expert', 'rank'], "
                                        "got 'expert,token'"),
        (["--layouts", "rank", "--capacity-factor", "0.5"],
         "--layouts 'rank' includes rank, which needs --capacity-factor 0 (the rank layout has no expert "
         "capacity), got --capacity-factor 0.5"),
        (["--backend", "cute", "--num-experts", "6144", "--layouts", "expert,rank"],
         "--layouts rank needs 2 * --num-experts + world size <= 12288 on backend cute, got 12292"),
    ],
)  # fmt: skip
def test_argument_errors_exit_2_with_the_constraint_and_no_traceback(args, message):
    assert_argument_error(_single(*SIZES, *args, **RANK0_OF_FOUR), message)


# python -c _PATCHED SCRIPT PATCH ARGS...: the script's main(ARGS) with ReferenceEpBuffer patched.
# "corrupt": one bit of the last received row flipped in every third dispatch (if any row arrived),
# one bit of token 0's combine output in every fourth combine from the first (if any token); at exit
# the counts are printed. "corrupt-rank": rank-layout calls only, one bit of the last row's first
# weight in the dispatch calls not divisible by 3 (if any row arrived), one bit of the last token's
# combine output in the calls divisible by 3 (if any token). "timeout": the fourth dispatch raises
# PeerTimeout.
_PATCHED = textwrap.dedent(
    """
    import atexit, importlib.util, sys
    import torch
    from cute_ep.status import PeerTimeout
    from cute_ep.reference_backend import ReferenceEpBuffer

    patch = sys.argv[2]
    dispatch, combine = ReferenceEpBuffer.dispatch, ReferenceEpBuffer.combine
    calls = {"dispatch": 0, "combine": 0}
    bad = {"dispatch": 0, "combine": 0}
    failed = set()

    def bad_dispatch(self, x, topk_idx, topk_weights, mode="scatter", fp8=False, layout="expert"):
        calls["dispatch"] += 1
        if patch == "timeout" and calls["dispatch"] == 4:
            raise PeerTimeout("dispatch on rank 0: rank 1 did not signal within 1 s (a test)",
                              op="dispatch", peer=1, call=4)
        res = dispatch(self, x, topk_idx, topk_weights, mode=mode, fp8=fp8, layout=layout)
        if patch == "corrupt" and calls["dispatch"] % 3 == 0 and res.num_recv:
            res.recv_x.view(torch.int16)[res.num_recv - 1, 5] ^= 1
            bad["dispatch"] += 1
            failed.add(calls["dispatch"])
        if patch == "corrupt-rank" and layout == "rank" and calls["dispatch"] % 3 != 0 and res.num_recv:
            res.recv_topk_weights.view(torch.int32)[res.num_recv - 1, 0] ^= 1
            bad["dispatch"] += 1
            failed.add(calls["dispatch"])
        return res

    def bad_combine(self, y, handle):
        calls["combine"] += 1
        out = combine(self, y, handle)
        if patch == "corrupt" and calls["combine"] % 4 == 1 and out.shape[0]:
            out.view(torch.int16)[0, 7] ^= 1
            bad["combine"] += 1
            failed.add(calls["combine"])
        if patch == "corrupt-rank" and handle.layout == "rank" and calls["combine"] % 3 == 0 and out.shape[0]:
            out.view(torch.int16)[out.shape[0] - 1, 3] ^= 1
            bad["combine"] += 1
            failed.add(calls["combine"])
        return out

    ReferenceEpBuffer.dispatch, ReferenceEpBuffer.combine = bad_dispatch, bad_combine
    atexit.register(lambda: print(f"corrupted: dispatch {bad['dispatch']} combine {bad['combine']} "
                                  f"iterations {len(failed)}", flush=True))
    spec = importlib.util.spec_from_file_location("soak_script", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    sys.exit(script.main(sys.argv[3:]))
    """
)


def _patched(patch: str, *args: str) -> subprocess.CompletedProcess:
    """The script in a single process (a world of one) with _PATCHED's ``patch``."""
    return run_single("-c", _PATCHED, SCRIPT, patch, *args, timeout=TIMEOUT)


def _corrupted(proc) -> tuple[int, int, int]:
    """The rows the patched soak corrupted (dispatch, combine) and in how many iterations; both kinds > 0."""
    m = re.search(r"corrupted: dispatch (\d+) combine (\d+) iterations (\d+)", proc.stdout)
    assert m, _text(proc)
    bad_d, bad_c, bad_iters = (int(v) for v in m.groups())
    assert bad_d > 0 and bad_c > 0
    return bad_d, bad_c, bad_iters


def test_wrong_results_are_counted_and_the_soak_goes_on():
    proc = _patched("corrupt", *SIZES, "--iters", "30", "--show-failures", "2", "--report-every", "0")
    assert proc.returncode == 1, _text(proc)
    bad_d, bad_c, bad_iters = _corrupted(proc)
    counts = _summary(proc)
    assert counts["iterations run"] == 30  # it went on after the failures
    assert counts["wrong dispatch rows"] == bad_d and counts["wrong combine rows"] == bad_c, _text(proc)
    assert counts["failed iterations"] == bad_iters and counts["layout failures"] == 0
    out = proc.stdout
    assert [ln for ln in out.splitlines() if ln.strip()][-2] == "FAIL"
    assert out.count(" FAILED (") == 2 and "later failures are counted, not printed" in out
    assert re.search(r"\[(scatter|atomic) #\d+\] dispatch: FAIL .*field recv_x differs", out), _text(proc)
    assert re.search(r"\[(scatter|atomic) #\d+\] combine: FAIL .*expected", out), _text(proc)
    assert "Traceback" not in proc.stderr


def test_wrong_rank_layout_results_are_counted_per_layout(tmp_path):
    path = tmp_path / "soak.json"
    proc = _patched("corrupt-rank", *SIZES, "--iters", "24", "--layouts", "expert,rank", "--show-failures",
                    "1", "--report-every", "0", "--straggler-prob", "0", "--out-json", str(path))  # fmt: skip
    assert proc.returncode == 1, _text(proc)
    bad_d, bad_c, bad_iters = _corrupted(proc)
    counts = _summary(proc)
    assert counts["iterations run"] == 24 and counts["failed iterations"] == bad_iters
    assert counts["wrong dispatch rows"] == bad_d and counts["wrong combine rows"] == bad_c, _text(proc)
    per_layout = _per_layout(proc)
    assert per_layout["expert"]["failed"] == 0 and per_layout["expert"]["wrong dispatch rows"] == 0
    assert per_layout["expert"]["wrong combine rows"] == 0
    assert per_layout["rank"]["failed"] == bad_iters, _text(proc)
    assert per_layout["rank"]["wrong dispatch rows"] == bad_d
    assert per_layout["rank"]["wrong combine rows"] == bad_c
    out = proc.stdout
    assert re.search(r"iteration \d+ FAILED \((scatter|atomic), rank layout, ", out), _text(proc)
    assert re.search(r"\[(scatter|atomic) rank-layout #\d+\] (dispatch|combine): FAIL", out), _text(proc)
    report = json.loads(path.read_text())
    assert report["per_layout"]["rank"]["wrong_dispatch_rows"] == bad_d
    assert report["per_layout"]["rank"]["wrong_combine_rows"] == bad_c
    assert {f["layout"] for f in report["failures"]} == {"rank"}
    messages = " ".join(m for f in report["failures"] for m in f["messages"].values())
    assert "field recv_topk_weights differs" in messages and "token rows: rank 0 row" in messages
    assert "Traceback" not in proc.stderr


def test_a_peer_timeout_stops_the_soak_with_a_partial_summary(tmp_path):
    path = tmp_path / "soak.json"
    proc = _patched("timeout", *SIZES, "--iters", "30", "--out-json", str(path))
    assert proc.returncode == 1, _text(proc)
    out = proc.stdout
    stopped = r"soak stopped in iteration 3 \(atomic, skewed\) by PeerTimeout"
    assert re.search(stopped, out), _text(proc)
    assert "soak summary (PARTIAL: stopped by an error)" in out and "iterations run: 3 of 30" in out
    assert "rank 0: error: PeerTimeout: dispatch on rank 0: rank 1 did not signal" in proc.stderr
    assert "--traceback" in proc.stderr and "Traceback" not in proc.stderr
    report = json.loads(path.read_text())
    assert report["passed"] is False and report["error"].startswith("PeerTimeout: ")
    assert report["stopped_in"]["iteration"] == 3 and report["iterations_run"] == 3


# --------------------------------------------------------------------------------------------------
# in-process: the plan and the wrong-row counts (a world of one, no process group)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_script_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_the_plan_is_ragged_deterministic_and_covers_modes_and_routings(soak):
    counts = [soak.tokens_of(3, it, 1, 16) for it in range(400)]
    assert counts == [soak.tokens_of(3, it, 1, 16) for it in range(400)]
    assert min(counts) == 0 and max(counts) == 16 and counts.count(0) > 5 and counts.count(16) > 5
    assert counts != [soak.tokens_of(3, it, 0, 16) for it in range(400)]  # per rank
    assert len({soak.input_seed(3, it) for it in range(100)}) == 100
    args = Namespace(mode_list=["scatter", "atomic"], routing_list=["uniform", "skewed", "dropped"],
                     layout_list=["expert"], routing_order="cycle", seed=0)  # fmt: skip
    plan = {(soak.mode_of(args, it), soak.routing_of(args, it)) for it in range(6)}
    assert len(plan) == 6
    # One layout: the plan of a soak before --layouts (the routing changes after a round of modes).
    routings = [soak.routing_of(args, it) for it in range(12)]
    assert routings == [args.routing_list[it // 2 % 3] for it in range(12)]
    assert {soak.layout_of(args, it) for it in range(12)} == {"expert"}
    args.routing_order = "random"
    assert {soak.routing_of(args, it) for it in range(50)} == set(args.routing_list)


def test_the_plan_alternates_layouts_so_every_layout_meets_every_mode_and_routing(soak):
    args = Namespace(mode_list=["scatter", "atomic"], routing_list=["uniform", "skewed", "dropped"],
                     layout_list=["expert", "rank"], routing_order="cycle", seed=0)  # fmt: skip
    plan = [(soak.mode_of(args, it), soak.layout_of(args, it), soak.routing_of(args, it)) for it in range(12)]
    assert len(set(plan)) == 12  # every (mode, layout, routing) in the first 2 * 2 * 3 iterations
    assert [p[1] for p in plan[:4]] == ["expert", "expert", "rank", "rank"]


def _buffer(max_tokens: int = 32, hidden: int = 64) -> ReferenceEpBuffer:
    env = DistEnv(rank=0, world_size=1, local_rank=0, physical_local_world_size=1, local_world_size=1)
    runtime = SimpleNamespace(env=env, device=torch.device("cpu"), cpu_group=None)
    cfg = EpConfig(world_size=1, local_world_size=1, num_experts=4, topk=2, hidden=hidden,
                   dtype=torch.bfloat16, max_tokens=max_tokens)  # fmt: skip
    return ReferenceEpBuffer(runtime, cfg)


def _clone(res, **changes):
    fields = {k: getattr(res, k).clone() for k in ("recv_x", "recv_weights", "recv_src")}
    fields.update(changes)
    return dataclasses.replace(res, **fields)


def test_wrong_dispatch_rows_counts_rows_not_elements(soak):
    buf = _buffer()
    cfg = buf.cfg
    x, idx, w = make_inputs(0, 32, 64, 4, 2, torch.bfloat16, seed=4)

    def wrong(res, ordered):
        return soak.wrong_dispatch_rows(x, idx, w, res, cfg, 0, ordered, None)

    res = buf.dispatch(x, idx, w, mode="scatter")
    n = res.num_recv
    tpe = res.tokens_per_expert.tolist()
    assert n == 64 and wrong(res, True) == 0 and wrong(res, False) == 0

    r = _clone(res)
    r.recv_x[3].fill_(float("nan"))  # one row, every element
    assert wrong(r, True) == 1

    inside = _clone(res)  # two rows of expert 0 swapped: wrong in order, right inside their group
    for t in (inside.recv_x, inside.recv_weights, inside.recv_src):
        t[[0, 1]] = t[[1, 0]]
    assert wrong(inside, True) == 2 and wrong(inside, False) == 0

    across = _clone(res)  # the first rows of experts 0 and 1 swapped: wrong in both modes
    for t in (across.recv_x, across.recv_weights, across.recv_src):
        t[[0, tpe[0]]] = t[[tpe[0], 0]]
    assert wrong(across, True) == 2 and wrong(across, False) == 2

    dup = _clone(res)  # row 1 received twice, row 2 never
    for t in (dup.recv_x, dup.recv_weights, dup.recv_src):
        t[2] = t[1]
    assert wrong(dup, True) == 1 and wrong(dup, False) == 1

    short = dataclasses.replace(
        res, recv_x=res.recv_x[: n - 3], recv_weights=res.recv_weights[: n - 3],
        recv_src=res.recv_src[: n - 3], num_recv=n - 3,
    )  # fmt: skip
    assert wrong(short, True) == 3

    atomic = buf.dispatch(x, idx, w, mode="atomic")
    assert wrong(atomic, False) == 0 and wrong(atomic, True) > 0  # shuffled inside the groups


def test_wrong_combine_rows_counts_tokens(soak):
    buf = _buffer()
    cfg = buf.cfg
    x, idx, w = make_inputs(0, 32, 64, 4, 2, torch.bfloat16, seed=5, routing="dropped")
    res = buf.dispatch(x, idx, w)
    y = buf.expert_output(res.num_recv)
    y.copy_(apply_test_expert(res.recv_x, global_expert_of_rows(res.tokens_per_expert, 0)))
    out = buf.combine(y, res.handle)

    def wrong(o):
        return soak.wrong_combine_rows(o, idx, w, y, res.handle.scatter, cfg, 0, None)

    assert wrong(out) == 0
    bad = out.clone()
    bad[[2, 9], 0] = float("nan")
    bad.view(torch.int16)[9, 1] ^= 1
    assert wrong(bad) == 2
    assert wrong(out[:5]) == 32  # an output of the wrong shape: every token


def _rank_dispatch(buf: ReferenceEpBuffer, routing: str = "dropped"):
    x, idx, w = make_inputs(0, 32, 64, 4, 2, torch.bfloat16, seed=6, routing=routing)
    return (x, idx, w), buf.dispatch(x, idx, w, mode="atomic", layout="rank")


def _rank_check(res, inputs, **kw):
    x, idx, w = inputs
    return check_rank_dispatch(res, [x], [idx], [w], max_tokens=32, num_experts=4, local_world_size=1, **kw)


def _tampered(res, name: str, fn) -> object:
    """A copy of the rank-layout result ``res`` with ``fn`` applied to a clone of its field ``name``."""
    t = getattr(res, name).clone()
    fn(t)
    return dataclasses.replace(res, **{name: t})


def test_rank_dispatch_check_passes_a_right_result_and_counts_each_tampered_field(soak):
    buf = _buffer()
    inputs, res = _rank_dispatch(buf)
    n = res.num_recv
    assert 0 < n < 32  # the dropped routing leaves some tokens without a destination
    ok = _rank_check(res, inputs)
    assert ok.passed and ok.wrong_rows == 0 and ok.message == "ok"
    gathered = check_rank_dispatch(res, *inputs, max_tokens=32, num_experts=4, local_world_size=1)
    assert gathered.passed and gathered.route_counts == ok.route_counts  # this rank's tensors: gathered

    def flip(t):  # one bit of row 3
        t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).view(n, -1)[3, 0] ^= 1

    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src"):
        bad = _rank_check(_tampered(res, name, flip), inputs)
        assert not bad.passed and bad.wrong_rows == 1, (name, bad.message)
        assert f"field {name} differs" in bad.message and "row 3" in bad.message, bad.message

    swapped = _tampered(res, "recv_x", lambda t: t.copy_(t[torch.tensor([1, 0, *range(2, n)])]))
    assert _rank_check(swapped, inputs).wrong_rows == 2  # one order in this layout: rows 0 and 1 are wrong

    tpe = _tampered(res, "tokens_per_expert", lambda t: t.__setitem__(1, t[1] + 1))
    bad = _rank_check(tpe, inputs)
    assert not bad.passed and bad.wrong_rows == 0 and "tokens_per_expert[1] is" in bad.message

    short = dataclasses.replace(
        res, num_recv=n - 2, recv_x=res.recv_x[: n - 2], recv_src=res.recv_src[: n - 2],
        recv_topk_idx=res.recv_topk_idx[: n - 2], recv_topk_weights=res.recv_topk_weights[: n - 2],
    )  # fmt: skip
    bad = _rank_check(short, inputs)
    assert not bad.passed and bad.wrong_rows == 2 and f"num_recv is {n - 2}, expected {n}" in bad.message

    handle = dataclasses.replace(res.handle, scatter=res.handle.scatter.clone())
    handle.scatter[handle.scatter >= 0] += 1
    bad = _rank_check(dataclasses.replace(res, handle=handle), inputs)
    assert not bad.passed and "handle.scatter[" in bad.message

    expert = buf.dispatch(*inputs)  # an expert-layout result: no per-row routing to compare
    bad = _rank_check(expert, inputs)
    assert not bad.passed and "recv_topk_idx is None" in bad.message and bad.wrong_rows >= n


def test_rank_combine_check_passes_the_rank_combine_and_counts_tampered_tokens(soak):
    buf = _buffer()
    (_, idx, _), res = _rank_dispatch(buf)
    y = buf.expert_output(res.num_recv)
    y.copy_(soak.rank_expert_output(res, 0, buf.cfg.experts_per_rank))
    out = buf.combine(y, res.handle)

    def check(o):
        return check_rank_combine(o, idx, res.handle.scatter, y, num_experts=4, local_world_size=1)

    ok = check(out)
    assert ok.passed and ok.wrong_rows == 0
    none = (idx < 0).all(dim=1)
    assert bool(none.any()) and not bool(out[none].any())  # tokens without a destination: zeros
    bad = out.clone()
    bad.view(torch.int16)[[2, 9], 5] ^= 1
    bad[9, 0] = float("nan")
    result = check(bad)
    assert not result.passed and result.wrong_rows == 2 and "(rank 0, token 2, column 5)" in result.message
    assert check(out[:5]).wrong_rows == 32  # the wrong shape: every token


def test_rank_expert_output_weights_each_local_expert(soak):
    buf = _buffer()
    _, res = _rank_dispatch(buf, routing="uniform")
    y = soak.rank_expert_output(res, 0, buf.cfg.experts_per_rank)
    ids, w = res.recv_topk_idx.to(torch.int64), res.recv_topk_weights
    scale = (w * (ids + 1).float()).where(ids >= 0, torch.zeros_like(w))
    assert torch.equal(y, (res.recv_x.float() * (scale[:, 0] + scale[:, 1])[:, None]).to(torch.bfloat16))
    wrong = dataclasses.replace(res, recv_topk_idx=res.recv_topk_idx.flip(1))  # ids swapped between k
    assert not torch.equal(soak.rank_expert_output(wrong, 0, buf.cfg.experts_per_rank), y)
    assert soak.rank_expert_output(dataclasses.replace(res, recv_topk_idx=None), 0, 4) is None


def test_rank_expert_output_of_an_fp8_dispatch_reads_the_dequantized_rows(soak):
    buf = _buffer(hidden=128)
    x, idx, w = make_inputs(0, 32, 128, 4, 2, torch.bfloat16, seed=6)
    res = buf.dispatch(x, idx, w, fp8=True, layout="rank")
    rows = soak.dequantized_rows(res, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(rows, dequantize_fp8(res.recv_x, res.recv_scales).to(torch.bfloat16))
    y = soak.rank_expert_output(res, 0, buf.cfg.experts_per_rank, rows)
    plain = buf.dispatch(x, idx, w, layout="rank")  # the same routing: the same ids and weights
    assert torch.equal(y, soak.rank_expert_output(dataclasses.replace(plain, recv_x=rows), 0, 4))
    assert not torch.equal(y, soak.rank_expert_output(plain, 0, 4))  # the rows really are the FP8 ones
    assert soak.dequantized_rows(dataclasses.replace(res, recv_scales=None), torch.bfloat16, "cpu") is None
