"""How a warp of the dispatch kernel (kernels/dispatch.py, whose docstring states the protocol) sends one
token: its row to each destination (``send_row_to_lanes``), and the pair records there, either for all
of a token's pairs at once from lanes (top-k <= 32: ``send_token_by_lanes`` in the expert layout,
``send_token_by_rank`` in the rank layout) or one pair at a time (``send_pair``, top-k > 32)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.config import ALGO_DEDUP, MODE_ATOMIC, VECTOR_BYTES, WARP
from cute_ep.kernels.rows import RowSpace, copy_row_to_lanes, element, row_space, row_view
from cute_ep.kernels.signals import stored_to


@cute.jit
def bound_for(p: EpParams, t: Int32, j: Int32, end: Int32, d: Int32, kept_only: Int32) -> Int32:
    """1 if token t's pair j (j < end) has an expert on rank d and, with ``kept_only``, a slot (it was
    not dropped for capacity); else 0. A lane's vote in the group scans of the dispatch kernel."""
    same = Int32(0)
    if j < end:
        e = p.topk_idx[t, j]
        if e >= 0:
            if e // p.experts_per_rank == d:
                same = Int32(1)
                if kept_only != 0:
                    if p.scatter[t, j] < 0:
                        same = Int32(0)
    return same


@cute.jit
def records_groups(p: EpParams, by_rank: cutlass.Constexpr) -> Int32:
    """1 if this dispatch lists each group's later members under its primary (``recv_group``, the primary's
    ``recv_from`` -1 - n). The expert layout does under dedup, whose fan-out (kernels/fanout.py) then copies
    a primary's row to its members from one load, and for the reduced combine, which sums a group on its
    rank; the rank layout only for its reduced combine."""
    groups = Int32(0)
    if p.combine_algo != 0:
        groups = Int32(1)
    if cutlass.const_expr(not by_rank):
        if p.algo == ALGO_DEDUP:
            groups = Int32(1)
    return groups


@cute.jit
def lists_members(p: EpParams, groups: Int32, d: Int32) -> Int32:
    """1 if a group bound for rank d has its later members listed under its primary: where the dispatch
    lists groups (``records_groups``), for a reduced combine every group, else (the fan-out's lists) only
    groups bound for other ranks, since this rank's own pairs receive their rows themselves."""
    lists = Int32(0)
    if groups != 0:
        lists = Int32(1)
        if p.combine_algo == 0:
            if d == p.rank:
                lists = Int32(0)
    return lists


# 128-bit pieces per lane in flight in the dispatch's row copies. With 8 (ROW_COPY_UNROLL) the dispatch
# kernels, 16 warps at 128 registers, spilled (ptxas: 248 / 308 bytes of spill stores in Dispatch /
# RankDispatch; ncu at 4096 tokens: 581,632 local-memory requests each); with 4 they use 122 / 128
# registers and spill nothing, and 16 warps x 4 pieces keep as many bytes in flight per SM as 8 x 8.
DISPATCH_ROW_UNROLL = 4


@cute.jit
def send_row_to_lanes(dtype: cutlass.Constexpr, p: EpParams, src_addr: Int64, d: Int32, slot: Int32,
                      sends: Int32, row_bytes: Int32, part, lane: Int32):
    """The warp moves ``part`` = (first byte, bytes) of one row (``row_bytes`` from ``src_addr``) into row
    ``slot`` of rank ``d``'s ``recv_x`` for each lane set in ``sends`` (each such lane holds its own d and
    slot; every lane calls this): ``send_row_into`` that buffer."""
    at, size = part
    send_row_into(dtype, p, row_space(p.recv_x, row_bytes).from_byte(at), src_addr + at, d, slot, sends, size,
                  lane)


@cute.jit
def send_row_into(dtype: cutlass.Constexpr, p: EpParams, dest: RowSpace, src_addr: Int64, d: Int32,
                  slot: Int32, sends: Int32, row_bytes: Int32, lane: Int32,
                  unroll: cutlass.Constexpr = DISPATCH_ROW_UNROLL):
    """The warp moves one row (``row_bytes`` from ``src_addr``) into row ``slot`` of rank ``d``'s copy of
    the symmetric rows ``dest`` for each lane set in ``sends`` (each such lane holds its own d and slot;
    every lane calls this): 128-bit stores through the peer pointers of this node, every destination from
    one load of each piece (ALGO_PUT_WARP: only to this rank itself), then ``put_warp`` to each destination
    on other nodes. ``unroll``: the pieces per lane in flight (``copy_row_to_lanes``)."""
    store = Int32(0)
    if ((sends >> lane) & 1) != 0:
        store = stored_to(p, d)
    stores = Int32(cute.arch.vote_ballot_sync(store != 0))
    dst = Int64(0)
    if store != 0:
        dst = dest.on_peer(d).row(slot)
    copy_row_to_lanes(dtype, src_addr, dst, stores, row_bytes // VECTOR_BYTES, lane, unroll)
    n = row_bytes // (dtype.width // 8)
    puts = sends & ~stores
    for _ in range(cute.arch.popc(puts)):
        j = Int32(cute.arch.clz(cute.arch.brev(puts)))  # the lowest destination left
        puts = puts & (puts - 1)
        dj = cute.arch.shuffle_sync(d, j)
        row = cute.arch.shuffle_sync(slot, j)
        nvshmem_cute.put_warp(row_view(dtype, dest.row(row), n),
                              row_view(dtype, src_addr, n), dj)


@cute.jit
def send_row(dtype: cutlass.Constexpr, p: EpParams, src_addr: Int64, d: Int32, slot: Int32, row_bytes: Int32,
             lane: Int32):
    """``send_row_to_lanes`` of the whole row to one destination (``d``, ``slot`` the same in every lane)."""
    send_row_to_lanes(dtype, p, src_addr, d, slot, Int32(1), row_bytes, (Int64(0), row_bytes), lane)


@cute.jit
def pair_in_lane(p: EpParams, t: Int32, lane: Int32, mode: Int32):
    """Token t's pair ``lane`` (K <= 32 lanes hold a token): (expert, slot, weight, destination rank), with
    -1 / -1 / 0.0 / -1 past K or without an expert. The slot is the layout's (-1: dropped for capacity),
    or in MODE_ATOMIC taken now from the expert's cursor (and written back into ``scatter``)."""
    e = Int32(-1)
    slot = Int32(-1)
    w = Float32(0.0)
    if lane < p.topk:
        e = p.topk_idx[t, lane]
        w = p.topk_w[t, lane]
        if mode == MODE_ATOMIC:
            if e >= 0:
                slot = cute.arch.atomic_add(p.cursor.iterator + e, Int32(1))
                if slot >= p.send_limit[e]:
                    slot = Int32(-1)  # beyond the expert's capacity: dropped
            p.scatter[t, lane] = slot
        else:
            slot = p.scatter[t, lane]  # -1: dropped by the layout (capacity)
    d = Int32(-1)
    if e >= 0:
        d = e // p.experts_per_rank
    return e, slot, w, d


@cute.jit
def send_token_by_lanes(dtype: cutlass.Constexpr, p: EpParams, t: Int32, k_begin: Int32, k_end: Int32, pair,
                        src_addr: Int64, row_bytes: Int32, part, lane: Int32):
    """Expert layout with K <= 32: lane j holds the token's pair j (``pair``: ``pair_in_lane``, loaded
    once, and in atomic mode every pair's slot taken at once, the token's experts being distinct). Each pair's
    group (the token's pairs bound for its rank) is one ``match_sync``; its primary (the group's first
    kept pair) the lowest bit of the group's kept lanes. Of the pairs [k_begin, k_end), each kept pair's
    lane writes its weight, source tag and from-slot (with ``groups`` the later members enter their
    primary's list; only with the row's first part), then ``part`` = (first byte, bytes) of the row goes
    in one copy to every pair that receives it (all kept pairs, or under dedup the primaries and the
    pairs of this rank)."""
    K, M, rank = p.topk, p.max_tokens, p.rank
    e, slot, w, d = pair
    lt = Int32(cute.arch.lanemask_lt())
    valid = Int32(cute.arch.vote_ballot_sync(d >= 0))
    kept = Int32(cute.arch.vote_ballot_sync(slot >= 0))
    same = Int32(cute.arch.match_sync(cute.arch.FULL_MASK, d))  # lanes bound for the same rank
    group = same & valid  # this pair's group, dropped pairs too (0 without an expert)
    g = Int32(cute.arch.clz(cute.arch.brev(same & kept)))  # the primary's lane (32: none kept)
    if g >= WARP:
        g = lane
    slot_g = cute.arch.shuffle_sync(slot, g)
    mine = Int32(0)
    if lane >= k_begin:
        if lane < k_end:
            mine = Int32(1)
    receives = Int32(0)  # this pair's row arrives itself (else its receiver fans it out)
    if slot >= 0:
        receives = Int32(1)
        if p.algo == ALGO_DEDUP:
            if d != rank:
                if g != lane:
                    receives = Int32(0)
    sends = Int32(cute.arch.vote_ballot_sync(receives * mine != 0))
    at, _ = part
    if at != 0:
        mine = Int32(0)  # the records go with the row's first part
    groups = records_groups(p, False)
    # The pair records before the row: the row's copy then needs only d and slot in registers.
    if mine != 0:
        if slot >= 0:
            from_slot = Int32(-1)
            if receives == 0:
                from_slot = slot_g
            if groups != 0:
                if g == lane:
                    from_slot = Int32(-1) - cute.arch.popc(group & ~lt)  # a primary: its group from here on
            nvshmem_cute.p(element(p.recv_w, slot), w, d)
            nvshmem_cute.p(element(p.recv_src, slot), (rank * M + t) * K + lane, d)
            nvshmem_cute.p(element(p.recv_from, slot), from_slot, d)
        if lists_members(p, groups, d) != 0:
            if d >= 0:
                if g < lane:
                    # A later member (or a dropped pair: -1) enters the primary's list at its place: the
                    # group's pairs in [g, lane).
                    m = cute.arch.popc(group & lt & ~((Int32(1) << g) - Int32(1)))
                    nvshmem_cute.p(element(p.recv_group, (slot_g, m)), slot, d)
    send_row_to_lanes(dtype, p, src_addr, d, slot, sends, row_bytes, part, lane)


@cute.jit
def send_token_by_rank(dtype: cutlass.Constexpr, p: EpParams, t: Int32, k_begin: Int32, k_end: Int32, pair,
                       src_addr: Int64, row_bytes: Int32, part, lane: Int32):
    """Rank layout with K <= 32: lane j holds the token's pair j (``pair``: ``pair_in_lane`` in scatter
    mode, one order in this layout: its rank and its row there, loaded once);
    the primaries (a rank's first pair, ``match_sync``) among pairs [k_begin, k_end) each send, from lanes
    j < K, the token's ids and weights masked to that rank's experts (with the row's first part only),
    and ``part`` = (first byte, bytes) of the row."""
    K, El = p.topk, p.experts_per_rank
    e, slot, w, d = pair
    same = Int32(cute.arch.match_sync(cute.arch.FULL_MASK, d))  # lanes bound for the same rank
    lead = Int32(0)
    if d >= 0:
        if slot >= 0:
            if (same & Int32(cute.arch.lanemask_lt())) == 0:
                if lane >= k_begin:
                    if lane < k_end:
                        lead = Int32(1)
    sends = Int32(cute.arch.vote_ballot_sync(lead != 0))
    # The records before the row: the row's copy then needs only d and slot in registers.
    at, _ = part
    left = sends
    if at != 0:
        left = Int32(0)  # the records go with the row's first part
    for _ in range(cute.arch.popc(left)):
        j = Int32(cute.arch.clz(cute.arch.brev(left)))  # the lowest primary left
        left = left & (left - 1)
        dj = cute.arch.shuffle_sync(d, j)
        row = cute.arch.shuffle_sync(slot, j)
        if lane < K:
            local = Int32(-1)
            wj = Float32(0.0)
            if d == dj:
                local = e - dj * El
                wj = w
            nvshmem_cute.p(element(p.recv_topk_idx, (row, lane)), local, dj)
            nvshmem_cute.p(element(p.recv_topk_w, (row, lane)), wj, dj)
        if lane == 0:
            nvshmem_cute.p(element(p.recv_src, row), p.rank * p.max_tokens + t, dj)
    send_row_to_lanes(dtype, p, src_addr, d, slot, sends, row_bytes, part, lane)  # one load for every rank


@cute.jit
def pair_slot(p: EpParams, t: Int32, k: Int32, e: Int32, lane: Int32) -> Int32:
    """Token t's pair k (expert ``e`` >= 0), every lane: its slot, the layout's (-1: dropped for capacity),
    or in MODE_ATOMIC taken now by lane 0 from the expert's cursor and written back into ``scatter``."""
    slot = Int32(-1)
    if p.mode == MODE_ATOMIC:
        got = Int32(0)
        if lane == 0:
            got = cute.arch.atomic_add(p.cursor.iterator + e, Int32(1))
            if got >= p.send_limit[e]:
                got = Int32(-1)  # beyond the expert's capacity: dropped
            p.scatter[t, k] = got
        slot = cute.arch.shuffle_sync(got, 0)
        cute.arch.sync_warp()  # the vote of a later k reads this scatter entry
    else:
        slot = p.scatter[t, k]  # -1: dropped by the layout (capacity)
    return slot


@cute.jit
def pair_group(p: EpParams, t: Int32, k: Int32, d: Int32, slot: Int32, groups: Int32, lane: Int32,
               by_rank: cutlass.Constexpr):
    """The group of (t, d) for token t's pair k (rank d, ``slot``): token t's pairs bound for rank d,
    ascending k. Returns (g, m, n): its primary g, the first kept pair (dedup sends the row only there, and
    the reduced combine sums the group on rank d into one partial row); k's place m in the group (pairs
    bound for d in [g, k), dropped ones too); and for a primary its group size n (pairs bound for d in
    [k, K)). m and n are counted only where the dispatch lists groups (``groups``: ``records_groups``)."""
    g = k
    vote = Int32(0)
    if slot >= 0:
        if p.algo == ALGO_DEDUP:
            vote = Int32(1)
        if cutlass.const_expr(by_rank):
            vote = Int32(1)
    if groups != 0:
        vote = Int32(1)
    if vote != 0:
        # The first kept k' < k bound for the same rank, if any; lanes split the k'.
        for j0 in range(0, k, WARP):
            kept = bound_for(p, t, j0 + lane, k, d, Int32(1))
            ballot = cute.arch.vote_ballot_sync(kept != 0)
            if g == k:
                if ballot != 0:
                    g = j0 + Int32(cute.arch.clz(cute.arch.brev(ballot)))
    m = Int32(0)
    n = Int32(0)
    if groups != 0:
        lo = k
        hi = p.topk
        if g != k:
            lo = g
            hi = k
        cnt = Int32(0)
        for j0 in range(lo, hi, WARP):
            member = bound_for(p, t, j0 + lane, hi, d, Int32(0))
            cnt = cnt + Int32(cute.arch.popc(cute.arch.vote_ballot_sync(member != 0)))
        if g != k:
            m = cnt
        else:
            n = cnt
    return g, m, n


@cute.jit
def send_token_ids_to_rank(p: EpParams, t: Int32, d: Int32, row: Int32, lane: Int32):
    """Rank layout, K > 32: the token's ids and weights into its ``row`` on rank d, those of other ranks'
    experts masked (-1, weight 0), lanes splitting the K; lane 0 writes its source tag."""
    K, El = p.topk, p.experts_per_rank
    for j in range(lane, K, WARP):
        ej = p.topk_idx[t, j]
        local = Int32(-1)
        wj = Float32(0.0)
        if ej >= 0:
            if ej // El == d:
                local = ej - d * El
                wj = p.topk_w[t, j]
        nvshmem_cute.p(element(p.recv_topk_idx, (row, j)), local, d)
        nvshmem_cute.p(element(p.recv_topk_w, (row, j)), wj, d)
    if lane == 0:
        nvshmem_cute.p(element(p.recv_src, row), p.rank * p.max_tokens + t, d)


@cute.jit
def send_pair(dtype: cutlass.Constexpr, p: EpParams, t: Int32, k: Int32, src_addr: Int64, row_bytes: Int32,
              lane: Int32, by_rank: cutlass.Constexpr):
    """K > 32: token t's pair k, by the whole warp (lane 0 writes the pair's scalars). Its slot, its group
    (``pair_group``); the row goes to the slot if this pair sends it (every kept pair under the per-pair
    primitives and for this rank; under dedup, and always in the rank layout, only the group's primary);
    then its weight, source tag and from-slot (expert layout) or the token's masked ids (rank layout), and
    where groups are listed (``records_groups``) a later member's slot into its primary's list."""
    K, M, rank = p.topk, p.max_tokens, p.rank
    e = p.topk_idx[t, k]
    if e >= 0:
        d = e // p.experts_per_rank
        slot = pair_slot(p, t, k, e, lane)
        groups = records_groups(p, by_rank)
        g, m, n = pair_group(p, t, k, d, slot, groups, lane, by_rank)
        if slot >= 0:
            first = g
            if p.algo != ALGO_DEDUP:
                first = k
            if d == rank:
                first = k
            if cutlass.const_expr(by_rank):
                first = g  # the rank layout has one row per (token, rank), whoever sends it
            if first == k:
                send_row(dtype, p, src_addr, d, slot, row_bytes, lane)
            if cutlass.const_expr(by_rank):
                if first == k:
                    send_token_ids_to_rank(p, t, d, slot, lane)
            if lane == 0:
                if cutlass.const_expr(not by_rank):
                    from_slot = Int32(-1)
                    if first != k:
                        from_slot = p.scatter[t, first]  # atomic mode: written above by this lane
                    if groups != 0:
                        if g == k:
                            from_slot = Int32(-1) - n  # a primary: <= -2 encodes its group size
                    nvshmem_cute.p(element(p.recv_w, slot), p.topk_w[t, k], d)
                    nvshmem_cute.p(element(p.recv_src, slot), (rank * M + t) * K + k, d)
                    nvshmem_cute.p(element(p.recv_from, slot), from_slot, d)
        if lists_members(p, groups, d) != 0:
            if g != k:
                if lane == 0:
                    # A later member (or a dropped pair: -1) enters the primary's list.
                    nvshmem_cute.p(element(p.recv_group, (p.scatter[t, g], m)), slot, d)
