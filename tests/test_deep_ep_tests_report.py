"""scripts/deep_ep_tests.py: DeepEP's own test output parsed into the side-by-side report, the report's
completeness check, the whole script against a stand-in DeepEP tree on a CPU, and every committed
``baselines/perf/*_deep_ep_tests.json`` whole."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from _launch import REPO, import_script


@pytest.fixture(scope="module")
def dt():
    return import_script(REPO / "scripts" / "deep_ep_tests.py", "deep_ep_tests_script")


def intranode_output(layout_ms: float, bf16: float, fp8: float, combine: float,
                     fail_one: bool = False) -> str:
    """What DeepEP v1.2.1's test_intranode.py prints on rank 0 (its f-strings, values filled in)."""
    checks = []
    for i, fmt in enumerate(("BF16", "FP8")):
        end = "" if (fail_one and i == 1) else " passed"
        checks.append(f"[testing] Running with {fmt}, with top-k (async=False, previous=False) ...{end}")
    return "\n".join([
        "[config] num_tokens=4096, hidden=7168, num_topk=8",
        f"[layout] Kernel performance: {layout_ms:.3f} ms",
        "",
        *checks,
        "",
        "[tuning] SMs 24, NVL chunk 4: 260.10 GB/s (NVL), avg_t: 700.00 us",
        f"[tuning] Best dispatch (BF16): SMs 24, NVL chunk 6, 300.12 GB/s (NVL), t: {bf16:.2f} us",
        "",
        f"[tuning] Best dispatch (FP8): SMs 24, NVL chunk 8, 200.00 GB/s (NVL), t: {fp8:.2f} us",
        "",
        "[tuning] SMs 24, NVL chunk 1: 100.00 GB/s (NVL), avg_t: 999.00 us",
        f"[tuning] Best combine: SMs 24, NVL chunk 7: 310.00 GB/s (NVL), t: {combine:.2f} us",
        "",
    ])


def low_latency_output(pair: list[float], disp: list[float], comb: list[float], hook: list[tuple]) -> str:
    """What DeepEP v1.2.1's test_low_latency.py prints, one set of lines per rank."""
    lines = ["Allocating buffer size: 2116.291072 MB ..."]
    for r, (p, d, c, (ds, dr, cs, cr)) in enumerate(zip(pair, disp, comb, hook, strict=True)):
        lines.append(f"[rank {r}] Dispatch + combine bandwidth: 150.00 GB/s, avg_t={p:.2f} us, "
                     "min_t=90.00 us, max_t=120.00 us")
        lines.append(f"[rank {r}] Dispatch bandwidth: 200.00 GB/s, avg_t={d:.2f} us | Combine bandwidth: "
                     f"180.00 GB/s, avg_t={c:.2f} us")
        lines.append(f"[rank {r}] Dispatch send/recv time: {ds:.2f} + {dr:.2f} us | Combine send/recv time: "
                     f"{cs:.2f} + {cr:.2f} us")
    return "\n".join(lines) + "\n"


def test_parses_rank_zero_lines_and_the_slowest_rank(dt):
    vals = dt.parse_values("intranode", intranode_output(0.047, 352.5, 257.7, 395.2))
    assert vals == {"[layout] Kernel performance": pytest.approx(47.0),
                    "[tuning] Best dispatch (BF16)": 352.5, "[tuning] Best dispatch (FP8)": 257.7,
                    "[tuning] Best combine": 395.2}
    hook = [(5.1, 6.2, 7.3, 8.4), (5.0, 9.9, 7.0, 8.0)]
    ll = low_latency_output([97.5, 99.1], [28.4, 31.0], [40.6, 40.2], hook)
    vals = dt.parse_values("low_latency", ll)
    assert vals["dispatch + combine (bench avg_t)"] == 99.1
    assert vals["dispatch kernel (bench_kineto avg_t)"] == 31.0
    assert vals["combine kernel (bench_kineto avg_t)"] == 40.6
    assert (vals["dispatch send (return_recv_hook)"], vals["dispatch recv (return_recv_hook)"]) == (5.1, 9.9)
    assert (vals["combine send (return_recv_hook)"], vals["combine recv (return_recv_hook)"]) == (7.3, 8.4)


def test_a_line_the_output_lacks_is_none_and_checks_are_counted(dt):
    text = intranode_output(0.1, 1.0, 2.0, 3.0, fail_one=True).replace("[tuning] Best combine", "[tuning] x")
    vals = dt.parse_values("intranode", text)
    assert vals["[tuning] Best combine"] is None and vals["[tuning] Best dispatch (FP8)"] == 2.0
    assert dt.count_checks("intranode", text) == {"run": 2, "passed": 1}
    assert dt.count_checks("low_latency", text) is None


def _runs(dt, ours_rc: int = 0) -> dict:
    hook = [(5.0, 6.0, 7.0, 8.0)] * 2
    return {
        "intranode": {"deep_ep": {"command": "a", "rc": 0,
                                  "text": intranode_output(0.047, 352.5, 257.7, 395.2)},
                      "cute_ep": {"command": "b", "rc": ours_rc,
                                  "text": intranode_output(0.040, 300.0, 250.0, 390.0)}},
        "low_latency": {"deep_ep": {"command": "c", "rc": 0,
                                    "text": low_latency_output([97.5] * 2, [30.0] * 2, [40.0] * 2, hook)},
                        "cute_ep": {"command": "d", "rc": 0,
                                    "text": low_latency_output([90.0] * 2, [29.0] * 2, [38.0] * 2, hook)}},
    }


def test_report_pairs_the_modules_with_their_ratio_and_is_whole(dt):
    rep = dt.build_report(_runs(dt), gpu="H200", num_gpus=4, commit="abc1234", date="2026-11-27",
                          deepep_version="v1.2.1")
    line = next(ln for ln in rep["lines"] if ln["line"] == "[tuning] Best dispatch (BF16)")
    assert (line["deep_ep"], line["cute_ep"], line["ratio"], line["how"]) == (352.5, 300.0, 0.851, "rank 0")
    assert len(rep["lines"]) == len(dt.LINES)
    assert rep["runs"]["intranode"]["cute_ep"]["checks"] == {"run": 2, "passed": 2}
    assert dt.check_report(rep) == []
    # both modules split a return_recv_hook call into its sending and receiving kernels: same fields
    hook = next(ln for ln in rep["lines"] if ln["line"] == "dispatch recv (return_recv_hook)")
    assert set(hook) == set(line) and hook["cute_ep"] is not None
    json.dumps(rep)  # plain JSON


def test_incomplete_reports_say_what_is_missing(dt):
    runs = _runs(dt, ours_rc=1)
    del runs["low_latency"]["deep_ep"]
    runs["intranode"]["cute_ep"]["text"] = runs["intranode"]["cute_ep"]["text"].replace("Best combine", "x")
    rep = dt.build_report(runs, gpu="H200", num_gpus=2, commit="abc", date="2026-11-27",
                          deepep_version="v1.2.1")
    problems = dt.check_report(rep)
    assert "intranode on cute_ep exited 1" in problems
    assert "no low_latency run on deep_ep" in problems
    assert "intranode '[tuning] Best combine': no value from cute_ep" in problems
    assert any("dispatch kernel" in p and "no value from deep_ep" in p for p in problems)
    rep = dt.build_report(_runs(dt), gpu="H200", num_gpus=2, commit="abc", date="2026-11-27",
                          deepep_version="v1.2.1")
    rep["lines"][0]["ratio"] = 0.5
    assert any("is not cute_ep / deep_ep" in p for p in dt.check_report(rep))


def test_usage_errors_exit_2_naming_the_fix(dt, tmp_path, capsys):
    assert dt.main(["--deepep", str(tmp_path), "--num-processes", "2"]) == 2
    assert "tests/test_intranode.py" in capsys.readouterr().err
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_intranode.py").write_text("")
    assert dt.main(["--deepep", str(tmp_path), "--num-processes", "0"]) == 2
    assert "--num-processes must be >= 1" in capsys.readouterr().err
    assert dt.main(["--deepep", str(tmp_path), "--num-processes", "2", "--tests", "internode"]) == 2
    assert "unknown test or module ['internode']" in capsys.readouterr().err


def test_the_script_runs_both_modules_and_reuses_kept_logs(dt, tmp_path, monkeypatch):
    """A stand-in DeepEP tree whose tests print DeepEP's lines, with values that say which deep_ep they
    imported (DeepEP's own, or the shim that re-exports cute_ep.deep_ep)."""
    tree = tmp_path / "DeepEP"
    (tree / "tests").mkdir(parents=True)
    (tree / "deep_ep.py").write_text("ORIGIN = 'deepep'\n")
    common = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        import deep_ep
        ours = getattr(deep_ep, 'ORIGIN', 'cute') == 'cute'
        from test_deep_ep_tests_report import intranode_output, low_latency_output
    """)
    (tree / "tests" / "test_intranode.py").write_text(
        common + "print(intranode_output(0.040 if ours else 0.047, 300.0 if ours else 352.5, 250.0, "
                 "390.0))\n")
    (tree / "tests" / "test_low_latency.py").write_text(
        common + "print(low_latency_output([90.0 if ours else 97.5], [29.0], [38.0], "
                 "[(5.0, 6.0, 7.0, 8.0)]))\n")
    monkeypatch.setattr(dt, "gpu_name", lambda: ("H200", 4))
    logs, out = tmp_path / "logs", tmp_path / "report.json"
    # DeepEP's low-latency run first and alone (as on a host where it must precede our NVSHMEM) ...
    assert dt.main(["--deepep", str(tree), "--num-processes", "1", "--log-dir", str(logs), "--tests",
                    "low_latency", "--modules", "deep_ep", "--no-report"]) == 0
    assert (logs / "low_latency_deep_ep_ep1.rc").read_text() == "0"
    # ... then the rest; the kept log joins the report.
    assert dt.main(["--deepep", str(tree), "--num-processes", "1", "--log-dir", str(logs), "--out", str(out),
                    "--tests", "intranode", "--modules", "deep_ep,cute_ep"]) == 0
    assert dt.main(["--deepep", str(tree), "--num-processes", "1", "--log-dir", str(logs), "--out", str(out),
                    "--tests", "low_latency", "--modules", "cute_ep"]) == 0
    rep = json.loads(out.read_text())
    assert dt.check_report(rep) == [], rep
    by = {(ln["test"], ln["line"]): ln for ln in rep["lines"]}
    assert by[("intranode", "[layout] Kernel performance")]["cute_ep"] == pytest.approx(40.0)
    assert by[("intranode", "[layout] Kernel performance")]["deep_ep"] == pytest.approx(47.0)
    assert by[("low_latency", "dispatch + combine (bench avg_t)")]["ratio"] == round(90.0 / 97.5, 3)
    assert rep["gpu"] == "H200" and rep["num_gpus"] == 1 and rep["deep_ep_version"] == "v1.2.1"


@pytest.mark.parametrize("path", sorted((REPO / "baselines" / "perf").glob("*_deep_ep_tests.json")),
                         ids=lambda p: p.name)
def test_committed_reports_are_whole(dt, path: Path):
    rep = json.loads(path.read_text())
    assert dt.check_report(rep) == []
    assert path.name == f"{rep['gpu'].lower()}x{rep['num_gpus']}_deep_ep_tests.json"
