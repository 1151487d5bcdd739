"""ElasticExperts (ECHO) in real gloo worlds of 2 and 4 ranks, reference backend: one torchrun launch per
world runs every distributed check (tests/_torchrun_elastic_worker.py); the assertions live here. The GPU
buffer exposes the same calls, so the same checks run on it (tests/gpu/test_elastic.py)."""

from __future__ import annotations

from pathlib import Path

from _worlds import gloo_worlds_fixture, needs_gloo

WORKER = Path(__file__).with_name("_torchrun_elastic_worker.py")

pytestmark = needs_gloo
ranks = gloo_worlds_fixture(WORKER, "elastic", timeout=400)


def test_every_rank_computes_the_same_valid_plan(ranks):
    for r, res in enumerate(ranks):
        for key in ("routing", "routing_capped"):
            assert all(res[key]["same_plan"]), (r, key)
            assert res[key]["problems"] == [[]] * len(res[key]["problems"]), (r, key, res[key]["problems"])


def test_clones_are_placed_under_skew_and_the_cap_holds(ranks):
    assert max(ranks[0]["routing"]["clones"]) >= 1, ranks[0]["routing"]
    assert max(ranks[0]["routing_capped"]["clones"]) <= 1, ranks[0]["routing_capped"]


def test_routed_pairs_reach_their_expert_and_the_peak_falls(ranks):
    peaks, peaks_plain = [], []
    for step in range(len(ranks[0]["routing"]["rows"])):
        peaks.append(max(res["routing"]["rows"][step] for res in ranks))
        peaks_plain.append(max(res["routing"]["rows_plain"][step] for res in ranks))
    for r, res in enumerate(ranks):
        got = res["routing"]
        assert all(got["routed_to_replica"]), r
        # The buffer delivers exactly the rows the plan predicted for this rank.
        assert got["rows"] == got["predicted"], (r, got["rows"], got["predicted"])
    assert all(a <= b for a, b in zip(peaks, peaks_plain, strict=True)), (peaks, peaks_plain)
    assert sum(peaks) < sum(peaks_plain), (peaks, peaks_plain)


def test_combine_with_clones_is_bit_identical(ranks):
    for r, res in enumerate(ranks):
        assert all(res["routing"]["same_output"]), (r, res["routing"]["same_output"])
        assert all(res["routing_capped"]["same_output"]), r


def test_clones_hold_their_experts_weights_bit_for_bit(ranks):
    assert ranks[0]["coherence"]["clones"] >= 1
    for r, res in enumerate(ranks):
        assert res["coherence"]["bad_slots"] == [], (r, res["coherence"])


def test_clone_gradients_reach_the_home_expert_in_fixed_order(ranks):
    home = ranks[0]["coherence"]
    assert home["homes_cloned"] == [0], home  # every clone is of an expert of rank 0
    assert home["home_changed"], "no clone gradient reached rank 0's experts: the check would be vacuous"
    for r, res in enumerate(ranks):
        assert res["coherence"]["grads_exact"], (r, res["coherence"])
        assert res["coherence"]["dtype"] == "torch.float32"


def test_exact_arithmetic_gives_bit_identical_gradients(ranks):
    assert ranks[0]["exact"]["clones"] >= 1 and ranks[0]["exact"]["grad_scale"] > 0
    for r, res in enumerate(ranks):
        assert res["exact"]["expert_grads_equal"], (r, res["exact"])
        assert res["exact"]["input_grads_equal"], (r, res["exact"])


def test_training_with_cloning_matches_training_without(ranks):
    t = ranks[0]["training"]
    assert max(max(step) for step in t["rows_echo"]) < max(max(step) for step in t["rows_plain"]), t
    for r, res in enumerate(ranks):
        assert res["training"]["relative_diff"] <= res["training"]["tolerance"], (r, res["training"])
        # Same losses to fp32 noise: the runs saw the same data and routing.
        for a, b in zip(res["training"]["losses_plain"], res["training"]["losses_echo"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (r, a, b)


def test_bad_arguments_name_the_constraint(ranks):
    for res in ranks:
        assert res["bad"]["experts"]["raised"] == "ValueError"
        assert "divisible by the world size" in res["bad"]["experts"]["message"]
        assert res["bad"]["idx"]["raised"] == "ValueError"
        assert "topk_idx must be [T, K]" in res["bad"]["idx"]["message"]
