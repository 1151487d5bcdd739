"""scripts/gpu_session.sh, a GPU host's verification in parts: its commands (dry run, no GPU) and its
errors."""

from __future__ import annotations

import os
import subprocess

import pytest
from _launch import REPO

SCRIPT = REPO / "scripts" / "gpu_session.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "DRY_RUN": "1", "N": "4", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=full,
                          cwd=REPO)


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_examples_compare_the_committed_baselines_and_save_the_gpu_run(tmp_path):
    proc = _run("examples", OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("--- example-")]
    assert len(lines) == 5
    for name in ("ep4_l4_bf16", "ep4_l2_bf16", "ep4_l4_fp32", "ep4_l2_fp32"):
        assert (REPO / "baselines" / f"{name}.npz").is_file()
        line = next(ln for ln in lines if f"example-{name}:" in ln)
        assert f"--compare-baseline baselines/{name}.npz" in line
        assert f"--save-baseline-to {tmp_path}/{name}.npz" in line
        assert f"CUTE_EP_LOCAL_WORLD_SIZE={name[5]}" in line  # 4 GPUs, then 2 virtual nodes x 2
    assert "--num-tokens 4096 --hidden 7168 --num-experts 256 --topk 8 --dtype bfloat16" in lines[-1]
    assert "--benchmark" in lines[-1]


@pytest.mark.parametrize("part,expect", [
    ("tests-a", 'LAUNCHES=1 2'),
    ("tests-b", 'LAUNCHES=virtual full'),
    ("tests-c", 'LAUNCHES=double doublev'),
    ("bench", "scripts/benchmark.py --tokens 128,4096 --routing uniform --fp8"),
    ("soak", "--fp8 --capacity-factor 0.75"),
    ("soak", "--layouts expert,rank"),
    ("peers", "--layouts expert,rank --num-sms 24,max --peers nccl,deepep"),
    ("decode", "--tokens 1,32,128,256 --num-sms 24,max --peers deepep"),
    ("grid-wait", "kernel_times.py --tokens 128,4096 --num-sms 24,max --layouts expert,rank --side-sleep-us 200"),  # noqa: E501
    ("sanitizer", "compute-sanitizer --tool memcheck --report-api-errors no --print-limit 100 python3 "
                  "scripts/dispatch_and_combine.py"),
])  # fmt: skip
def test_every_part_names_its_commands(tmp_path, part, expect):
    proc = _run(part, OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert expect in proc.stdout
    assert f"=== {part}: rc=0" in proc.stdout


@pytest.mark.parametrize("part,expect", [
    ("tests-a", "LAUNCHES=1 shared2 shared4"),
    ("tests-b", "LAUNCHES=shared4v shared8"),
    ("examples", "--nproc-per-node 4 --local-ranks-filter 0 scripts/dispatch_and_combine.py"),
    ("examples", "--compare-baseline baselines/ep4_l2_fp32.npz"),
    ("soak", "--nproc-per-node 4 --local-ranks-filter 0 scripts/soak.py --iters 1000"),
    ("peers", "--out-json {out}/shared_gpu_ep4_vs_deepep.json"),
])  # fmt: skip
def test_ranks_that_share_one_gpu(tmp_path, part, expect):
    """RANKS above the GPU count: the design card's 4-rank runs, the soak and the reports on one GPU."""
    proc = _run(part, OUT=str(tmp_path), N="1", RANKS="4")
    assert proc.returncode == 0, proc.stderr
    assert expect.format(out=tmp_path) in proc.stdout


def test_unknown_part_exits_2(tmp_path):
    proc = _run("everything", OUT=str(tmp_path))
    assert proc.returncode == 2 and "unknown part: everything" in proc.stderr
