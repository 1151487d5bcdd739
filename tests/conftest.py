"""Fixtures that several CPU test modules share (pytest loads this file for every test below tests/; the
GPU tests' own fixtures are in tests/gpu/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _launch import REPO, import_script
from _sm90 import DTYPES, Sm90Module, compile_sm90
from _worlds import gloo_worlds_fixture

MAX_WORKERS = 4
"""Most pytest-xdist workers ``-n auto`` starts: the slow tests launch 2-8 ranks each, so more workers
than cores only add contention (and gloo's 60 s timeouts)."""
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml's addopts): one worker per core, at most MAX_WORKERS; none (tests run
    in this process) on one core, inside a launch (the GPU tests run under torchrun, a process per rank,
    and a rank runs its tests itself) or where CUDA is visible (workers would share its GPUs)."""
    if any(name in os.environ for name in LAUNCH_VARIABLES) or torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 0 if cores < 2 else min(cores, MAX_WORKERS)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` a test without an ``xdist_group`` mark joins its module's group: a
    module's module-scoped fixtures (most of them launch ranks) are then made once, on one worker."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def bm() -> ModuleType:
    """scripts/benchmark.py as a module (its imports are torch-free), for tests/test_bench_report.py and
    tests/test_bench_peers.py."""
    return import_script(REPO / "scripts" / "benchmark.py", "benchmark_script")


@pytest.fixture(scope="session")
def sm90_module(tmp_path_factory: pytest.TempPathFactory) -> Callable[[torch.dtype], Sm90Module]:
    """``sm90_module(dtype)``: that dtype's EP module compiled for sm_90, once per session (see
    tests/_sm90.py; mark the tests that call it with ``sm90_group(dtype)``)."""
    modules: dict[torch.dtype, Sm90Module] = {}

    def get(dtype: torch.dtype) -> Sm90Module:
        if dtype not in modules:
            modules[dtype] = compile_sm90(dtype, tmp_path_factory.mktemp(f"sm90_{DTYPES[dtype]}"))
        return modules[dtype]

    return get


rank_layout_worlds = gloo_worlds_fixture(
    Path(__file__).with_name("_torchrun_rank_layout_worker.py"), "rank_layout_", "layout,fp8", timeout=300,
    scope="session",
)
"""The rank-layout worker's "layout" and "fp8" parts in one launch per world (ep2, ep4), shared by
tests/test_rank_layout.py and tests/test_rank_layout_fp8.py (their tests that use it carry
``RANK_LAYOUT_WORLDS``, so that under pytest-xdist one worker launches them)."""
