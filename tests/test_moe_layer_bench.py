"""scripts/moe_layer_bench.py on the CPU: a smoke run on the reference backend (with the all-to-all one
over gloo as the peer) at small sizes writes a report its own checker accepts, DeepEP is skipped with
the reason, bad arguments stop with exit status 2, the checker rejects broken reports, and any committed
report (baselines/perf/moe_layer_*.json) passes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from _launch import REPO, assert_argument_error, import_script, run_single

SCRIPT = REPO / "scripts" / "moe_layer_bench.py"
SMALL = ["--backend", "reference", "--tokens", "8,24", "--hidden", "64", "--intermediate", "32",
         "--num-experts", "8", "--topk", "2", "--groups", "4", "--topk-groups", "2", "--shared", "32",
         "--iters", "2", "--warmup", "1"]  # fmt: skip
COMMITTED = sorted([*(REPO / "baselines" / "perf").glob("moe_layer_*.json"),
                    *(REPO / "baselines" / "perf").glob("*_moe_layer.json")])


@pytest.fixture(scope="module")
def bench():
    return import_script(SCRIPT, "moe_layer_bench_script")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs gloo")
    out = tmp_path_factory.mktemp("moe_bench") / "moe.json"
    proc = run_single(SCRIPT, *SMALL, "--out-json", out, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def test_smoke_run_writes_a_valid_report(bench, smoke):
    bench.check_report(smoke)
    meta = smoke["meta"]
    assert meta["device"] == "cpu" and meta["world_size"] == 1 and meta["gpu_shared"] is False
    variants = {(r["tokens"], r["backend"], r["swiglu"]) for r in smoke["rows"]}
    for t in (8, 24):
        want = {(t, "reference", "torch"), (t, "reference", "plain"), (t, "a2a", "torch"),
                (t, "deepep", "kernel")}
        assert want <= variants, variants
    for r in smoke["rows"]:
        if r["backend"] == "deepep":
            assert r["forward_us"] is None and "deep_ep" in r["skipped"]
        else:
            assert r["forward_us"] > 0 and r["fwd_bwd_us"] > 0 and r["buffer_rows"] == meta["capacity"]


def test_swiglu_rows_cover_the_worst_case_buffer(smoke):
    rows = smoke["swiglu"]
    assert {(r["tokens"], r["impl"]) for r in rows} == {(t, i) for t in (8, 24) for i in ("plain", "torch")}
    for r in rows:
        assert 0 < r["live_rows"] <= r["buffer_rows"] == smoke["meta"]["capacity"]
    # 8 tokens of a buffer sized for 24: most rows are padding.
    assert all(r["live_rows"] < r["buffer_rows"] for r in rows if r["tokens"] == 8)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.update(schema="other"), "schema"),
        (lambda r: r["meta"].pop("ranks_per_gpu"), "meta lacks ['ranks_per_gpu']"),
        (lambda r: r["rows"][0].update(forward_us=-1.0), "forward_us must be positive"),
        (lambda r: r["rows"][0].update(fwd_bwd_us=None, skipped=None), "needs a 'skipped' reason"),
        (lambda r: r["swiglu"][0].pop("live_rows"), "swiglu row 0 lacks ['live_rows']"),
        (lambda r: r.update(rows=[]), "no rows"),
    ],
)
def test_the_checker_rejects_broken_reports(bench, smoke, change, message):
    report = json.loads(json.dumps(smoke))
    change(report)
    with pytest.raises(ValueError, match=re.escape(message)):
        bench.check_report(report)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "--tokens must list integers >= 1"),
    (["--peers", "nccl"], "--peers must list ['a2a', 'deepep'] or be 'none'"),
    (["--iters", "0"], "--iters must be >= 1"),
])
def test_bad_arguments_exit_2(argv, message):
    assert_argument_error(run_single(SCRIPT, *argv, timeout=60), message)


def test_sync_adds_the_synced_kernel_rows_of_the_kernels_backend(bench):
    """--sync: the kernel SwiGLU rows again with ``MoELayer(sync=True)`` (overlap off and on), labelled as
    such; without it, and for the other backends, every row is sync-free."""
    args = bench.parse_args(["--sync"])
    rows = bench.variants(args, "cute", True)
    assert [(r["swiglu"], r["overlap"], r["sync"]) for r in rows if r["sync"]] == [
        ("kernel", False, True), ("kernel", True, True)]
    assert bench.row_label(dict(rows[-1], backend="cute")) == "cute kernel overlap sync"
    assert not any(r["sync"] for r in bench.variants(bench.parse_args([]), "cute", True))
    assert not any(r["sync"] for r in bench.variants(args, "a2a", True))
    assert bench.row_label({"backend": "deepep", "swiglu": "kernel", "overlap": False,
                            "green_context": False, "sync": True}) == "deepep kernel"


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_reports_are_valid(bench, path: Path):
    bench.check_report(json.loads(path.read_text()))
