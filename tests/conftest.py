"""Fixtures that several CPU test modules share (pytest loads this file for every test below tests/; the
GPU tests' own fixtures are in tests/gpu/conftest.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
from _launch import REPO, import_script


@pytest.fixture
def bm() -> ModuleType:
    """scripts/benchmark.py as a module (its imports are torch-free), for tests/test_bench_report.py and
    tests/test_bench_peers.py."""
    return import_script(REPO / "scripts" / "benchmark.py", "benchmark_script")
