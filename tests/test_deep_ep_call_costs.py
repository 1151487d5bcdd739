"""scripts/deep_ep_call_costs.py on a machine without a GPU: its help, a clear refusal (exit 2) instead of a
traceback, and its host timer's arithmetic with a stand-in clock (its wall timer,
``cute_ep.tools.bench_timing.deepep_bench``: tests/test_deepep_bench.py)."""

from __future__ import annotations

import pytest
import torch
from _launch import REPO, assert_help_and_no_gpu_refusal, import_script


@pytest.fixture(scope="module")
def cc():
    return import_script(REPO / "scripts" / "deep_ep_call_costs.py", "deep_ep_call_costs_script")


def test_help_and_no_gpu(cc, capsys, monkeypatch):
    assert_help_and_no_gpu_refusal(cc.main, "cute_ep.deep_ep", ["--mode", "normal"], capsys, monkeypatch)
    with pytest.raises(SystemExit) as e:
        cc.main(["--mode", "internode"])
    assert e.value.code == 2


def test_bad_counts_are_refused(cc, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cc.main(["--iters", "1"]) == 2
    assert "--iters must be >= 2" in capsys.readouterr().err


def test_host_time_is_the_median_of_calls_after_settling(cc, monkeypatch):
    clock = iter([0.0, 5e-6, 1.0, 1.0 + 9e-6, 2.0, 2.0 + 7e-6])
    monkeypatch.setattr(cc.time, "perf_counter", lambda: next(clock))
    events = []
    median = cc.host_us(lambda: events.append("call"), 3, lambda: events.append("settle"))
    assert median == pytest.approx(7.0) and events == ["settle", "call"] * 3


def test_back_to_back_time_is_per_call_of_calls_issued_without_settling(cc, monkeypatch):
    clock = iter([10.0, 10.0 + 40e-6])
    monkeypatch.setattr(cc.time, "perf_counter", lambda: next(clock))
    events = []
    per_call = cc.back_to_back_us(lambda: events.append("call"), 4, lambda: events.append("settle"))
    assert per_call == pytest.approx(10.0) and events == ["settle"] + ["call"] * 4 + ["settle"]
