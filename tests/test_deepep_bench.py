"""``cute_ep.tools.bench_timing.deepep_bench``, the timer of the scripts that time calls as DeepEP's tests
do (``scripts/layout_bench.py``, ``scripts/deep_ep_call_costs.py``), on a machine without a GPU: stand-in
events and a stand-in L2 flush check its arithmetic (the first timing dropped, the average and the
minimum of the rest) and its order of calls."""

from __future__ import annotations

import pytest
import torch

from cute_ep.tools.bench_timing import deepep_bench


def test_averages_all_but_the_first_timing(monkeypatch):
    times = iter([9.0, 0.004, 0.002, 0.003])  # ms; the first (a cold call) is dropped
    log = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            log.append("record")

        def elapsed_time(self, other: Event) -> float:
            return next(times)

    class Flush:
        def zero_(self) -> None:
            log.append("flush")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: Flush())
    avg, low = deepep_bench(lambda: log.append("call"), warmup=3, iters=4)
    assert avg == pytest.approx(3.0) and low == pytest.approx(2.0)
    # warm-up, the L2 flushed once, then each timed call between its two events
    assert log == ["call"] * 3 + ["flush"] + ["record", "call", "record"] * 4
