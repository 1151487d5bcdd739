"""The committed benchmark reports (baselines/perf/*.json) parse and hold every configuration of
their sweep, with a plot beside each."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from cute_ep.tools import bench_report as br

PERF = Path(__file__).resolve().parents[1] / "baselines" / "perf"
# Decode reports (scripts/decode_breakdown.py, another schema, no plot) are checked by test_decode_report.py,
# ECHO reports (scripts/echo_bench.py, another schema) by test_committed_echo.py.
# MoE-layer reports (scripts/moe_layer_bench.py) by test_moe_layer_bench.py, DeepEP's own tests side by side
# (scripts/deep_ep_tests.py) by test_deep_ep_tests_report.py, the public calls' reports
# (scripts/public_calls.py) by test_public_calls_script.py.
# Launch-cost reports (scripts/launch_cost.py) by test_launch_cost_script.py.
OTHER_SCHEMAS = ("_decode", "_echo", "_moe_layer", "_deep_ep_tests", "_public_calls", "_launch_cost")
REPORTS = sorted(p for p in PERF.glob("*.json") if not p.stem.endswith(OTHER_SCHEMAS)
                 and not p.stem.startswith(("echo_", "moe_layer_")))


def test_there_are_committed_reports():
    assert REPORTS, f"no benchmark report in {PERF}"


@pytest.mark.parametrize("path", REPORTS, ids=[p.stem for p in REPORTS])
def test_report_holds_every_configuration_of_its_sweep(path):
    report = br.load_json(path)  # schema and required keys
    cfg = report["meta"]["config"]
    # The receive layouts swept (config "layouts"; reports written before it was recorded: the command's
    # --layouts, default expert).
    named = re.search(r"--layouts[ =](\S+)", report["meta"].get("command", ""))
    layouts = cfg.get("layouts") or (named.group(1).split(",") if named else ["expert"])
    # Expert layout: per mode, one row per combine (pull: the mode's own name; reduced: "<mode>+reduced");
    # rank layout: one row, mode "rank".
    labels = []
    if "expert" in layouts:
        labels += [m for m in cfg["modes"] if "pull" in cfg.get("combines", ["pull"])]
        labels += [f"{m}+reduced" for m in cfg["modes"] if "reduced" in cfg.get("combines", [])]
    if "rank" in layouts:
        # "rank+reduced": the rank layout's combine pushed; "rank+cached": its cached dispatch. Reports made
        # before these rows existed have none of them; a report that has one has it everywhere.
        labels.append("rank")
        labels += [m for m in ("rank+reduced", "rank+cached") if any(r["mode"] == m for r in report["rows"])]
    # --fp8 (config "fp8"; reports from before it was recorded were made without it): per layout's mode, a
    # row "<mode>+fp8" more.
    if cfg.get("fp8"):
        labels += [f"{m}+fp8" for m in cfg["modes"] if "expert" in layouts]
        labels += ["rank+fp8"] if "rank" in layouts else []
        # "rank+fp8+cached": the rank layout's cached FP8 dispatch (reports before it have none).
        labels += ["rank+fp8+cached"] if any(r["mode"] == "rank+fp8+cached" for r in report["rows"]) else []
    # A sweep over SM budgets (--num-sms) repeats every configuration per budget; older reports have one
    # budget and may not name it in meta.
    budgets = report["meta"].get("num_sms_budgets") or sorted({r.get("num_sms") for r in report["rows"]})
    want = set(itertools.product(cfg["routings"], cfg["tokens"], labels, budgets))
    got = [(r["routing"], r["tokens"], r["mode"], r.get("num_sms")) for r in report["rows"]]
    assert len(got) == len(set(got)), f"{path.name}: a configuration appears twice"
    missing, extra = sorted(want - set(got)), sorted(set(got) - want)
    assert not missing and not extra, f"{path.name}: missing {missing}, extra {extra}"
    world = report["meta"]["world_size"]
    for row in report["rows"]:
        assert len(row["dispatch_us_per_rank"]) == world and len(row["pairs_off"]) == world
        assert 0 < row["dispatch_us"] and 0 < row["combine_us"]
        assert 0 <= row["rows_off_mean"] <= row["pairs_off_mean"]
        # The ratio column is NCCL time over ours, as the table says.
        assert row["dispatch_ratio"] == pytest.approx(row["nccl_dispatch_us"] / row["dispatch_us"])
        # Moved bytes: one row per off-rank pair (pull), one partial row per off-rank group (reduced).
        moved_rows = row["rows_off_mean"] if row["mode"].endswith("+reduced") else row["pairs_off_mean"]
        expected = row["combine_alg_gbps"] * moved_rows / row["pairs_off_mean"]
        assert row["combine_moved_gbps"] == pytest.approx(expected)
    assert path.with_suffix(".png").is_file(), f"{path.name} has no plot beside it"


def test_the_4x_h200_report_measures_deepep_and_nccl_beside_both_layouts():
    """baselines/perf/h200x4_vs_deepep.json (4x H200, 2026-11-26): both receive layouts at 128, 4096 and
    8192 tokens per rank, at 24 SMs and the whole GPU, with DeepEP's dispatch and combine and NCCL's
    all-to-all timed in the same run for every row."""
    report = br.load_json(PERF / "h200x4_vs_deepep.json")
    meta = report["meta"]
    assert meta["world_size"] == 4 and meta["ranks_per_gpu"] == 1 and "H200" in meta["device"]
    assert sorted({r["tokens"] for r in report["rows"]}) == [128, 4096, 8192]
    assert sorted({r["num_sms"] for r in report["rows"]}) == [24, 132]
    for row in report["rows"]:
        assert row["deepep_dispatch_us"] > 0 and row["deepep_combine_us"] > 0, row["mode"]
        assert row["nccl_dispatch_us"] > 0
