"""scripts/layout_bench.py on a machine without a GPU: its help, and a clear refusal (exit 2) instead of a
traceback (its timer, ``cute_ep.tools.bench_timing.deepep_bench``: tests/test_deepep_bench.py)."""

from __future__ import annotations

import pytest
from _launch import REPO, assert_help_and_no_gpu_refusal, import_script


@pytest.fixture(scope="module")
def lb():
    return import_script(REPO / "scripts" / "layout_bench.py", "layout_bench_script")


def test_help_and_no_gpu(lb, capsys, monkeypatch):
    assert_help_and_no_gpu_refusal(lb.main, "get_dispatch_layout", ["--tokens", "128"], capsys, monkeypatch)
