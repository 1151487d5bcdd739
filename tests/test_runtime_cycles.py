"""A second (third, fourth) Runtime in the same process: start, use, close, start again with another
configuration (scripts/runtime_cycles.py), on the CPU with gloo ranks under torchrun.

Before each start took a store prefix of its own, 2 of 4 such 2-rank launches hung at their second or third
start: torch.distributed names its keys the same way at every start, and torchrun's store still held the
previous start's keys (the peers' old addresses)."""

from __future__ import annotations

import re

import pytest
from _launch import REPO, forkrun, run_single

SCRIPT = REPO / "scripts" / "runtime_cycles.py"


def _cycles(out: str) -> list[tuple[int, int]]:
    return sorted((int(r), int(c)) for r, c in re.findall(r"rank (\d+): cycle (\d+) .*? PASS", out))


@pytest.mark.parametrize("launch", [1, 2])
def test_four_runtimes_one_after_another_on_two_ranks(launch):
    proc = forkrun(SCRIPT, 2, "--backend", "reference", "--cycles", "4", timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert _cycles(proc.stdout) == [(r, c) for r in range(2) for c in range(4)], out[-4000:]
    assert "FAIL" not in proc.stdout


def test_runtimes_one_after_another_in_a_world_of_one():
    proc = run_single(SCRIPT, "--backend", "reference", "--cycles", "3", timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert _cycles(proc.stdout) == [(0, c) for c in range(3)]


def test_each_start_takes_a_store_prefix_of_its_own(monkeypatch):
    import torch.distributed as dist

    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime

    made = []
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(dist.HashStore(), 0, 2)]))
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: made.append(prefix) or store)
    env = DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    for _ in range(3):
        Runtime(env, backend="gloo")._rendezvous_store()
    assert len(set(made)) == 3 and all(p.startswith("cute_ep/runtime") for p in made), made
