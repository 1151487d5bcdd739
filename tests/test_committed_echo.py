"""The committed ECHO reports (baselines/perf/echo_*.json, written by scripts/echo_bench.py) hold the
measurement they claim: 4 ranks, 256 experts, top-8, 4096 tokens per rank, Zipf 0.8 / 1.0 / 1.2, both
scenarios; for every (scenario, skew) ECHO's max / mean rows per rank is no worse than no cloning (and
the rows ECHO routed matched its plan); the planner, weight-copy and step times are there and positive;
a plot lies beside each. ``check_echo_report`` lists what is wrong, so a tampered report is caught
(tested below)."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

PERF = Path(__file__).resolve().parents[1] / "baselines" / "perf"
REPORTS = sorted([*PERF.glob("echo_*.json"), *PERF.glob("*_echo.json")])
SCHEMA = "cute-ep-echo/1"
# The shapes the measurement is defined at (balance at full shape; the step may be smaller on a CPU).
SHAPES = {"world_size": 4, "num_experts": 256, "topk": 8, "tokens": 4096}
SKEWS = (0.8, 1.0, 1.2)
SCENARIOS = ("fixed", "drift")
NAMES = ("none", "static", "echo")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and value > 0


def check_echo_report(report: dict) -> list[str]:
    """What is wrong with an ECHO report (an empty list: nothing)."""
    problems = []
    if report.get("schema") != SCHEMA:
        return [f"schema is {report.get('schema')!r}, expected {SCHEMA!r}"]
    meta = report.get("meta", {})
    for key in ("backend", "device", "spare_slots", "steps", "iters", "expert_shape", "step_tokens",
                "step_hidden", "timing", "git_sha", "timestamp", "command", *SHAPES):
        if key not in meta:
            problems.append(f"meta lacks {key!r}")
    for key, want in SHAPES.items():
        if key in meta and meta[key] != want:
            problems.append(f"meta {key} is {meta[key]!r}, expected {want}")
    if meta.get("backend") == "reference" and "indicative" not in str(meta.get("timing", "")):
        problems.append("a reference-backend report must call its times indicative")

    # balance: one row per (scenario, skew); echo never above no cloning; the ratios follow the rows
    rows = report.get("balance", [])
    got = [(r.get("scenario"), r.get("skew")) for r in rows]
    want = set(itertools.product(SCENARIOS, SKEWS))
    if len(got) != len(set(got)) or set(got) != want:
        problems.append(f"balance rows are {sorted(got)}, expected {sorted(want)} once each")
    rows_per_rank = SHAPES["tokens"] * SHAPES["topk"]  # every rank sends T * K rows: the mean received
    for r in rows:
        where = f"balance {r.get('scenario')} zipf {r.get('skew')}"
        try:
            if r["mean_rows"] != pytest.approx(rows_per_rank):
                problems.append(f"{where}: mean_rows {r['mean_rows']} != tokens x topk = {rows_per_rank}")
            for name in NAMES:
                ratio = r[f"max_over_mean_{name}"]
                if ratio != pytest.approx(r[f"max_rows_{name}"] / r["mean_rows"]):
                    problems.append(f"{where}: max_over_mean_{name} is not max_rows_{name} / mean_rows")
                if not 1.0 <= ratio < SHAPES["world_size"]:
                    problems.append(f"{where}: max_over_mean_{name} {ratio} outside [1, world size)")
            if r["max_over_mean_echo"] > r["max_over_mean_none"]:
                problems.append(f"{where}: echo {r['max_over_mean_echo']:.4f} above no cloning "
                                f"{r['max_over_mean_none']:.4f}")
            if r["echo_matches_plan"] is not True or r["echo_never_worse"] is not True:
                problems.append(f"{where}: echo_matches_plan / echo_never_worse not both true")
            if not 0 <= r["clones_per_step"] <= SHAPES["world_size"] * meta.get("spare_slots", 0):
                problems.append(f"{where}: clones_per_step {r['clones_per_step']} outside [0, R x S]")
        except KeyError as exc:
            problems.append(f"{where}: lacks {exc}")

    # costs: the planner alone and with its all-gather, the weight copy of a plan with clones
    for key in ("plan_ms", "plan_clones_ms", "copy_ms"):
        if not _positive(report.get(key)):
            problems.append(f"{key} is {report.get(key)!r}, expected a positive time")
    if not (isinstance(report.get("clones_in_copy"), int) and report["clones_in_copy"] >= 1):
        problems.append(f"clones_in_copy is {report.get('clones_in_copy')!r}, expected >= 1")
    if "expert_shape" in meta and report.get("expert_bytes") != math.prod(meta["expert_shape"]) * 2:
        problems.append(f"expert_bytes {report.get('expert_bytes')!r} is not the bf16 size of "
                        f"{meta['expert_shape']}")

    # step: dispatch + stand-in expert + combine, without and with ECHO, one row per skew
    steps = report.get("step_ms", [])
    if sorted(s.get("skew") for s in steps) != sorted(SKEWS):
        problems.append(f"step_ms skews are {[s.get('skew') for s in steps]}, expected {list(SKEWS)}")
    for s in steps:
        for key in ("plain_ms", "echo_ms"):
            if not _positive(s.get(key)):
                problems.append(f"step zipf {s.get('skew')}: {key} is {s.get(key)!r}, not a positive time")
        if (s.get("tokens"), s.get("hidden")) != (meta.get("step_tokens"), meta.get("step_hidden")):
            problems.append(f"step zipf {s.get('skew')}: shape {(s.get('tokens'), s.get('hidden'))} is not "
                            f"meta's step_tokens / step_hidden")
    return problems


def test_the_cpu_reference_report_is_committed():
    assert PERF / "echo_cpu_reference.json" in REPORTS


@pytest.mark.parametrize("path", REPORTS, ids=[p.stem for p in REPORTS])
def test_echo_report_holds_its_measurement(path):
    report = json.loads(path.read_text())
    assert check_echo_report(report) == []
    png = path.with_suffix(".png")
    assert png.is_file(), f"{path.name} has no plot beside it"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png.name} is not a PNG"
    assert png.stat().st_size < 200_000, f"{png.name} is {png.stat().st_size} bytes"


def _tampered(report: dict, change: Any) -> dict:
    bad = copy.deepcopy(report)
    change(bad)
    return bad


def _echo_above_none(r: dict) -> None:
    row = r["balance"][-1]
    row["max_rows_echo"] = row["max_rows_none"] + 1
    row["max_over_mean_echo"] = row["max_rows_echo"] / row["mean_rows"]


TAMPERINGS = {
    "echo above none": _echo_above_none,
    "fewer tokens": lambda r: r["meta"].update(tokens=256),
    "two ranks": lambda r: r["meta"].update(world_size=2),
    "a skew missing": lambda r: r["balance"].pop(0),
    "no planner time": lambda r: r.pop("plan_ms"),
    "zero copy time": lambda r: r.update(copy_ms=0.0),
    "negative step time": lambda r: r["step_ms"][0].update(echo_ms=-1.0),
    "plan mismatch": lambda r: r["balance"][0].update(echo_matches_plan=False),
    "another schema": lambda r: r.update(schema="cute-ep-bench/1"),
}


@pytest.mark.parametrize("name", TAMPERINGS)
def test_a_tampered_report_is_caught(name):
    report = json.loads((PERF / "echo_cpu_reference.json").read_text())
    assert check_echo_report(_tampered(report, TAMPERINGS[name])), f"{name}: not caught"
