"""Expert capacity and FP8 dispatch of the host backends (reference, all-to-all) under torchrun: gloo
worlds of 2 and 4 ranks run tests/_torchrun_capacity_fp8_worker.py, whose "capacity" and "fp8" parts
record their findings (both parts in one launch per world); the assertions live here. The world-of-one
tests are in tests/test_capacity.py and tests/test_fp8.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import assert_cases_match
from _worlds import gloo_worlds_fixture, needs_gloo

WORKER = Path(__file__).with_name("_torchrun_capacity_fp8_worker.py")

pytestmark = needs_gloo
ranks = gloo_worlds_fixture(WORKER, "cap_fp8_", "capacity,fp8", timeout=180)


@pytest.fixture
def capacity_ranks(ranks: list[dict]) -> list[dict]:
    return [res["capacity"] for res in ranks]


@pytest.fixture
def fp8_ranks(ranks: list[dict]) -> list[dict]:
    return [res["fp8"] for res in ranks]


# --------------------------------------------------------------------------------------------------
# expert capacity
# --------------------------------------------------------------------------------------------------


def test_distributed_backends_match_the_effective_routing(capacity_ranks):
    assert_cases_match(capacity_ranks, 4)
    assert sum(c["dropped"] for c in capacity_ranks[0]["cases"]) > 50  # the cases do drop rows


def test_distributed_raise_is_the_same_on_every_rank(capacity_ranks):
    messages = set()
    for r, res in enumerate(capacity_ranks):
        for backend in ("a2a", "reference"):
            got = res["raise"][backend]
            assert got["raised"] == "CapacityExceeded", (r, backend, got)
            assert got["dropped_ok"] and got["total"] == got["want_total"] > 0, (r, backend, got)
            assert got["mismatches"] == [] and got["reset"], (r, backend, got)
            messages.add(got["message"])
    assert len(messages) == 1 and "expert 0 (rank 0):" in messages.pop()


# --------------------------------------------------------------------------------------------------
# FP8 dispatch
# --------------------------------------------------------------------------------------------------


def test_distributed_fp8_dispatch_delivers_the_senders_packed_rows(fp8_ranks):
    assert_cases_match(fp8_ranks, 4)
    assert sum(n for res in fp8_ranks for case in res["cases"] for n in case["num_recv"]) > 100


def test_distributed_fp8_flag_errors_raise_on_every_rank(fp8_ranks):
    last = len(fp8_ranks) - 1
    for r, res in enumerate(fp8_ranks):
        bad = res["bad"]
        for backend in ("a2a", "reference"):
            assert "every rank must pass the same fp8 flag" in bad[f"{backend}_mismatch"]["message"], (r, bad)
            got = bad[f"{backend}_not_bool_on_last"]
            assert got["raised"] == "ValueError", (r, got)
            if r == last:
                assert got["message"] == "fp8 must be True or False, got 'yes'"
            else:
                assert f"on another rank: rank {last}:" in got["message"], (r, got)
            assert "multiple of 128" in bad[f"{backend}_hidden64"]["message"], (r, bad)
            assert bad[f"{backend}_usable"]["ok"]
