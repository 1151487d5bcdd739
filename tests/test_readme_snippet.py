"""The README's Python step ("Using it from Python") runs as written: as a file in a world of one and under
torchrun with 2 ranks, on the CPU (reference backend), and its combine matches the stand-in expert."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from _launch import REPO


def _snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README has no Python block under 'Using it from Python'"
    return match.group(1)


def _run(tmp_path, *launch: str) -> subprocess.CompletedProcess:
    step = tmp_path / "step.py"
    step.write_text(_snippet())
    env_cmd = [sys.executable, *launch, str(step)]
    return subprocess.run(env_cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _rows(out: str) -> list[tuple[int, int, float]]:
    found = re.findall(r"rank (\d+): (\d+) rows received, largest difference (\S+) \(bf16 rounding\)", out)
    return [(int(r), int(n), float(e)) for r, n, e in found]


def test_the_readme_step_runs_in_a_world_of_one(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert [(r, n) for r, n, _ in rows] == [(0, 48 * 2)]  # every (token, k) pair lands on the one rank
    assert rows[0][2] < 0.1  # a bf16 rounding of |out| <= 2 * 4.5 at most, not a wrong row


def test_the_readme_step_runs_on_two_ranks(tmp_path):
    proc = _run(tmp_path, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29741")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sorted(_rows(proc.stdout))
    assert [r for r, _, _ in rows] == [0, 1]
    assert sum(n for _, n, _ in rows) == 2 * 48 * 2  # every pair of both ranks received somewhere
    assert all(e < 0.1 for _, _, e in rows)
