"""scripts/layout_bench.py on a machine without a GPU: its help, and a clear refusal (exit 2) instead of a
traceback; the timer's arithmetic (DeepEP's bench drops the first timing) is checked with stand-in
events."""

from __future__ import annotations

import pytest
import torch
from _launch import REPO, import_script


@pytest.fixture(scope="module")
def lb():
    return import_script(REPO / "scripts" / "layout_bench.py", "layout_bench_script")


def test_help_and_no_gpu(lb, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        lb.main(["--help"])
    assert e.value.code == 0 and "get_dispatch_layout" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lb.main(["--tokens", "128"]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err


def test_bench_averages_all_but_the_first_timing(lb, monkeypatch):
    times = iter([9.0, 0.004, 0.002, 0.003])  # ms; the first (a cold call) is dropped

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            pass

        def record(self) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return next(times)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(1))
    calls = []
    avg, low = lb.bench(lambda: calls.append(1), warmup=3, iters=4)
    assert len(calls) == 7 and avg == pytest.approx(3.0) and low == pytest.approx(2.0)
