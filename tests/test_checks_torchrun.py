"""The distributed checks in a real 4-process gloo world launched by torchrun (CPU only).

The worker (tests/_torchrun_checks_worker.py) runs every scenario on every rank and writes one JSON
per rank; the assertions live here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import worker_results

from cute_ep.inputs import make_inputs
from cute_ep.reference import (
    reference_combine,
    reference_dispatch,
    reference_expert_outputs,
    reference_layout,
)
from cute_ep.validators.checks import check_combine, check_dispatch, format_summary

WORLD = 4
WORKER = Path(__file__).with_name("_torchrun_checks_worker.py")
ALL_CLASSES = ("self", "same_node", "other_node_same_local_rank", "other_node_other_local_rank")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return worker_results(WORKER, WORLD, tmp_path_factory.mktemp("checks"), timeout=120)


def _all(ranks, name, key):
    return [r[name][key] for r in ranks]


def test_correct_dispatch_passes_with_all_route_classes(ranks):
    assert _all(ranks, "dispatch_ok", "passed") == [True] * WORLD, _all(ranks, "dispatch_ok", "message")
    counts = _all(ranks, "dispatch_ok", "route_counts")
    assert all(c == counts[0] for c in counts)  # the same totals on every rank
    assert all(counts[0][c] > 0 for c in ALL_CLASSES)
    assert sum(counts[0].values()) == ranks[0]["total_pairs"]
    assert ranks[0]["dispatch_ok"]["summary"].startswith("dispatch_ok: PASS (pairs: self=")


def test_unordered_mode_accepts_reordered_groups(ranks):
    assert any(r["rolled_changed"] for r in ranks)
    assert _all(ranks, "dispatch_unordered_ok", "passed") == [True] * WORLD
    # The same buffers are not the deterministic layout, so ordered mode must reject them.
    assert _all(ranks, "dispatch_rolled_but_ordered", "passed") == [False] * WORLD
    assert _all(ranks, "dispatch_unordered_duplicate", "passed") == [False] * WORLD
    assert "field recv_src differs" in ranks[0]["dispatch_unordered_duplicate"]["message"]


def test_corrupted_row_fails_everywhere_and_names_the_pair(ranks):
    res = [r["dispatch_bad_row"] for r in ranks]
    assert [r["passed"] for r in res] == [False] * WORLD
    assert [r["local_passed"] for r in res] == [True, False, True, True]
    assert all(r["failed_ranks"] == [1] for r in res)
    p = ranks[1]["corrupted_pair"]
    msg = res[1]["message"]
    assert (
        f"(source rank {p['s']}, token {p['t']}, k {p['k']}, expert {p['e']}, dest rank 1, slot {p['slot']})"
        in msg
    )
    assert "field recv_x differs" in msg and "at column 5" in msg
    assert "recv_w" not in msg and "recv_src" not in msg
    assert "failed on rank(s) [1]" in res[0]["message"]


def test_corrupted_weight_fails_naming_recv_w(ranks):
    res = [r["dispatch_bad_weight"] for r in ranks]
    assert [r["passed"] for r in res] == [False] * WORLD
    assert res[2]["local_passed"] is False
    assert "dest rank 2, slot 0)" in res[2]["message"] and "field recv_w differs" in res[2]["message"]


def test_short_buffer_is_a_failure_not_a_hang(ranks):
    res = [r["dispatch_short"] for r in ranks]
    assert [r["passed"] for r in res] == [False] * WORLD
    assert "recv_x has" in res[3]["message"]


def test_combine(ranks):
    assert _all(ranks, "combine_ok", "passed") == [True] * WORLD, _all(ranks, "combine_ok", "message")
    bad = [r["combine_bad_element"] for r in ranks]
    assert [r["passed"] for r in bad] == [False] * WORLD
    assert bad[0]["local_passed"] is False
    msg = bad[0]["message"]
    assert msg.startswith("(rank 0, token 1, column 6): expected ") and "token routes: (k 0, expert " in msg
    assert "1 of " in msg
    # Atomic-mode slots: right with the kernel's own scatter, wrong with the deterministic one.
    assert _all(ranks, "combine_atomic_scatter", "passed") == [True] * WORLD
    assert _all(ranks, "combine_atomic_default_scatter", "passed") == [False] * WORLD


def test_coverage_gate(ranks):
    res = [r["coverage_missing"] for r in ranks]
    assert [r["passed"] for r in res] == [False] * WORLD
    assert all(not r["coverage_ok"] for r in res)
    for r in res:
        assert "coverage" in r["message"]
        for missing in ALL_CLASSES[1:]:
            assert missing in r["message"]
    relaxed = [r["coverage_not_required"] for r in ranks]
    assert [r["passed"] for r in relaxed] == [True] * WORLD
    assert relaxed[0]["route_counts"]["same_node"] == 0 and relaxed[0]["route_counts"]["self"] > 0


def test_world_of_one_without_process_group():
    """group=None and no initialised process group: the checks run as a world of 1 (in-process)."""
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")
    x, idx, w = make_inputs(0, 10, 8, 4, 2, torch.float16, 3, routing="dropped")
    layout = reference_layout([idx], 4)
    exp = reference_dispatch([x], [idx], [w], layout, 16)[0]
    res = check_dispatch(
        x, idx, w, exp.recv_x, exp.recv_w, exp.recv_src, max_tokens=16, num_experts=4, local_world_size=1
    )
    assert res.passed and res.coverage_ok and res.route_counts["self"] == int(layout.counts.sum())
    assert format_summary(res, "dispatch") == (
        f"dispatch: PASS (pairs: self={res.route_counts['self']} same_node=0 "
        "other_node_same_local_rank=0 other_node_other_local_rank=0)"
    )
    y = reference_expert_outputs([exp], layout)[0]
    out = reference_combine([y], [idx], [w], layout.scatter, num_experts=4)[0]
    assert check_combine(out, idx, w, y, local_world_size=1, num_experts=4).passed
    nudged = out.clone()
    nudged.view(torch.int16)[2, 4] += 1
    strict = check_combine(nudged, idx, w, y, local_world_size=1, num_experts=4)
    assert not strict.passed and strict.message.startswith("(rank 0, token 2, column 4)")
    assert "FAIL" in format_summary(strict, "combine")
    assert check_combine(nudged, idx, w, y, local_world_size=1, num_experts=4, atol=0.1).passed
    nudged[2, 4] = float("nan")
    assert not check_combine(nudged, idx, w, y, local_world_size=1, num_experts=4, atol=0.1).passed
