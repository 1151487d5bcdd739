"""Expert capacity: which (token, k) pairs a dispatch keeps when experts receive at most C rows each.

The rule (``EpConfig.capacity_factor`` > 0; every backend and the GPU kernels follow it): for each
global expert e, order every pair routed to e by source rank ascending, then by the source's (t, k)
pairs in row-major order ``t * K + k``; the first ``expert_capacity`` pairs are kept, the rest are
dropped. A dropped pair behaves exactly as if its ``topk_idx`` were -1: not received, not counted in
``tokens_per_expert`` / ``num_recv``, left out of combine's weighted sum, and its slot in the handle's
``scatter`` is -1. So the receive layout of a dispatch with capacity is ``reference_layout`` of the
*effective* routing that :func:`apply_expert_capacity` returns.

Because sources are ordered by rank, source s keeps ``min(count[s][e], C - rows of e before s)`` pairs
of expert e (:func:`kept_counts`), always its first ones in (t, k) order (:func:`capacity_keep`): a
rank needs only the count rows of all ranks, not their routing, to know which of its pairs survive.

In "atomic" mode the GPU kernels keep the same number of pairs per (expert, source) but not
necessarily the same ones; :func:`effective_topk_from_scatter` recovers the routing a dispatch really
used from its handle, and :func:`check_atomic_drops` compares the two modes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "apply_expert_capacity",
    "capacity_keep",
    "check_atomic_drops",
    "effective_topk_from_scatter",
    "expert_counts",
    "kept_counts",
]


def _check_ids(name: str, idx: Tensor, num_experts: int) -> None:
    """idx must be a 2-D integer tensor of ids in [-1, num_experts)."""
    if idx.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, K], got shape {tuple(idx.shape)}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (int64/int32), got {idx.dtype}")
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"{name} ids must be in [-1, {num_experts}), got range [{lo}, {hi}]")


def _check_positive_int(name: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({what}), got {value!r}")


def _check_capacity(expert_capacity: object) -> None:
    _check_positive_int("expert_capacity", expert_capacity, "rows one expert may receive")


def expert_counts(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Pairs of one rank routed to each expert (-1 pairs not counted).

    Args:
        topk_idx: [T, K] int32/int64, ids in [-1, E).
        num_experts: E >= 1.

    Returns:
        [E] int64 on topk_idx's device.
    """
    ids = topk_idx.reshape(-1).to(torch.int64)
    # -1 goes to a virtual expert E that is cut off; scatter_add is exact and needs no host sync.
    key = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    hist = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    hist.scatter_add_(0, key, torch.ones_like(key))
    return hist[:num_experts]


def kept_counts(counts: Tensor, expert_capacity: int) -> Tensor:
    """Pairs each source keeps per expert under the capacity rule.

    Args:
        counts: [R, E] integer, counts[s][e] = pairs of source rank s routed to expert e.
        expert_capacity: C >= 1, rows one expert may receive.

    Returns:
        [R, E] int64 (counts' device): ``clamp(min(counts[s][e], C - sum_{s' < s} counts[s'][e]), 0)``.
        The dropped rows per expert are ``counts.sum(0) - kept.sum(0)``.
    """
    if counts.dim() != 2 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(
            f"counts must be a 2-D [R, E] integer tensor, got {tuple(counts.shape)} {counts.dtype}"
        )
    _check_capacity(expert_capacity)
    c = counts.to(torch.int64)
    before = torch.cumsum(c, dim=0) - c  # rows of each expert from lower ranks
    room = (expert_capacity - before).clamp_min(0)
    return torch.minimum(c, room)


def capacity_keep(topk_idx: Tensor, before: Tensor, expert_capacity: int) -> Tensor:
    """Which pairs of one source survive the capacity rule.

    Args:
        topk_idx: [T, K] int32/int64 of this source, ids in [-1, E).
        before: [E] integer, rows of each expert routed from the sources of lower rank (every pair, kept
            or not: ``sum_{s' < s} counts[s'][e]``).
        expert_capacity: C >= 1.

    Returns:
        [T, K] bool on topk_idx's device: True where the pair is valid (id >= 0) and its position among
        all pairs of its expert (sources before it, then its (t, k) row-major order) is below C.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2-D [T, K], got shape {tuple(topk_idx.shape)}")
    if before.dim() != 1:
        raise ValueError(f"before must be 1-D [E], got shape {tuple(before.shape)}")
    num_experts = before.numel()
    _check_capacity(expert_capacity)
    ids = topk_idx.reshape(-1).to(torch.int64)
    n = ids.numel()
    key = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    # A stable sort by expert keeps (t, k) order inside an expert: a pair's sorted position minus its
    # expert's first sorted position is its index among this source's pairs of that expert.
    order = torch.sort(key, stable=True).indices
    hist = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    hist.scatter_add_(0, key, torch.ones_like(key))
    first = torch.cumsum(hist, 0) - hist
    within = torch.empty_like(key)
    within[order] = torch.arange(n, device=ids.device) - first[key[order]]
    before64 = before.to(device=ids.device, dtype=torch.int64)
    ahead = torch.cat([before64, before64.new_zeros(1)])  # virtual expert E: masked out below
    keep = (ids >= 0) & (ahead[key] + within < expert_capacity)
    return keep.view(topk_idx.shape)


def apply_expert_capacity(
    topk_idx: Sequence[Tensor], num_experts: int, expert_capacity: int
) -> tuple[list[Tensor], Tensor]:
    """The routing a dispatch with expert capacity really carries out, for every rank at once.

    Args:
        topk_idx: per source rank s (R >= 1 tensors), [T_s, K] int32/int64, ids in [-1, E); T_s may
            differ between ranks and may be 0; K must be the same.
        num_experts: E >= 1 (global experts).
        expert_capacity: C >= 1, rows one expert may receive (``EpConfig.expert_capacity``).

    Returns:
        (effective, dropped): effective[s] has topk_idx[s]'s shape, dtype and device, with every dropped
        pair set to -1; dropped [E] int64 (on topk_idx[0]'s device): pairs dropped per global expert.

    Raises:
        ValueError: an empty sequence, K differing between ranks, ids outside [-1, E), E < 1 or C < 1.
    """
    _check_positive_int("num_experts", num_experts, "global experts")
    _check_capacity(expert_capacity)
    if len(topk_idx) < 1:
        raise ValueError("topk_idx must hold one [T, K] tensor per rank (got an empty sequence)")
    ks = set()
    for s, idx in enumerate(topk_idx):
        _check_ids(f"topk_idx[{s}]", idx, num_experts)
        ks.add(idx.shape[1])
    if len(ks) != 1:
        raise ValueError(f"every rank must use the same K, got {sorted(ks)}")
    device = topk_idx[0].device
    counts = torch.stack([expert_counts(idx, num_experts).to(device) for idx in topk_idx])  # [R, E]
    before = torch.cumsum(counts, dim=0) - counts
    effective = []
    for s, idx in enumerate(topk_idx):
        keep = capacity_keep(idx, before[s], expert_capacity)
        effective.append(torch.where(keep, idx, torch.full_like(idx, -1)))
    dropped = (counts.sum(0) - expert_capacity).clamp_min(0)
    return effective, dropped


def effective_topk_from_scatter(topk_idx: Tensor, scatter: Tensor) -> Tensor:
    """The routing a dispatch really used, read from its handle: pairs whose slot is -1 become -1.

    Args:
        topk_idx: [T, K] int32/int64, the routing passed to dispatch (ids in [-1, E)).
        scatter: [T, K] integer, the handle's slots (-1: not sent, dropped by the caller or by capacity).

    Returns:
        [T, K] with topk_idx's dtype and device.
    """
    if topk_idx.shape != scatter.shape or topk_idx.dim() != 2:
        raise ValueError(
            f"topk_idx and scatter must have the same [T, K] shape, got {tuple(topk_idx.shape)} and "
            f"{tuple(scatter.shape)}"
        )
    for name, ten in (("topk_idx", topk_idx), ("scatter", scatter)):
        if ten.dtype.is_floating_point or ten.dtype.is_complex or ten.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {ten.dtype}")
    sent = scatter.to(topk_idx.device) >= 0
    return torch.where(sent, topk_idx, torch.full_like(topk_idx, -1))


def check_atomic_drops(
    eff_atomic: Sequence[Tensor], eff_scatter: Sequence[Tensor], num_experts: int
) -> list[str]:
    """Compare the effective routings of an atomic-mode and a scatter-mode dispatch of the same inputs.

    Atomic mode may keep other pairs than scatter mode, but the same number per (expert, source), and
    a pair both modes kept must name the same expert (the same original routing).

    Args:
        eff_atomic: per source rank, [T_s, K] int32/int64 in [-1, E): the atomic dispatch's effective
            routing (e.g. :func:`effective_topk_from_scatter` of its handle).
        eff_scatter: per source rank, the same shapes: the scatter-mode (or
            :func:`apply_expert_capacity`) effective routing.
        num_experts: E >= 1.

    Returns:
        Human-readable problems (empty: consistent), at most 20 per kind of problem.
    """
    _check_positive_int("num_experts", num_experts, "global experts")
    if len(eff_atomic) != len(eff_scatter):
        return [f"atomic routing covers {len(eff_atomic)} ranks, scatter routing {len(eff_scatter)}"]
    problems: list[str] = []
    count_problems: list[str] = []
    for s, (a, b) in enumerate(zip(eff_atomic, eff_scatter, strict=True)):
        _check_ids(f"eff_atomic[{s}]", a, num_experts)
        _check_ids(f"eff_scatter[{s}]", b, num_experts)
        if a.shape != b.shape:
            problems.append(f"source {s}: atomic routing {tuple(a.shape)} vs scatter {tuple(b.shape)}")
            continue
        a64, b64 = a.to(torch.int64), b.to(device=a.device, dtype=torch.int64)
        both = (a64 >= 0) & (b64 >= 0) & (a64 != b64)
        if bool(both.any()):
            t, k = (int(v) for v in torch.nonzero(both)[0])
            problems.append(
                f"source {s}: pair (t={t}, k={k}) goes to expert {int(a64[t, k])} in atomic mode, "
                f"{int(b64[t, k])} in scatter mode ({int(both.sum())} such pairs)"
            )
        ca, cb = expert_counts(a64, num_experts), expert_counts(b64, num_experts)
        for e in torch.nonzero(ca != cb).flatten().tolist():
            count_problems.append(
                f"expert {e}, source {s}: atomic mode kept {int(ca[e])} rows, scatter mode {int(cb[e])}"
            )
    return problems[:20] + count_problems[:20]
