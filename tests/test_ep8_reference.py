"""EP8 on the CPU: the main script's whole flow with 8 ranks (the reference backend on gloo).

The standard expert-parallel configuration is 8 GPUs on one NVLink node; until an 8-GPU host is
lent, this runs the same layout, routing classes, checks and baselines with 8 processes, as one node
of 8 and as 2 virtual nodes of 4.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("local_world_size", [8, 4])
def test_ep8_reference_flow_passes(local_world_size):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--master-port",
        str(_free_port()), str(ROOT / "scripts" / "dispatch_and_combine.py"), "--backend", "reference",
        "--num-tokens", "32", "--hidden", "128", "--num-experts", "64", "--topk", "8",
        "--local-world-size", str(local_world_size),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "\nPASS" in out
    combine_lines = [line for line in out.splitlines() if "combine: PASS" in line]
    assert combine_lines, out[-4000:]
    if local_world_size == 4:  # 2 virtual nodes x 4: every route class carries pairs
        for cls in ("self", "same_node", "other_node_same_local_rank", "other_node_other_local_rank"):
            assert f" {cls}=0" not in combine_lines[0] and f"{cls}=" in combine_lines[0]
