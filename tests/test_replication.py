"""Hot-expert replication (cute_ep.replication): valid maps, device routing, and under skewed routing
a lower receive peak with bit-identical combine results (pure references over R simulated ranks)."""

from __future__ import annotations

import pytest
import torch

from cute_ep.inputs import make_inputs
from cute_ep.reference import (
    apply_test_expert,
    global_expert_of_rows,
    reference_combine,
    reference_dispatch,
    reference_layout,
)
from cute_ep.replication import ReplicaMap

R, E, K, H, T = 4, 32, 4, 64, 256


def _batch(seed: int, routing: str = "skewed"):
    return [make_inputs(r, T, H, E, K, torch.float32, seed, routing=routing) for r in range(R)]


def _run(batch, idxs, num_experts, logical_of):
    """Dispatch -> test expert of each row's LOGICAL expert -> combine; (outputs, rows per rank)."""
    xs, ws = [b[0] for b in batch], [b[2] for b in batch]
    layout = reference_layout(idxs, num_experts)
    got = reference_dispatch(xs, idxs, ws, layout, T)
    ys = []
    for d, res in enumerate(got):
        physical = global_expert_of_rows(layout.tokens_per_expert[d], d)
        ys.append(apply_test_expert(res.recv_x, logical_of(physical)))
    outs = reference_combine(ys, idxs, ws, [layout.scatter[s] for s in range(R)], num_experts=num_experts)
    return outs, [int(n) for n in layout.num_recv]


def test_identity_map_routes_every_id_to_itself():
    rmap = ReplicaMap.identity(E, R)
    idx = _batch(1, "dropped")[0][1]
    assert torch.equal(rmap.route(idx).long(), idx.long())
    assert rmap.local_logical(1) == list(range(8, 16))


def test_from_load_replicates_the_hot_experts_on_other_ranks():
    load = [1000, 900, 800, 700] + [10] * (E - 4)  # experts 0..3 are hot, all on rank 0
    rmap = ReplicaMap.from_load(load, R, extra_slots_per_rank=2)
    assert rmap.slots_per_rank == E // R + 2 and rmap.num_physical == R * (E // R + 2)
    for e in range(4):
        hosts = {p // rmap.slots_per_rank for p in rmap.replicas_of(e)}
        assert len(hosts) >= 2 and 0 in hosts, (e, hosts)
    hot = min(len(rmap.replicas_of(e)) for e in range(4))
    assert all(len(rmap.replicas_of(e)) <= hot for e in range(4, E)), "a cold expert got more replicas"

    def peak(m: ReplicaMap) -> float:  # tokens per rank when each expert's load splits over its replicas
        per_rank = [0.0] * R
        for p, e in enumerate(m.physical_to_logical):
            per_rank[p // m.slots_per_rank] += load[e] / len(m.replicas_of(e))
        return max(per_rank)

    assert peak(rmap) < 0.5 * peak(ReplicaMap.identity(E, R))


def test_skewed_routing_peak_drops_and_results_stay_bit_identical():
    observed = _batch(seed=5)
    counts = torch.zeros(E, dtype=torch.int64)
    for _, idx, _ in observed:
        counts += torch.bincount(idx[idx >= 0].long(), minlength=E)
    rmap = ReplicaMap.from_load(counts, R, extra_slots_per_rank=2)
    table = rmap.device_table()

    batch = _batch(seed=6)  # a fresh batch with the same skew
    logical = [b[1] for b in batch]
    physical = [rmap.route(i, table) for i in logical]
    for p, lg in zip(physical, logical, strict=True):
        assert torch.equal(rmap.logical_of(p), lg.long())  # every pair still reaches its expert
        valid = p[p >= 0]
        assert valid.numel() == lg[lg >= 0].numel()
        rows = p.long().tolist()
        assert all(len({e for e in row if e >= 0}) == len([e for e in row if e >= 0]) for row in rows)

    plain_out, plain_rows = _run(batch, logical, E, lambda g: g)
    rep_out, rep_rows = _run(batch, physical, rmap.num_physical, rmap.logical_of)
    for a, b in zip(plain_out, rep_out, strict=True):
        assert torch.equal(a, b)
    assert sum(plain_rows) == sum(rep_rows)
    assert max(rep_rows) < 0.6 * max(plain_rows), (plain_rows, rep_rows)


def test_route_spreads_a_hot_expert_evenly_over_its_replicas():
    rmap = ReplicaMap.from_load([100] + [1] * (E - 1), R, extra_slots_per_rank=1)
    reps = rmap.replicas_of(0)
    idx = torch.zeros(120, 1, dtype=torch.int32)  # every token to the hot expert
    counts = torch.bincount(rmap.route(idx).flatten().long(), minlength=rmap.num_physical)[reps]
    assert counts.max() - counts.min() <= 1 and int(counts.sum()) == 120


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_logical=4, world_size=2, slots_per_rank=2, physical_to_logical=(0, 1, 2)), "4 entries"),
        (dict(num_logical=4, world_size=2, slots_per_rank=2, physical_to_logical=(0, 1, 2, 2)),
         r"logical expert\(s\) \[3\] have no physical slot"),
        (dict(num_logical=3, world_size=2, slots_per_rank=2, physical_to_logical=(0, 0, 1, 2)),
         "rank 0 holds a logical expert twice"),
        (dict(num_logical=2, world_size=1, slots_per_rank=2, physical_to_logical=(0, 5)), "outside"),
    ],
)
def test_invalid_maps_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplicaMap(**kwargs)


def test_from_load_argument_errors():
    with pytest.raises(ValueError, match="divisible by world_size"):
        ReplicaMap.from_load([1, 2, 3], 2, 1)
    with pytest.raises(ValueError, match="more than can be filled"):
        ReplicaMap.from_load([5, 1], 2, 2)  # each rank can hold both experts at most
    with pytest.raises(ValueError, match=">= 0"):
        ReplicaMap.from_load([1, -1], 2, 1)
