"""EP8 on the CPU: the main script's whole flow with 8 ranks (the reference backend on gloo).

The standard expert-parallel configuration is 8 GPUs on one NVLink node; without an 8-GPU host, this
runs the same layout, routing classes, checks and baselines with 8 processes, as one node
of 8 and as 2 virtual nodes of 4.
"""

from __future__ import annotations

import pytest
from _launch import REPO, forkrun


@pytest.mark.parametrize("local_world_size", [8, 4])
def test_ep8_reference_flow_passes(local_world_size):
    proc = forkrun(
        REPO / "scripts" / "dispatch_and_combine.py", 8, "--backend", "reference",
        "--num-tokens", "32", "--hidden", "128", "--num-experts", "64", "--topk", "8",
        "--local-world-size", str(local_world_size), timeout=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "\nPASS" in out
    combine_lines = [line for line in out.splitlines() if "combine: PASS" in line]
    assert combine_lines, out[-4000:]
    if local_world_size == 4:  # 2 virtual nodes x 4: every route class carries pairs
        for cls in ("self", "same_node", "other_node_same_local_rank", "other_node_other_local_rank"):
            assert f" {cls}=0" not in combine_lines[0] and f"{cls}=" in combine_lines[0]
