"""Hot-expert replication: logical experts placed on physical expert slots, hot ones on several ranks.

Skewed routing sends most tokens to a few experts, so the ranks owning them receive far more rows
than the others (and their experts do far more work). A ``ReplicaMap`` gives every rank
``slots_per_rank`` physical expert slots (rank r owns slots [r*S, (r+1)*S)); each logical expert has
one home slot and the hot ones get more. The kernels are unchanged: they route *physical* ids, so a
buffer is built with ``num_experts = map.num_physical`` and the caller's experts on rank r are the
logical experts ``map.local_logical(r)`` (replicas hold copies of the same weights).

    counts = observed tokens per logical expert (e.g. summed tokens_per_expert of earlier steps)
    rmap = ReplicaMap.from_load(counts, world_size, extra_slots_per_rank=2)
    table = rmap.device_table(device)                       # once
    phys = rmap.route(topk_idx, table)                      # per step, on the device, no host sync
    res = buf.dispatch(x, phys, topk_weights)               # buf built with num_experts=rmap.num_physical
    ...experts of rank r: rmap.local_logical(r)...
    out = buf.combine(y, res.handle)                        # reads each (t, k) from its chosen replica

``route`` picks replica ``(t + k) % n_replicas`` of each (token t, k): round robin over tokens, so
the rows of a hot expert spread evenly over its replicas; dropped ids (-1) stay dropped, and distinct
logical experts map to distinct physical slots (a slot holds one logical expert), so a token's
physical ids stay distinct.

The map is static: built once from earlier load. ``cute_ep.elastic.ElasticExperts`` re-plans replicas
every step from the step's own routing, on the device, through the same ``route_replicas``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ReplicaMap", "ReplicaTable", "route_replicas"]


def route_replicas(topk_idx: Tensor, replicas: Tensor, count: Tensor,
                   position: Tensor | None = None) -> Tensor:
    """Physical ids [T, K] int32 of logical ``topk_idx`` [T, K] (int32 / int64, -1 kept): replica
    ``position[t, k] % count[e]`` of each pair's expert e, read from ``replicas[e]``.

    replicas: [E, W] int32 / int64, the physical slots of each logical expert, first ``count[e]`` valid.
    count: [E] int32 / int64, replicas per logical expert (>= 1).
    position: [T, K] int64, the pair's place in its expert's round robin; None: ``t + k`` (each rank
        spreads its own pairs). ``cute_ep.elastic`` passes the pair's ordinal among all ranks' pairs of
        the expert, which splits the expert's rows over its replicas to within one row.

    Device ops only (no host sync, fixed shapes) when every tensor is on topk_idx's device. The static
    ``ReplicaMap.route`` and the per-step ``ElasticExperts.route`` both route through here.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}")
    idx = topk_idx.to(torch.int64)
    logical = idx.clamp(min=0)
    if position is None:
        t = torch.arange(idx.shape[0], device=idx.device)[:, None]
        k = torch.arange(idx.shape[1], device=idx.device)[None, :]
        position = t + k
    n = count.to(torch.int64)[logical]
    pick = position % n
    phys = replicas.to(torch.int64)[logical, pick]
    return torch.where(idx >= 0, phys, torch.full_like(phys, -1)).to(torch.int32)


@dataclass(frozen=True)
class ReplicaTable:
    """Device form of a map: replicas [E, max_replicas] int32 (physical slots, padded with the first),
    count [E] int32 (replicas of each logical expert)."""

    replicas: Tensor
    count: Tensor


@dataclass(frozen=True)
class ReplicaMap:
    """physical_to_logical[p]: the logical expert held by physical slot p (len R * slots_per_rank).

    Every logical expert in [0, num_logical) is held by at least one slot; ``from_load`` and
    ``identity`` build valid maps, the constructor checks any other.
    """

    num_logical: int
    world_size: int
    slots_per_rank: int
    physical_to_logical: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_logical < 1 or self.world_size < 1 or self.slots_per_rank < 1:
            raise ValueError(
                f"num_logical, world_size and slots_per_rank must be >= 1, got {self.num_logical}, "
                f"{self.world_size}, {self.slots_per_rank}"
            )
        if len(self.physical_to_logical) != self.num_physical:
            raise ValueError(
                f"physical_to_logical must have world_size * slots_per_rank = {self.num_physical} entries, "
                f"got {len(self.physical_to_logical)}"
            )
        bad = [p for p, e in enumerate(self.physical_to_logical) if not 0 <= e < self.num_logical]
        if bad:
            raise ValueError(f"physical slot {bad[0]} holds {self.physical_to_logical[bad[0]]}, outside "
                             f"[0, {self.num_logical})")
        missing = sorted(set(range(self.num_logical)) - set(self.physical_to_logical))
        if missing:
            raise ValueError(f"logical expert(s) {missing[:8]} have no physical slot")
        for r in range(self.world_size):
            local = self.local_logical(r)
            if len(set(local)) != len(local):
                raise ValueError(f"rank {r} holds a logical expert twice: {local}")

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def identity(cls, num_experts: int, world_size: int) -> ReplicaMap:
        """No replication: slot p holds expert p (the layout of a plain buffer)."""
        if world_size < 1 or num_experts % world_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by world_size={world_size}")
        return cls(num_experts, world_size, num_experts // world_size, tuple(range(num_experts)))

    @classmethod
    def from_load(cls, tokens_per_expert: Sequence[int] | Tensor, world_size: int,
                  extra_slots_per_rank: int) -> ReplicaMap:
        """Give each rank ``extra_slots_per_rank`` more slots and fill them greedily: while a slot is
        free, the logical expert with the most tokens per replica gets a replica on the least-loaded
        rank that has a free slot and does not hold it yet (load = tokens per replica summed over the
        rank's slots). Home slots keep the plain layout (expert e on rank e // (E / R)).

        tokens_per_expert: [E] observed tokens (rows) per logical expert, E divisible by world_size.
        """
        load = [float(v) for v in (tokens_per_expert.tolist() if isinstance(tokens_per_expert, Tensor)
                                    else tokens_per_expert)]
        E, R = len(load), world_size
        if R < 1 or E < 1 or E % R:
            raise ValueError(f"len(tokens_per_expert)={E} must be >= 1 and divisible by world_size={R}")
        if any(v < 0 for v in load):
            raise ValueError("tokens_per_expert must be >= 0")
        if extra_slots_per_rank < 0:
            raise ValueError(f"extra_slots_per_rank must be >= 0, got {extra_slots_per_rank}")
        home = E // R
        slots = [[r * home + j for j in range(home)] for r in range(R)]  # logical experts per rank
        replicas = [1] * E

        def rank_load(r: int) -> float:
            return sum(load[e] / replicas[e] for e in slots[r])

        for _ in range(extra_slots_per_rank * R):
            open_ranks = [r for r in range(R) if len(slots[r]) < home + extra_slots_per_rank]
            best = None
            for e in sorted(range(E), key=lambda e: (-load[e] / replicas[e], e)):
                hosts = [r for r in open_ranks if e not in slots[r]]
                if hosts:
                    best = (e, min(hosts, key=lambda r: (rank_load(r), r)))
                    break
            if best is None:
                raise ValueError(
                    f"extra_slots_per_rank={extra_slots_per_rank} is more than can be filled: a rank with a "
                    f"free slot already holds every one of the {E} experts"
                )
            e, r = best
            slots[r].append(e)
            replicas[e] += 1
        return cls(E, R, home + extra_slots_per_rank, tuple(e for s in slots for e in s))

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_physical(self) -> int:
        return self.world_size * self.slots_per_rank

    def local_logical(self, rank: int) -> list[int]:
        """Logical expert held by each of ``rank``'s slots, in slot order."""
        s = self.slots_per_rank
        return list(self.physical_to_logical[rank * s:(rank + 1) * s])

    def replicas_of(self, logical: int) -> list[int]:
        """Physical slots holding ``logical``, ascending."""
        return [p for p, e in enumerate(self.physical_to_logical) if e == logical]

    def device_table(self, device: torch.device | str | None = None) -> ReplicaTable:
        reps = [self.replicas_of(e) for e in range(self.num_logical)]
        width = max(len(r) for r in reps)
        table = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.int32, device=device)
        count = torch.tensor([len(r) for r in reps], dtype=torch.int32, device=device)
        return ReplicaTable(table, count)

    def route(self, topk_idx: Tensor, table: ReplicaTable | None = None) -> Tensor:
        """Physical ids [T, K] int32 for logical ``topk_idx`` [T, K] (-1 kept): replica
        ``(t + k) % count[e]`` of each pair. Device ops only (no host sync) when ``table`` is on
        topk_idx's device."""
        if table is None:
            table = self.device_table(topk_idx.device)
        return route_replicas(topk_idx, table.replicas, table.count)

    def logical_of(self, physical: Tensor) -> Tensor:
        """Logical expert of physical ids (any shape; -1 kept)."""
        p2l = torch.tensor(self.physical_to_logical, dtype=torch.int64, device=physical.device)
        ids = physical.to(torch.int64)
        return torch.where(ids >= 0, p2l[ids.clamp(min=0)], torch.full_like(ids, -1))
