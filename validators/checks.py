"""Distributed correctness checks of dispatch and combine, on any torch.distributed process group.

Every rank passes its own inputs and its own output buffers; the inputs (and, for combine, the expert
outputs) are all-gathered to CPU, each rank computes the reference for itself with
:mod:`cute_ep.reference`, and compares bit for bit. The verdict is reduced over all ranks
(all_reduce MIN) so that one failing rank cannot leave the others passing, and errors while comparing
are turned into failures instead of exceptions so that no rank skips the final collective (which
would hang the others).

Works with gloo (CPU) and NCCL (the tensors may live on CUDA; they are moved to CPU first). Without
an initialised process group, world size 1 is assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.bootstrap.dist_env import ROUTE_CLASSES, possible_route_classes, route_class
from cute_ep.collectives import all_gather_objects, collective_device, world_of
from cute_ep.fp8 import fp8_row_bytes, pack_fp8_rows, quantize_fp8
from cute_ep.kernels.buffers import FP8_BLOCK
from cute_ep.reference import (
    COMBINE_REFERENCES,
    ExpectedRankRecv,
    Layout,
    pack_source,
    reference_combine_rank_layout,
    reference_dispatch_rank,
    reference_dispatch_rank_layout,
    reference_layout,
    reference_rank_layout,
    unpack_source,
)

__all__ = [
    "CheckResult",
    "check_capacity_drops",
    "check_combine",
    "check_dispatch",
    "check_layout",
    "check_rank_combine",
    "check_rank_dispatch",
    "format_summary",
    "report",
    "route_counts_of",
]


@dataclass
class CheckResult:
    """Outcome of a distributed check, as seen by one rank.

    Attributes:
        passed: True only if every rank passed (already reduced over the group).
        message: this rank's first mismatch (readable), or "ok"; on a passing rank of a failing run it
            names the failing ranks.
        route_counts: non-dropped (t, k) pairs per route class, summed over all ranks (every class of
            ROUTE_CLASSES is a key).
        coverage_ok: every route class possible in this topology has at least one pair.
        local_passed: this rank's own verdict (including the coverage gate).
        failed_ranks: ranks whose local verdict was a failure.
        wrong_rows: this rank's wrong rows, for the checks that count them (None for the others):
            check_rank_dispatch, received rows not bit-identical to their expected row in every field
            plus missing or extra rows; check_rank_combine, output tokens differing in any bit. 0 on a
            passing rank; sum it over the ranks for the run's count.
    """

    passed: bool
    message: str
    route_counts: dict[str, int]
    coverage_ok: bool
    local_passed: bool
    failed_ranks: list[int] = field(default_factory=list)
    wrong_rows: int | None = None


def _reduce_verdict(local_ok: bool, group: Any) -> list[int]:
    """Failing ranks, known on every rank: one all_reduce MIN over a per-rank flag vector."""
    rank, world = world_of(group)
    flags = torch.ones(world, dtype=torch.int32, device=collective_device(group))
    flags[rank] = int(local_ok)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return [r for r, f in enumerate(flags.cpu().tolist()) if f == 0]


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().cpu()


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def route_counts_of(layout: Layout, local_world_size: int) -> dict[str, int]:
    """Non-dropped pairs per route class (source rank -> expert owner), over all ranks.

    Args:
        layout: the routing's :class:`~cute_ep.reference.Layout`.
        local_world_size: L, ranks per (possibly virtual) node.

    Returns:
        {class: count} with every class of ROUTE_CLASSES as a key.
    """
    world, el = layout.world_size, layout.experts_per_rank
    per_dst = layout.counts.view(world, world, el).sum(dim=2)  # [src, dst] pairs
    counts = dict.fromkeys(ROUTE_CLASSES, 0)
    for s in range(world):
        for d in range(world):
            counts[route_class(s, d, local_world_size)] += int(per_dst[s, d])
    return counts


def _coverage_gate(
    route_counts: dict[str, int], world: int, local_world_size: int, require: bool
) -> tuple[bool, list[str]]:
    """(coverage ok, failure messages): the route classes possible in the topology that no pair
    exercised; a message only when coverage is required."""
    missing = [c for c in possible_route_classes(world, local_world_size) if route_counts.get(c, 0) == 0]
    msgs = []
    if missing and require:
        msgs.append(
            f"coverage: no pair exercised route class(es) {', '.join(missing)} "
            f"(world size {world}, local world size {local_world_size})"
        )
    return not missing, msgs


def _bits(t: Tensor) -> Tensor:
    """Integer view of the same bits, so NaN compares equal only to the same NaN and -0.0 != 0.0."""
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t


def _fmt(v: Tensor) -> str:
    """A scalar tensor's value and, for floats, its bits (two values may print alike yet differ)."""
    if v.dtype.is_floating_point:
        bits = int(_bits(v.reshape(1))[0]) & ((1 << (8 * v.element_size())) - 1)
        return f"{float(v)!r} (0x{bits:0{2 * v.element_size()}x})"
    return str(int(v))


def _finish(
    local_msgs: list[str],
    route_counts: dict[str, int],
    coverage_ok: bool,
    group: Any,
    wrong_rows: int | None = None,
) -> CheckResult:
    local_ok = not local_msgs
    failed = _reduce_verdict(local_ok, group)
    if local_msgs:
        message = "; ".join(local_msgs)
    elif failed:
        message = f"ok on this rank; failed on rank(s) {failed}"
    else:
        message = "ok"
    return CheckResult(
        passed=not failed,
        message=message,
        route_counts=route_counts,
        coverage_ok=coverage_ok,
        local_passed=local_ok,
        failed_ranks=failed,
        wrong_rows=wrong_rows,
    )


def _check_against_layout(
    local: tuple,
    compare: Callable[[list[tuple], Layout, int], list[str]],
    error: str,
    num_experts: int,
    local_world_size: int,
    require_coverage: bool,
    group: Any,
) -> CheckResult:
    """The frame of the checks against the reference layout (collective): all-gather every rank's
    ``local`` (its routing first), build the layout of all the routings and its route counts, and
    reduce this rank's messages over the group: ``compare(gathered, layout, rank)``'s, then the
    coverage gate's (``require_coverage``). An exception while checking becomes this rank's message
    (``error`` formatted with ``rank``, then the exception) instead of skipping the verdict collective.
    """
    rank, world = world_of(group)
    gathered = all_gather_objects(local, group)
    msgs: list[str] = []
    counts = dict.fromkeys(ROUTE_CLASSES, 0)
    coverage_ok = False
    try:
        layout = reference_layout([g[0] for g in gathered], num_experts)
        counts = route_counts_of(layout, local_world_size)
        coverage_ok, gate = _coverage_gate(counts, world, local_world_size, require_coverage)
        msgs += compare(gathered, layout, rank)
        msgs += gate
    except Exception as exc:  # every rank must still reach the verdict collective
        msgs.append(f"{error.format(rank=rank)}: {type(exc).__name__}: {exc}")
    return _finish(msgs, counts, coverage_ok, group)


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def _group_ids(layout: Layout, dst: int) -> Tensor:
    """[num_recv_dst] int64: the (local expert, source) group index l * R + s of every slot."""
    sizes = layout.group_sizes(dst)
    return torch.repeat_interleave(torch.arange(sizes.numel()), sizes)


def _sort_within_groups(
    layout: Layout, dst: int, x: Tensor, w: Tensor, src: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Atomic-mode canonical order: rows sorted by recv_src inside each (local expert, source) group."""
    groups = _group_ids(layout, dst)
    # Groups are contiguous ranges, so sorting by (group, tag) moves rows only inside their group;
    # the +2**31 shift keeps arbitrary (even negative) int32 tags ordered within one group.
    key = groups * (1 << 33) + (src.to(torch.int64) + (1 << 31))
    order = torch.argsort(key, stable=True)
    return x[order], w[order], src[order]


def _compare_dispatch(
    layout: Layout,
    expected: Any,
    recv_x: Tensor,
    recv_w: Tensor,
    recv_src: Tensor,
    topk_idx: Sequence[Tensor],
    max_tokens: int,
    rank: int,
    ordered: bool,
) -> list[str]:
    n = expected.num_recv
    hidden = expected.recv_x.shape[1]
    problems = []
    if recv_x.dim() != 2 or recv_x.shape[1] != hidden or recv_x.dtype != expected.recv_x.dtype:
        problems.append(
            f"recv_x must be [>= {n}, {hidden}] of {expected.recv_x.dtype}, "
            f"got {tuple(recv_x.shape)} {recv_x.dtype}"
        )
    if recv_w.dtype != torch.float32:
        problems.append(f"recv_w must be float32, got {recv_w.dtype}")
    if recv_src.dtype.is_floating_point or recv_src.dtype == torch.bool:
        problems.append(f"recv_src must be an integer tensor (int32), got {recv_src.dtype}")
    for name, t in (("recv_x", recv_x), ("recv_w", recv_w), ("recv_src", recv_src)):
        if t.dim() >= 1 and t.shape[0] < n:
            problems.append(f"{name} has {t.shape[0]} rows but rank {rank} receives {n}")
    if problems:
        return [f"dest rank {rank}: " + p for p in problems]

    got_x, got_w, got_src = recv_x[:n], recv_w[:n].reshape(n), recv_src[:n].reshape(n).to(torch.int64)
    if not ordered:
        got_x, got_w, got_src = _sort_within_groups(layout, rank, got_x, got_w, got_src)
    exp_src = expected.recv_src.to(torch.int64)
    bad_x = (_bits(got_x) != _bits(expected.recv_x)).any(dim=1)
    bad_w = _bits(got_w) != _bits(expected.recv_w)
    bad_src = got_src != exp_src
    bad = bad_x | bad_w | bad_src
    if not bool(bad.any()):
        return []

    i = int(torch.nonzero(bad)[0])
    k_total = layout.topk
    s, t, k = unpack_source(int(exp_src[i]), max_tokens, k_total)
    e = int(topk_idx[s][t, k])
    where = (
        f"(source rank {s}, token {t}, k {k}, expert {e}, dest rank {rank}, slot {i}"
        + ("" if ordered else ", after sorting within its (local expert, source) group")
        + ")"
    )
    fields = []
    if bool(bad_x[i]):
        col = int(torch.nonzero(_bits(got_x[i]) != _bits(expected.recv_x[i]))[0])
        fields.append(
            f"field recv_x differs: expected {_fmt(expected.recv_x[i, col])}, got {_fmt(got_x[i, col])} "
            f"at column {col}"
        )
    if bool(bad_w[i]):
        fields.append(f"field recv_w differs: expected {_fmt(expected.recv_w[i])}, got {_fmt(got_w[i])}")
    if bool(bad_src[i]):
        gs, gt, gk = unpack_source(int(got_src[i]), max_tokens, k_total)
        fields.append(
            f"field recv_src differs: expected {int(exp_src[i])} (rank {s}, token {t}, k {k}), "
            f"got {int(got_src[i])} (rank {gs}, token {gt}, k {gk})"
        )
    n_bad = int(bad.sum())
    more = f" [{n_bad} of {n} rows differ on dest rank {rank}]"
    return [f"{where}: " + "; ".join(fields) + more]


def check_dispatch(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    recv_x: Tensor,
    recv_w: Tensor,
    recv_src: Tensor,
    *,
    max_tokens: int,
    num_experts: int,
    local_world_size: int,
    ordered: bool = True,
    require_coverage: bool = True,
    group: Any = None,
) -> CheckResult:
    """Check this rank's dispatch receive buffers bit for bit against the reference (collective).

    Every rank of ``group`` must call it with its own tensors.

    Args:
        x: [T, H] this rank's input tokens (bf16 / fp16 / fp32; any device).
        topk_idx: [T, K] int64 or int32 in [-1, E), this rank's routing.
        topk_weights: [T, K] float32.
        recv_x: [C, H] this rank's received rows, C >= rows received (the tail is ignored).
        recv_w: [C] float32 received weights.
        recv_src: [C] int32 received source tags (see reference.pack_source).
        max_tokens: M, the most tokens per rank the buffers were built for (tags depend on it).
        num_experts: E.
        local_world_size: L, ranks per (possibly virtual) node, for the route classes.
        ordered: True: the deterministic layout exactly. False (atomic slot allocation): each (local
            expert, source) group must hold the right rows in any order (compared after sorting each
            group by recv_src).
        require_coverage: fail unless every route class possible for (R, L) has at least one pair.
        group: the process group (None: the default group, or a world of 1 if none is initialised).

    Returns:
        A :class:`CheckResult` with the verdict reduced over all ranks.
    """

    def compare(gathered: list[tuple], layout: Layout, rank: int) -> list[str]:
        idxs, xs, ws = ([g[i] for g in gathered] for i in range(3))
        expected = reference_dispatch_rank(xs, idxs, ws, layout, max_tokens, rank)
        return _compare_dispatch(
            layout, expected, _cpu(recv_x), _cpu(recv_w), _cpu(recv_src), idxs, max_tokens, rank, ordered
        )

    local = (_cpu(topk_idx), _cpu(x), _cpu(topk_weights))
    error = "dest rank {rank}: error while checking dispatch"
    return _check_against_layout(
        local, compare, error, num_experts, local_world_size, require_coverage, group
    )


# --------------------------------------------------------------------------------------------
# Capacity (which pairs a dispatch with a capacity factor dropped)
# --------------------------------------------------------------------------------------------


def check_capacity_drops(
    topk_idx: Tensor,
    scatter: Tensor,
    dropped: Tensor,
    *,
    num_experts: int,
    expert_capacity: int,
    ordered: bool = True,
    group: Any = None,
) -> tuple[CheckResult, Tensor]:
    """Check a dispatch's capacity drops and return this rank's routing after them (collective).

    Every rank of ``group`` must call it with its own tensors. The rule (cute_ep.capacity): each
    expert keeps its first ``expert_capacity`` pairs, sources in rank order, each source's in (t, k)
    order. Checked: the per-expert drop counts the buffer reported equal the rule's (the same on every
    rank); ordered (scatter mode): exactly the rule's pairs were dropped (slot -1); not ordered (atomic
    mode, which may keep other pairs of a source): each (expert, source) kept as many pairs.

    Args:
        topk_idx: [T, K] int32/int64 in [-1, E), this rank's routing (the dispatch's input).
        scatter: [T, K] integer, the handle's slots (-1: not sent).
        dropped: [E] integer, rows dropped per global expert as the buffer reported them
            (``buffer.dropped_rows()``).
        num_experts: E. expert_capacity: ``cfg.expert_capacity``.
        ordered: True for scatter mode, False for atomic mode.
        group: the process group (None: the default group, or a world of 1).

    Returns:
        (result, effective): the verdict reduced over all ranks, and [T, K] routing (topk_idx's dtype
        and device) with every pair this dispatch dropped set to -1: pass it to check_layout,
        check_dispatch and check_combine in place of topk_idx.
    """
    from cute_ep.capacity import (
        apply_expert_capacity,
        check_atomic_drops,
        effective_topk_from_scatter,
    )

    rank, _ = world_of(group)
    idx_all = all_gather_objects(_cpu(topk_idx), group)
    msgs: list[str] = []
    effective = topk_idx
    actual = rule = None
    try:
        rule, expected = apply_expert_capacity(idx_all, num_experts, expert_capacity)
        got = _cpu(dropped).to(torch.int64).reshape(-1)
        if not torch.equal(got, expected):
            msgs.append(f"rank {rank}: dropped per expert {got.tolist()}, expected {expected.tolist()}")
        actual = effective_topk_from_scatter(_cpu(topk_idx), _cpu(scatter))
        if ordered:
            bad = actual != rule[rank].to(actual.dtype)
            if bool(bad.any()):
                t, k = (int(v) for v in torch.nonzero(bad)[0])
                kept = int(actual[t, k]) >= 0
                msgs.append(
                    f"rank {rank}: pair (t={t}, k={k}) to expert {int(topk_idx[t, k])} was "
                    f"{'kept' if kept else 'dropped'}, the rule {'drops' if kept else 'keeps'} it "
                    f"({int(bad.sum())} such pairs)"
                )
        effective = actual.to(device=topk_idx.device, dtype=topk_idx.dtype)
    except Exception as exc:  # every rank must still reach the collectives below
        msgs.append(f"rank {rank}: error while checking capacity drops: {type(exc).__name__}: {exc}")
    actual_all = all_gather_objects(actual, group)  # collective: every rank, even after an error
    if not ordered and rule is not None and all(a is not None for a in actual_all):
        msgs += [f"rank {rank}: {p}" for p in check_atomic_drops(actual_all, rule, num_experts)[:5]]
    return _finish(msgs, dict.fromkeys(ROUTE_CLASSES, 0), True, group), effective


# --------------------------------------------------------------------------------------------
# Layout (what check_dispatch / check_combine take on trust: counts, num_recv, handle slots)
# --------------------------------------------------------------------------------------------


def _layout_problems(gathered: list[tuple], layout: Layout, max_tokens: int, rank: int) -> list[str]:
    idx, _, tpe, num_recv, scatter = gathered[rank]
    el, topk = layout.experts_per_rank, layout.topk
    problems = []
    exp_tpe = layout.tokens_per_expert[rank]
    if tpe.dtype != torch.int32 or tuple(tpe.shape) != (el,):
        problems.append(
            f"rank {rank}: tokens_per_expert must be [{el}] int32, got {list(tpe.shape)} {tpe.dtype}"
        )
    elif not torch.equal(tpe.to(torch.int64), exp_tpe):
        local = int(torch.nonzero(tpe.to(torch.int64) != exp_tpe)[0])
        problems.append(
            f"rank {rank}: tokens_per_expert[{local}] (expert {rank * el + local}) is "
            f"{int(tpe[local])}, expected {int(exp_tpe[local])}"
        )
    exp_n = int(layout.num_recv[rank])
    if num_recv != exp_n:
        problems.append(f"rank {rank}: num_recv is {num_recv}, expected {exp_n}")

    t_count, k_count = idx.shape
    if scatter.dtype != torch.int32 or tuple(scatter.shape) != (t_count, k_count):
        problems.append(
            f"rank {rank}: handle.scatter must be [{t_count}, {k_count}] int32, got "
            f"{list(scatter.shape)} {scatter.dtype}"
        )
        return problems
    ids = idx.to(torch.int64)
    slots = scatter.to(torch.int64)
    dropped = (ids < 0) & (slots != -1)
    if bool(dropped.any()):
        t, k = (int(v) for v in torch.nonzero(dropped)[0])
        problems.append(
            f"rank {rank}: handle.scatter[{t}, {k}] is {int(slots[t, k])} for a dropped pair, expected -1"
        )
    owner = torch.div(ids, el, rounding_mode="floor")
    for d in range(layout.world_size):
        mask = (ids >= 0) & (owner == d)
        if not bool(mask.any()):
            continue
        pairs = torch.nonzero(mask)  # [P, 2] (t, k), row-major
        sl = slots[mask]
        recv_src = gathered[d][1].to(torch.int64)
        out_of_range = (sl < 0) | (sl >= recv_src.numel())
        want = pack_source(rank, pairs[:, 0], pairs[:, 1], max_tokens, topk).to(torch.int64)
        if recv_src.numel() == 0:  # nothing arrived: every slot is out of range (no indexing)
            found = torch.full_like(sl, -1)
        else:
            found = torch.where(
                out_of_range, torch.full_like(sl, -1), recv_src[sl.clamp(0, recv_src.numel() - 1)]
            )
        bad = out_of_range | (found != want)
        if not bool(bad.any()):
            continue
        i = int(torch.nonzero(bad)[0])
        t, k = int(pairs[i, 0]), int(pairs[i, 1])
        head = (
            f"rank {rank}: handle.scatter[{t}, {k}] = {int(sl[i])} (expert {int(ids[t, k])}, dest rank {d})"
        )
        if bool(out_of_range[i]):
            problems.append(f"{head} is outside dest rank {d}'s {recv_src.numel()} received rows")
        else:
            s2, t2, k2 = unpack_source(int(found[i]), max_tokens, topk)
            problems.append(
                f"{head} holds the row of (rank {s2}, token {t2}, k {k2}), "
                f"not (rank {rank}, token {t}, k {k}) [{int(bad.sum())} such slots]"
            )
    return problems


def check_layout(
    res: Any,
    topk_idx: Tensor,
    *,
    max_tokens: int,
    num_experts: int,
    local_world_size: int,
    group: Any = None,
) -> CheckResult:
    """Check this rank's dispatch layout against the reference (collective).

    tokens_per_expert and num_recv must equal the reference's, and every slot of the handle must hold
    its (t, k) pair: the slots are checked against the owners' recv_src (all-gathered), so the check
    holds in atomic mode too; with a dispatch that passed check_dispatch in scatter (ordered) mode it
    also means the slots are the deterministic layout's. check_dispatch and check_combine take these
    on trust. Every rank of ``group`` must call it with its own dispatch result. Coverage never fails
    this check (it is reported in ``coverage_ok`` only).

    Args:
        res: this rank's dispatch result (an ``EpBuffer`` / ``ReferenceEpBuffer`` DispatchResult, or
            anything with the same attributes; any device):
            ``recv_src``: [>= num_recv] int32 received source tags (see reference.pack_source);
            ``tokens_per_expert``: [El] int32 rows received per local expert, El = E // R;
            ``num_recv``: int, rows received;
            ``handle.scatter``: [T, K] int32, the slot of each (t, k) on its owner, -1 for dropped pairs.
        topk_idx: [T, K] int64 or int32 in [-1, E), this rank's routing (the dispatch's input).
        max_tokens: M, the most tokens per rank the buffers were built for (tags depend on it).
        num_experts: E.
        local_world_size: L, ranks per (possibly virtual) node, for the route classes.
        group: the process group (None: the default group, or a world of 1 if none is initialised).

    Returns:
        A :class:`CheckResult` with the verdict reduced over all ranks.
    """
    local = (
        _cpu(topk_idx),
        _cpu(res.recv_src),
        _cpu(res.tokens_per_expert),
        int(res.num_recv),
        _cpu(res.handle.scatter),
    )

    def compare(gathered: list[tuple], layout: Layout, rank: int) -> list[str]:
        return _layout_problems(gathered, layout, max_tokens, rank)

    # Coverage never fails this check (require_coverage False): it is only reported.
    error = "rank {rank}: error while checking the layout"
    return _check_against_layout(local, compare, error, num_experts, local_world_size, False, group)


# --------------------------------------------------------------------------------------------
# Combine
# --------------------------------------------------------------------------------------------


def check_combine(
    out: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    recv_y: Tensor,
    *,
    local_world_size: int,
    num_experts: int,
    scatter: Tensor | None = None,
    atol: float = 0.0,
    require_coverage: bool = True,
    group: Any = None,
    algorithm: str = "pull",
) -> CheckResult:
    """Check this rank's combine output against the reference (collective).

    Every rank of ``group`` must call it with its own tensors.

    Args:
        out: [T, H] this rank's combine output, in recv_y's dtype.
        topk_idx: [T, K] int64 or int32 in [-1, E), this rank's routing.
        topk_weights: [T, K] float32.
        recv_y: [N, H] this rank's expert outputs, the rows the combine read (N >= rows received).
        local_world_size: L, ranks per (possibly virtual) node, for the route classes.
        num_experts: E.
        scatter: optional [T, K] integer: the slot each (t, k) was written to on its owner (e.g. an
            atomic-mode kernel's slots); default: the reference layout's.
        atol: 0.0 compares bits; > 0 allows |expected - got| <= atol (NaN never passes).
        require_coverage: fail unless every route class possible for (R, L) has at least one pair.
        group: the process group (None: the default group, or a world of 1 if none is initialised).
        algorithm: the combine that made ``out``: "pull" (``reference_combine``) or "reduced"
            (``reference_combine_reduced``: per-rank partial rows rounded to the row dtype).

    Returns:
        A :class:`CheckResult` with the verdict reduced over all ranks.
    """
    if algorithm not in COMBINE_REFERENCES:
        raise ValueError(f"algorithm must be 'pull' or 'reduced', got {algorithm!r}")

    def compare(gathered: list[tuple], layout: Layout, rank: int) -> list[str]:
        idx, weights, slots, _ = gathered[rank]
        slots = slots if slots is not None else layout.scatter[rank]
        ys = [g[3] for g in gathered]
        ref = COMBINE_REFERENCES[algorithm]
        expected = ref(ys, [idx], [weights], [slots], num_experts=num_experts)[0]
        return _compare_combine(expected, _cpu(out), idx, slots, layout, rank, atol)

    local = (_cpu(topk_idx), _cpu(topk_weights), _cpu(scatter), _cpu(recv_y))
    error = "rank {rank}: error while checking combine"
    return _check_against_layout(
        local, compare, error, num_experts, local_world_size, require_coverage, group
    )


def _compare_combine(
    expected: Tensor, out: Tensor, idx: Tensor, slots: Tensor, layout: Layout, rank: int, atol: float
) -> list[str]:
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return [
            f"rank {rank}: combine output must be {tuple(expected.shape)} of {expected.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        ]
    bad = _bits(out) != _bits(expected)
    if atol > 0:
        close = (out.float() - expected.float()).abs() <= atol  # False for NaN
        bad &= ~close
    if not bool(bad.any()):
        return []
    t, col = (int(v) for v in torch.nonzero(bad)[0])
    routes = []
    for k in range(idx.shape[1]):
        e = int(idx[t, k])
        if e < 0:
            routes.append(f"(k {k}, dropped)")
        else:
            routes.append(f"(k {k}, expert {e}, dest rank {int(layout.owner(e))}, slot {int(slots[t, k])})")
    n_bad = int(bad.sum())
    return [
        f"(rank {rank}, token {t}, column {col}): "
        f"expected {_fmt(expected[t, col])}, got {_fmt(out[t, col])}; "
        f"token routes: {', '.join(routes)} [{n_bad} of {bad.numel()} elements differ on rank {rank}]"
    ]


# --------------------------------------------------------------------------------------------
# Rank layout (dispatch(..., layout="rank") and its combine)
# --------------------------------------------------------------------------------------------


def _every_rank(
    x: Tensor | Sequence[Tensor],
    topk_idx: Tensor | Sequence[Tensor],
    topk_weights: Tensor | Sequence[Tensor],
    group: Any,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Every rank's (x, topk_idx, topk_weights) on the CPU, in rank order: all-gathered from this rank's
    tensors (collective), or taken as given when the caller already holds every rank's sequences."""
    given = [isinstance(v, Tensor) for v in (x, topk_idx, topk_weights)]
    if any(given) != all(given):
        raise TypeError("x, topk_idx and topk_weights must all be tensors (this rank's) or all sequences")
    if all(given):
        gathered = all_gather_objects((_cpu(x), _cpu(topk_idx), _cpu(topk_weights)), group)
        return [g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered]
    xs, idxs, ws = ([t.detach().cpu() for t in p] for p in (x, topk_idx, topk_weights))
    return xs, idxs, ws


def _rows_of(res: Any) -> int:
    """num_recv as an int, or 0 when even that is unreadable (for a count of wrong rows after an error)."""
    try:
        return max(int(res.num_recv), 0)
    except Exception:
        return 0


def _rank_field_problems(res: Any, expected: ExpectedRankRecv, got_n: int) -> list[str]:
    """Missing fields, wrong dtypes or row shapes, or fewer rows than the compare needs."""
    m = min(expected.num_recv, got_n)
    problems = []
    for name, want in (
        ("recv_x", expected.recv_x),
        ("recv_topk_idx", expected.recv_topk_idx),
        ("recv_topk_weights", expected.recv_topk_weights),
        ("recv_src", expected.recv_src),
    ):
        got = getattr(res, name, None)
        if got is None:
            problems.append(f"{name} is None (not a rank-layout result?)")
        elif got.dtype != want.dtype or tuple(got.shape[1:]) != tuple(want.shape[1:]) or got.shape[0] < m:
            problems.append(
                f"{name} must be [{m}{''.join(f', {d}' for d in want.shape[1:])}] of {want.dtype}, got "
                f"{tuple(got.shape)} {got.dtype}"
            )
    return problems


def _rank_counts_problems(res: Any, expected: ExpectedRankRecv, exp_scatter: Tensor, got_n: int) -> list[str]:
    """num_recv, tokens_per_expert and the handle (layout, the row of every (t, k) on its owner)."""
    problems = []
    if got_n != expected.num_recv:
        problems.append(f"num_recv is {got_n}, expected {expected.num_recv}")
    tpe, exp_tpe = _cpu(res.tokens_per_expert), expected.tokens_per_expert
    if tpe is None or tpe.dtype != exp_tpe.dtype or tpe.shape != exp_tpe.shape:
        got = "None" if tpe is None else f"{list(tpe.shape)} {tpe.dtype}"
        problems.append(f"tokens_per_expert must be {list(exp_tpe.shape)} {exp_tpe.dtype}, got {got}")
    elif not torch.equal(tpe, exp_tpe):
        local = int(torch.nonzero(tpe != exp_tpe)[0])
        problems.append(f"tokens_per_expert[{local}] is {int(tpe[local])}, expected {int(exp_tpe[local])}")
    handle = res.handle
    layout = getattr(handle, "layout", "expert")
    if layout != "rank":
        problems.append(f"handle.layout is {layout!r}, expected 'rank'")
    scatter = _cpu(handle.scatter)
    if scatter.dtype != torch.int32 or scatter.shape != exp_scatter.shape:
        problems.append(
            f"handle.scatter must be {list(exp_scatter.shape)} int32, got {list(scatter.shape)} "
            f"{scatter.dtype}"
        )
    else:
        bad = scatter.to(torch.int64) != exp_scatter.to(torch.int64)
        if bool(bad.any()):
            t, k = (int(v) for v in torch.nonzero(bad)[0])
            problems.append(
                f"handle.scatter[{t}, {k}] is {int(scatter[t, k])}, expected {int(exp_scatter[t, k])} "
                f"[{int(bad.sum())} such entries]"
            )
    return problems


def _row_any(bad: Tensor) -> Tensor:
    """[N] bool: rows of an [N] or [N, ...] bool tensor with any True (also for N = 0)."""
    return bad if bad.dim() == 1 else bad.flatten(1).any(dim=1)


def _packed_column(col: int, hidden: int) -> str:
    """Where byte ``col`` of a packed FP8 row (cute_ep.fp8's format) comes from."""
    if col < hidden:
        return f"byte {col} (recv_x column {col})"
    scale = (col - hidden) // 4
    if scale < hidden // FP8_BLOCK:
        return f"byte {col} (recv_scales column {scale})"
    return f"byte {col} (padding)"


def _compare_rank_dispatch(
    res: Any, expected: ExpectedRankRecv, exp_scatter: Tensor, rank: int, max_tokens: int,
    fp8_hidden: int | None = None,
) -> tuple[list[str], int]:
    """(problems, wrong rows) of this rank's rank-layout result. Rows have one order in this layout, so
    row i is compared with expected row i; a row is wrong if any bit of any field differs. ``fp8_hidden``:
    H when ``res.recv_x`` and ``expected.recv_x`` are packed FP8 rows (``_fp8_packed``), which the
    messages then name byte by byte."""
    n, got_n = expected.num_recv, int(res.num_recv)
    problems = _rank_counts_problems(res, expected, exp_scatter, got_n)
    fields = _rank_field_problems(res, expected, got_n)
    problems = [f"dest rank {rank}: {p}" for p in problems + fields]
    if fields:  # nothing row by row to trust
        return problems, max(n, got_n)
    m = min(n, got_n)
    got = {name: _cpu(getattr(res, name))[:m] for name in ("recv_x", "recv_topk_idx", "recv_topk_weights")}
    got["recv_src"] = _cpu(res.recv_src)[:m].reshape(m)
    want = {
        "recv_x": expected.recv_x[:m], "recv_topk_idx": expected.recv_topk_idx[:m],
        "recv_topk_weights": expected.recv_topk_weights[:m], "recv_src": expected.recv_src[:m],
    }  # fmt: skip
    # [m] per field: a row is wrong if any of its elements differs (recv_src has one per row).
    bad_by = {name: _row_any(_bits(got[name]) != _bits(want[name])) for name in got}
    bad = torch.zeros(m, dtype=torch.bool)
    for b in bad_by.values():
        bad |= b
    wrong = int(bad.sum()) + abs(n - got_n)  # every missing or extra row is wrong too
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        s, t = divmod(int(want["recv_src"][i]), max_tokens)
        diffs = []
        for name in ("recv_x", "recv_topk_weights"):
            if bool(bad_by[name][i]):
                col = int(torch.nonzero(_bits(got[name][i]) != _bits(want[name][i]))[0])
                where = f"column {col}" if name == "recv_x" else f"k {col}"
                if name == "recv_x" and fp8_hidden is not None:
                    where = f"packed FP8 {_packed_column(col, fp8_hidden)}"
                expect, found = _fmt(want[name][i, col]), _fmt(got[name][i, col])
                diffs.append(f"field {name} differs: expected {expect}, got {found} at {where}")
        if bool(bad_by["recv_topk_idx"][i]):
            diffs.append(
                f"field recv_topk_idx differs: expected {want['recv_topk_idx'][i].tolist()}, "
                f"got {got['recv_topk_idx'][i].tolist()}"
            )
        if bool(bad_by["recv_src"][i]):
            gs, gt = divmod(int(got["recv_src"][i]), max_tokens)
            diffs.append(
                f"field recv_src differs: expected {int(want['recv_src'][i])} (rank {s}, token {t}), "
                f"got {int(got['recv_src'][i])} (rank {gs}, token {gt})"
            )
        head = f"(source rank {s}, token {t}, dest rank {rank}, row {i})"
        problems.append(f"{head}: {'; '.join(diffs)} [{int(bad.sum())} of {m} rows differ]")
    return problems, wrong


# What the rank-layout compare reads of a result besides recv_x.
_RANK_RESULT_FIELDS = ("num_recv", "tokens_per_expert", "handle", "recv_topk_idx", "recv_topk_weights",
                       "recv_src")


def _fp8_packed(res: Any, row_bytes: int) -> SimpleNamespace:
    """An FP8 rank-layout result with recv_x replaced by its rows packed again with recv_scales ([rows,
    row_bytes] uint8 on the CPU: e4m3 values, fp32 scales, zero padding, as ``cute_ep.fp8.pack_fp8_rows``),
    every other field as it is: the rank-layout compare then checks values and scales byte for byte, as
    ``check_dispatch`` does the expert layout's packed rows. Raises ValueError for a missing or malformed
    recv_x / recv_scales (``check_rank_dispatch`` reports it)."""
    q, scales = _cpu(res.recv_x), _cpu(getattr(res, "recv_scales", None))
    if scales is None:
        raise ValueError("recv_scales is None after an FP8 dispatch")
    rows = min(q.shape[0], scales.shape[0])  # fewer rows than received: the field checks report it
    fields = {name: getattr(res, name, None) for name in _RANK_RESULT_FIELDS}
    return SimpleNamespace(**fields, recv_x=pack_fp8_rows(q[:rows], scales[:rows], row_bytes))


def check_rank_dispatch(
    res: Any,
    x: Tensor | Sequence[Tensor],
    topk_idx: Tensor | Sequence[Tensor],
    topk_weights: Tensor | Sequence[Tensor],
    *,
    max_tokens: int,
    num_experts: int,
    local_world_size: int,
    require_coverage: bool = True,
    fp8: bool = False,
    group: Any = None,
) -> CheckResult:
    """Check this rank's ``dispatch(..., layout="rank")`` result bit for bit (collective).

    Compared with ``reference_dispatch_rank_layout`` of every rank's inputs: recv_x, recv_topk_idx,
    recv_topk_weights and recv_src row by row (the layout has one order, in either mode), num_recv,
    tokens_per_expert, and the handle (layout "rank"; ``scatter`` the row of every (t, k) on its owner,
    -1 for -1 ids, as ``reference_rank_layout``). Every rank of ``group`` must call it with its own result.

    With ``fp8`` (a ``dispatch(..., fp8=True, layout="rank")`` result) the rows are compared as packed FP8
    rows, byte for byte, as the expert layout's FP8 check does: the received e4m3 ``recv_x`` and fp32
    ``recv_scales`` packed again (``cute_ep.fp8.pack_fp8_rows``) against every sender's rows quantized and
    packed by ``cute_ep.fp8`` (a message names the byte: a value, a scale or the padding).

    Args:
        res: this rank's rank-layout ``DispatchResult`` (any device; or anything with its attributes).
        x: [T, H] this rank's input rows (all-gathered), or every rank's, in rank order (no gather:
            e.g. recomputed from seeds).
        topk_idx: [T, K] int64 or int32 in [-1, E), the same kind as x (this rank's, or every rank's).
        topk_weights: [T, K] float32, the same kind as x.
        max_tokens: M, the most tokens per rank the buffers were built for (recv_src = s * M + t).
        num_experts: E.
        local_world_size: L, ranks per (possibly virtual) node, for the route classes.
        require_coverage: fail unless every route class possible for (R, L) has at least one pair.
        fp8: ``res`` is an FP8 dispatch's result (x still the senders' rows in their own dtype).
        group: the process group (None: the default group, or a world of 1 if none is initialised).

    Returns:
        A :class:`CheckResult` with the verdict reduced over all ranks; ``route_counts`` counts (t, k)
        pairs as the expert-layout checks do; ``wrong_rows`` this rank's wrong received rows.
    """
    rank, world = world_of(group)
    xs, idxs, ws = _every_rank(x, topk_idx, topk_weights, group)
    msgs: list[str] = []
    counts = dict.fromkeys(ROUTE_CLASSES, 0)
    coverage_ok = False
    wrong: int | None = None
    try:
        if len(idxs) != world:
            raise ValueError(f"got the inputs of {len(idxs)} ranks for a world of {world}")
        counts = route_counts_of(reference_layout(idxs, num_experts), local_world_size)
        coverage_ok, gate = _coverage_gate(counts, world, local_world_size, require_coverage)
        layout = reference_rank_layout(idxs, num_experts)
        fp8_hidden = None
        if fp8:  # what travels: each sender's rows quantized and packed (cute_ep.fp8)
            fp8_hidden = xs[0].shape[1]
            row_bytes = fp8_row_bytes(fp8_hidden)
            xs = [pack_fp8_rows(*quantize_fp8(v), row_bytes) for v in xs]
            res = _fp8_packed(res, row_bytes)
        expected = reference_dispatch_rank_layout(xs, idxs, ws, layout, max_tokens, rank)
        problems, wrong = _compare_rank_dispatch(res, expected, layout.scatter[rank], rank, max_tokens,
                                                 fp8_hidden)
        msgs += problems + gate
    except Exception as exc:  # every rank must still reach the verdict collective
        error = "error while checking the rank-layout dispatch"
        msgs.append(f"dest rank {rank}: {error}: {type(exc).__name__}: {exc}")
        wrong = max(_rows_of(res), 1)  # unreadable: every received row is wrong (at least one)
    return _finish(msgs, counts, coverage_ok, group, wrong_rows=wrong)


def _compare_rank_combine(
    expected: Tensor, out: Tensor, idx: Tensor, slots: Tensor, experts_per_rank: int, rank: int
) -> tuple[list[str], int]:
    """(problems, wrong output tokens) of this rank's rank-layout combine output."""
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return [
            f"rank {rank}: combine output must be {tuple(expected.shape)} of {expected.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        ], max(expected.shape[0], 1)
    bad = _bits(out) != _bits(expected)
    bad_tokens = bad.any(dim=1) if bad.dim() == 2 else bad
    if not bool(bad_tokens.any()):
        return [], 0
    t, col = (int(v) for v in torch.nonzero(bad)[0])
    rows = {}  # destination rank -> the token's row there, ascending (the order of the sum)
    for k in range(idx.shape[1]):
        e = int(idx[t, k])
        if e >= 0:
            rows.setdefault(e // experts_per_rank, int(slots[t, k]))
    where = ", ".join(f"rank {d} row {rows[d]}" for d in sorted(rows)) or "none"
    n_bad = int(bad_tokens.sum())
    values = f"expected {_fmt(expected[t, col])}, got {_fmt(out[t, col])}"
    return [
        f"(rank {rank}, token {t}, column {col}): {values}; token rows: {where} "
        f"[{n_bad} of {bad_tokens.numel()} tokens differ on rank {rank}]"
    ], n_bad


def check_rank_combine(
    out: Tensor,
    topk_idx: Tensor,
    scatter: Tensor,
    recv_y: Tensor,
    *,
    num_experts: int,
    local_world_size: int,
    require_coverage: bool = True,
    group: Any = None,
) -> CheckResult:
    """Check this rank's combine of a rank-layout handle bit for bit (collective).

    The reference is ``reference_combine_rank_layout`` of every rank's ``recv_y`` (all-gathered): a
    token's rows on its destination ranks summed in ascending rank order in fp32, one rounding, no
    weights. Every rank of ``group`` must call it with its own tensors.

    Args:
        out: [T, H] this rank's combine output, in recv_y's dtype.
        topk_idx: [T, K] int64 or int32 in [-1, E), this rank's routing (the handle's).
        scatter: [T, K] integer, the handle's rows (the row of token t on each destination rank).
        recv_y: [N, H] the rows this rank gave combine (one per received row; N >= rows received).
        num_experts: E.
        local_world_size: L, ranks per (possibly virtual) node, for the route classes.
        require_coverage: fail unless every route class possible for (R, L) has at least one pair.
        group: the process group (None: the default group, or a world of 1 if none is initialised).

    Returns:
        A :class:`CheckResult` with the verdict reduced over all ranks; ``wrong_rows`` this rank's output
        tokens that differ in any bit.
    """
    wrong: list[int] = []

    def compare(gathered: list[tuple], layout: Layout, rank: int) -> list[str]:
        idx, slots, _ = gathered[rank]
        ys = [g[2] for g in gathered]
        expected = reference_combine_rank_layout(ys, [idx], [slots], num_experts=num_experts)[0]
        problems, n_bad = _compare_rank_combine(
            expected, _cpu(out), idx, slots, layout.experts_per_rank, rank
        )
        wrong.append(n_bad)
        return problems

    local = (_cpu(topk_idx), _cpu(scatter), _cpu(recv_y))
    error = "rank {rank}: error while checking the rank-layout combine"
    result = _check_against_layout(
        local, compare, error, num_experts, local_world_size, require_coverage, group
    )
    # No count from compare: it raised (every token counts as wrong) or never ran (all right).
    result.wrong_rows = wrong[0] if wrong else (0 if result.local_passed else max(int(topk_idx.shape[0]), 1))
    return result


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def format_summary(result: CheckResult, name: str) -> str:
    """One readable line, e.g. "dispatch: PASS (pairs: self=10 same_node=12 ...)".

    Args:
        result: a :class:`CheckResult`.
        name: what was checked ("dispatch", "combine", ...).
    """
    verdict = "PASS" if result.passed else "FAIL"
    line = f"{name}: {verdict}"
    if any(result.route_counts.values()):  # checks that count no pairs (capacity) print none
        pairs = " ".join(f"{c}={result.route_counts.get(c, 0)}" for c in ROUTE_CLASSES)
        line += f" (pairs: {pairs})"
    if not result.coverage_ok:
        line += " [route coverage incomplete]"
    if not result.passed:
        line += f" -- {result.message}"
    return line


def report(result: CheckResult, name: str, group: Any, say: Callable[[str], None]) -> bool:
    """Print the check's line with ``say`` (e.g. ``cute_ep.tools.cli.Printer``: rank 0 only) and, if it
    failed, every failing rank's own message.

    Collective when the check failed (the verdict is the same on every rank). Returns result.passed.
    """
    say(format_summary(result, name))
    if not result.passed:  # the same on every rank, so the gather below is collective-safe
        messages = all_gather_objects(None if result.local_passed else result.message, group)
        for r, m in enumerate(messages):
            if m is not None:
                say(f"    rank {r}: {m}")
    return result.passed
