"""scripts/profile_backends.py on CPUs: the reference and the all-to-all fallback profiled under a
2-rank torchrun, the table, the JSON, the per-shape cache, and bad arguments."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from _launch import REPO, assert_argument_error, forkrun, run_single

SCRIPT = REPO / "scripts" / "profile_backends.py"
SMALL = ["--backends", "reference,a2a", "--hidden", "64", "--num-experts", "8", "--topk", "2",
         "--iters", "2", "--warmup", "1"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _ok(proc) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_profiles_every_shape_and_writes_the_table(tmp_path):
    out_json = tmp_path / "profile.json"
    out = _ok(forkrun(SCRIPT, 2, *SMALL, "--tokens", "8,16", "--out-json", out_json, timeout=180))
    assert "cute-ep profile_backends: backend reference,a2a (gloo)" in out
    assert out.count("<- chosen") == 2 and "excluded" not in out
    tables = json.loads(out_json.read_text())
    assert [t["tokens"] for t in tables] == [8, 16]
    for t in tables:
        assert t["winner"] in ("reference", "a2a")
        assert {c["name"] for c in t["candidates"]} == {"reference", "a2a"}
        assert all(c["error"] is None and c["dispatch_us"] > 0 for c in t["candidates"])


def test_the_reduced_combine_is_profiled_under_its_own_key(tmp_path):
    cache = tmp_path / "choices.json"
    _ok(forkrun(SCRIPT, 2, *SMALL, "--tokens", "8", "--cache", cache, timeout=180))
    out = _ok(forkrun(SCRIPT, 2, *SMALL, "--tokens", "8", "--cache", cache, "--combine", "reduced",
                       timeout=180))
    assert "reduced combine" in out and "<- chosen" in out and "excluded" not in out
    keys = sorted(json.loads(cache.read_text()))
    assert len(keys) == 2 and keys[1] == keys[0] + "|reduced", keys


def test_the_cache_answers_the_second_run(tmp_path):
    cache = tmp_path / "choices.json"
    _ok(forkrun(SCRIPT, 2, *SMALL, "--tokens", "8", "--cache", cache, timeout=180))
    assert len(json.loads(cache.read_text())) == 1
    out = _ok(forkrun(SCRIPT, 2, *SMALL, "--tokens", "8", "--cache", cache, timeout=180))
    assert "(cached in" in out and "<- chosen" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backends", "reference,nccl"], "--backends"),
        (["--tokens", "0"], "--tokens"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--topk", "9"], "topk must be in"),
        (["--cute-algorithms", "dedup,fastest"], "--cute-algorithms must be a comma-separated list of"),
    ],
)
def test_bad_arguments_exit_2(args, message):
    assert_argument_error(run_single(SCRIPT, *SMALL, *args, timeout=60), message)
