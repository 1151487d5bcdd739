"""Dispatch kernel: every (token, k) row goes to the rank that owns expert topk_idx[t, k].

A warp per token (persistent grid-stride loop; with fewer tokens than warps, in scatter mode without
FP8, a warp per (token, k) pair). For each k: skip -1; find the slot (precomputed
``scatter`` in MODE_SCATTER, or an atomic add on this rank's per-expert cursor in MODE_ATOMIC, written
back into ``scatter`` for combine); lane 0 ``p``-puts the fp32 weight into ``recv_w[slot]``, the source
tag (rank * max_tokens + t) * K + k into ``recv_src[slot]`` and ``recv_from[slot]``.

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

Completion: each thread ``quiet``s its puts and fences its stores; the last CTA to finish (a
self-resetting arrival counter) raises ``dispatch_signal[rank]`` on every peer to this call's epoch,
then waits until every peer has raised its own on this rank (at most ``timeout_ms`` per peer; a peer
that never arrives is recorded in ``fault`` and the epoch is not advanced). So when the kernel ends
with its epoch advanced, this rank's receive buffer is complete, and everything later on the stream
may read it.
"""

from __future__ import annotations

import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64
from nvshmem.core.device.cute.mem import nvshmem_ptr

from cute_ep.kernels.config import ALGO_DEDUP, ALGO_PUT_WARP, MODE_ATOMIC, OP_DISPATCH, VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import (
    SIGNAL_SET,
    copy_row_warp,
    fence_sys,
    ld_volatile_i32,
    record_fault,
    row_view,
    wait_signal_ge,
)
from cute_ep.kernels.quantize import quantize_row_warp


class DispatchKernel:
    """Compile-time configuration plus the dispatch kernel (see the module docstring)."""

    threads = 256

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        topk_idx: cute.Tensor,
        topk_w: cute.Tensor,
        scatter: cute.Tensor,
        cursor: cute.Tensor,
        send_limit: cute.Tensor,
        packed: cute.Tensor,
        recv_x: cute.Tensor,
        recv_w: cute.Tensor,
        recv_src: cute.Tensor,
        recv_from: cute.Tensor,
        recv_group: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        mode: Int32,
        fp8: Int32,
        algo: Int32,
        groups: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        max_tokens: Int32,
        num_ctas: Int32,
        timeout_ms: Int32,
        stream,
    ):
        self.kernel(
            x, topk_idx, topk_w, scatter, cursor, send_limit, packed, recv_x, recv_w, recv_src, recv_from,
            recv_group, signals, epochs, done, fault, rank, num_tokens, mode, fp8, algo, groups, world_size,
            local_world_size, num_experts, topk, max_tokens, timeout_ms,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        topk_idx: cute.Tensor,
        topk_w: cute.Tensor,
        scatter: cute.Tensor,
        cursor: cute.Tensor,
        send_limit: cute.Tensor,
        packed: cute.Tensor,
        recv_x: cute.Tensor,
        recv_w: cute.Tensor,
        recv_src: cute.Tensor,
        recv_from: cute.Tensor,
        recv_group: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        mode: Int32,
        fp8: Int32,
        algo: Int32,
        groups: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        max_tokens: Int32,
        timeout_ms: Int32,
    ):
        R = world_size
        L = local_world_size
        K = topk
        El = num_experts // world_size
        M = max_tokens
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        dtype = x.element_type
        H = x.shape[1]
        X_ROW_BYTES = Int64(H) * (dtype.width // 8)
        # Bytes that travel per row: the row itself, or its packed FP8 form (kernels/quantize.py).
        row_bytes = H * (dtype.width // 8)
        if fp8 != 0:
            row_bytes = packed.shape[1]
        ROW_BYTES = Int64(row_bytes)
        NV = row_bytes // VECTOR_BYTES  # 128-bit pieces per row
        ROW_ELEMS = row_bytes // (dtype.width // 8)  # the moved bytes as elements, for put_warp

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        epoch = epochs[1] + Int64(1)
        my_node = rank // L
        x_base = x.iterator.toint()
        packed_base = packed.iterator.toint()
        recv_x_base = recv_x.iterator.toint()
        fault_addr = fault.iterator.toint()
        # After a fault (a timed-out wait here or in the layout) this buffer moves no more data.
        live = ld_volatile_i32(fault_addr) == Int32(0)
        work = Int32(0)
        if live:
            work = num_tokens

        # Fewer tokens than warps (decode): a warp per (token, k) pair instead of per token, so that all
        # warps work. Only in scatter mode without FP8: there a pair needs nothing an earlier pair of
        # its token computes (slots are precomputed; atomic mode allocates them in k order, and FP8
        # quantizes each token once).
        split = Int32(0)
        if mode != MODE_ATOMIC:
            if fp8 == 0:
                if work < NCTA * WPC:
                    split = Int32(1)
        items = work
        if split != 0:
            items = work * K
        for u in range(bid * WPC + warp, items, NCTA * WPC):
            t = u
            k_begin = Int32(0)
            k_end = K
            if split != 0:
                t = u // K
                k_begin = u % K
                k_end = k_begin + 1
            src_addr = x_base + Int64(t) * X_ROW_BYTES
            if fp8 != 0:
                # Quantize once per token; every destination gets the same packed bytes.
                dst = packed_base + Int64(t) * ROW_BYTES
                quantize_row_warp(dtype, src_addr, dst, H, row_bytes, lane)
                cute.arch.sync_warp()  # lanes copy bytes other lanes wrote
                src_addr = dst
            for k in range(k_begin, k_end):
                e = topk_idx[t * K + k]
                if e >= 0:
                    d = e // El
                    slot = Int32(-1)
                    if mode == MODE_ATOMIC:
                        got = Int32(0)
                        if lane == 0:
                            got = cute.arch.atomic_add(cursor.iterator + e, Int32(1))
                            if got >= send_limit[e]:
                                got = Int32(-1)  # beyond the expert's capacity: dropped
                            scatter[t * K + k] = got
                        slot = cute.arch.shuffle_sync(got, 0)
                        cute.arch.sync_warp()  # the vote of a later k reads this scatter entry
                    else:
                        slot = scatter[t * K + k]  # -1: dropped by the layout (capacity)
                    # The group of (t, d): token t's pairs bound for rank d, ascending k. Its primary g is
                    # the first kept one: dedup sends the row only there, and the reduced combine sums the
                    # group on rank d into one partial row (the lists below are written only for it).
                    g = k
                    vote = Int32(0)
                    if slot >= 0:
                        if algo == ALGO_DEDUP:
                            vote = Int32(1)
                    if groups != 0:
                        vote = Int32(1)
                    if vote != 0:
                        # The first kept k' < k bound for the same rank, if any; lanes split the k'.
                        for j0 in range(0, k, WARP):
                            j = j0 + lane
                            same = Int32(0)
                            if j < k:
                                ej = topk_idx[t * K + j]
                                if ej >= 0:
                                    if ej // El == d:
                                        if scatter[t * K + j] >= 0:
                                            same = Int32(1)
                            ballot = cute.arch.vote_ballot_sync(same != 0)
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
                            j = j0 + lane
                            same = Int32(0)
                            if j < hi:
                                ej = topk_idx[t * K + j]
                                if ej >= 0:
                                    if ej // El == d:
                                        same = Int32(1)
                            cnt = cnt + Int32(cute.arch.popc(cute.arch.vote_ballot_sync(same != 0)))
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
                        if first == k:
                            # Peer-pointer stores on the node, except the put_warp primitive's remote rows.
                            store = Int32(0)
                            if d // L == my_node:
                                store = Int32(1)
                                if algo == ALGO_PUT_WARP:
                                    if d != rank:
                                        store = Int32(0)
                            if store != 0:
                                copy_row_warp(
                                    dtype, src_addr, nvshmem_ptr(recv_x_base, d) + Int64(slot) * ROW_BYTES,
                                    NV, lane,
                                )
                            else:
                                nvshmem_cute.put_warp(
                                    row_view(dtype, recv_x_base + Int64(slot) * ROW_BYTES, ROW_ELEMS),
                                    row_view(dtype, src_addr, ROW_ELEMS),
                                    d,
                                )
                        if lane == 0:
                            from_slot = Int32(-1)
                            if first != k:
                                from_slot = scatter[t * K + first]  # atomic mode: written above by this lane
                            if groups != 0:
                                if g == k:
                                    from_slot = Int32(-1) - n  # a primary: <= -2 encodes its group size
                            nvshmem_cute.p(
                                cute.make_tensor(recv_w.iterator + slot, cute.make_layout(1)),
                                topk_w[t * K + k],
                                d,
                            )
                            nvshmem_cute.p(
                                cute.make_tensor(recv_src.iterator + slot, cute.make_layout(1)),
                                (rank * M + t) * K + k,
                                d,
                            )
                            nvshmem_cute.p(
                                cute.make_tensor(recv_from.iterator + slot, cute.make_layout(1)), from_slot, d
                            )
                    if groups != 0:
                        if g != k:
                            if lane == 0:
                                # A later member (or a dropped pair: -1) enters the primary's list.
                                nvshmem_cute.p(
                                    cute.make_tensor(recv_group.iterator + scatter[t * K + g] * K + m,
                                                     cute.make_layout(1)),
                                    slot,
                                    d,
                                )
        nvshmem_cute.quiet()
        fence_sys()  # this thread's peer-pointer stores, before the CTA's arrival below
        cute.arch.sync_threads()

        if tid == 0:
            fence_sys()
            arrived = cute.arch.atomic_add(done.iterator, Int32(1))
            if arrived == NCTA - 1:
                # Last CTA: every CTA's puts are complete; announce them, then wait for the peers'.
                done[0] = Int32(0)
                if live:
                    fence_sys()
                    my_signal = cute.make_tensor(signals.iterator + (R + rank), cute.make_layout(1))
                    for p in range(R):
                        nvshmem_cute.signal_op(my_signal, epoch, SIGNAL_SET, p)
                    signals_base = signals.iterator.toint()
                    arrived_all = Int32(1)
                    for p in range(R):
                        if arrived_all == Int32(1):
                            addr = signals_base + Int64((R + p) * 8)
                            if wait_signal_ge(addr, epoch, Int64(timeout_ms) * 1000000) == 0:
                                record_fault(fault, Int32(OP_DISPATCH), p, epoch)
                                arrived_all = Int32(0)
                    if arrived_all == Int32(1):
                        epochs[1] = epoch
