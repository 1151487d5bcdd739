"""Ranks that share a GPU (bootstrap/gpu_share.py and where the runtime, the buffer and the benchmark use
it): the binding rule, the world group, the MPS check's message, the SM share and the heap fit. CPU only."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch
from _launch import REPO

from cute_ep.bootstrap.gpu_share import (
    GPUS_PER_HOST_VAR,
    GpuPlacement,
    GpuShareError,
    gpus_in_use,
    mps_missing_message,
    place,
    shared_gpu_environ,
    sm_share,
    sm_share_error,
    world_group_backend,
)
from cute_ep.bootstrap.runtime import GIB, HeapConfigError, check_heap_fits, format_size, heap_bytes_for
from cute_ep.input_checks import check_buffer_config, check_sm_budget, fit_hint, max_tokens_that_fit
from cute_ep.kernels.config import ConfigError, EpConfig
from cute_ep.tools import bench_peers as bp

DSV3 = dict(num_experts=256, topk=8, hidden=7168, dtype=torch.bfloat16, max_tokens=4096)


# -- binding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks,gpus,expect", [
    (8, 8, [(r, 1) for r in range(8)]),           # one rank per GPU: GPU = local rank
    (4, 1, [(0, 4)] * 4),                          # all on one GPU
    (8, 2, [(r % 2, 4) for r in range(8)]),       # round robin
    (6, 4, [(0, 2), (1, 2), (2, 1), (3, 1), (0, 2), (1, 2)]),  # uneven: GPUs 0, 1 serve two ranks
    (1, 8, [(0, 1)]),
])  # fmt: skip
def test_local_rank_r_binds_gpu_r_mod_g(ranks, gpus, expect):
    got = [place(r, ranks, gpus) for r in range(ranks)]
    assert [(p.gpu, p.ranks_per_gpu) for p in got] == expect
    assert all(p.shared == (ranks > gpus) for p in got)  # the whole host's verdict, the same on every rank
    # Every rank of a GPU agrees on how many share it.
    for g in {p.gpu for p in got}:
        assert len({p.ranks_per_gpu for p in got if p.gpu == g}) == 1
        assert sum(p.gpu == g for p in got) == got[[p.gpu for p in got].index(g)].ranks_per_gpu


def test_placement_describes_itself():
    assert place(3, 4, 1).describe() == "gpu 0 of 1, shared by 4 ranks"
    assert place(3, 8, 8).describe() == "gpu 3 of 8"


def test_gpus_in_use_reads_the_override():
    assert gpus_in_use(2, {}) == 2
    assert gpus_in_use(2, {GPUS_PER_HOST_VAR: "1"}) == 1
    assert gpus_in_use(2, {GPUS_PER_HOST_VAR: " "}) == 2
    with pytest.raises(GpuShareError, match=r"CUTE_EP_GPUS_PER_HOST='3' must be in 1..2"):
        gpus_in_use(2, {GPUS_PER_HOST_VAR: "3"})
    with pytest.raises(GpuShareError, match=r"CUTE_EP_GPUS_PER_HOST='one' is not an integer"):
        gpus_in_use(2, {GPUS_PER_HOST_VAR: "one"})
    with pytest.raises(GpuShareError, match="shows no CUDA GPU"):
        gpus_in_use(0, {})
    with pytest.raises(ValueError, match="local_rank must be in 0..3, got 4"):
        place(4, 4, 1)


# -- the world group and MPS -------------------------------------------------------------------------------


def test_world_group_is_gloo_only_when_ranks_share_a_gpu():
    assert world_group_backend(place(0, 4, 4)) == "cpu:gloo,cuda:nccl"
    assert world_group_backend(place(0, 4, 1)) == "gloo"
    # Uneven sharing: a rank alone on its GPU still joins the host's gloo group (every rank must agree).
    assert world_group_backend(place(3, 6, 4)) == "gloo"


def test_ranks_that_share_a_gpu_tell_nvshmem_to_run_without_mps_percentages():
    ignore = "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
    assert shared_gpu_environ(place(0, 4, 1), {}) == {ignore: "1"}
    assert shared_gpu_environ(place(0, 4, 4), {}) == {}  # a GPU each: nothing to tell
    assert shared_gpu_environ(place(3, 6, 4), {}) == {}  # alone on its GPU (uneven sharing)
    # The user's choices stand: a percentage of their own, or the variable either way.
    assert shared_gpu_environ(place(0, 4, 1), {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}) == {}
    assert shared_gpu_environ(place(0, 4, 1), {ignore: "0"}) == {}


def test_mps_missing_message_says_how_to_start_it():
    msg = mps_missing_message(0, 4)
    assert msg.startswith("4 ranks share GPU 0, but CUDA MPS is not serving it")
    assert "bash scripts/mps.sh start" in msg and "nvidia-cuda-mps-control -d" in msg
    assert "one rank per GPU" in msg


# -- SM share ----------------------------------------------------------------------------------------------


def test_sm_share_splits_the_gpu_and_respects_the_mps_limit():
    assert sm_share(132, 1) == 132
    # Ranks sharing a GPU hold at most half of it between them (bootstrap/gpu_share.py says why).
    assert [sm_share(132, n) for n in (2, 3, 4, 8)] == [33, 22, 16, 8]
    assert sm_share(132, 4, context_sms=34) == 16  # a looser MPS limit than the split: still 16
    assert sm_share(132, 8, context_sms=6) == 6  # a user's 5% (6 SMs on an H100): the limit wins
    assert sm_share(132, 64) == 1  # never 0: one CTA per rank
    assert sm_share(132, 1, context_sms=None) == 132


def test_num_sms_above_the_share_is_refused_naming_it():
    assert sm_share_error(33, [(33, 132, 2), (33, 132, 2)]) is None
    assert sm_share_error(500, []) is None  # no GPU: nothing to fit
    msg = sm_share_error(34, [(33, 132, 2), (33, 132, 2)])
    assert msg == ("num_sms must be at most a rank's share of its GPU, 33 SMs (132 SMs shared by 2 ranks, "
                   "which may hold half of them between them: a rank the others wait for needs the rest for "
                   "its own work), got 34: pass num_sms <= 33 (0 takes it)")
    assert sm_share_error(133, [(132, 132, 1)]).startswith("num_sms must be at most the GPU's SM count, 132:")
    with pytest.raises(ConfigError, match=r"share of its GPU, 8 SMs \(132 SMs shared by 8 ranks,.*got 16"):
        check_sm_budget(16, [(8, 132, 8)] * 8)


def _runtime(share, ranks, device_sms=132, world_size=4):
    placement = GpuPlacement(gpu=0, gpus=1, ranks_per_gpu=ranks, shared=ranks > 1)
    return SimpleNamespace(env=SimpleNamespace(world_size=world_size), device=torch.device("cuda", 0),
                           sm_share=share, device_sms=device_sms, placement=placement)


def test_default_num_sms_is_the_share_and_an_explicit_one_above_it_is_refused():
    base = dict(world_size=4, local_world_size=4, **DSV3)
    assert EpConfig(**base).num_sms == 0  # "the rank's share", resolved by the GPU buffer
    resolved = check_buffer_config(_runtime(16, 4), EpConfig(**base), kernels=True)
    assert resolved.num_sms == 16
    assert check_buffer_config(_runtime(16, 4), EpConfig(**base, num_sms=12), kernels=True).num_sms == 12
    with pytest.raises(ConfigError, match=r"share of its GPU, 16 SMs \(132 SMs shared by 4 ranks,.*got 17"):
        check_buffer_config(_runtime(16, 4), EpConfig(**base, num_sms=17), kernels=True)
    # The CPU and all-to-all backends launch no kernels of ours: nothing is resolved or refused.
    assert check_buffer_config(_runtime(16, 4), EpConfig(**base, num_sms=500)).num_sms == 500
    with pytest.raises(ConfigError, match=r"num_sms must be >= 1 \(or 0: this rank's share .*got -1"):
        EpConfig(**base, num_sms=-1)


def test_benchmark_budgets_take_max_as_the_share():
    assert bp.parse_num_sms("24,max") == [24, bp.SHARE_BUDGET]
    assert bp.parse_num_sms("MAX") == [bp.SHARE_BUDGET]
    assert bp.resolve_num_sms([24, bp.SHARE_BUDGET], 66) == [24, 66]
    assert bp.resolve_num_sms([bp.SHARE_BUDGET, 132], 132) == [132]  # duplicates go
    assert bp.resolve_num_sms([bp.SHARE_BUDGET], None) == [bp.FULL_GPU_SMS]  # no GPU: the full-GPU label
    with pytest.raises(bp.BenchReportError, match="integers >= 1 or max; 'most' in '24,most' is not one"):
        bp.parse_num_sms("24,most")


# -- the heap on a shared GPU ------------------------------------------------------------------------------


def test_eight_ranks_at_deepseek_v3_shapes_fit_one_80gb_gpu():
    cfg = EpConfig(world_size=8, local_world_size=8, **DSV3)
    heap = heap_bytes_for(cfg.symmetric_bytes(), shared_gpu=True)
    assert heap < cfg.symmetric_bytes() * 1.1 + GIB  # tight: the buffers, 1/16 and the reserve
    assert heap_bytes_for(cfg.symmetric_bytes()) * 8 >= 80 * GIB  # the padded rule alone would not fit
    check_heap_fits(format_size(heap), 8, 80 * 10**9)  # an H100 80GB
    with pytest.raises(HeapConfigError):
        check_heap_fits(format_size(heap_bytes_for(cfg.symmetric_bytes())), 8, 80 * 10**9)


def test_a_heap_that_does_not_fit_says_what_does():
    cfg = EpConfig(world_size=8, local_world_size=8, **{**DSV3, "max_tokens": 8192})
    heap = format_size(heap_bytes_for(cfg.symmetric_bytes(), shared_gpu=True))
    budgets: list[int] = []

    def hint(budget: int) -> str:
        budgets.append(budget)
        return fit_hint(cfg)(budget)

    with pytest.raises(HeapConfigError) as err:
        check_heap_fits(heap, 8, 80 * 10**9, hint)
    msg = str(err.value)
    assert msg.startswith("8 ranks share a GPU of 74.51 GiB, and each needs a symmetric heap of ")
    assert "What fits: at most 7.53 GiB of symmetric buffers per rank" in msg
    fits = max_tokens_that_fit(cfg, budgets[0])
    assert f"max_tokens={fits} fits with this configuration's other fields (it asks for 8192)" in msg
    # The hint is exact: that many tokens fit the GPU, one more does not.
    smaller = dataclasses.replace(cfg, max_tokens=fits, capacity=0)
    check_heap_fits(format_size(heap_bytes_for(smaller.symmetric_bytes(), shared_gpu=True)), 8, 80 * 10**9)
    assert dataclasses.replace(cfg, max_tokens=fits + 1, capacity=0).symmetric_bytes() > budgets[0]
    assert max_tokens_that_fit(cfg, 1) == 0
    assert "not even max_tokens=1 fits" in fit_hint(cfg)(1)


# -- scripts -----------------------------------------------------------------------------------------------


def test_mps_script_syntax_and_usage():
    script = REPO / "scripts" / "mps.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run(["bash", str(script), "restart"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: bash scripts/mps.sh start|stop|status" in proc.stderr


def _launches(tmp_path, gpus: int, **environ: str
              ) -> tuple[subprocess.CompletedProcess, list[str], list[tuple[str, ...]]]:
    """run_gpu_tests.sh on a host of ``gpus`` GPUs, with stand-ins for nvidia-smi, torchrun and mps.sh that
    record what it runs: (the run, every call, (GPUS=, LWS=, ranks) of each launch)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    smi = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3'\n" for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}")
    (bin_dir / "python3").write_text(
        f"#!/bin/sh\necho \"launch GPUS=$CUTE_EP_GPUS_PER_HOST LWS=$CUTE_EP_LOCAL_WORLD_SIZE $*"
        f" SEED=$GPU_TEST_SEED\" >> {log}\n"
        # FAIL_LWS: the launches of that local world size fail, as a launch with a failed test ends
        "if [ \"$CUTE_EP_LOCAL_WORLD_SIZE\" = \"$FAIL_LWS\" ]; then\n"
        "  echo '3 passed in 2.9s'; echo 'E1127 torch/distributed/elastic: failed (exitcode: 1)'\n"
        "  echo 'FAILED tests/gpu/test_a.py::test_b[x] - AssertionError: no'\n"
        "  echo '[rank 2] FAILED tests/gpu/test_a.py::test_b[x] (call):'\n"
        "  echo '[rank 3] FAILED tests/gpu/test_c.py::test_d (setup):'\n"
        "  echo '1 failed, 2 passed in 3.0s'; echo '3 passed in 3.1s'\n"
        "  echo '  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html'\n"
        "  exit 1\nfi\n"
        "echo '3 passed'\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("run_gpu_tests.sh",):
        (repo / "scripts" / name).write_text((REPO / "scripts" / name).read_text())
    (repo / "scripts" / "mps.sh").write_text(f"#!/bin/sh\necho \"mps $1\" >> {log}\necho 'mps: started'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_TEST_SEED", "FAIL_LWS")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", GPU_TEST_LOG_DIR=str(tmp_path / "logs"), **environ)
    proc = subprocess.run(["bash", str(repo / "scripts" / "run_gpu_tests.sh")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == (1 if "FAIL_LWS" in environ else 0), proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    launches = [(*c.split()[1:3], c.split("--nproc-per-node ")[1].split()[0])
                for c in calls if c.startswith("launch")]
    return proc, calls, launches


def test_gpu_test_launches_on_one_gpu(tmp_path):
    """run_gpu_tests.sh on a one-GPU host: 1 rank, then 2, 4, 4 as 2 virtual nodes and 8 ranks sharing it,
    starting MPS first."""
    proc, calls, launches = _launches(tmp_path, 1)
    assert launches == [("GPUS=1", "LWS=1", "1"), ("GPUS=1", "LWS=2", "2"), ("GPUS=1", "LWS=4", "4"),
                        ("GPUS=1", "LWS=2", "4"), ("GPUS=1", "LWS=8", "8")]
    # MPS starts before the first shared launch and, having been started here, stops at the end.
    assert calls[1] == "mps start" and calls[-1] == "mps stop"
    assert re.search(r"^8 ranks on one GPU \(seed \d+\): rc=0 3 passed \(1 rank\)$", proc.stdout,
                     re.M), proc.stdout


def test_gpu_test_launches_on_four_gpus(tmp_path):
    """run_gpu_tests.sh on a 4-GPU host: 1, 2, 4 as 2 virtual nodes, 4, then EP8 with two ranks per GPU
    (one node, and 2 virtual nodes of 4) under MPS, started before the first of those; every launch without
    a rank filter, so every rank's failures and watchdog reports reach the log."""
    proc, calls, launches = _launches(tmp_path, 4)
    assert launches == [("GPUS=1", "LWS=1", "1"), ("GPUS=2", "LWS=2", "2"), ("GPUS=4", "LWS=2", "4"),
                        ("GPUS=4", "LWS=4", "4"), ("GPUS=4", "LWS=8", "8"), ("GPUS=4", "LWS=4", "8")]
    starts = [i for i, c in enumerate(calls) if c == "mps start"]
    assert len(starts) == 1 and "--nproc-per-node 8" in calls[starts[0] + 1] and calls[-1] == "mps stop"
    assert not any("--local-ranks-filter" in c for c in calls)
    assert re.search(r"^8 ranks on 4 GPUs as 2 virtual nodes x 4 \(seed \d+\): rc=0 3 passed \(1 rank\)$",
                     proc.stdout, re.M), proc.stdout


def test_a_failed_shared_launch_restarts_mps_and_its_summary_has_every_ranks_result(tmp_path):
    """After a shared launch fails, the MPS daemon the script started is stopped and the next shared launch
    starts a fresh one (a failed launch can leave the server refusing clients); the summary line holds
    every rank's pytest result (each distinct one once, failures first, timing dropped), not torchrun's
    failure lines: a test that fails on one rank only shows; then the failed tests by name, every rank's,
    each once; the launch's output is kept in its log folder."""
    proc, calls, launches = _launches(tmp_path, 1, FAIL_LWS="4")
    names = [c.split()[0] if not c.startswith("launch") else "launch LWS=" + c.split()[2][4:] for c in calls]
    assert names == ["launch LWS=1", "mps", "launch LWS=2", "launch LWS=4", "mps", "mps", "launch LWS=2",
                     "launch LWS=8", "mps"], calls
    assert [c for c in calls if c.startswith("mps")] == ["mps start", "mps stop", "mps start", "mps stop"]
    want = (r"^4 ranks on one GPU \(seed \d+\): rc=1 1 failed, 2 passed \(1 rank\); 3 passed \(2 ranks\); "
            r"failed: tests/gpu/test_a\.py::test_b\[x\], tests/gpu/test_c\.py::test_d$")
    assert re.search(want, proc.stdout, re.M), proc.stdout
    # the launch's whole output stays beside the other ranks' reports (rank 0's report is in it)
    kept = (tmp_path / "logs" / "4_ranks_on_one_GPU" / "launch.log").read_text()
    assert "FAILED tests/gpu/test_a.py::test_b[x] - AssertionError: no" in kept
    assert re.search(r"^2 ranks on one GPU \(seed \d+\): rc=0 3 passed \(1 rank\)$", proc.stdout, re.M)


def test_each_launch_draws_a_fresh_input_seed_and_prints_it(tmp_path):
    """Every launch passes its ranks a GPU_TEST_SEED of its own (fresh inputs on every run), printed in its
    header and summary line; a GPU_TEST_SEED set by the caller repeats a launch's inputs."""
    proc, calls, _ = _launches(tmp_path, 1)
    seeds = [c.rsplit("SEED=", 1)[1] for c in calls if c.startswith("launch")]
    assert len(seeds) == 5 and all(s.isdigit() for s in seeds) and len(set(seeds)) > 1, seeds
    for seed in seeds:
        assert f"GPU_TEST_SEED={seed}" in proc.stdout and f"(seed {seed})" in proc.stdout
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    _, calls, _ = _launches(fixed, 1, GPU_TEST_SEED="42")
    assert [c.rsplit("SEED=", 1)[1] for c in calls if c.startswith("launch")] == ["42"] * 5


def test_reports_record_who_shares_a_gpu():
    from cute_ep.tools.bench_report import gpu_share_meta

    nobody = {"ranks_per_gpu": None, "shared_gpu": None}
    assert gpu_share_meta(SimpleNamespace(device=torch.device("cpu"))) == nobody
    assert gpu_share_meta(SimpleNamespace(placement=place(3, 8, 8))) == {**nobody, "ranks_per_gpu": 1}
    shared = gpu_share_meta(SimpleNamespace(placement=place(1, 2, 1)))
    assert shared["ranks_per_gpu"] == 2
    assert shared["shared_gpu"].startswith("shared GPU: 2 ranks per GPU under CUDA MPS")
    assert "not NVLink" in shared["shared_gpu"]
