"""GPU test session: one Runtime (torch.distributed + NVSHMEM) per process, shared by all tests.

Launch (one process per GPU; see scripts/run_gpu_tests.sh for the 1/2/4/virtual-node matrix):
    torchrun --nproc-per-node 4 -m pytest tests/gpu -m gpu -q
    CUTE_EP_LOCAL_WORLD_SIZE=2 torchrun --nproc-per-node 4 -m pytest tests/gpu -m gpu -q  # 2 nodes x 2
Without CUDA the tests here are skipped (CI has no GPU).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run under torchrun on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Print a failure as soon as it happens, with its rank. pytest prints failures only in its final
    summary, and a multi-rank launch that hangs after one rank fails (its peers wait in a collective it
    skipped) is killed by its timeout before that summary: the cause was lost."""
    if report.failed:
        rank = os.environ.get("RANK", "0")
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def runtime():
    from cute_ep.bootstrap.compile import ModuleRegistry
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime

    env = DistEnv.from_environ()
    # Heap: the largest configuration of the suite plus headroom (sized before NVSHMEM starts).
    rt = Runtime(
        env,
        symmetric_bytes=int(os.environ.get("CUTE_EP_TEST_HEAP_BYTES", 2 << 30)),
        timeout=timedelta(seconds=300),
    ).start()
    rt.registry = ModuleRegistry(device_id=rt.device.index)
    rt.add_finalizer(rt.registry.finalize_all)
    try:
        yield rt
    finally:
        rt.close()
