"""Dispatch kernel: every (token, k) row goes to the rank that owns expert topk_idx[t, k].

Each CTA sends the contiguous range of tokens ``cta_tokens`` gives it (the layout's CTAs count and place the
same ranges), a warp per token; with fewer tokens than warps in the CTA, in scatter mode (FP8 only in the rank
layout with the layout folded in, where every token is cast while the counts travel), a token's row in parts
over the idle warps (``token_parts``: each part goes to every destination of the token, the first part carries
the pair records; top-k > 32: a warp per (token, k) pair). For each k: skip -1; find the slot (precomputed
``scatter`` in MODE_SCATTER, or an atomic add on this rank's per-expert cursor in MODE_ATOMIC, written back
into ``scatter`` for combine); ``p``-put the fp32 weight into ``recv_w[slot]``, the source tag (rank *
max_tokens + t) * K + k into ``recv_src[slot]`` and ``recv_from[slot]``. With K <= 32 lane k holds pair k
(``pair_in_lane``) and the lanes do this for all pairs at once (``send_token_by_lanes``); larger K walks the
pairs one at a time, lane 0 writing.

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

Groups (``records_groups``: the expert layout under dedup, for its fan-out, and every reduced combine):
the pairs of a token bound for one rank form a group; its primary is the first kept pair. The primary's
``recv_from`` holds -1 - n (n: the group's pairs from the primary on, dropped ones included), and every
later pair writes its slot (-1 if dropped for capacity) into ``recv_group[primary slot * K + m]``, m its
place in the group (``lists_members``: for the pull combine only groups bound for other ranks, the fan-out's;
this rank's own pairs received their rows themselves). Without groups a primary's ``recv_from`` is -1.

Rank layout (``RankDispatchKernel``, kernels/rank_dispatch.py: this kernel compiled with ``by_rank``):
the slot of a pair is its token's row on the destination rank (one
per (token, rank), from the layout kernel); only the token's first pair for a rank sends the row there,
with ``recv_src`` = rank * max_tokens + t and the token's K ids and weights in ``recv_topk_idx`` /
``recv_topk_w`` (local expert ids; -1 and weight 0 for experts of other ranks). No fan-out follows.
With K <= 32 (``send_token_by_rank``) lane j holds pair j, loaded once per token, and the primaries are
found with one ``match_sync``; a lane per k with group votes of global loads before (kept for K > 32).

Layout folded in (``num_tokens <= layout_in_dispatch``, either receive layout): the module launches
no layout kernel; every CTA first runs the layout's steps for its own tokens (kernels/layout.py,
``LayoutKernel.route``: counts, the count exchange and offsets, slots), then sends those tokens.
A CTA reads only slots it wrote itself, so no grid-wide wait follows the slots. One launch and one kernel
boundary less per dispatch.

Routed (``routed`` != 0; ``EpBuffer.launch_cached_dispatch``, DeepEP's cached dispatch): the slots of the
buffer's latest layout, and its receive counts, are this call's too; no layout runs, only the wait for every
rank to enter the call (``announce_entry``, ``await_entry``; an FP8 dispatch casts its first tokens during
it), and the last CTA advances the layout's epoch as a layout would.

Completion: each thread ``quiet``s its puts and fences its stores; the last CTA to finish (a
self-resetting arrival counter, ``done[DONE_DISPATCH]``) raises ``signals[SIGNAL_DISPATCH, rank]`` on
every peer to this call's epoch and waits until every peer has raised its own on this rank
(``signal_and_wait_peers``: at most ``timeout_ms`` per peer; a peer that never arrives is recorded in
``fault`` and the epoch is not advanced). So when the kernel ends
with its epoch advanced, this rank's receive buffer is complete, and everything later on the stream
may read it. A synced dispatch's host does not wait for that: the layout's leader mirrors the status to it
(kernels/layout.py, ``mirror_status``) once the count is known, while the rows still move.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import DONE_DISPATCH, INPUT_FAULT_RANKS, SIGNAL_COUNT, SIGNAL_DISPATCH, EpParams
from cute_ep.kernels.config import MODE_ATOMIC, MODE_SCATTER, OP_DISPATCH, OP_LAYOUT, VECTOR_BYTES, WARP
from cute_ep.kernels.dispatch_senders import pair_in_lane, send_pair, send_token_by_lanes, send_token_by_rank
from cute_ep.kernels.layout import LayoutKernel, announce_entry, await_entry, cta_tokens
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.ptx import ld_acquire_u64, ld_volatile_i32
from cute_ep.kernels.quantize import quantize_row_warp
from cute_ep.kernels.rank_layout import RankLayoutKernel
from cute_ep.kernels.rows import element_addr, row_space
from cute_ep.kernels.signals import cta_arrives_last, every_rank_at, fault_free, signal_and_wait_peers

# Warp steps of a token's FP8 cast loaded before the first is cast: a warp alone on a 7168-bf16 row
# otherwise waits a load latency for each of its 28 steps. EP2 (2x H200), 24 SMs, 4096 tokens: the FP8 rank
# dispatch took 287.9 us a step at a time (the bf16 one 233.0), 195.0 with 7; 10 or 14 spill in ptxas.
QUANTIZE_UNROLL = 7


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
        # The layout's steps, run by every CTA of this launch up to ``layout_in_dispatch`` tokens; an FP8
        # dispatch's CTAs cast rows while they wait there for the leader.
        self.folded_layout = (RankLayoutKernel if self.by_rank else LayoutKernel)(dtype)
        self.folded_layout.ahead = self.cast_ahead
        self.folded_layout.sends_after = True

    @cute.kernel
    def kernel(self, p: EpParams):
        self.send(p)

    @cute.jit
    def cast_ahead(self, p: EpParams, ready: Int64, t_first: Int32, t_end: Int32, warp: Int32, lane: Int32):
        """FP8, by every warp of a CTA that waits: the warp's tokens cast into ``packed`` in the order the
        send loop takes them until the wait is over, i.e. ``layout_done`` reaches ``ready`` (the layout
        folded in: the leader's offsets) or, in a routed dispatch, every rank's entry signal does
        (``await_entry``); with ``ready`` < 0 (the rank layout, while its CTAs' counts travel) one token a
        warp. Returns how many (the send loop casts the rest). Why: the SMs idle in those waits (7-25 us
        for the offsets at EP2); EP2, 24 SMs, 4096 / 8192 tokens: 195.0 / 354.5 us without, 192.8 / 353.4
        with."""
        dtype = p.x.element_type
        WPC = self.threads // WARP
        x_rows = row_space(p.x, Int64(p.hidden) * (dtype.width // 8))
        packed_rows = row_space(p.packed, p.fp8_row_bytes)
        cast = Int32(0)
        u = warp
        n = t_end - t_first
        if ready < Int64(0):
            if n > warp + 1:
                n = warp + 1  # one token a warp, no flag to look at
        if p.fp8 == 0:
            u = n  # nothing to cast
        while u < n:
            waiting = Int32(0)
            if lane == 0:
                if ready < Int64(0):
                    waiting = Int32(1)
                else:
                    if p.routed != 0:
                        waiting = Int32(1) - every_rank_at(p, Int32(SIGNAL_COUNT), ready)
                    else:
                        if ld_acquire_u64(element_addr(p.layout_done, 0)) < ready:
                            waiting = Int32(1)
            if cute.arch.shuffle_sync(waiting, 0) != 0:  # the warp's one answer
                t = t_first + u
                quantize_row_warp(dtype, x_rows.row(t), packed_rows.row(t), p.hidden, p.fp8_row_bytes, lane,
                                  p.fp8, QUANTIZE_UNROLL)
                cast = cast + 1
                u = u + WPC
            else:
                u = n
        return cast

    @cute.jit
    def token_parts(self, p: EpParams, work: Int32, num_pieces: Int32, folded: Int32):
        """(parts, pieces per part, by pairs, split) of each of the CTA's ``work`` tokens in the send loop
        (``folded``: the layout ran in this launch). Split with fewer tokens than warps, in scatter mode
        (there a part needs nothing another part of its token computes: slots are precomputed, atomic mode
        allocates them in k order), FP8 only where every token was cast before (the rank layout folded in: a
        warp per token while the words travel; EP2, 24 SMs, 128 tokens: the FP8 rank dispatch took 28.5-28.6
        us in parts, 29.1-29.2 a warp per token). Split, the row's 128-bit pieces in parts over the warps the
        tokens leave idle (``row_split``; each part carries every destination's copy of its bytes, the first
        part the pair records too), or with K > 32 a part per pair (``send_pair`` sends whole rows); else one
        part, the whole token. Why parts rather than a warp per pair: a pair that sends carries a whole row (7
        rounds of loads of a 7168-bf16 row), and only a rank's first pair sends in the rank layout, so most
        pair warps idled. EP2, 24 SMs, 128 tokens: the rank layout's dispatch 28.3 us against 31.2-31.5 a warp
        per pair, its cached dispatch 20.8-20.9 against 21.9-22.2, the expert layout's 42.4 against 45.9."""
        WPC = self.threads // WARP
        split = Int32(0)
        if p.mode != MODE_ATOMIC:
            if work < WPC:
                split = Int32(1)
                if p.fp8 != 0:
                    if cutlass.const_expr(not self.by_rank):
                        split = Int32(0)
                    if folded == 0:
                        split = Int32(0)
        parts, span = self.row_split(work, num_pieces, WPC, split)
        by_pairs = Int32(0)
        if split != 0:
            if p.topk > WARP:
                by_pairs = Int32(1)
                parts = p.topk
                span = num_pieces
        return parts, span, by_pairs, split

    @cute.jit
    def token_part(self, u: Int32, t_first: Int32, parts: Int32, span: Int32, by_pairs: Int32, K: Int32,
                   num_pieces: Int32):
        """Work unit ``u`` of the send loop (``token_parts``): (token, its pairs [k_begin, k_end), the part
        of its row as (first byte, bytes))."""
        i, v_begin, v_end = self.part_of(u, parts, span, num_pieces)
        k_begin, k_end = Int32(0), K
        if by_pairs != 0:
            k_begin = u % parts
            k_end = k_begin + 1
            v_begin, v_end = Int32(0), num_pieces
        return t_first + i, k_begin, k_end, (Int64(v_begin) * VECTOR_BYTES, (v_end - v_begin) * VECTOR_BYTES)

    @cute.jit
    def send(self, p: EpParams):
        """The kernel's body, by every thread of every CTA (the module docstring); the rank layout's
        kernel (kernels/rank_dispatch.py) runs it too, under its own name."""
        K, mode = p.topk, p.mode
        by_rank = self.by_rank  # one row per (token, destination rank), at the layout's row
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
        t_first, t_end = cta_tokens(p.num_tokens, bid, NCTA)
        cast_ahead = Int32(0)  # FP8: this warp's first tokens cast while the CTA waited (cast_ahead)
        lead, layout_epoch, accepted = Int32(0), Int64(0), Int32(0)  # the folded layout's, for its finish
        folded = Int32(0)  # the layout ran in this launch (the rank layout's warps then cast each token)
        if p.routed != 0:
            # The latest layout's slots: only the wait for every rank to enter the call, while which an FP8
            # dispatch's warps cast their first tokens.
            entry = announce_entry(p)
            cast_ahead = self.cast_ahead(p, entry, t_first, t_end, warp, lane)
            await_entry(p, entry)
        else:
            if p.num_tokens <= p.layout_in_dispatch:
                # The layout runs here, in every CTA for its own tokens, instead of in a kernel of its own
                # (one launch and one kernel boundary less on the critical path).
                folded = Int32(1)
                cast_ahead, lead, layout_epoch, accepted = self.folded_layout.route(p)
        # After a fault (a timed-out wait here or in the layout) this buffer moves no more data.
        work = Int32(0)
        if fault_free(p.fault):
            # the layout refused invalid inputs (on any rank); written in this launch when folded in
            if ld_volatile_i32(element_addr(p.input_fault, INPUT_FAULT_RANKS)) == 0:
                work = t_end - t_first
        # Fewer tokens than warps (decode): a token's row in parts over the warps (``token_parts``).
        NV = row_bytes // VECTOR_BYTES
        parts, span, by_pairs, split = self.token_parts(p, work, NV, folded)
        if split != 0:
            cast_ahead = work * parts  # FP8 in parts: every token was cast while the counts travelled
        for u in range(warp, work * parts, WPC):
            t, k_begin, k_end, part = self.token_part(u, t_first, parts, span, by_pairs, K, NV)
            src_addr = x_rows.row(t)
            # K <= 32: the token's pairs in lanes, loaded before an FP8 cast so that their loads overlap it
            e, slot, w, d = Int32(-1), Int32(-1), Float32(0.0), Int32(-1)
            if K <= WARP:
                if cutlass.const_expr(by_rank):
                    e, slot, w, d = pair_in_lane(p, t, lane, Int32(MODE_SCATTER))  # one order in this layout
                else:
                    e, slot, w, d = pair_in_lane(p, t, lane, mode)
            if p.fp8 != 0:
                # Quantize once per token; every destination gets the same packed bytes.
                dst = packed_rows.row(t)
                if u >= warp + cast_ahead * WPC:  # not cast while the layout waited
                    quantize_row_warp(dtype, src_addr, dst, H, row_bytes, lane, p.fp8, QUANTIZE_UNROLL)
                    cute.arch.sync_warp()  # lanes copy bytes other lanes wrote
                src_addr = dst
            k_stop = k_end
            if K <= WARP:
                # a token's pairs in lanes, loaded once (the per-pair loop below then only for K > 32)
                pair = (e, slot, w, d)
                if cutlass.const_expr(by_rank):
                    send_token_by_rank(dtype, p, t, k_begin, k_end, pair, src_addr, row_bytes, part, lane)
                else:
                    send_token_by_lanes(dtype, p, t, k_begin, k_end, pair, src_addr, row_bytes, part, lane)
                k_stop = k_begin
            for k in range(k_begin, k_stop):
                send_pair(dtype, p, t, k, src_addr, row_bytes, lane, by_rank)
        if lead != 0:
            self.folded_layout.before_arrival(p, layout_epoch, tid)
        # The last CTA to finish announces every CTA's rows to the peers, then waits for theirs.
        smem = cutlass.memory.SmemAllocator()
        last = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
        if cta_arrives_last(p, DONE_DISPATCH, last, tid) != 0:
            signal_and_wait_peers(p, Int32(SIGNAL_DISPATCH), epoch, Int32(OP_DISPATCH), epoch, Int32(1))
            if tid == 0:
                if fault_free(p.fault):
                    p.epochs[OP_DISPATCH] = epoch
                    if p.routed != 0:  # every CTA read the layout epoch in announce_entry by now
                        p.epochs[OP_LAYOUT] = p.epochs[OP_LAYOUT] + Int64(1)
        if lead != 0:
            # After the CTA's arrival, so that the last CTA's signal does not wait for it; what it writes is
            # read after this launch ends.
            self.folded_layout.finish(p, layout_epoch, accepted, tid)


profiler_name(DispatchKernel.kernel, "dispatch")
