"""cute_ep.tools.bench_report (metrics, JSON, table, plot) on the CPU, and scripts/benchmark.py's --help."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _launch import (
    REPO,
    assert_argument_error,
    assert_imports_none,
    launch_ranks,
    run_single,
    write_worker,
)

from cute_ep.tools import bench_report as br

SCRIPT = REPO / "scripts" / "benchmark.py"


# --------------------------------------------------------------------------------------------------
# routing metrics against naive loops
# --------------------------------------------------------------------------------------------------


def _naive_pairs_off(idx: np.ndarray, rank: int, el: int) -> int:
    n = 0
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0 and e // el != rank:
                n += 1
    return n


def _naive_rows_off(idx: np.ndarray, rank: int, el: int) -> int:
    n = 0
    for t in range(idx.shape[0]):
        dests = set()
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0 and e // el != rank:
                dests.add(e // el)
        n += len(dests)
    return n


def _naive_splits(idx: np.ndarray, world: int, el: int) -> list[int]:
    out = [0] * world
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[e // el] += 1
    return out


def _random_idx(rng: np.random.Generator, tokens: int, topk: int, experts: int, drop: float) -> np.ndarray:
    idx = (
        np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)])
        if tokens
        else np.zeros((0, topk), dtype=np.int64)
    )
    idx = idx.astype(np.int64)
    idx[rng.random(idx.shape) < drop] = -1
    return idx


@pytest.mark.parametrize("world,experts,topk,tokens,drop", [
    (4, 32, 2, 64, 0.0), (4, 32, 8, 37, 0.25), (2, 8, 3, 1, 0.5), (8, 256, 8, 100, 0.1), (1, 4, 4, 9, 0.3),
    (4, 16, 2, 0, 0.0),
])  # fmt: skip
def test_pairs_off_and_split_sizes_match_naive_loops(world, experts, topk, tokens, drop):
    rng = np.random.default_rng(world * 1000 + tokens)
    idx = _random_idx(rng, tokens, topk, experts, drop)
    el = experts // world
    for dtype in (np.int64, np.int32):
        splits = br.split_sizes(idx.astype(dtype), world, el)
        assert splits == _naive_splits(idx, world, el)
        assert all(isinstance(v, int) for v in splits)
        for rank in range(world):
            got = br.pairs_off(idx.astype(dtype), rank, el)
            assert isinstance(got, int)
            assert got == _naive_pairs_off(idx, rank, el)
            # off-rank pairs = all kept pairs minus those to self
            assert got == sum(splits) - splits[rank]


def _random_idx_repeats(rng: np.random.Generator, tokens: int, topk: int, experts: int, drop: float):
    """Like _random_idx but experts drawn with replacement: several k of a token may share a
    destination rank, or even an expert."""
    idx = rng.integers(0, experts, size=(tokens, topk)).astype(np.int64)
    idx[rng.random(idx.shape) < drop] = -1
    return idx


@pytest.mark.parametrize("world,experts,topk,tokens,drop", [
    (4, 32, 2, 64, 0.0), (4, 32, 8, 37, 0.25), (2, 8, 3, 1, 0.5), (8, 256, 8, 100, 0.1), (1, 4, 4, 9, 0.3),
    (4, 16, 2, 0, 0.0), (8, 64, 8, 50, 0.0), (16, 32, 6, 40, 0.4), (4, 8, 1, 20, 0.2), (2, 4, 4, 30, 1.0),
])  # fmt: skip
def test_rows_off_matches_naive_loop(world, experts, topk, tokens, drop):
    rng = np.random.default_rng(world * 7919 + topk * 31 + tokens)
    el = experts // world
    for idx in (
        _random_idx(rng, tokens, topk, experts, drop),
        _random_idx_repeats(rng, tokens, topk, experts, drop),
    ):
        for dtype in (np.int64, np.int32):
            for rank in range(world):
                got = br.rows_off(idx.astype(dtype), rank, el)
                assert isinstance(got, int)
                assert got == _naive_rows_off(idx, rank, el)
                # at most one row per off-rank pair, and at most one per (token, other rank)
                assert got <= br.pairs_off(idx, rank, el)
                assert got <= tokens * min(topk, world - 1)
        if drop == 1.0:
            assert all(br.rows_off(idx, r, el) == 0 for r in range(world))


def test_rows_off_edge_cases():
    # 2 ranks, 4 experts per rank: every kept pair goes to rank 0's experts.
    idx = np.array([[0, -1], [3, 1], [-1, -1], [2, 0]])
    assert br.rows_off(idx, 0, 4) == 0  # all to self
    assert br.rows_off(idx, 1, 4) == 3  # tokens 0, 1, 3 each send one row to rank 0
    assert br.rows_off(np.full((3, 2), -1), 1, 4) == 0  # all dropped
    assert br.rows_off(np.zeros((0, 4), dtype=np.int32), 0, 4) == 0  # no tokens
    assert br.rows_off(np.zeros((5, 0), dtype=np.int32), 0, 4) == 0  # top-k 0
    # One token, 8 experts on 3 other ranks (one repeated), one to self, one dropped.
    one = np.array([[4, 5, 8, 12, 13, 0, -1, 4]])
    assert br.rows_off(one, 0, 4) == 3 and br.pairs_off(one, 0, 4) == 6
    assert br.rows_off(one, 1, 4) == 3  # ranks 0, 2, 3
    torch = pytest.importorskip("torch")
    assert br.rows_off(torch.tensor([[0, 5], [7, 6]], dtype=torch.int32), 0, 4) == 2
    with pytest.raises(br.BenchReportError, match="2-D"):
        br.rows_off(np.zeros(4, dtype=np.int64), 0, 2)
    with pytest.raises(br.BenchReportError, match=">= -1"):
        br.rows_off(np.array([[-2, 0]]), 0, 2)
    with pytest.raises(br.BenchReportError, match="integers"):
        br.rows_off(np.array([[0.5]]), 0, 2)
    with pytest.raises(br.BenchReportError, match="experts_per_rank"):
        br.rows_off(np.array([[0]]), 0, 0)


def test_dropped_ids_and_a_rank_with_no_pairs():
    # 2 ranks, 4 experts per rank: every kept pair goes to rank 0's experts.
    idx = np.array([[0, -1], [3, 1], [-1, -1], [2, 0]])
    assert br.split_sizes(idx, 2, 4) == [5, 0]
    assert br.pairs_off(idx, 0, 4) == 0  # all to self
    assert br.pairs_off(idx, 1, 4) == 5  # all off-rank
    everything_dropped = np.full((3, 2), -1)
    assert br.split_sizes(everything_dropped, 2, 4) == [0, 0]
    assert br.pairs_off(everything_dropped, 1, 4) == 0


def test_pairs_off_accepts_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    idx = torch.tensor([[0, 5], [7, -1]], dtype=torch.int32)
    assert br.pairs_off(idx, 0, 4) == 2
    assert br.split_sizes(idx, 2, 4) == [1, 2]


def test_routing_metrics_reject_bad_input():
    with pytest.raises(br.BenchReportError, match="2-D"):
        br.pairs_off(np.zeros(4, dtype=np.int64), 0, 2)
    with pytest.raises(br.BenchReportError, match=">= -1"):
        br.split_sizes(np.array([[-2, 0]]), 2, 2)
    with pytest.raises(br.BenchReportError, match="outside world_size"):
        br.split_sizes(np.array([[0, 9]]), 2, 2)
    with pytest.raises(br.BenchReportError, match="integers"):
        br.pairs_off(np.array([[0.5]]), 0, 2)


# --------------------------------------------------------------------------------------------------
# bandwidth, median, rows
# --------------------------------------------------------------------------------------------------


def test_bandwidth_formula():
    assert br.bandwidth_gbps(1e9, 1.0) == pytest.approx(1.0)
    # 4096 off-rank pairs of a 7168-element bf16 row in 100 us
    assert br.bandwidth_gbps(4096 * 7168 * 2, 100e-6) == pytest.approx(587.20256)  # bytes per us / 1e3
    assert br.bandwidth_gbps(0, 1e-6) == 0.0
    with pytest.raises(br.BenchReportError):
        br.bandwidth_gbps(1, 0.0)
    with pytest.raises(br.BenchReportError):
        br.bandwidth_gbps(-1, 1.0)
    assert br.TAG_BYTES == 12  # fp32 weight, int32 source tag, int32 from-slot
    assert br.dispatch_moved_bytes(10, 10, 14336) == 10 * (14336 + 12)  # no token shares a rank
    assert br.dispatch_moved_bytes(4, 10, 14336) == 4 * 14336 + 10 * 12
    assert br.dispatch_moved_bytes(0, 0, 14336) == 0
    assert br.combine_moved_bytes(10, 14336) == 10 * 14336


def test_median():
    assert br.median([3, 1, 2]) == 2
    assert br.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert br.median(iter([7])) == 7
    with pytest.raises(br.BenchReportError):
        br.median([])


_ROW_KW = dict(
    routing="uniform", tokens=4096, mode="scatter", checked=False, row_bytes=7168 * 2,
    pairs_off=[4096 * 6.0 + r for r in range(4)], rows_off=[4096 * 2.5 + 2 * r for r in range(4)],
    dispatch_us=[100.0 + r for r in range(4)], combine_us=[150.0 + 2 * r for r in range(4)],
    nccl_dispatch_us=[300.0 - r for r in range(4)], nccl_combine_us=[310.0] * 4,
)  # fmt: skip


def _row(routing="uniform", tokens=4096, mode="scatter", checked=False, scale=1.0, world=4) -> br.BenchRow:
    return br.BenchRow.from_measurements(
        routing=routing, tokens=tokens, mode=mode, checked=checked, row_bytes=7168 * 2,
        pairs_off=[tokens * 6.0 + r for r in range(world)],
        rows_off=[tokens * 2.5 + 2 * r for r in range(world)],
        dispatch_us=[scale * (100.0 + r) for r in range(world)],
        combine_us=[scale * (150.0 + 2 * r) for r in range(world)],
        nccl_dispatch_us=[scale * (300.0 - r) for r in range(world)],
        nccl_combine_us=[scale * 310.0 for _ in range(world)],
    )  # fmt: skip


def test_row_derived_fields():
    row = _row()
    rb = 7168 * 2
    mean_pairs = 4096 * 6.0 + 1.5
    mean_rows = 4096 * 2.5 + 3.0
    assert row.pairs_off_mean == pytest.approx(mean_pairs)
    assert row.rows_off == [10240.0, 10242.0, 10244.0, 10246.0]
    assert row.rows_off_mean == pytest.approx(mean_rows)
    assert (row.dispatch_us, row.dispatch_us_min, row.dispatch_us_max) == (103.0, 100.0, 103.0)
    assert row.dispatch_us_per_rank == [100.0, 101.0, 102.0, 103.0]
    assert (row.combine_us, row.nccl_dispatch_us, row.nccl_dispatch_us_min) == (156.0, 300.0, 297.0)
    assert row.dispatch_alg_gbps == pytest.approx(mean_pairs * rb / 103e-6 / 1e9)
    assert row.combine_alg_gbps == pytest.approx(mean_pairs * rb / 156e-6 / 1e9)
    # moved: each distinct (token, rank) row once, 12 B of metadata per pair; slowest rank 103 us
    assert row.dispatch_moved_gbps == pytest.approx((mean_rows * rb + 12 * mean_pairs) / 103e-6 / 1e9)
    assert row.dispatch_moved_gbps == pytest.approx((10243.0 * 14336 + 12 * 24577.5) / 103e3)
    assert row.dispatch_moved_gbps < row.dispatch_alg_gbps  # de-duplication moves fewer bytes here
    assert row.combine_moved_gbps == pytest.approx(row.combine_alg_gbps)
    assert row.dispatch_line_pct == pytest.approx(100 * row.dispatch_moved_gbps / 450.0)
    assert row.nccl_dispatch_gbps == pytest.approx(mean_pairs * rb / 300e-6 / 1e9)
    assert row.dispatch_ratio == pytest.approx(300.0 / 103.0)
    assert row.combine_ratio == pytest.approx(310.0 / 156.0)
    # Same bytes for both: the bandwidth ratio is the time ratio.
    assert row.dispatch_alg_gbps / row.nccl_dispatch_gbps == pytest.approx(row.dispatch_ratio)
    assert set(row.to_dict()) == set(br.ROW_KEYS) | set(br.OPTIONAL_ROW_KEYS)


def test_fp8_row_moves_packed_rows_but_keeps_the_algorithmic_formula():
    packed = 7168 + 224  # e4m3 values + 56 fp32 scales
    plain, fp8 = _row(), br.BenchRow.from_measurements(**{**_ROW_KW, "mode": "scatter+fp8"},
                                                       dispatch_row_bytes=packed)
    mean_pairs, mean_rows = 4096 * 6.0 + 1.5, 4096 * 2.5 + 3.0
    assert fp8.dispatch_row_bytes == packed and plain.dispatch_row_bytes == 0
    assert fp8.dispatch_alg_gbps == pytest.approx(plain.dispatch_alg_gbps)  # the application's bf16 rows
    assert fp8.dispatch_moved_gbps == pytest.approx((mean_rows * packed + 12 * mean_pairs) / 103e3)
    assert fp8.nccl_dispatch_gbps == pytest.approx(mean_pairs * packed / 300e3)  # NCCL moved packed rows
    assert fp8.combine_moved_gbps == pytest.approx(plain.combine_moved_gbps)  # combine is unchanged


def test_reduced_combine_row_moves_one_partial_row_per_group():
    plain = _row()
    red = br.BenchRow.from_measurements(**{**_ROW_KW, "mode": "scatter+reduced"}, reduced_combine=True)
    mean_rows = 4096 * 2.5 + 3.0
    assert red.combine_moved_gbps == pytest.approx(mean_rows * 7168 * 2 / 156e3)
    assert red.combine_moved_gbps < red.combine_alg_gbps == pytest.approx(plain.combine_alg_gbps)
    assert red.combine_line_pct == pytest.approx(100 * red.combine_moved_gbps / 450.0)
    assert red.dispatch_moved_gbps == pytest.approx(plain.dispatch_moved_gbps)  # dispatch is unchanged


def test_reports_without_optional_row_keys_still_load(tmp_path):
    report = br.write_json(tmp_path / "r.json", _meta(), _rows())
    for row in report["rows"]:
        for key in br.OPTIONAL_ROW_KEYS:
            del row[key]
    (tmp_path / "old.json").write_text(json.dumps(report))
    assert len(br.load_json(tmp_path / "old.json")["rows"]) == len(report["rows"])


def test_row_rejects_inconsistent_measurements():
    kw = dict(routing="u", tokens=1, mode="scatter", checked=True, row_bytes=16)
    with pytest.raises(br.BenchReportError, match="one length"):
        br.BenchRow.from_measurements(
            **kw,
            pairs_off=[1, 2],
            rows_off=[1, 2],
            dispatch_us=[1.0],
            combine_us=[1, 1],
            nccl_dispatch_us=[1, 1],
            nccl_combine_us=[1, 1],
        )
    one = dict(dispatch_us=[1], combine_us=[1], nccl_dispatch_us=[1], nccl_combine_us=[1])
    with pytest.raises(br.BenchReportError, match="rows_off=1"):
        br.BenchRow.from_measurements(**kw, **one | {"combine_us": [1, 1]}, pairs_off=[1], rows_off=[1])
    with pytest.raises(br.BenchReportError, match="one length"):
        br.BenchRow.from_measurements(**kw, **one, pairs_off=[1], rows_off=[1, 1])
    with pytest.raises(br.BenchReportError, match="positive"):
        br.BenchRow.from_measurements(**kw, **one | {"dispatch_us": [0.0]}, pairs_off=[1], rows_off=[1])
    with pytest.raises(br.BenchReportError, match="pairs_off must be >= 0"):
        br.BenchRow.from_measurements(**kw, **one, pairs_off=[-1], rows_off=[0])
    with pytest.raises(br.BenchReportError, match="rows_off must be >= 0"):
        br.BenchRow.from_measurements(**kw, **one, pairs_off=[1], rows_off=[-0.5])
    with pytest.raises(TypeError, match="rows_off"):  # required
        br.BenchRow.from_measurements(**kw, **one, pairs_off=[1])
    # Nothing off-rank: zero bandwidths, not an error.
    row = br.BenchRow.from_measurements(**kw, **one, pairs_off=[0], rows_off=[0])
    assert (row.rows_off_mean, row.dispatch_moved_gbps, row.dispatch_alg_gbps) == (0.0, 0.0, 0.0)


# --------------------------------------------------------------------------------------------------
# JSON, table, plot
# --------------------------------------------------------------------------------------------------


def _meta() -> dict:
    return {
        "device": "NVIDIA H200",
        "world_size": 4,
        "local_world_size": 4,
        "config": {"hidden": 7168, "topk": 8, "num_experts": 256, "dtype": "bfloat16", "iters": 50},
        "symmetric_bytes": 123456,
        "line_rate_gbps": br.NVLINK4_LINE_RATE_GBPS,
        "versions": br.package_versions(),
        "git_sha": br.git_sha(),
        "timestamp": br.utc_timestamp(),
        "command": "python scripts/benchmark.py --tokens 128,4096",
        "extra": {"kept": True},
    }


def _rows() -> list[br.BenchRow]:
    return [
        _row(routing, tokens, checked=tokens <= 1024, scale=tokens / 4096)
        for routing in ("uniform", "skewed")
        for tokens in (128, 1024, 4096)
    ]


def test_json_round_trip(tmp_path):
    path = tmp_path / "sub" / "report.json"
    rows = _rows()
    written = br.write_json(path, _meta(), rows)
    loaded = br.load_json(path)
    assert loaded == written
    assert loaded["schema"] == br.SCHEMA
    assert loaded["meta"]["extra"] == {"kept": True}
    assert [r["tokens"] for r in loaded["rows"]] == [r.tokens for r in rows]
    assert loaded["rows"][0] == rows[0].to_dict()
    assert not [p for p in path.parent.iterdir() if p.name != "report.json"]  # no temporary left
    # Rows given as dicts (as the script holds them) write the same report.
    assert (
        br.write_json(
            path, _meta() | {"timestamp": written["meta"]["timestamp"]}, [r.to_dict() for r in rows]
        )["rows"]
        == written["rows"]
    )


@pytest.mark.parametrize("where", ["meta", "row", "top"])
def test_load_json_names_a_missing_key(tmp_path, where):
    report = {"schema": br.SCHEMA, "meta": _meta(), "rows": [r.to_dict() for r in _rows()]}
    if where == "meta":
        del report["meta"]["git_sha"]
        pattern = r"meta is missing key\(s\) \['git_sha'\]"
    elif where == "row":
        del report["rows"][4]["combine_ratio"]
        pattern = r"row 4 \(skewed, tokens=1024, mode=scatter\) is missing key\(s\) \['combine_ratio'\]"
    else:
        del report["rows"]
        pattern = r"missing top-level key\(s\) \['rows'\]"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(report))
    with pytest.raises(br.BenchReportError, match=pattern):
        br.load_json(path)


def test_load_json_other_problems(tmp_path):
    with pytest.raises(br.BenchReportError, match="cannot read"):
        br.load_json(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(br.BenchReportError, match="not JSON"):
        br.load_json(bad)
    bad.write_text(json.dumps({"schema": "other/0", "meta": {}, "rows": []}))
    with pytest.raises(br.BenchReportError, match="schema"):
        br.load_json(bad)


def test_write_json_refuses_an_incomplete_report(tmp_path):
    meta = _meta()
    del meta["device"]
    with pytest.raises(br.BenchReportError, match="device"):
        br.write_json(tmp_path / "r.json", meta, _rows())
    assert not (tmp_path / "r.json").exists()


def test_write_json_refuses_nan(tmp_path):
    row = _rows()[0].to_dict() | {"dispatch_ratio": math.nan}
    with pytest.raises(ValueError):
        br.write_json(tmp_path / "r.json", _meta(), [row])


def test_format_table_has_every_row():
    rows = _rows()
    table = br.format_table(rows)
    lines = table.splitlines()
    assert lines[0] == br.table_header()
    assert len(lines) == 2 + len(rows) + 1  # header, rule, rows, note
    body = lines[2:-1]
    for row, line in zip(rows, body, strict=True):
        assert line == br.format_row(row)
        assert line.split()[:3] == [row.routing, str(row.tokens), row.mode]
        assert f"{row.dispatch_us:.1f}" in line and f"{row.combine_ratio:.2f}" in line
        assert f"({row.dispatch_line_pct:.0f}%)" in line
        assert len(line) == len(lines[0])  # aligned
    assert br.format_table([r.to_dict() for r in rows]) == table


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the dev extra")
    report = br.write_json(tmp_path / "r.json", _meta(), _rows() + [_row(mode="atomic", tokens=512)])
    path = br.plot(report, tmp_path / "plots" / "r.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # A report loaded back from disk plots too.
    assert br.plot(br.load_json(tmp_path / "r.json"), tmp_path / "again.png").stat().st_size > 10_000


def test_plot_lines_hold_ours_nccl_and_deepep_at_equal_work():
    """The committed 2x H100 report timed DeepEP: its lines are there, over the same off-rank pairs."""
    report = br.load_json(REPO / "baselines" / "perf" / "h100x2_vs_deepep.json")
    lines = {(ln["op"], ln["label"]): ln for ln in br.plot_lines(report)}
    for op in ("dispatch", "combine"):
        assert {(op, "cute-ep uniform (rank)"), (op, "NCCL all_to_all uniform"),
                (op, "DeepEP uniform (24 SMs)")} <= set(lines), sorted(lines)
    rank_4096 = next(r for r in report["rows"] if r["mode"] == "rank" and r["tokens"] == 4096)
    deepep = lines[("dispatch", "DeepEP uniform (24 SMs)")]
    ours = lines[("dispatch", "cute-ep uniform (rank)")]
    assert deepep["tokens"] == ours["tokens"] == [128, 4096]
    # Same work, so the bandwidth ratio is the inverse time ratio.
    ratio = ours["gbps"][1] / deepep["gbps"][1]
    assert ratio == pytest.approx(rank_4096["deepep_dispatch_us"] / rank_4096["dispatch_us"], rel=1e-9)
    assert ours["gbps"][1] == pytest.approx(rank_4096["dispatch_alg_gbps"], rel=1e-9)


def test_plot_lines_split_sm_budgets_and_skip_deepep_when_untimed():
    rows = [_row(tokens=t).to_dict() | {"num_sms": sms} for t in (128, 512) for sms in (24, 132)]
    lines = br.plot_lines({"meta": _meta(), "rows": rows})
    labels = [ln["label"] for ln in lines if ln["op"] == "dispatch"]
    assert sum(lb.startswith("cute-ep") for lb in labels) == 2  # one per budget, not one zig-zag line
    assert any("24 SMs" in lb for lb in labels) and any("132 SMs" in lb for lb in labels)
    assert not any(lb.startswith("DeepEP") for lb in labels)
    for ln in lines:
        assert ln["tokens"] == sorted(ln["tokens"]) and len(ln["tokens"]) == len(ln["gbps"]) == 2


def test_parse_lists():
    assert br.parse_int_list("128, 256,128,8192", "--tokens") == [128, 256, 8192]
    for bad in ("", "12,x", "0,4", "-1"):
        with pytest.raises(br.BenchReportError, match="--tokens"):
            br.parse_int_list(bad, "--tokens")
    assert br.parse_name_list("uniform,skewed,uniform", "--routing", ("uniform", "skewed")) == [
        "uniform",
        "skewed",
    ]
    with pytest.raises(br.BenchReportError, match="--routing"):
        br.parse_name_list("uniform,hot", "--routing", ("uniform", "skewed"))


def test_bench_report_has_no_gpu_or_torch_import():
    assert_imports_none("import cute_ep.tools.bench_report",
                        ("torch", "cutlass", "nvshmem", "cuda", "matplotlib"))


# --------------------------------------------------------------------------------------------------
# the script on the CPU: --help and argument errors need no GPU
# --------------------------------------------------------------------------------------------------


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_single(SCRIPT, *args, timeout=120, **env)


def test_benchmark_help_runs_on_cpu():
    res = _script("--help")
    assert res.returncode == 0, res.stderr
    for flag in ("--hidden", "--tokens", "--routing", "--modes", "--iters", "--warmup", "--input-sets",
                 "--num-sms", "--peers", "--validate-max-tokens", "--local-world-size", "--out-json",
                 "--out-png", "--seed"):  # fmt: skip
        assert flag in res.stdout
    assert "nccl,deepep" in res.stdout  # the default peers


def test_benchmark_help_imports_nothing_of_the_gpu():
    code = (
        "import sys; sys.argv = ['benchmark.py', '--help']\n"
        "import runpy\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code"
    )
    assert_imports_none(code, ("torch", "cutlass", "nvshmem", "cuda.bindings", "cuda.core"), timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--tokens", "128,abc"], "--tokens must be a comma-separated list of integers, got '128,abc'"),
    (["--routing", "uniform,hot"], "--routing must be a comma-separated list of ['uniform', 'skewed', "
                                   "'dropped'], got 'uniform,hot'"),
    (["--modes", "fast"], "--modes must be a comma-separated list of ['scatter', 'atomic'], got 'fast'"),
    (["--iters", "0"], "need --iters >= 1, --warmup >= 0, --input-sets >= 1; got 0, 10, 3"),
    (["--tokens", "70000"], "--tokens values must be <= 65536, got 70000"),
    (["--fp8", "--hidden", "200"], "--fp8 needs --hidden to be a multiple of 128, got 200"),
    (["--num-sms", "24,0"], "--num-sms values must be integers >= 1 (or max); 0 in '24,0' is not"),
    (["--num-sms", "24,many"], "--num-sms must be a comma-separated list of integers >= 1 or max; 'many' in"),
    (["--peers", "nccl,deepepp"], "--peers must be a comma-separated list of ['nccl', 'deepep'] (or 'none'); "
                                  "'deepepp' in 'nccl,deepepp' is not one"),
    (["--peers", ","], "--peers must name at least one of"),
])  # fmt: skip
def test_benchmark_rejects_bad_arguments_before_any_launch(args, message):
    assert_argument_error(_script(*args), message)


def test_benchmark_usage_error_is_printed_by_other_ranks_too():
    # Rank 0 prints at once; another rank prints the same line after a pause (under torchrun it is
    # normally stopped first), so that the error reaches the user whichever rank exits first.
    res = _script("--iters", "0", RANK="1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr == "error: need --iters >= 1, --warmup >= 0, --input-sets >= 1; got 0, 10, 3\n"


def _output_cases(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(flag, path, expected message) of outputs that rank 0 could not write."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    return [
        ("--out-json", str(a_file / "r.json"), f"{a_file} is not a directory"),
        ("--out-json", str(a_file / "sub" / "r.json"), f"{a_file} is not a directory"),
        ("--out-json", str(tmp_path), "is a directory"),
        ("--out-png", str(tmp_path), "is a directory"),
    ]


def test_benchmark_rejects_unwritable_outputs_before_any_launch(tmp_path):
    pytest.importorskip("matplotlib")  # --out-png needs it
    for flag, path, message in _output_cases(tmp_path):
        res = _script(flag, path)
        assert res.returncode == 2, (flag, path, res.stdout + res.stderr)
        assert f"error: {flag} {path}" in res.stderr and message in res.stderr, res.stderr


def test_check_writable(bm, tmp_path):
    for flag, path, message in _output_cases(tmp_path):
        with pytest.raises(bm.UsageError, match=message):
            bm.check_writable(flag, path)
    # Missing parents are fine (write_json and plot create them), and so is an existing file.
    bm.check_writable("--out-json", str(tmp_path / "new" / "deeper" / "r.json"))
    (tmp_path / "old.json").write_text("{}")
    bm.check_writable("--out-json", str(tmp_path / "old.json"))
    bm.check_writable("--out-json", "relative-name.json")  # the working directory
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        try:
            with pytest.raises(bm.UsageError, match=f"directory {locked} is not writable"):
                bm.check_writable("--out-json", str(locked / "new" / "r.json"))
        finally:
            locked.chmod(0o755)


@pytest.mark.parametrize("error,code", [("heap", 2), ("other", 1)])
def test_benchmark_heap_setting_error_exits_2(bm, monkeypatch, capsys, error, code):
    # NVSHMEM_SYMMETRIC_SIZE is checked when the Runtime starts (it needs a GPU there, so a stand-in
    # raises here): a bad setting exits 2 like a bad argument, other run-time errors 1.
    pytest.importorskip("torch")
    from cute_ep.bootstrap import runtime as rt

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                "CUTE_EP_LOCAL_WORLD_SIZE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)

    def runtime(*args, **kwargs):
        if error == "heap":
            raise rt.HeapConfigError("NVSHMEM_SYMMETRIC_SIZE='1M' is too small")
        raise RuntimeError("no GPU")

    monkeypatch.setattr(rt, "Runtime", runtime)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # past the check for a GPU
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert bm.main(["--tokens", "8", "--hidden", "64", "--num-experts", "8", "--topk", "2"]) == code
    err = capsys.readouterr().err
    heap = "error: NVSHMEM_SYMMETRIC_SIZE='1M' is too small"
    expected = heap if error == "heap" else "rank 0: error: RuntimeError: no GPU"
    assert expected in err, err


# --------------------------------------------------------------------------------------------------
# the script's whole sweep over gloo (4 CPU ranks as 2 virtual nodes): the torch reference buffer
# stands in for EpBuffer, a step counter for the CUDA-event timer (tests/_bench_stand_ins.py), gloo for NCCL
# --------------------------------------------------------------------------------------------------

_WORKER = r'''
import benchmark as bm
from _bench_stand_ins import Launching, StepTimer
from cute_ep.tools.cli import Printer, config_from_args
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime


class Corrupting(Launching):
    def dispatch(self, *a, **k):
        res = super().dispatch(*a, **k)
        if self.rank == 1 and res.num_recv:
            self.recv_x[0] += 1  # res.recv_x is a view: the check must see it
        return res


args = bm.build_parser().parse_args(sys.argv[2:])
bm.validate_args(args)
env = DistEnv.from_environ(local_world_size=args.local_world_size)
cfg = config_from_args(args, env, max_tokens=max(args.token_list))  # the script's own config


class CorruptingFp8(Launching):
    def dispatch(self, *a, **k):
        res = super().dispatch(*a, **k)
        if k.get("fp8") and self.rank == 1 and res.num_recv:
            self.recv_fp8[0, 0] ^= 1  # one bit of the first packed row's first value (the reference's rows)
        return res


buffer = {"corrupt": Corrupting, "corrupt_fp8": CorruptingFp8}.get(sys.argv[1], Launching)
with Runtime(env, backend="gloo") as rt:
    code = bm.sweep(args, cfg, rt, Printer(env.rank), make_buffer=buffer, make_timer=StepTimer)
sys.exit(code)
'''


def _run_sweep(tmp_path: Path, kind: str, *args: str, world: int = 4) -> tuple[list[int], str]:
    return launch_ranks(write_worker(tmp_path, _WORKER), kind, *args, world=world, timeout=240)


SWEEP_ARGS = ("--hidden", "64", "--topk", "2", "--num-experts", "16", "--tokens", "8,24", "--routing",
              "uniform,dropped", "--modes", "scatter,atomic", "--iters", "3", "--warmup", "1",
              "--input-sets", "2", "--validate-max-tokens", "8", "--local-world-size", "2")  # fmt: skip


def test_sweep_times_the_reduced_combine_as_its_own_rows(tmp_path):
    out_json = tmp_path / "r.json"
    args = ("--hidden", "64", "--topk", "4", "--num-experts", "16", "--tokens", "8,24", "--routing", "skewed",
            "--modes", "scatter", "--iters", "2", "--warmup", "1", "--input-sets", "2",
            "--validate-max-tokens", "24", "--local-world-size", "2",
            "--combine", "pull,reduced")  # fmt: skip
    codes, out = _run_sweep(tmp_path, "ok", *args, "--out-json", str(out_json))
    assert codes == [0, 0, 0, 0], out[-6000:]
    rows = br.load_json(out_json)["rows"]
    assert [(r["tokens"], r["mode"], r["checked"]) for r in rows] == [
        (8, "scatter", True), (8, "scatter+reduced", True),
        (24, "scatter", True), (24, "scatter+reduced", True),
    ]
    assert "reduced combine: PASS" not in out  # checks print only on failure
    assert br.load_json(out_json)["meta"]["config"]["combines"] == ["pull", "reduced"]


def test_sweep_runs_over_gloo_and_writes_report_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    codes, out = _run_sweep(
        tmp_path, "ok", *SWEEP_ARGS, "--out-json", str(out_json), "--out-png", str(out_png)
    )
    assert codes == [0, 0, 0, 0], out[-6000:]
    report = br.load_json(out_json)
    rows = report["rows"]
    expected = [
        (routing, t, mode)
        for routing in ("uniform", "dropped")
        for t in (8, 24)
        for mode in ("scatter", "atomic")
    ]
    assert [(r["routing"], r["tokens"], r["mode"]) for r in rows] == expected
    assert [r["checked"] for r in rows] == [r["tokens"] <= 8 for r in rows]
    for r in rows:
        assert len(r["pairs_off"]) == 4 and r["pairs_off_mean"] > 0
        assert len(r["rows_off"]) == 4 and 0 < r["rows_off_mean"] <= r["pairs_off_mean"]
        assert all(0 <= ro <= po for ro, po in zip(r["rows_off"], r["pairs_off"], strict=True))
        moved = (r["rows_off_mean"] * r["row_bytes"] + 12 * r["pairs_off_mean"]) / 41e-6 / 1e9
        assert r["dispatch_moved_gbps"] == pytest.approx(moved)
        # StepTimer: rank r's iterations take 10 (r + 1) + i us; the median is 10 (r + 1) + 1
        assert r["dispatch_us_per_rank"] == [11.0, 21.0, 31.0, 41.0]
        assert (r["dispatch_us"], r["dispatch_us_min"], r["nccl_combine_us_max"]) == (41.0, 11.0, 41.0)
        assert r["dispatch_ratio"] == pytest.approx(1.0)
    assert report["meta"]["world_size"] == 4 and report["meta"]["local_world_size"] == 2
    assert report["meta"]["config"]["tokens"] == [8, 24]
    assert report["meta"]["symmetric_bytes"] > 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert br.table_header() in out
    for r in rows:
        assert br.format_row(r) in out  # printed progressively on rank 0
    assert out.count(br.table_header()) == 1  # rank 0 only


def test_sweep_with_fp8_adds_a_checked_packed_row_per_mode(tmp_path):
    out_json = tmp_path / "r.json"
    codes, out = _run_sweep(
        tmp_path, "ok", "--hidden", "128", "--topk", "2", "--num-experts", "8", "--tokens", "8",
        "--routing", "uniform", "--modes", "scatter,atomic", "--iters", "2", "--warmup", "0",
        "--input-sets", "2", "--validate-max-tokens", "8", "--fp8", "--out-json", str(out_json), world=2,
    )  # fmt: skip
    assert codes == [0, 0], out[-6000:]
    rows = br.load_json(out_json)["rows"]
    assert [r["mode"] for r in rows] == ["scatter", "scatter+fp8", "atomic", "atomic+fp8"]
    assert [r["dispatch_row_bytes"] for r in rows] == [0, 144, 0, 144]  # 128 B of e4m3 + 4 B scale, padded
    assert all(r["checked"] for r in rows)
    assert rows[1]["combine_us"] == rows[0]["combine_us"]  # combine is the mode's own


FP8_RANK = ("--hidden", "128", "--topk", "2", "--num-experts", "8", "--tokens", "8", "--routing", "uniform",
            "--modes", "scatter", "--iters", "2", "--warmup", "0", "--input-sets", "2",
            "--validate-max-tokens", "8", "--fp8", "--layouts", "rank")  # fmt: skip


def test_sweep_with_fp8_adds_a_checked_rank_fp8_row(tmp_path):
    out_json = tmp_path / "r.json"
    codes, out = _run_sweep(tmp_path, "ok", *FP8_RANK, "--out-json", str(out_json), world=2)
    assert codes == [0, 0], out[-6000:]
    rows = br.load_json(out_json)["rows"]
    assert [(r["mode"], r["layout"], r["dispatch_row_bytes"]) for r in rows] == [
        ("rank", "rank", 0), ("rank+cached", "rank", 0), ("rank+fp8", "rank", 144),
        ("rank+fp8+cached", "rank", 144)]
    assert all(r["checked"] and r["combine_us"] == rows[0]["combine_us"] for r in rows[2:])
    assert br.load_json(out_json)["meta"]["config"]["fp8"] is True
    assert "[uniform T=8 rank+fp8] checked: the packed FP8 rows bit-identical to the reference" in out
    assert "[uniform T=8 rank+fp8+cached] checked: the cached dispatch receives what the full one does" in out


def test_sweep_aborts_when_the_rank_fp8_check_fails(tmp_path):
    out_json = tmp_path / "r.json"
    codes, out = _run_sweep(tmp_path, "corrupt_fp8", *FP8_RANK, "--out-json", str(out_json), world=2)
    assert codes == [1, 1], out[-6000:]
    assert "[uniform T=8 rank+fp8] rank FP8 dispatch: FAIL" in out
    assert not out_json.exists()


def test_sweep_times_the_rank_layout_as_its_own_checked_rows(tmp_path):
    out_json = tmp_path / "r.json"
    args = ("--hidden", "64", "--topk", "4", "--num-experts", "16", "--tokens", "8,24", "--routing", "skewed",
            "--modes", "scatter", "--iters", "2", "--warmup", "1", "--input-sets", "2",
            "--validate-max-tokens", "8", "--local-world-size", "2", "--layouts", "expert,rank")  # fmt: skip
    codes, out = _run_sweep(tmp_path, "ok", *args, "--out-json", str(out_json))
    assert codes == [0, 0, 0, 0], out[-6000:]
    rows = br.load_json(out_json)["rows"]
    assert [(r["tokens"], r["mode"], r["layout"], r["checked"]) for r in rows] == [
        (8, "rank", "rank", True), (8, "rank+cached", "rank", True), (8, "scatter", "expert", True),
        (24, "rank", "rank", False), (24, "rank+cached", "rank", False), (24, "scatter", "expert", False),
    ]
    assert "[skewed T=8 rank layout] checked: dispatch and combine bit-identical to the reference" in out
    assert "[skewed T=8 rank cached] checked: the cached dispatch receives what the full one does" in out
    for full, cached in zip(rows[0::3], rows[1::3], strict=True):  # the cached row repeats the combine
        assert cached["combine_us"] == full["combine_us"]
    assert br.load_json(out_json)["meta"]["config"]["layouts"] == ["expert", "rank"]


def test_sweep_times_the_rank_layouts_pushed_combine_beside_its_pull(tmp_path):
    """--combine pull,reduced with the rank layout: a row "rank+reduced" (the latest dispatch's handle, its
    combine pushed) after each "rank" row (pulled), on the same dispatch times."""
    out_json = tmp_path / "r.json"
    args = ("--hidden", "64", "--topk", "4", "--num-experts", "16", "--tokens", "8,24",
            "--routing", "uniform", "--iters", "2", "--warmup", "1", "--input-sets", "2",
            "--validate-max-tokens", "8", "--layouts", "rank", "--combine", "pull,reduced")  # fmt: skip
    codes, out = _run_sweep(tmp_path, "ok", *args, "--out-json", str(out_json))
    assert codes == [0, 0, 0, 0], out[-6000:]
    rows = br.load_json(out_json)["rows"]
    assert [(r["tokens"], r["mode"], r["layout"]) for r in rows] == [
        (8, "rank", "rank"), (8, "rank+reduced", "rank"), (8, "rank+cached", "rank"),
        (24, "rank", "rank"), (24, "rank+reduced", "rank"), (24, "rank+cached", "rank"),
    ]
    for pulled, pushed in zip(rows[::3], rows[1::3], strict=True):
        assert pushed["dispatch_us"] == pulled["dispatch_us"]


def test_sweep_aborts_when_the_rank_layout_check_fails(tmp_path):
    out_json = tmp_path / "r.json"
    codes, out = _run_sweep(tmp_path, "corrupt", *SWEEP_ARGS, "--layouts", "rank",
                            "--out-json", str(out_json))
    assert codes == [1, 1, 1, 1], out[-6000:]
    assert "[uniform T=8 rank layout] rank dispatch: FAIL" in out
    assert not out_json.exists()


def test_sweep_aborts_when_the_checked_round_fails(tmp_path):
    out_json = tmp_path / "r.json"
    codes, out = _run_sweep(tmp_path, "corrupt", *SWEEP_ARGS, "--out-json", str(out_json))
    assert codes == [1, 1, 1, 1], out[-6000:]
    assert "[uniform T=8 scatter] dispatch: FAIL" in out
    assert "not timing it" in out
    assert not out_json.exists()  # nothing was measured
