"""Real multi-process launches of the bootstrap on CPU (gloo): torchrun, and srun-style variables.

Each test starts its processes in a new session and kills that process group on timeout, so a hung
rendezvous fails the test instead of blocking the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from _launch import clean_env, free_port, torchrun_cmd

from cute_ep.bootstrap.dist_env import OTHER_NODE_OTHER_LOCAL, OTHER_NODE_SAME_LOCAL, SAME_NODE, SELF

WORKER = Path(__file__).with_name("_torchrun_bootstrap_worker.py")
TIMEOUT_S = 60

def _clean_env(**extra: str) -> dict[str, str]:
    """A clean launch environment with unbuffered Python output (what a hung rank printed shows)."""
    return clean_env(PYTHONUNBUFFERED="1", **extra)


def run_group(commands: list[list[str]], envs: list[Mapping[str, str]]) -> list[tuple[int, str]]:
    """Start all commands, wait up to TIMEOUT_S for all of them, kill the rest; (returncode, output)."""
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    results: list[tuple[int, str]] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
        outputs = []
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the session we created: the child and its workers
            outputs.append(proc.communicate()[0])
        pytest.fail(f"launch did not finish in {TIMEOUT_S} s; output:\n" + "\n-----\n".join(outputs))
    return results


def load_results(out_dir: Path, world: int) -> list[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert len(files) == world, [f.name for f in files]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def check_common(results: list[dict], world: int, launcher: str) -> None:
    uids = {r["uid_hex"] for r in results}
    assert len(uids) == 1, uids
    assert len(next(iter(uids))) == 2 * 128
    for r in results:
        assert r["world_size"] == world and r["launcher"] == launcher
        assert r["all_uids_equal"] and r["uid_nonzero"]
        assert r["make_uid_calls"] == (1 if r["rank"] == 0 else 0)
        assert r["finalized"] == ["second", "first"]
        assert r["closed"] and not r["pg_after_close"]
        # Every rank saw the same placement of every rank.
        assert r["placements"] == results[0]["placements"]


def test_torchrun_four_ranks(tmp_path: Path) -> None:
    world = 4
    cmd = torchrun_cmd(WORKER, world, tmp_path, "torchrun", "2")
    [(code, out)] = run_group([cmd], [_clean_env()])
    assert code == 0, out
    results = load_results(tmp_path, world)
    check_common(results, world, "torchrun")

    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["local_rank"] == rank and r["physical_local_world_size"] == world
        # Physical layout: one node of four.
        topo = r["topology"]
        assert (topo["local_world_size"], topo["nnodes"], topo["node_id"], topo["local_index"]) == (
            4,
            1,
            0,
            rank,
        )
        assert not topo["is_virtual"]
        assert topo["routes"] == [SELF if dst == rank else SAME_NODE for dst in range(world)]
        # CUTE_EP_LOCAL_WORLD_SIZE=2: two virtual nodes of two on the same host.
        virt = r["virtual"]
        assert (virt["local_world_size"], virt["nnodes"]) == (2, 2)
        assert (virt["node_id"], virt["local_index"]) == (rank // 2, rank % 2)
        assert virt["is_virtual"]
    assert results[0]["placements"] == [[0, r, r] for r in range(world)]
    assert results[1]["virtual"]["routes"] == [SAME_NODE, SELF, OTHER_NODE_OTHER_LOCAL, OTHER_NODE_SAME_LOCAL]


def test_srun_style_two_tasks(tmp_path: Path) -> None:
    # What srun exports for `srun -N 2 --ntasks-per-node 1` (without --ntasks-per-node echoed back):
    # two "nodes" of one task, here both on this host.
    world = 2
    port = str(free_port())
    envs = [
        _clean_env(
            SLURM_PROCID=str(rank),
            SLURM_LOCALID="0",
            SLURM_NTASKS=str(world),
            SLURM_TASKS_PER_NODE="1(x2)",
            SLURM_NNODES="2",
            SLURM_NODEID=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for rank in range(world)
    ]
    cmds = [[sys.executable, str(WORKER), str(tmp_path), "slurm", "0"] for _ in range(world)]
    for code, out in run_group(cmds, envs):
        assert code == 0, out
    results = load_results(tmp_path, world)
    check_common(results, world, "slurm")
    for rank, r in enumerate(results):
        assert (r["rank"], r["local_rank"], r["physical_local_world_size"]) == (rank, 0, 1)
        topo = r["topology"]
        assert (topo["local_world_size"], topo["nnodes"], topo["node_id"], topo["local_index"]) == (
            1,
            2,
            rank,
            0,
        )
        assert topo["routes"] == [SELF if dst == rank else OTHER_NODE_SAME_LOCAL for dst in range(world)]
        assert r["virtual"] is None
    assert results[0]["placements"] == [[0, 0, 0], [1, 0, 0]]


def test_srun_style_bad_environment_fails_fast(tmp_path: Path) -> None:
    # Non-uniform tasks per node must stop the process before any rendezvous (no hang, clear text).
    env = _clean_env(
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NTASKS="3",
        SLURM_TASKS_PER_NODE="2,1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    [(code, out)] = run_group([[sys.executable, str(WORKER), str(tmp_path), "slurm", "0"]], [env])
    assert code != 0
    assert "DistEnvError" in out and "SLURM_TASKS_PER_NODE='2,1'" in out
    assert not list(tmp_path.glob("rank*.json"))


_WORLD_OF_ONE = """
import torch, torch.distributed as dist
from cute_ep.bootstrap import DistEnv, Runtime
with Runtime(DistEnv.from_environ(), backend="gloo") as rt:
    t = torch.ones(3)
    dist.all_reduce(t, group=rt.cpu_group)
    print("sum", t.tolist(), rt.env.launcher)
"""


def test_a_world_of_one_needs_no_port(tmp_path: Path) -> None:
    """A single process (no launcher) starts without a TCP rendezvous: with MASTER_PORT held by another
    listener (another single-process run on the host, say) it still starts, and exits cleanly."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-c", _WORLD_OF_ONE], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path,
                              env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sum [1.0, 1.0, 1.0] single" in proc.stdout
