"""cute_ep.tools.bench_peers on the CPU: DeepEP as an optional benchmark peer (skip reasons, the adapter
against a stand-in ``deep_ep``), the SM-budget mapping, link bytes, the results form's check, and
scripts/benchmark.py's --peers / --num-sms (validate_args, and whole sweeps over gloo; their argument errors
are tested with the script's others in tests/test_bench_report.py)."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from _launch import REPO, assert_imports_none, launch_ranks, write_worker

from cute_ep.tools import bench_peers as bp
from cute_ep.tools import bench_report as br

SCRIPT = REPO / "scripts" / "benchmark.py"


# --------------------------------------------------------------------------------------------------
# import hygiene, arguments
# --------------------------------------------------------------------------------------------------


def test_bench_peers_imports_no_gpu_module_nor_deep_ep():
    assert_imports_none("import cute_ep.tools.bench_peers",
                        ("torch", "cutlass", "nvshmem", "cuda", "matplotlib", "deep_ep"))  # fmt: skip


def test_parse_peers():
    assert bp.parse_peers("nccl,deepep") == ["nccl", "deepep"]
    assert bp.parse_peers(" deepep , nccl,deepep") == ["deepep", "nccl"]
    assert bp.parse_peers("none") == []
    with pytest.raises(br.BenchReportError, match=r"'nvshmem' in 'nccl,nvshmem' is not one"):
        bp.parse_peers("nccl,nvshmem")
    with pytest.raises(br.BenchReportError, match="at least one"):
        bp.parse_peers(" , ")


def test_parse_num_sms():
    assert bp.parse_num_sms("24,48,132") == [24, 48, 132]
    assert bp.parse_num_sms("132, 24,132") == [132, 24]
    assert bp.parse_num_sms("1") == [1]
    assert bp.parse_num_sms("24,max,max") == [24, bp.SHARE_BUDGET]
    with pytest.raises(br.BenchReportError, match=r"integers >= 1 \(or max\); 0 in '24,0' is not"):
        bp.parse_num_sms("24,0")
    with pytest.raises(br.BenchReportError, match=r"integers >= 1 \(or max\); -4 in '-4' is not"):
        bp.parse_num_sms("-4")
    with pytest.raises(br.BenchReportError, match=r"'x' in '24,x' is not one"):
        bp.parse_num_sms("24,x")
    with pytest.raises(br.BenchReportError, match="must list SM budgets"):
        bp.parse_num_sms("")


def test_validate_args_fills_the_lists(bm):
    args = bm.build_parser().parse_args(["--num-sms", "48,24,48", "--peers", "deepep"])
    bm.validate_args(args)
    assert (args.num_sms_list, args.num_sms, args.peer_list) == ([48, 24], 48, ["deepep"])
    bm.validate_args(args)  # again (a worker re-validates): the same result
    assert (args.num_sms_list, args.num_sms) == ([48, 24], 48)
    # The defaults: one budget, each rank's share of its GPU ("max", a number once the runtime is up),
    # NCCL and DeepEP.
    args = bm.build_parser().parse_args([])
    bm.validate_args(args)
    assert (args.num_sms_list, args.num_sms, args.peer_list) == ([bp.SHARE_BUDGET], 0, ["nccl", "deepep"])


# --------------------------------------------------------------------------------------------------
# SM budgets and skip reasons
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ours,theirs", [
    (132, 128), (128, 128), (130, 128), (200, 128), (127, 126), (48, 48), (25, 24), (24, 24), (3, 2), (2, 2),
    (1, 0),
])  # fmt: skip
def test_deepep_num_sms(ours, theirs):
    assert bp.deepep_num_sms(ours) == theirs
    assert bp.deepep_num_sms(bp.FULL_GPU_SMS) == bp.DEEPEP_FULL_GPU_SMS


def test_deepep_budget_skip_reason():
    assert bp.deepep_budget_skip_reason(2) is None
    assert bp.deepep_budget_skip_reason(1) == "an SM budget of 1 leaves DeepEP no even SM count >= 2"
    with pytest.raises(br.BenchReportError, match="num_sms must be >= 1, got 0"):
        bp.deepep_num_sms(0)


GOOD_WORLD = dict(import_error=None, device_type="cuda", world_size=2, ranks_per_host=2, dtype="bfloat16",
                  hidden=7168, experts_per_rank=128, topk=8)  # fmt: skip


@pytest.mark.parametrize("change,expected", [
    ({}, None),
    ({"world_size": 4, "ranks_per_host": 4}, None),
    ({"world_size": 8, "ranks_per_host": 8, "experts_per_rank": 32}, None),
    ({"import_error": "deep_ep is not importable (X)", "world_size": 3}, "deep_ep is not importable (X)"),
    ({"device_type": "cpu"}, "DeepEP needs CUDA GPUs (this run's device is cpu)"),
    ({"world_size": 1, "ranks_per_host": 1}, "needs 2, 4 or 8 ranks on one node, this world has 1"),
    ({"world_size": 6, "ranks_per_host": 6}, "needs 2, 4 or 8 ranks on one node, this world has 6"),
    ({"world_size": 16, "ranks_per_host": 8}, "this world has 16"),
    ({"world_size": 8, "ranks_per_host": 4}, "every rank on one node (NVLink); 8 ranks run 4 per host"),
    ({"dtype": "float32"}, "DeepEP dispatches bfloat16 rows; this run's --dtype is float32"),
    ({"hidden": 7160}, "--hidden a multiple of 16 and <= 8176"),
    ({"hidden": 8192}, "got 8192"),
    ({"experts_per_rank": 129}, "<= 128 experts per rank, got 129"),
    ({"topk": 129}, "top-k <= 128, got 129"),
])  # fmt: skip
def test_deepep_skip_reason(change, expected):
    why = bp.deepep_skip_reason(**(GOOD_WORLD | change))
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why, why


def test_first_reason():
    assert bp.first_reason([None, None]) is None
    assert bp.first_reason(["same", "same"]) == "same"
    assert bp.first_reason([None, "only here", "and here"]) == "rank 1: only here"
    assert bp.first_reason(["a", "b"]) == "rank 0: a"


def test_import_skip_path_without_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # what an absent package looks like to import
    module, why = bp.import_deep_ep()
    assert module is None
    assert why.startswith("deep_ep is not importable (ModuleNotFoundError") or why.startswith(
        "deep_ep is not importable (ImportError"
    ), why
    with pytest.raises(ImportError, match="deep_ep is not importable"):
        bp.DeepEpPeer(None, world_size=2, hidden=64, num_experts=8)


def test_import_skip_path_with_a_broken_build(monkeypatch, tmp_path):
    pkg = tmp_path / "deep_ep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libdeep_ep_cpp.so: undefined symbol')\n")
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    module, why = bp.import_deep_ep()
    assert module is None
    assert why == "deep_ep is not importable (OSError: libdeep_ep_cpp.so: undefined symbol)"
    verdict = bp.deepep_skip_reason(**(GOOD_WORLD | {"import_error": why}))
    assert verdict == why


# --------------------------------------------------------------------------------------------------
# routing arithmetic on a hand-computed routing
# --------------------------------------------------------------------------------------------------

# World of 2, 2 experts per rank (E = 4). Rank 0's tokens: t0 -> experts 0 (rank 0) and 2 (rank 1),
# t1 -> 2 and 3 (both rank 1), t2 -> 1 (rank 0) and a dropped id.
IDX_RANK0 = np.array([[0, 2], [2, 3], [1, -1]])
# Rank 1's tokens: t0 -> 3 and 1 (ranks 1, 0), t1 -> 0 and 1 (rank 0 twice).
IDX_RANK1 = np.array([[3, 1], [0, 1]])


def test_routing_arithmetic_by_hand():
    assert bp.rows_per_rank(IDX_RANK0, 2, 2) == [2, 2]  # rank 0 gets t0, t2; rank 1 gets t0, t1
    assert bp.rows_per_rank(IDX_RANK1, 2, 2) == [2, 1]  # rank 0 gets t0, t1; rank 1 gets t0
    assert bp.dest_ranks_per_token(IDX_RANK0, 2, 2).tolist() == [2, 1, 1]
    assert bp.dest_ranks_per_token(np.array([[-1, -1]]), 2, 2).tolist() == [0]
    assert bp.pairs_per_expert(IDX_RANK0, 4) == [1, 1, 2, 1]
    assert bp.pairs_per_expert(IDX_RANK1, 4) == [1, 2, 0, 1]
    rows = [bp.rows_per_rank(IDX_RANK0, 2, 2), bp.rows_per_rank(IDX_RANK1, 2, 2)]
    pairs = [bp.pairs_per_expert(IDX_RANK0, 4), bp.pairs_per_expert(IDX_RANK1, 4)]
    assert bp.expected_receive(rows, pairs, 0, 2) == (4, [2, 3])
    assert bp.expected_receive(rows, pairs, 1, 2) == (3, [2, 2])
    with pytest.raises(br.BenchReportError, match="outside world_size=1"):
        bp.rows_per_rank(IDX_RANK0, 1, 2)
    with pytest.raises(br.BenchReportError, match="outside num_experts=3"):
        bp.pairs_per_expert(IDX_RANK0, 3)


def test_link_bytes_by_hand():
    # Rank 0 sends t0 and t1 to rank 1 (t0 once although only one of its ids is there; t2 stays home).
    assert bp.dispatch_link_bytes(IDX_RANK0, 0, 2, 14336) == 2 * 14336
    # Rank 1 sends t0 and t1 to rank 0: t1 once although both its ids are there.
    assert bp.dispatch_link_bytes(IDX_RANK1, 1, 2, 16) == 32
    assert bp.dispatch_link_bytes(np.array([[1, 0]]), 0, 2, 16) == 0  # everything stays home
    with pytest.raises(br.BenchReportError, match="row_bytes must be >= 1"):
        bp.dispatch_link_bytes(IDX_RANK0, 0, 2, 0)
    # mean of (32, 64) bytes over the slowest of (1, 2) us: 48 B / 2e-6 s = 0.024 GB/s
    assert bp.link_gbps([32, 64], [1.0, 2.0]) == pytest.approx(0.024)
    # A 2x H200 dispatch at 4096 tokens: 4081 rows of 14336 B in 398 us ~ 147 GB/s.
    assert bp.link_gbps([4081 * 14336], [398.0]) == pytest.approx(147.0, abs=0.2)


# --------------------------------------------------------------------------------------------------
# DeepEP's outputs: the permute and the checks (torch on the CPU)
# --------------------------------------------------------------------------------------------------


def test_expert_major_permute_by_hand():
    torch = pytest.importorskip("torch")
    # Received rows 0..3 (their first column names them); local expert ids per row, -1 elsewhere.
    recv_x = torch.arange(4, dtype=torch.float32).repeat_interleave(3).view(4, 3).to(torch.bfloat16)
    idx = torch.tensor([[1, -1, 0], [0, 2, -1], [-1, -1, 1], [-1, -1, -1]])
    w = torch.tensor([[0.1, 9.0, 0.2], [0.3, 0.4, 9.0], [9.0, 9.0, 0.5], [9.0, 9.0, 9.0]])
    rows, weights, src = bp.expert_major_permute(recv_x, idx, w, num_pairs=5)
    # expert 0: rows 0, 1; expert 1: rows 0, 2; expert 2: row 1 (the received order inside an expert)
    assert src.tolist() == [0, 1, 0, 2, 1]
    assert rows[:, 0].float().tolist() == [0.0, 1.0, 0.0, 2.0, 1.0]
    assert weights.tolist() == pytest.approx([0.2, 0.3, 0.1, 0.5, 0.4])


def test_check_deepep_dispatch():
    assert bp.check_deepep_dispatch(4, [2, 3], 4, [2, 3]) is None
    assert "received 3 rows, the routing gives 4" in bp.check_deepep_dispatch(3, [2, 3], 4, [2, 3])
    assert "counted [3, 2] rows per local expert" in bp.check_deepep_dispatch(4, [3, 2], 4, [2, 3])


def test_check_deepep_combine():
    torch = pytest.importorskip("torch")
    x = torch.tensor([[1.0, -2.0], [0.5, 3.0], [7.0, 7.0]], dtype=torch.bfloat16)
    dest = torch.tensor([2, 1, 0])
    good = torch.tensor([[2.0, -4.0], [0.5, 3.0], [123.0, 0.0]], dtype=torch.bfloat16)  # row 2: not sent
    assert bp.check_deepep_combine(x, good, dest) is None
    bad = good.clone()
    bad[1, 1] = 3.5
    why = bp.check_deepep_combine(x, bad, dest)
    assert why is not None and "on 1 token(s), first 1" in why
    assert "shape (2, 2)" in bp.check_deepep_combine(x, good[:2], dest)


# --------------------------------------------------------------------------------------------------
# the adapter against a stand-in deep_ep that records its calls
# --------------------------------------------------------------------------------------------------


def _recording_deep_ep() -> tuple[types.ModuleType, list]:
    """A module shaped like deep_ep v1.2.1's Python API (Buffer, set_num_sms, get_*_config, Config's size
    hint), recording every call in ``log``."""
    log: list = []

    class Config:
        def __init__(self, num_sms, send_tokens, recv_tokens, *rdma):
            self.num_sms, self.send_tokens, self.recv_tokens = num_sms, send_tokens, recv_tokens

        def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
            log.append(("hint", self.num_sms, hidden_bytes, num_ranks))
            return self.num_sms * self.recv_tokens * hidden_bytes * num_ranks

    class Buffer:
        num_sms = 20

        @staticmethod
        def set_num_sms(n):
            assert n % 2 == 0, "The SM count must be even"
            log.append(("set_num_sms", n))
            Buffer.num_sms = n

        @staticmethod
        def get_dispatch_config(num_ranks):
            log.append(("dispatch_config", Buffer.num_sms, num_ranks))
            return Config(Buffer.num_sms, 24, 256)

        @staticmethod
        def get_combine_config(num_ranks):
            log.append(("combine_config", Buffer.num_sms, num_ranks))
            return Config(Buffer.num_sms, 10, 128)

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                     num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                     explicitly_destroy=False, comm=None):  # fmt: skip
            self.sms = Buffer.num_sms
            log.append(("Buffer", group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy, Buffer.num_sms))

        def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                                allocate_on_comm_stream=False):  # fmt: skip
            log.append(("layout", self.sms, num_experts))
            return "per_rank", None, "per_expert", "in_rank", None

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                     expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None,
                     async_finish=False, allocate_on_comm_stream=False):  # fmt: skip
            if handle is not None:
                log.append(("dispatch_cached", self.sms, config.num_sms, handle, topk_idx, topk_weights))
                return f"recv({x})", None, None, None, None, None
            log.append(("dispatch", self.sms, config.num_sms, num_tokens_per_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights))  # fmt: skip
            return f"recv({x})", "recv_idx", "recv_w", [3, 4], f"handle@{self.sms}", None

        def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                    async_finish=False, allocate_on_comm_stream=False):  # fmt: skip
            log.append(("combine", self.sms, config.num_sms, config.recv_tokens, handle, topk_weights))
            return f"combined({x})", None, None

        def destroy(self):
            log.append(("destroy", self.sms))

    module = types.ModuleType("deep_ep")
    module.Buffer, module.Config = Buffer, Config
    return module, log


def test_adapter_sets_the_mapped_budget_before_making_the_buffer():
    fake, log = _recording_deep_ep()
    peer = bp.DeepEpPeer("group", world_size=2, hidden=7168, num_experts=256, module=fake)
    dep = peer.budget(132)
    assert dep.deepep_num_sms == 128 and dep.num_sms == 132
    names = [e[0] for e in log]
    assert names == ["set_num_sms", "dispatch_config", "combine_config", "hint", "hint", "Buffer"]
    assert log[0] == ("set_num_sms", 128)
    assert log[1] == ("dispatch_config", 128, 2) and log[2] == ("combine_config", 128, 2)
    # Sized by the larger of the two configs' hints, for bf16 rows of 7168, no RDMA, freed explicitly.
    want = max(128 * 256 * 14336 * 2, 128 * 128 * 14336 * 2)
    assert log[-1] == ("Buffer", "group", want, 0, True, 128)
    assert dep.num_nvl_bytes == want


def test_adapter_reuses_a_budget_and_keeps_its_config_after_another_budget():
    fake, log = _recording_deep_ep()
    peer = bp.DeepEpPeer("group", world_size=4, hidden=64, num_experts=32, module=fake)
    full = peer.budget(132)
    assert peer.budget(132) is full and peer.budget(129) is full  # 129 -> 128 as well: the same handle
    assert [e[0] for e in log].count("Buffer") == 1 and [e[0] for e in log].count("set_num_sms") == 1
    small = peer.budget(24)
    assert small is not full and log[-1][-1] == 24 and fake.Buffer.num_sms == 24
    log.clear()
    # The full-GPU budget's calls still carry its own 128-SM configs (the class attribute now says 24).
    made = full.dispatch_full("x", "idx64", "w")
    assert log[0] == ("layout", 128, 32)
    assert log[1] == ("dispatch", 128, 128, "per_rank", "in_rank", "per_expert", "idx64", "w")
    assert made.tokens_per_expert == [3, 4] and made.num_pairs == 7 and made.handle == "handle@128"
    assert full.dispatch_cached("x", made.handle) == "recv(x)"
    assert log[2] == ("dispatch_cached", 128, 128, "handle@128", None, None)  # no top-k with a handle
    assert full.combine("y", made.handle) == "combined(y)"
    assert log[3] == ("combine", 128, 128, 128, "handle@128", None)  # the combine config, no weights
    small.combine("y", "h")
    assert log[4][:3] == ("combine", 24, 24)


def test_adapter_release_close_discard():
    fake, log = _recording_deep_ep()
    peer = bp.DeepEpPeer("group", world_size=2, hidden=64, num_experts=8, module=fake)
    peer.budget(24)
    peer.budget(48)
    peer.budget(132)
    peer.release(24)
    assert [e for e in log if e[0] == "destroy"] == [("destroy", 24)]
    peer.release(24)  # nothing left to free
    peer.discard(48)  # forgotten, not freed
    peer.close()
    assert [e for e in log if e[0] == "destroy"] == [("destroy", 24), ("destroy", 128)]
    made_again = peer.budget(24)  # a released budget is made anew
    assert [e[0] for e in log].count("Buffer") == 4 and not made_again.closed
    with pytest.raises(ValueError, match="an SM budget of 1 leaves DeepEP no even SM count"):
        peer.budget(1)


def test_adapter_dispatch_permute_uses_the_cached_handle_and_the_full_calls_routing():
    torch = pytest.importorskip("torch")
    fake, log = _recording_deep_ep()
    dep = bp.DeepEpPeer("g", world_size=2, hidden=4, num_experts=4, module=fake).budget(2)
    recv = torch.arange(3, dtype=torch.float32).repeat_interleave(4).view(3, 4)
    dep.dispatch_cached = lambda x, handle: recv if handle == "h" else None
    made = bp.DeepEpDispatch(recv, torch.tensor([[1, -1], [0, 1], [-1, 0]]), torch.ones(3, 2), [2, 2], "h", 4)
    rows, _, src = dep.dispatch_permute("x", made)
    assert src.tolist() == [1, 2, 0, 1] and rows[:, 0].tolist() == [1.0, 2.0, 0.0, 1.0]


# --------------------------------------------------------------------------------------------------
# rows and the results form
# --------------------------------------------------------------------------------------------------


def _fields(**change):
    kw = dict(num_sms=132, layout="expert", row_bytes=1000, rows_off=[10.0, 30.0], dispatch_us=[1.0, 2.0],
              combine_us=[3.0, 4.0], nccl_dispatch_us=[5.0, 6.0], deepep_num_sms=128,
              deepep_us=[[1.0, 2.0, 3.0, 4.0], [0.5, 2.5, 3.5, 1.0]], deepep_skipped=None)  # fmt: skip
    return bp.peer_fields(**(kw | change))


def test_peer_fields_measured():
    f = _fields()
    assert (f["num_sms"], f["layout"], f["deepep_num_sms"], f["deepep_skipped"]) == (132, "expert", 128, None)
    assert f["dispatch_link_bytes"] == 20_000.0  # mean of 10 and 30 rows of 1000 B
    assert f["dispatch_link_gbps"] == pytest.approx(20_000 / 2e-6 / 1e9)  # over our slowest: 2 us
    assert f["nccl_us"] == 6.0
    assert (f["deepep_dispatch_us"], f["deepep_full_dispatch_us"]) == (1.0, 2.5)
    assert (f["deepep_dispatch_permute_us"], f["deepep_combine_us"]) == (3.5, 4.0)
    assert f["deepep_combine_us_per_rank"] == [4.0, 1.0]
    assert f["deepep_dispatch_link_gbps"] == pytest.approx(20_000 / 1e-6 / 1e9)
    assert f["dispatch_vs_deepep"] == 2.0 and f["combine_vs_deepep"] == 1.0


def test_peer_fields_skipped_and_errors():
    f = _fields(deepep_us=None, deepep_skipped="why", nccl_dispatch_us=None, deepep_num_sms=0)
    assert f["deepep_skipped"] == "why" and f["nccl_us"] is None and f["deepep_num_sms"] is None
    assert all(f[f"deepep_{n}_us"] is None for n in bp.DEEPEP_TIMES)
    assert f["dispatch_vs_deepep"] is None and f["deepep_dispatch_link_gbps"] is None
    with pytest.raises(br.BenchReportError, match="either DeepEP's times or the reason"):
        _fields(deepep_skipped="both")
    with pytest.raises(br.BenchReportError, match="either DeepEP's times or the reason"):
        _fields(deepep_us=None)
    with pytest.raises(br.BenchReportError, match="deepep_combine_us must be"):
        _fields(deepep_us=[[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    with pytest.raises(br.BenchReportError, match="layout must be one of"):
        _fields(layout="token")
    with pytest.raises(br.BenchReportError, match="rows_off must be >= 0, one per rank"):
        _fields(rows_off=[1.0])


def _good_results() -> dict:
    meta = {"world_size": 2, "device": "NVIDIA H200", "hidden": 7168, "topk": 8, "num_experts": 256,
            "dtype": "bfloat16"}  # fmt: skip
    measured = {"tokens": 4096, "mode": "scatter", "dispatch_us": 398.0, "combine_us": 406.0} | _fields()
    skipped = {"tokens": 128, "mode": "scatter", "dispatch_us": 37.0, "combine_us": 40.0} | _fields(
        num_sms=1, deepep_us=None, deepep_skipped="an SM budget of 1 leaves DeepEP no even SM count >= 2",
        deepep_num_sms=0, nccl_dispatch_us=None,
    )  # fmt: skip
    return {"meta": meta, "rows": [measured, skipped]}


def test_check_perf_json_accepts_good_results(tmp_path):
    good = _good_results()
    bp.check_perf_json(good)
    bp.check_perf_json(json.loads(json.dumps(good)))  # as read back from a file
    path = tmp_path / "r.json"
    path.write_text(json.dumps(good))
    assert bp.load_results(path)["rows"][1]["deepep_skipped"].startswith("an SM budget of 1")
    # A narrower requirement (e.g. a file written before DeepEP was added) checks only those fields.
    legacy = {"meta": good["meta"], "rows": [{"tokens": 8, "dispatch_us": 1.0}]}
    bp.check_perf_json(legacy, ("tokens", "dispatch_us"))


@pytest.mark.parametrize("mutate,message", [
    (lambda o: o["meta"].pop("device"), r"meta is missing key\(s\) \['device'\]"),
    (lambda o: o["rows"][0].pop("dispatch_link_gbps"), r"row 0 \(tokens=4096, num_sms=132\): missing "
                                                       r"'dispatch_link_gbps'"),
    (lambda o: o["rows"][1].pop("deepep_skipped"), r"row 1 .*'deepep_dispatch_us' is None without a "
                                                   r"'deepep_skipped' reason"),
    (lambda o: o["rows"][1].update(deepep_skipped=" "), "without a 'deepep_skipped' reason"),
    (lambda o: o["rows"][0].update(deepep_combine_us=None, deepep_skipped="x"), "DeepEP measured in part"),
    (lambda o: o["rows"][0].update(layout="token"), "'layout' must be one of"),
    (lambda o: o["rows"][0].update(num_sms=0), "'num_sms' must be an integer >= 1, got 0"),
    (lambda o: o["rows"][0].update(tokens=True), "'tokens' must be an integer >= 1, got True"),
    (lambda o: o["rows"][0].update(dispatch_us=-1.0), "'dispatch_us' must be a positive time"),
    (lambda o: o["rows"][0].update(combine_us=None), "'combine_us' is None"),
    (lambda o: o["rows"][0].update(deepep_dispatch_us=math.inf), "'deepep_dispatch_us' must be a positive"),
    (lambda o: o["rows"][0].update(deepep_num_sms=25), "'deepep_num_sms' must be an even integer >= 2"),
    (lambda o: o["rows"][0].update(dispatch_link_gbps=-0.5), "'dispatch_link_gbps' must be a number >= 0"),
    (lambda o: o["rows"].clear(), "'rows' must be a non-empty list"),
    (lambda o: o["rows"].append(3), "row 2 must be an object"),
    (lambda o: o.pop("meta"), "'meta' must be an object"),
])  # fmt: skip
def test_check_perf_json_names_what_is_wrong(mutate, message):
    bad = _good_results()
    mutate(bad)
    with pytest.raises(br.BenchReportError, match=message):
        bp.check_perf_json(bad)


def test_check_perf_json_refuses_a_non_object():
    with pytest.raises(br.BenchReportError, match="must be a JSON object, got list"):
        bp.check_perf_json([])


PEERS_BASELINE = REPO / "baselines" / "perf" / "h200x2_vs_deepep.json"


def check_peers_baseline(report: dict) -> None:
    """What the committed 2x H200 report must hold: a valid results object from 2
    ranks with a row per (tokens, num_sms, layout) for tokens 4096 and 8192, num_sms 24 and the full GPU,
    both layouts, an FP8 row per (tokens, layout) at 24 SMs, and DeepEP measured in each at its budget for
    ours (128 for the full GPU)."""
    bp.check_perf_json(report)
    assert report["meta"]["world_size"] == 2, report["meta"]["world_size"]
    rows = report["rows"]
    have = {(r["tokens"], r["num_sms"], r["layout"]) for r in rows}
    want = {(t, s, lay) for t in (4096, 8192) for s in (24, bp.FULL_GPU_SMS) for lay in ("rank", "expert")}
    assert want <= have, sorted(want - have)
    fp8 = {(r["tokens"], r["layout"]) for r in rows if r["mode"].endswith("+fp8") and r["num_sms"] == 24}
    assert {(t, lay) for t in (4096, 8192) for lay in ("rank", "expert")} <= fp8, sorted(fp8)
    for r in rows:
        assert r["deepep_skipped"] is None, (r["tokens"], r["num_sms"], r["deepep_skipped"])
        assert r["deepep_num_sms"] == bp.deepep_num_sms(r["num_sms"]), r
        assert r["dispatch_link_gbps"] > 0, r


def test_committed_h200x2_vs_deepep_report():
    if not PEERS_BASELINE.exists():
        pytest.skip(f"{PEERS_BASELINE.relative_to(REPO)} is not committed yet (scripts/gpu_session.sh peers)")
    check_peers_baseline(json.loads(PEERS_BASELINE.read_text()))
    assert PEERS_BASELINE.with_suffix(".png").exists()


def test_the_peers_baseline_check_can_fail():
    report = json.loads(PEERS_BASELINE.read_text()) if PEERS_BASELINE.exists() else None
    if report is None:
        pytest.skip("no committed report to mutate")
    dropped = {**report, "rows": [r for r in report["rows"] if r["num_sms"] != 24]}
    with pytest.raises(AssertionError, match="24"):
        check_peers_baseline(dropped)
    one = {**report, "meta": {**report["meta"], "world_size": 1}}
    with pytest.raises(AssertionError):
        check_peers_baseline(one)
    no_fp8 = {**report, "rows": [r for r in report["rows"] if not r["mode"].endswith("+fp8")]}
    with pytest.raises(AssertionError, match="4096"):
        check_peers_baseline(no_fp8)
    skipped = {**report, "rows": [{**report["rows"][0], "deepep_skipped": "x", "deepep_dispatch_us": None,
                                   "deepep_combine_us": None, "deepep_full_dispatch_us": None,
                                   "deepep_dispatch_permute_us": None}, *report["rows"][1:]]}  # fmt: skip
    with pytest.raises(AssertionError):
        check_peers_baseline(skipped)


def test_peer_table_and_plot(tmp_path):
    results = _good_results()
    for r in results["rows"]:
        r |= {"routing": "uniform", "nccl_combine_us": 7.0}
    table = bp.format_peer_table(results["rows"])
    lines = table.splitlines()
    assert len(lines) == 2 + 2 + 2  # header, rule, 2 rows, note, one skip reason
    assert lines[2].split()[:4] == ["uniform", "4096", "scatter", "132"]
    assert "128" in lines[2].split() and "skip" in lines[3].split() and "skip" not in lines[2].split()
    assert lines[-1] == "DeepEP skipped: an SM budget of 1 leaves DeepEP no even SM count >= 2"
    pytest.importorskip("matplotlib")
    path = bp.plot_peers(results, tmp_path / "p" / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(br.BenchReportError, match="no row has the results fields"):
        bp.plot_peers({"meta": {}, "rows": [{"tokens": 1}]}, tmp_path / "x.png")


def test_bench_row_without_nccl(tmp_path):
    kw = dict(routing="uniform", tokens=64, mode="scatter", checked=False, row_bytes=128, pairs_off=[4, 6],
              rows_off=[2, 3], dispatch_us=[1.0, 2.0], combine_us=[2.0, 4.0])  # fmt: skip
    row = br.BenchRow.from_measurements(**kw, nccl_dispatch_us=None, nccl_combine_us=None)
    d = row.to_dict()
    nccl = [k for k in d if k.startswith("nccl_")] + ["dispatch_ratio", "combine_ratio"]
    assert len(nccl) == 12 and all(d[k] is None for k in nccl)
    assert d["dispatch_moved_gbps"] > 0 and d["dispatch_us"] == 2.0  # ours unchanged
    assert br.format_row(d).split()[-4:] == ["-", "-", "-", "-"]
    with pytest.raises(br.BenchReportError, match="both be given or both be None"):
        br.BenchRow.from_measurements(**kw, nccl_dispatch_us=[1.0, 1.0], nccl_combine_us=None)
    with_nccl = br.BenchRow.from_measurements(**kw, nccl_dispatch_us=[3.0, 4.0], nccl_combine_us=[4.0, 8.0])
    assert (with_nccl.dispatch_ratio, with_nccl.combine_ratio) == (2.0, 2.0)
    pytest.importorskip("matplotlib")
    meta = {k: 0 for k in br.META_KEYS} | {"config": {}}
    report = br.write_json(tmp_path / "r.json", meta, [d, with_nccl.to_dict()])
    assert br.plot(report, tmp_path / "r.png").stat().st_size > 1000  # NCCL plotted where measured


# --------------------------------------------------------------------------------------------------
# whole sweeps over gloo (stand-ins of tests/_bench_stand_ins.py): ReferenceEpBuffer stands in for EpBuffer,
# a step counter for the timer, and for DeepEP either nothing (the skip path) or a stand-in with DeepEP's
# semantics over torch.distributed
# --------------------------------------------------------------------------------------------------

_WORKER = r'''
import benchmark as bm
from _bench_stand_ins import Buffer, Launching, StepTimer, deepep_peer
from cute_ep.tools.cli import Printer, config_from_args
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime

KIND = sys.argv[1]
sys.modules["deep_ep"] = None  # this machine's deep_ep (if any) must not decide the test
Buffer.short_on_rank0 = KIND == "deepep_wrong"  # a row short: the benchmark must refuse to time it
Buffer.fp8_scales_off_on_rank0 = KIND == "deepep_fp8_wrong"

args = bm.build_parser().parse_args(sys.argv[2:])
bm.validate_args(args)
env = DistEnv.from_environ(local_world_size=args.local_world_size)
cfg = config_from_args(args, env, max_tokens=max(args.token_list))  # the script's own config
with Runtime(env, backend="gloo") as rt:
    code = bm.sweep(args, cfg, rt, Printer(env.rank), make_buffer=Launching, make_timer=StepTimer,
                    make_deepep=None if KIND == "absent" else deepep_peer)
    if KIND != "absent":
        print(f"rank {env.rank} DeepEP buffers made at {Buffer.made}", flush=True)
sys.exit(code)
'''

SMALL = ("--hidden", "64", "--topk", "2", "--num-experts", "8", "--tokens", "8,24", "--routing", "uniform",
         "--modes", "scatter", "--iters", "3", "--warmup", "1", "--input-sets", "2",
         "--validate-max-tokens", "8")  # fmt: skip


def _sweep(tmp_path: Path, kind: str, *args: str, world: int = 2) -> tuple[list[int], str, dict]:
    out_json = tmp_path / "r.json"
    worker = write_worker(tmp_path, _WORKER)
    codes, out = launch_ranks(worker, kind, *args, "--out-json", str(out_json), world=world, timeout=240)
    assert codes == [0] * world, out[-6000:]
    return codes, out, bp.load_results(out_json)


def test_sweep_reports_deepep_skipped_when_it_does_not_import(tmp_path):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "r.png"
    _, out, results = _sweep(tmp_path, "absent", *SMALL, "--num-sms", "24,132,1", "--out-png", str(out_png))
    rows = results["rows"]
    assert [(r["num_sms"], r["tokens"]) for r in rows] == [(b, t) for b in (24, 132, 1) for t in (8, 24)]
    assert [r["deepep_num_sms"] for r in rows] == [24, 24, 128, 128, None, None]
    for r in rows:
        assert r["layout"] == "expert"
        assert r["deepep_skipped"].startswith("deep_ep is not importable ("), r["deepep_skipped"]
        assert all(r[f"deepep_{n}_us"] is None for n in bp.DEEPEP_TIMES)
        assert r["nccl_us"] == r["nccl_dispatch_us"] == 21.0  # StepTimer: slowest of 2 ranks' medians
        link = r["rows_off_mean"] * r["row_bytes"] / 21e-6 / 1e9
        assert r["dispatch_link_gbps"] == pytest.approx(link) and r["rows_off_mean"] > 0
    assert br.load_json(tmp_path / "r.json")["schema"] == br.SCHEMA  # today's schema still holds
    meta = results["meta"]
    assert meta["num_sms_budgets"] == [24, 132, 1] and meta["config"]["num_sms"] == [24, 132, 1]
    assert meta["deepep"]["skipped"].startswith("deep_ep is not importable")
    assert meta["deepep"]["num_sms"] == {"24": 24, "132": 128, "1": None}
    assert "DeepEP skipped: deep_ep is not importable" in out
    assert out.count(br.table_header()) == 1
    assert bp.format_peer_table(rows) in out
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_times_deepep_beside_ours_at_each_budget(tmp_path):
    _, out, results = _sweep(tmp_path, "deepep", *SMALL, "--num-sms", "24,132,1", "--combine", "pull,reduced")
    rows = results["rows"]
    assert [(r["num_sms"], r["tokens"], r["mode"]) for r in rows] == [
        (b, t, m) for b in (24, 132, 1) for t in (8, 24) for m in ("scatter", "scatter+reduced")
    ]
    for r in rows:
        if r["num_sms"] == 1:
            assert r["deepep_skipped"] == "an SM budget of 1 leaves DeepEP no even SM count >= 2"
            assert r["deepep_dispatch_us"] is None
            continue
        assert r["deepep_skipped"] is None, r["deepep_skipped"]
        assert r["deepep_num_sms"] == {24: 24, 132: 128}[r["num_sms"]]
        for n in bp.DEEPEP_TIMES:  # StepTimer: rank r's median is 10 (r + 1) + 1
            assert r[f"deepep_{n}_us"] == 21.0 and r[f"deepep_{n}_us_per_rank"] == [11.0, 21.0]
        assert r["dispatch_vs_deepep"] == 1.0
        assert r["deepep_dispatch_link_gbps"] == pytest.approx(r["dispatch_link_gbps"])
    # One DeepEP buffer per budget that can run it, at DeepEP's count.
    assert "rank 0 DeepEP buffers made at [24, 128]" in out
    assert "DeepEP at 1 SMs skipped: an SM budget of 1" in out
    assert "DeepEP skipped" not in out.replace("DeepEP skipped: an SM budget of 1", "")


def test_sweep_refuses_to_time_wrong_deepep_output_and_goes_on(tmp_path):
    _, out, results = _sweep(tmp_path, "deepep_wrong", *SMALL, "--peers", "deepep")
    rows = results["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["deepep_dispatch_us"] is None
        # rank 0 sees the short dispatch first (rank 1 sees the combine it spoils)
        assert r["deepep_skipped"].startswith("rank 0: DeepEP dispatch received "), r["deepep_skipped"]
        assert r["dispatch_us"] == 21.0  # ours still measured
        # --peers without nccl: NCCL not measured, its fields None, the table shows "-"
        assert r["nccl_us"] is None and r["nccl_dispatch_us"] is None and r["dispatch_ratio"] is None
        assert br.format_row(r).split()[-4:] == ["-", "-", "-", "-"]
    assert "[uniform T=8 num_sms=132] DeepEP skipped: rank 0: DeepEP dispatch received" in out


FP8 = ("--hidden", "128", "--topk", "2", "--num-experts", "8", "--tokens", "8", "--routing", "uniform",
       "--modes", "scatter", "--iters", "2", "--warmup", "0", "--input-sets", "2",
       "--validate-max-tokens", "8", "--layouts", "expert,rank", "--fp8", "--peers", "deepep")  # fmt: skip


def test_sweep_times_deepeps_fp8_dispatch_beside_our_fp8_rows(tmp_path):
    _, out, results = _sweep(tmp_path, "deepep", *FP8)
    rows = results["rows"]
    assert [r["mode"] for r in rows] == ["rank", "rank+cached", "rank+fp8", "rank+fp8+cached", "scatter",
                                         "scatter+fp8"]
    assert all(r["checked"] for r in rows)
    assert "[uniform T=8 rank+fp8] checked: the packed FP8 rows bit-identical to the reference" in out
    # the cached FP8 row stands beside DeepEP's FP8 dispatches, as the full FP8 row does
    assert rows[3]["deepep_dispatch_us_per_rank"] == rows[2]["deepep_dispatch_us_per_rank"]
    for r in rows:
        assert r["deepep_skipped"] is None, r["deepep_skipped"]
        for n in bp.DEEPEP_TIMES:  # StepTimer, 2 iterations: rank r's median is 10 (r + 1) + 0.5
            assert r[f"deepep_{n}_us_per_rank"] == [10.5, 20.5]
    assert [r["dispatch_row_bytes"] for r in rows] == [0, 0, 144, 144, 0, 144]
    assert "FP8 input" in results["meta"]["deepep"]["timing"]


def test_sweep_refuses_to_time_deepeps_fp8_dispatch_when_it_receives_other_bytes(tmp_path):
    _, out, results = _sweep(tmp_path, "deepep_fp8_wrong", *FP8)
    for r in results["rows"]:
        assert r["deepep_dispatch_us"] is None and r["dispatch_us"] == 20.5
        assert r["deepep_skipped"] == ("rank 0: DeepEP's FP8 dispatch did not receive the sent rows' e4m3 "
                                       "values and scales"), r["deepep_skipped"]


def test_fp8_peer_times_takes_the_fp8_dispatches_and_the_combine():
    medians = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # DEEPEP_TIMES, then DEEPEP_FP8_TIMES
    assert bp.fp8_peer_times(medians) == [5.0, 6.0, 7.0, 4.0]
    assert bp.fp8_peer_times(medians[:4]) is None and bp.fp8_peer_times(None) is None


def test_expert_major_permute_moves_fp8_values_and_scales_alike():
    import torch

    q = torch.arange(12, dtype=torch.float32).view(3, 4).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0], [2.0], [3.0]])
    idx = torch.tensor([[1, -1], [0, 1], [-1, 0]])
    w = torch.tensor([[0.5, 0.0], [0.25, 0.75], [0.0, 1.0]])
    (rows_q, rows_s), weights, src = bp.expert_major_permute((q, scales), idx, w, 4)
    assert src.tolist() == [1, 2, 0, 1]  # expert 0: tokens 1, 2; expert 1: tokens 0, 1
    assert torch.equal(rows_q.view(torch.uint8), q.view(torch.uint8)[src])
    assert rows_s.view(-1).tolist() == [2.0, 3.0, 1.0, 2.0] and weights.tolist() == [0.25, 1.0, 0.5, 0.75]
