"""scripts/decode_breakdown.py needs GPUs to measure; here: its help and its argument errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys

from _launch import REPO, run_single

SCRIPT = REPO / "scripts" / "decode_breakdown.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_single(SCRIPT, *args, timeout=120)


def test_help_names_what_is_timed():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "Where a dispatch / combine call's GPU time goes" in proc.stdout


def test_bad_tokens_exit_2_naming_the_argument():
    proc = _run("--tokens", "128,zero")
    assert proc.returncode == 2 and "--tokens" in proc.stderr, proc.stderr


def test_host_costs_time_the_torch_operations_on_the_cpu():
    """--host-costs on a CPU stand-in buffer: the torch operations are timed (the GPU-only ones, launches,
    syncs, the driver copy and the status read, need a CUDA device), each a positive time per call."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    import decode_breakdown as db

    buf = SimpleNamespace(device=torch.device("cpu"), cfg=SimpleNamespace(topk=4))
    costs = db.host_costs(buf, iters=5)
    assert list(costs) == ["view", "slice", "empty [3, T, K]", "cat of three", "split into three",
                           "unbind into three", "Tensor.copy_"]
    assert all(us > 0 for us in costs.values())
    table = db.format_host_costs(costs)
    assert table.startswith("host costs (us per call, rank 0):") and "cat of three" in table
    assert "--host-costs" in _run("--help").stdout
