"""Hot-expert replication and the profiler on the GPU buffer.

Replication: the same skewed batch is dispatched once over the logical experts and once over a
replica map built from the observed load (``ReplicaMap.from_load``, replicas chosen on the device by
``route``); the expert runs on each row's LOGICAL expert (replicas hold the same weights). The busiest
rank must receive fewer rows with replicas, and the combine outputs must be bit-identical.

Profiler: ``choose`` times the CuTe kernels against the all_to_all_single backend for one shape; both
must agree bit for bit (a candidate that differs is excluded with the reason), a winner is picked
and cached, and a second ``choose`` takes it from the cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.buffer import EpBuffer
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.profiler import ProfileCache, choose
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.replication import ReplicaMap

pytestmark = pytest.mark.gpu


def _round(runtime, cfg, x, idx, w, logical_of):
    """Dispatch, the test expert of each row's logical expert, combine: (out, rows received per rank)."""
    rank, dev = runtime.env.rank, runtime.device
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        res = buf.dispatch(x, idx, w)
        physical = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(dev)
        y = buf.expert_output(res.num_recv)
        y.copy_(apply_test_expert(res.recv_x, logical_of(physical)))
        out = buf.combine(y, res.handle)
        received = [None] * runtime.env.world_size
        dist.all_gather_object(received, res.num_recv, group=runtime.cpu_group)
    return out, received


def test_replicas_lower_the_peak_and_keep_results_bit_identical(runtime):
    env = runtime.env
    R, rank, dev = env.world_size, env.rank, runtime.device
    if R < 2:
        pytest.skip("replication moves rows between ranks: needs 2 ranks or more")
    E, K, H, T = 8 * R, 4, 256, 128
    x, idx, w = make_inputs(rank, T, H, E, K, torch.bfloat16, runtime.seed + 31, routing="skewed")
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    load = torch.bincount(idx[idx >= 0].long(), minlength=E).cpu()
    dist.all_reduce(load, group=runtime.cpu_group)
    rmap = ReplicaMap.from_load(load.tolist(), R, extra_slots_per_rank=2)

    def cfg(num_experts: int) -> EpConfig:
        return EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=num_experts, topk=K,
                        hidden=H, dtype=torch.bfloat16, max_tokens=T, num_sms=min(16, runtime.sm_share))

    plain_out, plain_recv = _round(runtime, cfg(E), x, idx, w, lambda p: p)
    table = rmap.device_table(dev)
    rep_out, rep_recv = _round(runtime, cfg(rmap.num_physical), x, rmap.route(idx, table), w, rmap.logical_of)
    assert torch.equal(rep_out, plain_out), "replicated routing changed the combine output"
    assert max(rep_recv) < max(plain_recv), f"peak rows per rank: {plain_recv} -> {rep_recv}"
    if rank == 0:
        print(f"\n  rows received per rank: {plain_recv} -> with replicas {rep_recv}")


def test_profiler_picks_and_caches_a_checked_backend(runtime, tmp_path_factory):
    env = runtime.env
    R = env.world_size
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=8 * R, topk=4, hidden=512,
                   dtype=torch.bfloat16, max_tokens=64, num_sms=min(16, runtime.sm_share))
    folder = [str(tmp_path_factory.mktemp("profile"))]
    dist.broadcast_object_list(folder, src=0, group=runtime.cpu_group)  # rank 0's file decides
    cache = ProfileCache(f"{folder[0]}/choices.json")
    candidates = {
        "cute": lambda c: EpBuffer(runtime, c, registry=runtime.registry),
        "a2a": lambda c: A2aEpBuffer(runtime, c),
    }
    lines: list[str] = []
    name, buf = choose(runtime, cfg, candidates, tokens=64, cache=cache, say=lines.append, iters=3, warmup=1)
    buf.close()
    table = "\n".join(lines)
    assert name in candidates, table
    assert "excluded" not in table, table  # both ran and agreed bit for bit with each other
    again: list[str] = []
    name2, buf2 = choose(runtime, cfg, candidates, tokens=64, cache=cache, say=again.append)
    buf2.close()
    assert name2 == name and "cached" in again[0], again
    if env.rank == 0:
        print("\n" + table)
