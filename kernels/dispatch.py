"""Dispatch kernel: every (token, k) row goes to the rank that owns expert topk_idx[t, k].

Each CTA sends the contiguous range of tokens ``cta_tokens`` gives it (the layout's CTAs count and
place the same ranges), a warp per token (with fewer tokens than warps in the CTA, in scatter mode
without FP8, a warp per (token, k) pair). For each k: skip -1; find the slot (precomputed
``scatter`` in MODE_SCATTER, or an atomic add on this rank's per-expert cursor in MODE_ATOMIC, written
back into ``scatter`` for combine); ``p``-put the fp32 weight into ``recv_w[slot]``, the source tag
(rank * max_tokens + t) * K + k into ``recv_src[slot]`` and ``recv_from[slot]``. With K <= 32 lane k
holds pair k (``pair_in_lane``) and the lanes do this for all pairs at once (``send_token_by_lanes``);
larger K walks the pairs one at a time, lane 0 writing.

Rank de-duplication (``algo`` ALGO_DEDUP, the default primitive; ALGO_PER_PAIR and ALGO_PUT_WARP send
every pair's own row, see kernels.config): the row itself crosses the link once per destination RANK,
not once per k. Only
the first k of the token bound for a rank (its "primary" pair) sends the row, into its own slot, and
sets ``recv_from[slot] = -1``; every later k bound for the same rank sets ``recv_from[slot]`` to that
primary slot, and the receiver's fan-out kernel (kernels/fanout.py) copies the row locally. Pairs
bound for this rank itself are all written directly: there is no link to save, and the local writes
overlap the peers' transfers instead of adding fan-out reads after them. A same-node destination is
written with 128-bit stores through its NVSHMEM peer pointer (unrolled, see ``copy_row_warp``);
another node's with ``put_warp``.

Groups for the reduced combine (``groups`` != 0, when the buffer was built for it): the pairs of a
token bound for one rank form a group; its primary is the first kept pair. The primary's
``recv_from`` holds -1 - n (n: the group's pairs from the primary on, dropped ones included), and every
later pair writes its slot (-1 if dropped for capacity) into ``recv_group[primary slot * K + m]``, m its
place in the group. Without ``groups`` a primary's ``recv_from`` is -1.

Rank layout (``RankDispatchKernel``, kernels/rank_dispatch.py: this kernel compiled with ``by_rank``):
the slot of a pair is its token's row on the destination rank (one
per (token, rank), from the layout kernel); only the token's first pair for a rank sends the row there,
with ``recv_src`` = rank * max_tokens + t and the token's K ids and weights in ``recv_topk_idx`` /
``recv_topk_w`` (local expert ids; -1 and weight 0 for experts of other ranks). No fan-out follows.
With K <= 32 (``send_token_by_rank``) lane j holds pair j, loaded once per token, and the primaries are
found with one ``match_sync``; a lane per k with group votes of global loads before (kept for K > 32).

Layout folded in (``num_tokens <= layout_in_dispatch``, either receive layout): the module launches
no layout kernel; every CTA first runs the layout's steps for its own tokens (kernels/layout.py,
``LayoutKernel.route``: counts, the leader's count exchange and offsets, slots), then sends those tokens.
A CTA reads only slots it wrote itself, so no grid-wide wait follows the slots. One launch and one kernel
boundary less per dispatch.

Completion: each thread ``quiet``s its puts and fences its stores; the last CTA to finish (a
self-resetting arrival counter, ``done[DONE_DISPATCH]``) raises ``signals[SIGNAL_DISPATCH, rank]`` on
every peer to this call's epoch and waits until every peer has raised its own on this rank
(``signal_and_wait_peers``: at most ``timeout_ms`` per peer; a peer that never arrives is recorded in
``fault`` and the epoch is not advanced). So when the kernel ends
with its epoch advanced, this rank's receive buffer is complete, and everything later on the stream
may read it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import DONE_DISPATCH, INPUT_FAULT_RANKS, SIGNAL_DISPATCH, EpParams
from cute_ep.kernels.config import (
    ALGO_DEDUP,
    ALGO_PUT_WARP,
    MODE_ATOMIC,
    MODE_SCATTER,
    OP_DISPATCH,
    VECTOR_BYTES,
    WARP,
)
from cute_ep.kernels.layout import LayoutKernel, cta_tokens
from cute_ep.kernels.ptx import fence_sys, ld_volatile_i32
from cute_ep.kernels.quantize import quantize_row_warp
from cute_ep.kernels.rank_layout import RankLayoutKernel
from cute_ep.kernels.rows import copy_row_to_lanes, element, element_addr, row_space, row_view
from cute_ep.kernels.signals import fault_free, last_cta_arrives, signal_and_wait_peers


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


# 128-bit pieces per lane in flight in the dispatch's row copies. With 8 (ROW_COPY_UNROLL) the dispatch
# kernels, 16 warps at 128 registers, spilled (ptxas: 248 / 308 bytes of spill stores in Dispatch /
# RankDispatch; ncu at 4096 tokens: 581,632 local-memory requests each); with 4 they use 122 / 128
# registers and spill nothing, and 16 warps x 4 pieces keep as many bytes in flight per SM as 8 x 8.
DISPATCH_ROW_UNROLL = 4


@cute.jit
def send_row_to_lanes(dtype: cutlass.Constexpr, p: EpParams, src_addr: Int64, d: Int32, slot: Int32,
                      sends: Int32, row_bytes: Int32, lane: Int32):
    """The warp moves one row (``row_bytes`` from ``src_addr``) into row ``slot`` of rank ``d``'s
    ``recv_x`` for each lane set in ``sends`` (each such lane holds its own d and slot; every lane calls
    this): 128-bit stores through the peer pointers of this node, every destination from one load of each
    piece (ALGO_PUT_WARP: only to this rank itself), then ``put_warp`` to each destination on other nodes."""
    recv_x = row_space(p.recv_x, row_bytes)
    store = Int32(0)
    if ((sends >> lane) & 1) != 0:
        if d // p.local_world_size == p.rank // p.local_world_size:
            store = Int32(1)
            if p.algo == ALGO_PUT_WARP:
                if d != p.rank:
                    store = Int32(0)
    stores = Int32(cute.arch.vote_ballot_sync(store != 0))
    dst = Int64(0)
    if store != 0:
        dst = recv_x.on_peer(d).row(slot)
    copy_row_to_lanes(dtype, src_addr, dst, stores, row_bytes // VECTOR_BYTES, lane, DISPATCH_ROW_UNROLL)
    n = row_bytes // (dtype.width // 8)
    puts = sends & ~stores
    for _ in range(cute.arch.popc(puts)):
        j = Int32(cute.arch.clz(cute.arch.brev(puts)))  # the lowest destination left
        puts = puts & (puts - 1)
        dj = cute.arch.shuffle_sync(d, j)
        row = cute.arch.shuffle_sync(slot, j)
        nvshmem_cute.put_warp(row_view(dtype, recv_x.row(row), n),
                              row_view(dtype, src_addr, n), dj)


@cute.jit
def send_row(dtype: cutlass.Constexpr, p: EpParams, src_addr: Int64, d: Int32, slot: Int32, row_bytes: Int32,
             lane: Int32):
    """``send_row_to_lanes`` for one destination (``d`` and ``slot`` the same in every lane)."""
    send_row_to_lanes(dtype, p, src_addr, d, slot, Int32(1), row_bytes, lane)


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
def send_token_by_lanes(dtype: cutlass.Constexpr, p: EpParams, t: Int32, k_begin: Int32, k_end: Int32,
                        src_addr: Int64, row_bytes: Int32, lane: Int32):
    """Expert layout with K <= 32: lane j holds the token's pair j (expert, slot, weight: loaded once, and
    in atomic mode every pair's slot taken at once, the token's experts being distinct). Each pair's
    group (the token's pairs bound for its rank) is one ``match_sync``; its primary (the group's first
    kept pair) the lowest bit of the group's kept lanes. Of the pairs [k_begin, k_end), the row goes in
    one copy to every pair that receives it (all kept pairs, or under dedup the primaries and the pairs of
    this rank), and each kept pair's lane writes its weight, source tag and from-slot; with ``groups`` the
    later members enter their primary's list."""
    K, M, rank = p.topk, p.max_tokens, p.rank
    e, slot, w, d = pair_in_lane(p, t, lane, p.mode)
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
    send_row_to_lanes(dtype, p, src_addr, d, slot, sends, row_bytes, lane)
    if mine != 0:
        if slot >= 0:
            from_slot = Int32(-1)
            if receives == 0:
                from_slot = slot_g
            if p.combine_algo != 0:
                if g == lane:
                    from_slot = Int32(-1) - cute.arch.popc(group & ~lt)  # a primary: its group from here on
            nvshmem_cute.p(element(p.recv_w, slot), w, d)
            nvshmem_cute.p(element(p.recv_src, slot), (rank * M + t) * K + lane, d)
            nvshmem_cute.p(element(p.recv_from, slot), from_slot, d)
        if p.combine_algo != 0:
            if d >= 0:
                if g < lane:
                    # A later member (or a dropped pair: -1) enters the primary's list at its place: the
                    # group's pairs in [g, lane).
                    m = cute.arch.popc(group & lt & ~((Int32(1) << g) - Int32(1)))
                    nvshmem_cute.p(element(p.recv_group, (slot_g, m)), slot, d)


@cute.jit
def send_token_by_rank(dtype: cutlass.Constexpr, p: EpParams, t: Int32, k_begin: Int32, k_end: Int32,
                       src_addr: Int64, row_bytes: Int32, lane: Int32):
    """Rank layout with K <= 32: lane j holds the token's pair j (its rank and its row there, loaded once);
    the primaries (a rank's first pair, ``match_sync``) among pairs [k_begin, k_end) each send the row
    and, from lanes j < K, the token's ids and weights masked to that rank's experts."""
    K, El = p.topk, p.experts_per_rank
    e, slot, w, d = pair_in_lane(p, t, lane, Int32(MODE_SCATTER))  # one order in this layout
    same = Int32(cute.arch.match_sync(cute.arch.FULL_MASK, d))  # lanes bound for the same rank
    lead = Int32(0)
    if d >= 0:
        if slot >= 0:
            if (same & Int32(cute.arch.lanemask_lt())) == 0:
                if lane >= k_begin:
                    if lane < k_end:
                        lead = Int32(1)
    sends = Int32(cute.arch.vote_ballot_sync(lead != 0))
    send_row_to_lanes(dtype, p, src_addr, d, slot, sends, row_bytes, lane)  # one load for every rank
    for _ in range(cute.arch.popc(sends)):
        j = Int32(cute.arch.clz(cute.arch.brev(sends)))  # the lowest primary left
        sends = sends & (sends - 1)
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


@cute.jit
def mirror_status(p: EpParams, NT: cutlass.Constexpr):
    """The dispatch's last CTA (every thread; NT of them), after the call's status is final: the status
    block into ``status_mirror`` (pinned host memory), then ``mirror_seq`` into its last word. The host
    polls that word instead of copying the block and syncing the stream (a driver copy and a stream sync
    cost it 14 us on an idle H200). The status words were written by other CTAs: volatile loads."""
    tid, _, _ = cute.arch.thread_idx()
    W = p.status_words
    words = cute.make_tensor(cute.recast_ptr(p.epochs.iterator, dtype=Int32), cute.make_layout(W))
    mirror = p.status_mirror
    cute.arch.sync_threads()  # thread 0's epoch, above
    for i in range(tid, W, NT):
        mirror[i] = ld_volatile_i32(element_addr(words, i))
    fence_sys()  # each thread's words before the barrier, and so before thread 0's flag
    cute.arch.sync_threads()
    if tid == 0:
        mirror[W] = p.mirror_seq


class DispatchKernel(EpKernel):
    """The dispatch kernel (see the module docstring); every size is a run-time argument."""

    by_rank = False  # compile-time: the rank layout's variant (kernels/rank_dispatch.py) is compiled apart
    # 16 warps per SM: a warp's token waits on chains of small loads (its ids, slots, group votes) before
    # its rows move, and more warps per SM keep more rows in flight at a 24-SM budget. One CTA per SM by
    # design, so the hint lets ptxas use up to 128 registers. The layout's CTAs have the same shape, so
    # its steps run here unchanged when it is folded in.
    threads = LayoutKernel.threads
    ctas_per_sm = 1

    def __init__(self, dtype) -> None:
        super().__init__(dtype)
        # The layout's steps, run by every CTA of this launch up to ``layout_in_dispatch`` tokens.
        self.folded_layout = (RankLayoutKernel if self.by_rank else LayoutKernel)(dtype)

    @cute.kernel
    def kernel(self, p: EpParams):
        K, El, M, rank = p.topk, p.experts_per_rank, p.max_tokens, p.rank
        mode, algo = p.mode, p.algo
        groups = p.combine_algo  # a reduced-combine buffer: record each (token, rank) group
        by_rank = self.by_rank  # one row per (token, destination rank), at the layout's row
        topk_idx, scatter = p.topk_idx, p.scatter  # [T, K], [M, K]
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        dtype = p.x.element_type
        H = p.hidden
        # Bytes that travel per row: the row itself, or its packed FP8 form (kernels/quantize.py).
        row_bytes = H * (dtype.width // 8)
        if p.fp8 != 0:
            row_bytes = p.fp8_row_bytes

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        epoch = p.epochs[OP_DISPATCH] + Int64(1)
        x_rows = row_space(p.x, Int64(H) * (dtype.width // 8))
        packed_rows = row_space(p.packed, row_bytes)
        if p.num_tokens <= p.layout_in_dispatch:
            # The layout runs here, in every CTA for its own tokens, instead of in a kernel of its own (one
            # launch and one kernel boundary less on the critical path).
            self.folded_layout.route(p)
        # After a fault (a timed-out wait here or in the layout) this buffer moves no more data.
        t_first, t_end = cta_tokens(p.num_tokens, bid, NCTA)
        work = Int32(0)
        if fault_free(p.fault):
            # the layout refused invalid inputs (on any rank); written in this launch when folded in
            if ld_volatile_i32(element_addr(p.input_fault, INPUT_FAULT_RANKS)) == 0:
                work = t_end - t_first

        # Fewer tokens than warps (decode): a warp per (token, k) pair instead of per token, so that all
        # warps work. Only in scatter mode without FP8: there a pair needs nothing an earlier pair of
        # its token computes (slots are precomputed; atomic mode allocates them in k order, and FP8
        # quantizes each token once).
        split = Int32(0)
        if mode != MODE_ATOMIC:
            if p.fp8 == 0:
                if work < WPC:
                    split = Int32(1)
        items = work
        if split != 0:
            items = work * K
        for u in range(warp, items, WPC):
            t = t_first + u
            k_begin = Int32(0)
            k_end = K
            if split != 0:
                t = t_first + u // K
                k_begin = u % K
                k_end = k_begin + 1
            src_addr = x_rows.row(t)
            if p.fp8 != 0:
                # Quantize once per token; every destination gets the same packed bytes.
                dst = packed_rows.row(t)
                quantize_row_warp(dtype, src_addr, dst, H, row_bytes, lane)
                cute.arch.sync_warp()  # lanes copy bytes other lanes wrote
                src_addr = dst
            k_stop = k_end
            if K <= WARP:
                # a token's pairs in lanes, loaded once (the per-pair loop below then only for K > 32)
                if cutlass.const_expr(by_rank):
                    send_token_by_rank(dtype, p, t, k_begin, k_end, src_addr, row_bytes, lane)
                else:
                    send_token_by_lanes(dtype, p, t, k_begin, k_end, src_addr, row_bytes, lane)
                k_stop = k_begin
            for k in range(k_begin, k_stop):
                e = topk_idx[t, k]
                if e >= 0:
                    d = e // El
                    slot = Int32(-1)
                    if mode == MODE_ATOMIC:
                        got = Int32(0)
                        if lane == 0:
                            got = cute.arch.atomic_add(p.cursor.iterator + e, Int32(1))
                            if got >= p.send_limit[e]:
                                got = Int32(-1)  # beyond the expert's capacity: dropped
                            scatter[t, k] = got
                        slot = cute.arch.shuffle_sync(got, 0)
                        cute.arch.sync_warp()  # the vote of a later k reads this scatter entry
                    else:
                        slot = scatter[t, k]  # -1: dropped by the layout (capacity)
                    # The group of (t, d): token t's pairs bound for rank d, ascending k. Its primary g is
                    # the first kept one: dedup sends the row only there, and the reduced combine sums the
                    # group on rank d into one partial row (the lists below are written only for it).
                    g = k
                    vote = Int32(0)
                    if slot >= 0:
                        if algo == ALGO_DEDUP:
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
                    m = Int32(0)  # k's place in the group: pairs bound for d in [g, k), dropped ones too
                    n = Int32(0)  # the primary's group size: pairs bound for d in [k, K)
                    if groups != 0:
                        lo = k
                        hi = K
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
                    if slot >= 0:
                        # The per-pair primitives send every pair's row; rows for this rank are local
                        # writes (no fan-out needed).
                        first = g
                        if algo != ALGO_DEDUP:
                            first = k
                        if d == rank:
                            first = k
                        if cutlass.const_expr(by_rank):
                            first = g  # the rank layout has one row per (token, rank), whoever sends it
                        if first == k:
                            send_row(dtype, p, src_addr, d, slot, row_bytes, lane)
                        if cutlass.const_expr(by_rank):
                            if first == k:
                                # The token's ids and weights, those of other ranks' experts masked.
                                for j in range(lane, K, WARP):
                                    ej = topk_idx[t, j]
                                    local = Int32(-1)
                                    wj = Float32(0.0)
                                    if ej >= 0:
                                        if ej // El == d:
                                            local = ej - d * El
                                            wj = p.topk_w[t, j]
                                    nvshmem_cute.p(element(p.recv_topk_idx, (slot, j)), local, d)
                                    nvshmem_cute.p(element(p.recv_topk_w, (slot, j)), wj, d)
                                if lane == 0:
                                    nvshmem_cute.p(element(p.recv_src, slot), rank * M + t, d)
                        if lane == 0:
                            if cutlass.const_expr(not by_rank):
                                from_slot = Int32(-1)
                                if first != k:
                                    from_slot = scatter[t, first]  # atomic mode: written above by this lane
                                if groups != 0:
                                    if g == k:
                                        from_slot = Int32(-1) - n  # a primary: <= -2 encodes its group size
                                nvshmem_cute.p(element(p.recv_w, slot), p.topk_w[t, k], d)
                                nvshmem_cute.p(element(p.recv_src, slot), (rank * M + t) * K + k, d)
                                nvshmem_cute.p(element(p.recv_from, slot), from_slot, d)
                    if groups != 0:
                        if g != k:
                            if lane == 0:
                                # A later member (or a dropped pair: -1) enters the primary's list.
                                nvshmem_cute.p(element(p.recv_group, (scatter[t, g], m)), slot, d)
        nvshmem_cute.quiet()
        fence_sys()  # this thread's peer-pointer stores, before the CTA's arrival below

        # The last CTA to finish announces every CTA's rows to the peers, then waits for theirs.
        smem = cutlass.memory.SmemAllocator()
        last = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
        cute.arch.sync_threads()
        if tid == 0:
            last[0] = last_cta_arrives(p.done, DONE_DISPATCH)
        cute.arch.sync_threads()
        if last[0] != 0:
            signal_and_wait_peers(p, Int32(SIGNAL_DISPATCH), epoch, Int32(OP_DISPATCH), epoch, Int32(1))
            if tid == 0:
                if fault_free(p.fault):
                    p.epochs[OP_DISPATCH] = epoch
            if p.mirror_seq != 0:
                mirror_status(p, self.threads)
