"""The decode report of scripts/decode_breakdown.py on the CPU: its arguments (exit 2, messages),
row assembly from per-rank medians (cute_ep.tools.bench_peers.decode_row), the report's check
(check_decode_json), the committed baselines/perf/h200x2_decode.json, and a whole run of the script's
driver over gloo with stand-ins for the GPU parts (EpBuffer, the CUDA-event timer, deep_ep)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
from _launch import (
    RANK0_OF_FOUR,
    REPO,
    assert_argument_error,
    assert_imports_none,
    import_script,
    launch_ranks,
    run_single,
    write_worker,
)

from cute_ep.tools import bench_peers as bp
from cute_ep.tools import bench_report as br

SCRIPT = REPO / "scripts" / "decode_breakdown.py"
BASELINE = REPO / "baselines" / "perf" / "h200x2_decode.json"
REPORT_TOKENS = (1, 32, 128, 256)
REPORT_BUDGETS = (24, bp.FULL_GPU_SMS)


@pytest.fixture(scope="module")
def db():
    """scripts/decode_breakdown.py as a module (its imports are torch-free)."""
    return import_script(SCRIPT, "decode_breakdown_script")


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--tokens", "1,x"], "--tokens must be a comma-separated list of integers, got '1,x'"),
    (["--tokens", "0,32"], "--tokens must list integers >= 1, got '0,32'"),
    (["--tokens", "1,70000"], "--tokens values must be <= 65536, got 70000"),
    (["--num-sms", "24,0"], "--num-sms values must be integers >= 1 (or max); 0 in '24,0' is not"),
    (["--num-sms", "24,full"], "--num-sms must be a comma-separated list of integers >= 1 or max; 'full' in"),
    (["--peers", "nccl"], "--peers takes 'deepep' or 'none' here (NCCL is scripts/benchmark.py's peer); "
                          "'nccl' in 'nccl' is not one"),
    (["--peers", "deepep,pplx"], "--peers must be a comma-separated list of ['nccl', 'deepep'] (or 'none'); "
                                 "'pplx' in 'deepep,pplx' is not one"),
    (["--iters", "0"], "need --iters >= 1 and --warmup >= 0, got 0 and 10"),
    (["--warmup", "-1"], "need --iters >= 1 and --warmup >= 0, got 50 and -1"),
    (["--layout-in-dispatch", "-1"], "--layout-in-dispatch must be >= 0 tokens, got -1"),
    # the rank-0 process of a 4-rank world: the config error stops it before any rendezvous
    (["--num-experts", "254"], "num_experts must be divisible by world_size=4, got 254"),
])  # fmt: skip
def test_bad_arguments_exit_2_naming_the_constraint_and_the_value(args, message):
    assert_argument_error(run_single(SCRIPT, *args, timeout=120, **RANK0_OF_FOUR), message)


def test_unwritable_out_json_exits_2_before_running(tmp_path):
    proc = run_single(SCRIPT, "--out-json", str(tmp_path), timeout=120, **RANK0_OF_FOUR)
    assert_argument_error(proc, f"--out-json {tmp_path} is a directory")
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_single(SCRIPT, "--out-json", str(blocker / "r.json"), timeout=120, **RANK0_OF_FOUR)
    assert_argument_error(proc, f"--out-json {blocker / 'r.json'}: {blocker} is not a directory")


def test_help_names_the_report_flags():
    proc = run_single(SCRIPT, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--num-sms", "--peers", "--out-json", "--combine", "--tokens", "--layout-in-dispatch"):
        assert flag in proc.stdout, flag


def test_validate_args_fills_the_lists(db, tmp_path):
    args = db.build_parser().parse_args(["--tokens", "1,32,128,256,32", "--num-sms", "24,132",
                                         "--peers", "deepep", "--out-json", str(tmp_path / "new" / "r.json")])
    db.validate_args(args)
    assert args.token_list == [1, 32, 128, 256] and args.num_sms_list == [24, 132]
    assert args.peer_list == ["deepep"]
    args = db.build_parser().parse_args(["--peers", "none"])
    db.validate_args(args)
    assert args.peer_list == [] and args.combine == "reduced"


# --------------------------------------------------------------------------------------------------
# row assembly
# --------------------------------------------------------------------------------------------------


def _rank(base: float, *, reduced: bool = True) -> dict[str, float | None]:
    """One rank's medians: kernel and call times from ``base``, host parts small."""
    m: dict[str, float | None] = {
        "layout": base, "dispatch": base + 10, "pull_combine": base + 20,
        "reduced_combine": base + 15 if reduced else None,
        "api_dispatch": base + 100, "api_dispatch_nosync": base + 50, "api_combine": base + 60,
        "dispatch_checks": 1.0, "dispatch_enqueue": 2.0, "dispatch_status": 3.0,
        "combine_checks": 0.5, "combine_enqueue": 1.5,
    }  # fmt: skip
    return m


def test_decode_row_takes_each_fields_slowest_rank():
    r0, r1 = _rank(5.0), _rank(7.0)
    r0["reduced_combine"] = 40.0  # rank 0 is the slower on this one field only
    r1["dispatch_checks"] = 4.0
    row = bp.decode_row(tokens=128, num_sms=24, combine_algorithm="reduced", per_rank=[r0, r1],
                        deepep_us=[[30.0, 60.0, 35.0, 31.0], [32.0, 59.0, 36.0, 29.0]],
                        deepep_skipped=None)  # fmt: skip
    assert row["tokens"] == 128 and row["num_sms"] == 24 and row["combine_algorithm"] == "reduced"
    assert row["layout_us"] == 7.0 and row["dispatch_us"] == 17.0 and row["pull_combine_us"] == 27.0
    assert row["reduced_combine_us"] == 40.0 and row["combine_us"] == 40.0  # the default: reduced
    assert row["api_dispatch_us"] == 107.0 and row["api_combine_us"] == 67.0
    assert row["api_dispatch_nosync_us"] == 57.0
    assert row["api_dispatch_host_us"] == 107.0 - 17.0 and row["api_combine_host_us"] == 67.0 - 40.0
    assert row["dispatch_checks_us"] == 4.0 and row["dispatch_status_us"] == 3.0
    assert row["per_rank"]["reduced_combine_us"] == [40.0, 22.0]
    assert row["per_rank"]["dispatch_us"] == [15.0, 17.0]
    # DeepEP: slowest rank per call, at its budget for ours
    assert row["deepep_num_sms"] == 24 and row["deepep_skipped"] is None
    assert (row["deepep_dispatch_us"], row["deepep_full_dispatch_us"]) == (32.0, 60.0)
    assert (row["deepep_dispatch_permute_us"], row["deepep_combine_us"]) == (36.0, 31.0)
    assert row["per_rank"]["deepep_combine_us"] == [31.0, 29.0]
    assert row["dispatch_vs_deepep"] == pytest.approx(17.0 / 32.0)
    assert row["combine_vs_deepep"] == pytest.approx(40.0 / 31.0)
    assert all(k in row for k in bp.DECODE_ROW_FIELDS)


def test_decode_row_skipped_deepep_and_a_pull_buffer():
    why = "deep_ep is not importable (ModuleNotFoundError: No module named 'deep_ep')"
    row = bp.decode_row(tokens=1, num_sms=132, combine_algorithm="pull",
                        per_rank=[_rank(5.0, reduced=False), _rank(6.0, reduced=False)], deepep_us=None,
                        deepep_skipped=why)  # fmt: skip
    assert row["deepep_num_sms"] == 128  # the full GPU: DeepEP at 128 (bench_peers' mapping)
    assert row["deepep_skipped"] == why
    assert all(row[f"deepep_{n}_us"] is None for n in bp.DEEPEP_TIMES)
    assert row["dispatch_vs_deepep"] is None and "deepep_dispatch_us" not in row["per_rank"]
    assert row["reduced_combine_us"] is None and row["combine_us"] == row["pull_combine_us"] == 26.0
    assert "reduced_combine_us" not in row["per_rank"]
    row = bp.decode_row(tokens=1, num_sms=1, combine_algorithm="pull", per_rank=[_rank(5.0, reduced=False)],
                        deepep_us=None, deepep_skipped=bp.deepep_budget_skip_reason(1))  # fmt: skip
    assert row["deepep_num_sms"] is None


@pytest.mark.parametrize("change,message", [
    (dict(combine_algorithm="push"), "combine_algorithm must be one of ['pull', 'reduced'], got 'push'"),
    (dict(per_rank=[]), "at least one rank"),
    (dict(per_rank=[{"layout": 1.0}]), "rank 0's measurements lack ['dispatch'"),
    (dict(deepep_us=None), "either DeepEP's times or the reason"),
    (dict(deepep_skipped="also skipped"), "either DeepEP's times or the reason"),
    (dict(deepep_us=None, deepep_skipped=" "), "deepep_skipped must be a non-empty reason"),
    (dict(deepep_us=[[1.0, 1.0, 1.0, 1.0]]), "DeepEP times for 1 ranks, ours for 2"),
    (dict(deepep_us=[[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0]]),
     "deepep_full_dispatch_us: rank 1's median must be a positive time (us), got 0.0"),
    (dict(combine_algorithm="pull"), "reduced_combine must be measured exactly when"),
])  # fmt: skip
def test_decode_row_refuses_inconsistent_input(change, message):
    kwargs = dict(tokens=32, num_sms=24, combine_algorithm="reduced", per_rank=[_rank(5.0), _rank(6.0)],
                  deepep_us=[[1.0, 2.0, 3.0, 4.0]] * 2, deepep_skipped=None)  # fmt: skip
    kwargs.update(change)
    with pytest.raises(br.BenchReportError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):  # fmt: skip
        bp.decode_row(**kwargs)


@pytest.mark.parametrize("field,value,message", [
    ("dispatch", -1.0, "dispatch_us: rank 1's median must be a positive time (us), got -1.0"),
    ("api_combine", float("nan"), "api_combine_us: rank 1's median must be a positive time"),
    ("dispatch_checks", -0.5, "dispatch_checks_us: rank 1's median must be a time >= 0 (us), got -0.5"),
    ("reduced_combine", None, "reduced_combine_us: rank 1's median must be a positive time (us), got None"),
    ("layout", True, "layout_us: rank 1's median must be a positive time (us), got True"),
])  # fmt: skip
def test_decode_row_refuses_bad_medians(field, value, message):
    bad = _rank(6.0)
    bad[field] = value
    with pytest.raises(br.BenchReportError) as err:
        bp.decode_row(tokens=32, num_sms=24, combine_algorithm="reduced", per_rank=[_rank(5.0), bad],
                      deepep_us=None, deepep_skipped="not requested")  # fmt: skip
    assert message in str(err.value)


def test_host_parts_of_zero_are_accepted():
    zero = _rank(5.0)
    zero["combine_checks"] = 0.0
    row = bp.decode_row(tokens=1, num_sms=24, combine_algorithm="reduced", per_rank=[zero],
                        deepep_us=None, deepep_skipped="not requested")  # fmt: skip
    assert row["combine_checks_us"] == 0.0


# --------------------------------------------------------------------------------------------------
# the report's check
# --------------------------------------------------------------------------------------------------


def _meta() -> dict:
    return {"world_size": 2, "device": "NVIDIA H200", "hidden": 7168, "topk": 8, "num_experts": 256,
            "dtype": "bfloat16", "iters": 50}  # fmt: skip


def _report(tokens=REPORT_TOKENS, budgets=REPORT_BUDGETS, *, skip_at: int | None = 132) -> dict:
    """A decode report as the script writes it (DeepEP measured, skipped at the ``skip_at`` budget)."""
    rows = []
    for b in budgets:
        for t in tokens:
            skipped = "DeepEP Buffer at 128 SMs failed (RuntimeError: no NVLink)" if b == skip_at else None
            rows.append(bp.decode_row(
                tokens=t, num_sms=b, combine_algorithm="reduced",
                per_rank=[_rank(t / 8 + 1), _rank(t / 8 + 2)],
                deepep_us=None if skipped else [[60.0, 120.0, 70.0, 65.0]] * 2, deepep_skipped=skipped,
            ))  # fmt: skip
    return json.loads(json.dumps({"schema": bp.DECODE_SCHEMA, "meta": _meta(), "rows": rows}))


def test_check_decode_json_accepts_a_good_report_and_requires_the_grid(tmp_path):
    good = _report()
    bp.check_decode_json(good)
    bp.check_decode_json(good, tokens=REPORT_TOKENS, num_sms=REPORT_BUDGETS)
    bp.check_perf_json(good, ("tokens", "num_sms", "dispatch_us", "combine_us"))  # the results form holds
    written = bp.write_decode_json(tmp_path / "sub" / "d.json", good["meta"], good["rows"])
    assert json.loads((tmp_path / "sub" / "d.json").read_text()) == written == good
    partial = {**good, "rows": [r for r in good["rows"] if (r["tokens"], r["num_sms"]) != (256, 24)]}
    bp.check_decode_json(partial)  # fine as a report, but not the committed report's grid
    with pytest.raises(br.BenchReportError, match=r"no row for \(tokens, num_sms\) \[\(256, 24\)\]"):
        bp.check_decode_json(partial, tokens=REPORT_TOKENS, num_sms=REPORT_BUDGETS)


def _set(path: str, value):
    def mutate(report: dict) -> None:
        where, key = path.split(".", 1)
        target = report["meta"] if where == "meta" else report["rows"][int(where)]
        if value is KeyError:
            del target[key]
        else:
            target[key] = value

    return mutate


@pytest.mark.parametrize("mutate,message", [
    (_set("meta.iters", KeyError), "meta is missing key(s) ['iters']"),
    (_set("meta.iters", 0), "meta 'iters' must be an integer >= 1, got 0"),
    (_set("0.api_dispatch_us", KeyError), "row 0 (tokens=1, num_sms=24): missing 'api_dispatch_us'"),
    (_set("0.deepep_skipped", KeyError), "missing 'deepep_skipped'"),
    (_set("1.dispatch_us", 0.0), "row 1 (tokens=32, num_sms=24): 'dispatch_us' must be a positive time"),
    (_set("2.api_combine_us", -3.0), "'api_combine_us' must be a positive time (us), got -3.0"),
    (_set("2.layout_us", None), "'layout_us' must be a positive time (us), got None"),
    (_set("2.reduced_combine_us", None), "'reduced_combine_us' must be a positive time (us), got None"),
    (_set("3.dispatch_status_us", -1.0), "'dispatch_status_us' must be a time >= 0 (us), got -1.0"),
    (_set("3.api_dispatch_host_us", "12"), "'api_dispatch_host_us' must be a number (us), got '12'"),
    (_set("0.combine_us", 1.5), "'combine_us' (1.5) must be the default combine's time 'reduced_combine_us'"),
    (_set("0.combine_algorithm", "push"),
     "'combine_algorithm' must be one of ['pull', 'reduced'], got 'push'"),
    (_set("0.deepep_dispatch_us", None), "DeepEP measured in part"),
    (_set("4.deepep_skipped", None), "'deepep_dispatch_us' is None without a 'deepep_skipped' reason"),
    (_set("0.deepep_skipped", "why not"), "DeepEP has times and a skip reason ('why not')"),
    (_set("0.deepep_num_sms", 25), "'deepep_num_sms' must be an even integer >= 2 or None, got 25"),
    (_set("0.tokens", 32), "rows 0 and 1 are both tokens=32, num_sms=24"),
    (lambda r: r.update(rows=[]), "'rows' must be a non-empty list"),
    (lambda r: r.update(schema="cute-ep-bench/1"),
     "schema is 'cute-ep-bench/1', expected 'cute-ep-decode/1'"),
])  # fmt: skip
def test_check_decode_json_names_what_is_wrong(mutate, message):
    bad = copy.deepcopy(_report())
    mutate(bad)
    with pytest.raises(br.BenchReportError) as err:
        bp.check_decode_json(bad)
    assert message in str(err.value)


def test_check_decode_json_accepts_a_pull_buffer_without_the_reduced_combine():
    row = bp.decode_row(tokens=1, num_sms=24, combine_algorithm="pull", per_rank=[_rank(2.0, reduced=False)],
                        deepep_us=None, deepep_skipped="not requested (--peers none)")  # fmt: skip
    bp.check_decode_json(json.loads(json.dumps({"meta": _meta(), "rows": [row]})))


def test_check_decode_json_refuses_a_non_object():
    with pytest.raises(br.BenchReportError, match="must be a JSON object"):
        bp.check_decode_json([])


def test_tables_and_progress_lines():
    report = _report(tokens=(1, 128), budgets=(24, 132))
    rows = report["rows"]
    text = bp.format_decode_tables(rows)
    lines = text.splitlines()
    assert "dep sms" in lines[0] and "dep full" in lines[0] and "reduced combine" in lines[0]
    assert lines[1].split()[:2] == ["24", "1"] and lines[1].split()[-4:] == ["24", "60.0", "120.0", "65.0"]
    assert lines[3].split()[-4:] == ["128", "skip", "skip", "skip"]  # 132 SMs: DeepEP at 128, skipped
    calls = [ln for ln in lines if "dispatch()" in ln or "combine()" in ln or "sync=False" in ln]
    assert len(calls) == 3 * len(rows)
    first = calls[0].split()  # sms tokens call wall kernels host checks enqueue status DeepEP
    r = rows[0]
    assert first[:3] == ["24", "1", "dispatch()"]
    want = (r["api_dispatch_us"], r["dispatch_us"], r["api_dispatch_host_us"], 1.0, 2.0, 3.0, 120.0)
    assert first[3:] == [f"{v:.1f}" for v in want]
    assert calls[1].split()[-2:] == ["-", "-"] and calls[2].split()[-1] == "65.0"
    assert "DeepEP skipped: DeepEP Buffer at 128 SMs failed (RuntimeError: no NVLink)" in text
    assert bp.format_decode_progress(rows[0]).startswith("[T=1 num_sms=24] kernels: dispatch ")
    assert "DeepEP (24 SMs): dispatch 60.0, full 120.0, combine 65.0" in bp.format_decode_progress(rows[0])
    assert bp.format_decode_progress(rows[2]).endswith("DeepEP skipped: DeepEP Buffer at 128 SMs failed "
                                                       "(RuntimeError: no NVLink)")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the committed report (produced by one 2x H200 run)
# --------------------------------------------------------------------------------------------------


def check_decode_baseline(report: dict) -> None:
    """What the committed 2x H200 report must hold: a valid decode report from
    2 ranks with a row for every tokens in 1, 32, 128, 256 at 24 SMs and the full GPU, DeepEP measured in
    each at its budget for ours."""
    bp.check_decode_json(report, tokens=REPORT_TOKENS, num_sms=REPORT_BUDGETS)
    assert report["meta"]["world_size"] == 2, report["meta"]["world_size"]
    for row in report["rows"]:
        assert row["deepep_skipped"] is None, (row["tokens"], row["num_sms"], row["deepep_skipped"])
        assert row["deepep_num_sms"] == bp.deepep_num_sms(row["num_sms"])


def test_committed_h200x2_decode_report():
    if not BASELINE.exists():
        pytest.skip(f"{BASELINE.relative_to(REPO)} is not committed yet (a 2x H200 run of "
                    "scripts/decode_breakdown.py --tokens 1,32,128,256 --num-sms 24,132 --peers deepep "
                    "--out-json ... writes it)")
    check_decode_baseline(json.loads(BASELINE.read_text()))


def test_the_baseline_check_can_fail():
    check_decode_baseline(_report(skip_at=None))
    with pytest.raises(AssertionError):  # DeepEP skipped at the full GPU
        check_decode_baseline(_report())
    with pytest.raises(br.BenchReportError, match=r"no row for \(tokens, num_sms\) \[\(1, 132\)"):
        check_decode_baseline(_report(budgets=(24,), skip_at=None))


# --------------------------------------------------------------------------------------------------
# a whole run over gloo: ReferenceEpBuffer for EpBuffer, a counting timer, and deep_ep absent or a
# stand-in with DeepEP's intranode semantics (tests/_bench_stand_ins.py)
# --------------------------------------------------------------------------------------------------

_WORKER = r'''
import types

import _bench_stand_ins as stand_ins
import decode_breakdown as db
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.tools.cli import Printer
from cute_ep.input_checks import resolve_combine_algorithm

KIND = sys.argv[1]
sys.modules["deep_ep"] = None  # this machine's deep_ep (if any) must not decide the test


class Launching(stand_ins.Launching):
    """EpBuffer's launch API on the torch reference (each launch a collective, as on the GPU)."""

    status = types.SimpleNamespace(read=lambda: {})

    def launch_dispatch(self, x, idx, w, mode="scatter", fp8=False, algorithm=None, layout="expert"):
        self.dispatch(x, idx, w, mode, fp8=fp8)

    def _launch(self, op, num_tokens, **tensors):  # the layout kernel alone: its count exchange
        self._all_gather(num_tokens)

    def _check_combine_algorithm(self, handle, algorithm):
        resolve_combine_algorithm(self.cfg, algorithm)

    def check_ran(self):
        pass


class CountingTimer:
    """Call k on rank r: iteration i takes 10 (k + 1) + 3 [r == k % 2] + i us (median: + 1)."""

    def __init__(self, runtime):
        self.runtime, self.calls = runtime, 0

    def run(self, step, warmup, iters):
        self.runtime.barrier()
        for i in range(warmup + 1 + iters):
            step(i)
        k, self.calls = self.calls, self.calls + 1
        base = 10 * (k + 1) + (3 if self.runtime.env.rank == k % 2 else 0)
        return [float(base + i) for i in range(iters)]


args = db.build_parser().parse_args(sys.argv[2:])
db.validate_args(args)
env = DistEnv.from_environ()
cfg = db.make_config(args, env)
with Runtime(env, backend="gloo") as rt:
    code = db.decode_report(args, cfg, rt, Printer(env.rank), make_buffer=Launching, make_timer=CountingTimer,
                            make_deepep=None if KIND == "absent" else stand_ins.deepep_peer)
    if KIND != "absent":
        print(f"rank {env.rank} DeepEP buffers made at {stand_ins.Buffer.made}", flush=True)
sys.exit(code)
'''

SMALL = ("--hidden", "64", "--topk", "2", "--num-experts", "8", "--tokens", "1,8", "--iters", "3",
         "--warmup", "1")  # fmt: skip


def _run(tmp_path: Path, kind: str, *args: str) -> tuple[str, dict]:
    out_json = tmp_path / "d.json"
    worker = write_worker(tmp_path, _WORKER)
    codes, out = launch_ranks(worker, kind, *SMALL, *args, "--out-json", str(out_json), world=2, timeout=300)
    assert codes == [0, 0], out[-6000:]
    report = json.loads(out_json.read_text())
    bp.check_decode_json(report)
    return out, report


def _median(k: int) -> float:
    """The slowest rank's median of CountingTimer's call k (the rank with the + 3 that call)."""
    return 10.0 * (k + 1) + 3 + 1


def test_whole_run_with_deepep_beside_ours_at_each_budget(tmp_path):
    out, report = _run(tmp_path, "deepep", "--num-sms", "24,132,1")
    rows = report["rows"]
    assert [(r["num_sms"], r["tokens"]) for r in rows] == [(b, t) for b in (24, 132, 1) for t in (1, 8)]
    bp.check_decode_json(report, tokens=(1, 8), num_sms=(24, 132, 1))
    k = 0  # timer calls, in the driver's order: layout, dispatch, pull, reduced, then DeepEP's four
    for r in rows:
        assert (r["layout_us"], r["dispatch_us"]) == (_median(k), _median(k + 1))
        assert (r["pull_combine_us"], r["reduced_combine_us"]) == (_median(k + 2), _median(k + 3))
        assert r["combine_us"] == r["reduced_combine_us"] and r["combine_algorithm"] == "reduced"
        assert r["per_rank"]["layout_us"] == [_median(k), _median(k) - 3]  # rank 0 slower on even calls
        assert r["per_rank"]["dispatch_us"] == [_median(k + 1) - 3, _median(k + 1)]
        k += 4
        assert r["api_dispatch_us"] > 0 and r["api_combine_us"] > 0 and r["dispatch_enqueue_us"] > 0
        assert r["api_dispatch_host_us"] == r["api_dispatch_us"] - r["dispatch_us"]
        if r["num_sms"] == 1:
            assert r["deepep_skipped"] == "an SM budget of 1 leaves DeepEP no even SM count >= 2"
            assert r["deepep_num_sms"] is None and r["deepep_dispatch_us"] is None
            continue
        assert r["deepep_skipped"] is None, r["deepep_skipped"]
        assert r["deepep_num_sms"] == {24: 24, 132: 128}[r["num_sms"]]
        times = [r[f"deepep_{n}_us"] for n in bp.DEEPEP_TIMES]
        assert times == [_median(k + j) for j in range(4)]
        k += 4
    meta = report["meta"]
    assert (meta["world_size"], meta["device"], meta["iters"], meta["hidden"]) == (2, "cpu", 3, 64)
    assert meta["num_sms_budgets"] == [24, 132, 1] and meta["deepep"]["num_sms"] == {"24": 24, "132": 128,
                                                                                      "1": None}  # fmt: skip
    assert meta["deepep"]["skipped"] is None
    assert "rank 0 DeepEP buffers made at [24, 128]" in out  # one DeepEP buffer per budget that runs it
    for r in rows:
        assert bp.format_decode_progress(r) in out  # one progress line per row, as measured
    assert bp.format_decode_tables(rows) in out


def test_whole_run_without_deep_ep_says_why_in_every_row(tmp_path):
    out, report = _run(tmp_path, "absent", "--num-sms", "24,132", "--combine", "pull")
    rows = report["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["deepep_skipped"].startswith("deep_ep is not importable ("), r["deepep_skipped"]
        assert all(r[f"deepep_{n}_us"] is None for n in bp.DEEPEP_TIMES)
        assert r["deepep_num_sms"] == {24: 24, 132: 128}[r["num_sms"]]
        # a pull buffer: no reduced combine; combine() and combine_us are the pull combine
        assert r["reduced_combine_us"] is None and r["combine_us"] == r["pull_combine_us"]
    assert report["meta"]["deepep"]["skipped"].startswith("deep_ep is not importable")
    assert "DeepEP skipped: deep_ep is not importable" in out
    assert bp.format_decode_tables(rows) in out


def test_whole_run_with_peers_none(tmp_path):
    _, report = _run(tmp_path, "absent", "--num-sms", "24", "--tokens", "8", "--peers", "none")
    (row,) = report["rows"]
    assert row["deepep_skipped"] == "not requested (--peers none)"
    assert report["meta"]["peers"] == [] and report["meta"]["deepep"]["requested"] is False


def test_script_and_bench_peers_import_no_gpu_module():
    code = (
        f"import sys; sys.argv = ['x']; sys.path.insert(0, {str(SCRIPT.parent)!r}); "
        "import decode_breakdown, cute_ep.tools.bench_peers"
    )
    assert_imports_none(code, ("torch", "cutlass", "nvshmem", "deep_ep"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_layout_in_dispatch_reaches_the_config(db):
    """--layout-in-dispatch sets EpConfig.layout_in_dispatch (0: the layout kernel of its own at every size);
    without it the config's default applies."""
    from types import SimpleNamespace

    from cute_ep.kernels.config import LAYOUT_IN_DISPATCH_TOKENS

    env = SimpleNamespace(world_size=2, local_world_size=2)
    for flag, want in ((["--layout-in-dispatch", "0"], 0), ([], LAYOUT_IN_DISPATCH_TOKENS)):
        args = db.build_parser().parse_args(["--tokens", "1,8", *flag])
        db.validate_args(args)
        assert db.make_config(args, env).layout_in_dispatch == want


def test_committed_h200x4_decode_report():
    """The 4x H200 run (2026-11-26): scripts/decode_breakdown.py --tokens 1,128,256 --num-sms 24,max
    --peers deepep at 4 ranks; DeepEP measured beside every row."""
    report = json.loads((REPO / "baselines" / "perf" / "h200x4_decode.json").read_text())
    bp.check_decode_json(report, tokens=[1, 128, 256], num_sms=[24, 132])
    assert report["meta"]["world_size"] == 4 and report["meta"]["ranks_per_gpu"] == 1
    for row in report["rows"]:
        assert row["deepep_skipped"] is None, (row["tokens"], row["num_sms"], row["deepep_skipped"])
