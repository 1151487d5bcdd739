"""Elastic cloning of hot experts (ECHO): every step, copies of the busiest experts on spare slots.

Skewed routing sends most rows to a few experts, and the step waits for the ranks that own them.
``ReplicaMap`` (cute_ep.replication) places replicas once, from load seen earlier. ``ElasticExperts``
re-plans every step from the step's own routing, on the device the tensors live on, with fixed shapes
and no host sync, so the whole step can be captured in a CUDA graph:

    ee = ElasticExperts(num_experts=E, spare_slots=2, group=group)      # group: the ranks of the EP group
    buf = EpBuffer(rt, EpConfig(..., num_experts=ee.num_physical))      # E/R home slots + spares per rank
    for step:
        plan = ee.plan(topk_idx)                        # counts gathered on the device, greedy planner
        phys = ee.route(topk_idx, plan)                 # [T, K] int32 physical ids, rows split evenly
        clones = ee.clone_weights(home_weights, plan)   # [S, ...]: each spare slot's expert, current weights
        res = buf.dispatch(x, phys, topk_weights)
        y = experts(res.recv_x, res.tokens_per_expert, torch.cat([home_weights, clones]))   # El + S slots
        out = buf.combine(y, res.handle)
        loss(out).backward()                            # clones.requires_grad_() before the forward
        home_weights.grad = ee.reduce_grads(home_weights.grad, clones.grad, plan).to(home_weights.dtype)

Physical slots: rank r owns slots [r * P, (r + 1) * P), P = E / R + S: first its E / R home experts (expert
r * E / R + j in slot r * P + j), then S spare slots, each empty (-1) or holding a clone of an expert homed
on another rank. A rank holds an expert at most once, so a token's physical ids stay distinct.

The planner's rule (``plan_clones``), greedy, one pass of at most C = min(R * S, max_clones) moves: the
rows of expert e with n replicas are split by the round robin of ``route`` (replica i, in ascending rank
order, takes ceil((c_e - i) / n) of its c_e rows), and a rank's load is the sum of its replicas' rows. Each
move takes the most loaded rank h (lowest rank on a tie) and, for every expert e with rows on h, the least
loaded rank d_e that has a free spare slot and does not hold e (lowest rank on a tie); it adds the
replica of e on d_e that leaves the lowest max(load of h, load of d_e) (lowest e on a tie), if that move
leaves d_e below h's load before the move and takes at least ``min_gain_rows`` rows off h. The first move
that finds no such candidate ends the plan (the later moves change nothing). A move only lowers the
loads of e's holders and raises d_e's to below the maximum, so the maximum rows per rank never grows:
a plan is never worse than no cloning by that measure, and the planner's ``rows_per_rank`` is exactly
what the dispatch of the routed ids delivers (no capacity drops). Integer arithmetic and first-index
argmin / argmax only, so every rank (and the CPU) computes the same plan from the same counts.

Coherence: ``clone_weights`` gives every spare slot the bits of its expert's current weights (an exact
copy), and ``reduce_grads`` adds each clone's weight gradient into its home expert's in fp32, in a fixed
order (the home gradient first, then the clones by ascending rank, then slot). Training with cloning
matches training without it up to fp32 re-association: the weight gradient of an expert is the sum
over its rows, and with clones that sum is split into per-replica partial sums (each a GEMM over fewer
rows) added in that fixed order. Where every partial sum is exact (e.g. integer-valued data) the two
are bit for bit equal; ``tests/test_elastic*.py`` checks both.

The moves (``CloneTransport``): the planner's counts are one all-gather of [E] int64 per rank; the
weight copy and the gradient return are all-to-alls of fixed [R, S, *weight] blocks
(``CollectiveTransport``: torch.distributed, gloo on CPUs, NCCL on GPUs, capturable in a CUDA graph).
Each rank sends R * S expert blocks, most of them zeros: R times the bytes of a one-sided copy (each
spare slot reading its expert from the home rank's symmetric memory, S blocks per rank), which a
transport with peer access implements by overriding ``fetch_clones`` / ``return_grads``.

When cloning pays: a clone of an expert of ``expert_bytes`` costs a copy of those bytes into the spare
slot before the experts run (and, in training, its gradient back: fp32, twice the bytes of bf16
weights). It saves the time of the rows it takes off the busiest rank. ``break_even_rows`` gives the
rows a clone must move to pay for its copy; pass it as ``min_gain_rows``, and bound the copies per
step with ``max_clones``. A DeepSeek-V3 expert (3 x 7168 x 2048 bf16, 88 MB) at 400 GB/s takes 0.22 ms
to copy, the time of about 1700 rows of that expert at 700 TFLOP/s; at 4096 tokens per rank and top-8
over 256 experts an expert averages 128 rows per rank, so only experts many times hotter than the
mean pay for their clone, which is what skewed routing produces (``scripts/echo_bench.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.collectives import world_of
from cute_ep.replication import route_replicas

__all__ = [
    "ClonePlan",
    "CloneTransport",
    "CollectiveTransport",
    "ElasticExperts",
    "break_even_rows",
    "count_tokens",
    "plan_clones",
]

_BIG = 2**62  # "no candidate" in int64 min / max searches (row counts stay far below it)


# --------------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClonePlan:
    """One step's placement of clones. Every tensor lives on the device of the routing it was planned
    from and has a shape fixed by (R, E, S): a plan built inside a CUDA graph is rebuilt by each replay.

    Fields (R ranks, E logical experts, El = E / R home experts per rank, S spare slots per rank,
    P = El + S physical slots per rank):

    counts [R, E] int64: the step's (token, k) pairs per logical expert on each source rank (ids -1 not
        counted).
    slot_expert [R, S] int64: the logical expert cloned into each rank's spare slots, -1 for an empty
        slot. Rank r's spare slot s is physical slot r * P + El + s.
    replicas [E, R] int64: the physical slots holding each expert, ascending (home slot among them),
        padded with -1 after ``num_replicas[e]`` entries.
    num_replicas [E] int64: replicas per expert (1 + its clones; at most R).
    rows_per_rank [R] int64: rows each rank receives when the step's pairs are routed by ``route``
        (the planner's measure of balance).
    rows_without [R] int64: rows each rank would receive with no clones (its home experts' counts).
    num_clones [] int64: spare slots filled this step (<= min(R * S, max_clones)).
    experts_per_rank: El; spare_slots: S.
    """

    counts: Tensor
    slot_expert: Tensor
    replicas: Tensor
    num_replicas: Tensor
    rows_per_rank: Tensor
    rows_without: Tensor
    num_clones: Tensor
    experts_per_rank: int
    spare_slots: int

    @property
    def world_size(self) -> int:
        return self.counts.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.experts_per_rank + self.spare_slots

    def local_experts(self, rank: int) -> Tensor:
        """[P] int64: the logical expert of each of ``rank``'s physical slots (home experts, then the
        spare slots' clones; -1 for an empty spare slot). Row i of a dispatch result belongs to local
        slot ``cute_ep.reference.local_expert_of_rows(res.tokens_per_expert)[i]``."""
        el = self.experts_per_rank
        home = torch.arange(rank * el, (rank + 1) * el, device=self.counts.device, dtype=torch.int64)
        return torch.cat([home, self.slot_expert[rank]])

    def physical_to_logical(self) -> Tensor:
        """[R * P] int64: the logical expert of every physical slot (-1: an empty spare slot)."""
        return torch.cat([self.local_experts(r) for r in range(self.world_size)])


def count_tokens(topk_idx: Tensor, num_experts: int) -> Tensor:
    """[E] int64: the pairs of ``topk_idx`` [T, K] (ids in [-1, E); -1 not counted) per expert.

    Sorting and a binary search instead of ``bincount``: no host sync (bincount reads the largest id
    back to size its output), no atomics, the same result on every device."""
    key = _pair_keys(topk_idx, num_experts)
    ends = torch.searchsorted(torch.sort(key).values, torch.arange(num_experts + 1, device=key.device),
                              right=False)
    return ends[1:] - ends[:-1]


def _pair_keys(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Flat [T * K] int64 keys: the expert id, or E for a dropped pair (sorts after every expert)."""
    idx = topk_idx.reshape(-1).to(torch.int64)
    return torch.where(idx >= 0, idx, torch.full_like(idx, num_experts))


def _replica_rows(total: Tensor, holder: Tensor) -> Tensor:
    """[E, R] int64: rows each holder of each expert receives under ``route``'s round robin (replica i in
    ascending rank order takes ceil((c - i) / n) of c rows), 0 where the rank does not hold it."""
    h = holder.to(torch.int64)
    n = h.sum(1, keepdim=True).clamp(min=1)
    i = h.cumsum(1) - 1
    rows = torch.div(total[:, None] - i + n - 1, n, rounding_mode="floor").clamp(min=0)
    return torch.where(holder, rows, torch.zeros_like(rows))


def check_clone_limits(spare_slots: int, max_clones: int | None, min_gain_rows: int) -> None:
    """ValueError naming the first of the planner's limits out of range."""
    if spare_slots < 0:
        raise ValueError(f"spare_slots must be >= 0, got {spare_slots}")
    if max_clones is not None and max_clones < 0:
        raise ValueError(f"max_clones must be >= 0 or None, got {max_clones}")
    if min_gain_rows < 1:
        raise ValueError(f"min_gain_rows must be >= 1, got {min_gain_rows}")


def plan_clones(counts: Tensor, spare_slots: int, *, max_clones: int | None = None,
                min_gain_rows: int = 1) -> ClonePlan:
    """The step's clone placement from every rank's counts (the module docstring states the rule).

    Args:
        counts: [R, E] int64 (or int32) on any device: pairs per logical expert on each source rank
            (``count_tokens`` of each rank's topk_idx, gathered). E must be divisible by R.
        spare_slots: S >= 0, spare expert slots per rank.
        max_clones: at most this many clones per step over all ranks (>= 0; None: R * S). Bounds the
            weight copies (each moves one expert's weights).
        min_gain_rows: >= 1; a clone is placed only if it takes at least this many rows off the most
            loaded rank (e.g. ``break_even_rows`` of the weight copy).

    Returns:
        ``ClonePlan`` on counts' device. Deterministic, fixed shapes, no host sync (the loop runs
        min(R * S, max_clones) times whatever the counts).
    """
    if counts.dim() != 2 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be [R, E] int32 or int64, got {tuple(counts.shape)} {counts.dtype}")
    R, E = counts.shape
    if R < 1 or E < 1 or E % R:
        raise ValueError(f"counts: the number of experts E={E} must be >= 1 and divisible by the ranks R={R}")
    check_clone_limits(spare_slots, max_clones, min_gain_rows)
    dev = counts.device
    counts = counts.to(torch.int64)
    el, S = E // R, spare_slots
    moves = R * S if max_clones is None else min(R * S, max_clones)
    ranks = torch.arange(R, device=dev)
    experts = torch.arange(E, device=dev)
    slots = torch.arange(S, device=dev)
    home = torch.div(experts, el, rounding_mode="floor")
    total = counts.sum(0)
    holder = home[:, None] == ranks[None, :]  # [E, R]
    rows_without = _replica_rows(total, holder).sum(0)
    slot_expert = torch.full((R, S), -1, dtype=torch.int64, device=dev)
    used = torch.zeros(R, dtype=torch.int64, device=dev)
    active = torch.ones(1, dtype=torch.bool, device=dev)
    big = torch.full((), _BIG, dtype=torch.int64, device=dev)
    for _ in range(moves):
        rows = _replica_rows(total, holder)  # [E, R]
        load = rows.sum(0)  # [R]
        # [1]-shaped indices throughout: indexing with a 0-d tensor would read it back to the host.
        h = torch.argmax(load, dim=0, keepdim=True)  # first maximum: lowest rank on a tie
        load_h = load.gather(0, h)
        # Every candidate expert at once: its destination, and the loads after adding that replica.
        free = (used < S)[None, :] & ~holder  # [E, R]
        d = torch.argmin(torch.where(free, load[None, :], big), dim=1)  # [E]
        has_d = free.gather(1, d[:, None])[:, 0]
        grown = holder | (ranks[None, :] == d[:, None])
        load_after = load[None, :] - rows + _replica_rows(total, grown)  # [E, R]
        new_h = load_after.index_select(1, h)[:, 0]
        new_d = load_after.gather(1, d[:, None])[:, 0]
        on_h = rows.index_select(1, h)[:, 0]
        ok = has_d & (on_h > 0) & (new_d < load_h) & (load_h - new_h >= min_gain_rows)
        score = torch.where(ok, torch.maximum(new_h, new_d), big)
        e = torch.argmin(score, dim=0, keepdim=True)  # lowest expert on a tie
        take = active & ok.gather(0, e)  # [1]
        to = d.gather(0, e)
        # [R, S]: the first free slot of the destination, or nothing
        put = take & (ranks[:, None] == to) & (slots[None, :] == used.gather(0, to))
        slot_expert = torch.where(put, e, slot_expert)
        used = used + (take & (ranks == to)).to(torch.int64)
        holder = torch.where(take & (experts[:, None] == e), grown, holder)
        active = take  # the first move without a candidate ends the plan
    rows_per_rank = _replica_rows(total, holder).sum(0)

    # Physical slots of each expert in ascending rank order (= ascending physical id).
    P = el + S
    phys = torch.full((E + 1, R), -1, dtype=torch.int64, device=dev)  # row E: where empty slots go
    spare_ids = ranks[:, None] * P + el + slots[None, :]  # [R, S]
    target = torch.where(slot_expert >= 0, slot_expert, torch.full_like(slot_expert, E))
    phys.index_put_((target.reshape(-1), ranks[:, None].expand(R, S).reshape(-1)), spare_ids.reshape(-1))
    phys = phys[:E]
    home_ids = home * P + (experts - home * el)
    phys = torch.where(holder & (ranks[None, :] == home[:, None]), home_ids[:, None], phys)
    # Holders first, keeping rank order (a stable sort on "not a holder").
    not_held, order = torch.sort((~holder).to(torch.int64), dim=1, stable=True)
    replicas = torch.where(not_held == 0, phys.gather(1, order), torch.full_like(phys, -1))
    return ClonePlan(
        counts=counts, slot_expert=slot_expert, replicas=replicas, num_replicas=holder.sum(1),
        rows_per_rank=rows_per_rank, rows_without=rows_without, num_clones=(slot_expert >= 0).sum(),
        experts_per_rank=el, spare_slots=S,
    )


def break_even_rows(expert_bytes: float, copy_bytes_per_s: float, seconds_per_row: float) -> int:
    """Rows a clone must take off the busiest rank to pay for copying its weights: the copy time
    ``expert_bytes / copy_bytes_per_s`` over the time one row spends in the expert (forward only; in
    training add the backward's share and the gradient's way back). >= 1; use it as
    ``min_gain_rows``."""
    if expert_bytes < 0 or copy_bytes_per_s <= 0 or seconds_per_row <= 0:
        raise ValueError(
            f"need expert_bytes >= 0, copy_bytes_per_s > 0 and seconds_per_row > 0, got {expert_bytes}, "
            f"{copy_bytes_per_s}, {seconds_per_row}"
        )
    return max(1, math.ceil(expert_bytes / copy_bytes_per_s / seconds_per_row))


# --------------------------------------------------------------------------------------------------
# moving counts, weights and gradients
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class CloneTransport(Protocol):
    """How the ranks exchange what ECHO needs; every call is collective, with fixed shapes.

    rank, world_size: this rank and R.
    """

    rank: int
    world_size: int

    def all_gather(self, t: Tensor) -> Tensor:
        """[R, *t.shape]: every rank's ``t`` (same shape and dtype everywhere), in rank order."""
        ...

    def fetch_clones(self, home: Tensor, slot_expert: Tensor) -> Tensor:
        """[S, *w] in home's dtype: for each of this rank's spare slots s, an exact copy of
        ``home_h[e - h * El]`` on the home rank h of e = slot_expert[rank, s] (zeros for an empty slot).
        home: [El, *w], this rank's home experts; slot_expert: [R, S] int64, the same on every rank."""
        ...

    def return_grads(self, clone_grad: Tensor, slot_expert: Tensor, experts_per_rank: int) -> Tensor:
        """[R, S, *w] fp32: block (r, s) is rank r's ``clone_grad[s]`` if its expert is homed on this
        rank (experts_per_rank = El home experts per rank), else zeros. clone_grad: [S, *w] fp32, this
        rank's spare slots' gradients."""
        ...


# torch.distributed.all_gather_single where torch has it (there all_gather_into_tensor, its older name, is
# deprecated and warns with a FutureWarning), else all_gather_into_tensor: the same collective.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveTransport:
    """``CloneTransport`` on torch.distributed collectives of ``group`` (NCCL: GPU tensors, capturable in
    a CUDA graph; gloo: CPU tensors, or GPU tensors moved through the host, as when ranks share a GPU,
    which a CUDA graph cannot capture). Without an initialised process group: a world of one.

    The weight copy and the gradient return are each one ``all_to_all_single`` of [R, S, *w] blocks
    (block (h, s) to rank r: rank r's spare slot s if h is its expert's home, else zeros), sent as raw
    bytes, so any dtype moves exactly on either backend.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank, self.world_size = world_of(group)

    def all_gather(self, t: Tensor) -> Tensor:
        t = t.contiguous()
        if self.world_size == 1 and not dist.is_initialized():
            return t[None].clone()
        # One flat buffer, rank r's t at [r * numel, (r + 1) * numel): the shape every backend takes (gloo
        # splits the output along its first dimension and wants each part shaped like the input; a GPU
        # tensor on a gloo group, as with ranks sharing a GPU, goes this way too).
        out = torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t.reshape(-1), group=self.group)
        return out.view(self.world_size, *t.shape)

    def _all_to_all(self, blocks: Tensor) -> Tensor:
        """[R, ...] -> [R, ...]: block r goes to rank r; block h of the result came from rank h."""
        if self.world_size == 1 and not dist.is_initialized():
            return blocks.clone()
        flat = blocks.contiguous().reshape(self.world_size, -1)
        raw = flat.view(torch.uint8) if flat.numel() else flat
        out = torch.empty_like(raw)
        dist.all_to_all_single(out, raw, group=self.group)
        return (out.view(blocks.dtype) if flat.numel() else out).reshape(blocks.shape)

    def fetch_clones(self, home: Tensor, slot_expert: Tensor) -> Tensor:
        R, S = slot_expert.shape
        el, me = home.shape[0], self.rank
        e = slot_expert
        mine = (e >= 0) & (torch.div(e, el, rounding_mode="floor") == me)  # [R, S]: slots I feed
        local = torch.where(mine, e - me * el, torch.zeros_like(e))
        send = home.index_select(0, local.reshape(-1)).reshape(R, S, *home.shape[1:])
        send = torch.where(_expand(mine, send), send, torch.zeros_like(send))
        recv = self._all_to_all(send)  # recv[h, s]: what rank h sent for my slot s
        wanted = e[me]
        src = torch.where(wanted >= 0, torch.div(wanted, el, rounding_mode="floor"), torch.zeros_like(wanted))
        return recv[src, torch.arange(S, device=e.device)]

    def return_grads(self, clone_grad: Tensor, slot_expert: Tensor, experts_per_rank: int) -> Tensor:
        R = slot_expert.shape[0]
        wanted = slot_expert[self.rank]
        owner = torch.where(wanted >= 0, torch.div(wanted, experts_per_rank, rounding_mode="floor"),
                            torch.full_like(wanted, -1))
        to = owner[None, :] == torch.arange(R, device=owner.device)[:, None]  # [R, S]: block r's slots
        send = clone_grad[None].expand(R, *clone_grad.shape)
        send = torch.where(_expand(to, send), send, torch.zeros_like(send))
        return self._all_to_all(send)


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    """``mask`` [a, b] broadcast over the trailing dimensions of ``like`` [a, b, ...]."""
    return mask.reshape(*mask.shape, *([1] * (like.dim() - mask.dim())))


# --------------------------------------------------------------------------------------------------
# the public class
# --------------------------------------------------------------------------------------------------


class ElasticExperts:
    """Per-step cloning of hot experts onto spare slots: planner, routing, weight copy, gradient return.

    Args:
        num_experts: E, logical experts, divisible by the group's size R (rank r is home to experts
            [r * E / R, (r + 1) * E / R)).
        spare_slots: S >= 0, spare expert slots per rank; a buffer for the routed ids is built with
            ``num_experts=self.num_physical`` (= R * (E / R + S)).
        group: the torch.distributed group of the expert-parallel ranks (gloo for CPU tensors, NCCL for
            GPU ones; None: the default group, or a world of one without a process group).
        max_clones: at most this many clones per step over all ranks (None: R * S), >= 0.
        min_gain_rows: a clone must take at least this many rows off the busiest rank (>= 1; see
            ``break_even_rows``).
        transport: a ``CloneTransport`` (default: ``CollectiveTransport(group)``).

    Every method is collective where it moves data (``plan``, ``clone_weights``, ``reduce_grads``):
    every rank calls it in the same order. Nothing here reads a device value back to the host.
    """

    def __init__(self, num_experts: int, spare_slots: int, *, group: Any = None,
                 max_clones: int | None = None, min_gain_rows: int = 1,
                 transport: CloneTransport | None = None) -> None:
        self.transport = transport if transport is not None else CollectiveTransport(group)
        self.rank, self.world_size = self.transport.rank, self.transport.world_size
        R = self.world_size
        if num_experts < 1 or num_experts % R:
            raise ValueError(f"num_experts={num_experts} must be >= 1 and divisible by the world size {R}")
        check_clone_limits(spare_slots, max_clones, min_gain_rows)
        self.num_experts = num_experts
        self.spare_slots = spare_slots
        self.max_clones = max_clones
        self.min_gain_rows = min_gain_rows
        self.experts_per_rank = num_experts // R

    @property
    def slots_per_rank(self) -> int:
        """P = E / R + S physical slots per rank."""
        return self.experts_per_rank + self.spare_slots

    @property
    def num_physical(self) -> int:
        """R * P: the ``num_experts`` of the buffer that carries the routed ids."""
        return self.world_size * self.slots_per_rank

    # -- planner and routing -----------------------------------------------------------------------

    def plan(self, topk_idx: Tensor) -> ClonePlan:
        """This step's plan from this rank's routing ``topk_idx`` [T, K] int32 / int64 in [-1, E) (T may
        differ between ranks): counts per expert, gathered from every rank (one all-gather of [E] int64
        on topk_idx's device), then ``plan_clones``. Collective; the same plan on every rank."""
        self._check_idx(topk_idx)
        counts = self.transport.all_gather(count_tokens(topk_idx, self.num_experts))
        return plan_clones(counts, self.spare_slots, max_clones=self.max_clones,
                           min_gain_rows=self.min_gain_rows)

    def route(self, topk_idx: Tensor, plan: ClonePlan) -> Tensor:
        """Physical ids [T, K] int32 for the logical ``topk_idx`` [T, K] the plan counted (-1 kept).

        The j-th pair of expert e over all ranks (source rank, then t, then k ascending) goes to replica
        j % num_replicas[e]: each replica gets its share of the expert's rows to within one row, as the
        plan's ``rows_per_rank`` says. Device ops only, no collective."""
        self._check_idx(topk_idx)
        if plan.counts.shape != (self.world_size, self.num_experts):
            raise ValueError(f"plan is for {tuple(plan.counts.shape)} (ranks, experts), this object for "
                             f"{(self.world_size, self.num_experts)}")
        E = self.num_experts
        key = _pair_keys(topk_idx, E)
        ordered, order = torch.sort(key, stable=True)
        starts = torch.searchsorted(ordered, torch.arange(E + 1, device=key.device))
        ordinal = torch.empty_like(key)
        ordinal[order] = torch.arange(key.numel(), device=key.device) - starts[ordered]
        before = plan.counts.cumsum(0)[self.rank] - plan.counts[self.rank]  # pairs on lower ranks
        position = (before[key.clamp(max=E - 1)] + ordinal).reshape(topk_idx.shape)
        return route_replicas(topk_idx, plan.replicas, plan.num_replicas, position)

    # -- coherence ---------------------------------------------------------------------------------

    def clone_weights(self, home: Tensor, plan: ClonePlan) -> Tensor:
        """[S, *w] (home's dtype and device): each spare slot's expert's current weights, bit for bit
        (zeros in an empty slot). home: [E / R, *w], this rank's home experts (any float dtype; one
        tensor per weight of the expert, or all of them stacked in *w). Collective. Returns a new
        tensor, detached: call ``requires_grad_()`` on it to get the clones' gradients in training."""
        self._check_stack("home", home, self.experts_per_rank)
        return self.transport.fetch_clones(home.detach(), plan.slot_expert)

    def slot_weights(self, home: Tensor, clones: Tensor) -> Tensor:
        """[P, *w]: this rank's home experts, then its spare slots (the order of the physical slots and
        of ``res.tokens_per_expert``). Differentiable in both."""
        self._check_stack("home", home, self.experts_per_rank)
        self._check_stack("clones", clones, self.spare_slots, like=home)
        return torch.cat([home, clones])

    def reduce_grads(self, home_grad: Tensor | None, clone_grad: Tensor | None, plan: ClonePlan,
                     like: Tensor | None = None) -> Tensor:
        """[E / R, *w] fp32: each home expert's gradient plus its clones' gradients, summed in fp32 in a
        fixed order: the home gradient first, then every clone by ascending rank, then spare slot.

        home_grad: [E / R, *w] any float dtype (None: zeros); clone_grad: [S, *w] this rank's spare
        slots' gradients (None: zeros, e.g. no clone got a row); like: a [E / R, *w] tensor giving the
        shape and device when both are None. Collective (every rank, also one without clones)."""
        ref = home_grad if home_grad is not None else clone_grad if clone_grad is not None else like
        if ref is None:
            raise ValueError("reduce_grads: home_grad and clone_grad are None: pass like= for the shape")
        w_shape, dev = tuple(ref.shape[1:]), ref.device
        el, S = self.experts_per_rank, self.spare_slots
        if home_grad is None:
            home_grad = torch.zeros((el, *w_shape), dtype=torch.float32, device=dev)
        if clone_grad is None:
            clone_grad = torch.zeros((S, *w_shape), dtype=torch.float32, device=dev)
        self._check_stack("home_grad", home_grad, el)
        self._check_stack("clone_grad", clone_grad, S, like=home_grad)
        recv = self.transport.return_grads(clone_grad.detach().to(torch.float32), plan.slot_expert, el)
        acc = home_grad.detach().to(torch.float32).clone()
        e = plan.slot_expert
        mine = (e >= 0) & (torch.div(e, el, rounding_mode="floor") == self.rank)
        local = torch.where(mine, e - self.rank * el, torch.zeros_like(e))
        for r in range(self.world_size):  # the fixed order: rank, then slot
            for s in range(S):
                j = local[r, s].reshape(1)
                row = acc.index_select(0, j)
                acc.index_copy_(0, j, torch.where(mine[r, s], row + recv[r, s][None], row))
        return acc

    # -- checks ------------------------------------------------------------------------------------

    def _check_idx(self, topk_idx: Tensor) -> None:
        if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"topk_idx must be [T, K] int32 or int64, got shape {tuple(topk_idx.shape)} {topk_idx.dtype}"
            )

    def _check_stack(self, name: str, t: Tensor, rows: int, like: Tensor | None = None) -> None:
        if t.dim() < 1 or t.shape[0] != rows:
            raise ValueError(f"{name} must have {rows} rows (one per slot) in dimension 0, got shape "
                             f"{tuple(t.shape)}")
        if like is not None and (t.shape[1:] != like.shape[1:] or t.device != like.device):
            raise ValueError(f"{name} must match the home experts' shape {tuple(like.shape[1:])} and device "
                             f"{like.device}, got {tuple(t.shape[1:])} on {t.device}")
