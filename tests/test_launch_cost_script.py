"""scripts/launch_cost.py needs a GPU to measure; here: the PTX of its empty kernels (parsed by ptxas where
one is installed), its argument errors (exit 2), its refusal without a GPU (exit 1), and a committed
report's shape."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _launch import REPO, assert_argument_error, import_script, run_single

SCRIPT = REPO / "scripts" / "launch_cost.py"
COMMITTED = sorted((REPO / "baselines" / "perf").glob("*_launch_cost.json"))


@pytest.fixture(scope="module")
def lc():
    return import_script(SCRIPT, "launch_cost_script")


@pytest.mark.parametrize("kind, count, params",
                         [("separate", 1, 1), ("separate", 84, 84), ("struct", 536, 1)])
def test_each_kernel_takes_the_parameters_it_is_named_for(lc, kind, count, params, tmp_path):
    name, ptx = lc.kernel_ptx(kind, count)
    entry = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S)
    assert entry and entry.group(1).count(".param") == params
    if kind == "struct":
        assert f".b8 p0[{count}]" in ptx
    else:
        assert len(re.findall(r"\.param \.u64 p\d+", ptx)) == count
    ptxas = shutil.which("ptxas")
    if ptxas:  # the text is valid PTX for the GPUs it runs on
        path = tmp_path / "k.ptx"
        path.write_text(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90", str(path), "-o", str(tmp_path / "k.o")],
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--params", "0"], "argument --params: every count must be in [1, 512]"),
    (["--params", "a,b"], "argument --params: expected comma-separated integers"),
    (["--struct-bytes", "12"], "--struct-bytes must be a multiple of 8"),
    (["--burst", "1000"], "--burst must be in [1, 512]"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_arguments_exit_2_naming_the_constraint(argv, message):
    assert_argument_error(run_single(SCRIPT, *argv, timeout=60), message)


def test_without_a_gpu_it_says_so_and_exits_1():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would measure")
    proc = run_single(SCRIPT, timeout=60)
    assert proc.returncode == 1 and "needs a GPU" in proc.stderr, proc.stderr


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_reports_hold_every_kind_with_positive_times(lc, path: Path):
    report = json.loads(path.read_text())
    assert report["schema"] == lc.SCHEMA
    assert report["meta"]["command"].startswith("python scripts/launch_cost.py")
    kinds = [r["kind"] for r in report["rows"]]
    assert "torch add_" in kinds and "struct" in kinds and "packed buffer" in kinds and "separate" in kinds
    for r in report["rows"]:
        assert 0 < r["host_us_min"] <= r["host_us"] and r["event_us"] > 0, r
