"""Reduced combine, phase 1 of 2, on every expert's rank: sum each token's rows here into one partial
row and push it to the token's rank.

Why: the pull combine moves every (token, k) row across the link. Summing a token's rows on the rank
that holds them first moves one row per (token, rank) instead: with top-8 over 2 ranks, about 1 row per
token crosses the link instead of 4. Each partial is rounded to the row dtype, so the result differs
from the pull combine's by that rounding (``cute_ep.reference.reference_combine_reduced`` is the
bit-exact reference).

Input: the groups dispatch recorded (kernels/dispatch.py, ``groups``): a received slot p whose
``recv_from[p]`` is -1 - n (n >= 1) is the primary of a group of n pairs of one token, whose later
members are ``recv_group[p * K + m]`` (m in [1, n), -1 where the pair was dropped for capacity).

Start barrier: a rank writes partial rows into its peers' ``partials``, which a peer may still be
reading in its previous combine's phase 2, so every rank first raises ``combine_signal[rank]`` on every
peer to 2 * epoch - 1 and waits for all of theirs (``signal_and_wait_peers``, bounded).

A warp per group (persistent grid-stride loop over the received slots; the row is split over idle warps
when there are fewer groups than warps and every peer is on this node): the members' (row, weight) in
ascending k go to a per-warp list; ``weighted_sum_rows`` computes the partial (fp32, ascending k, then
the row dtype) and stores it into row t * R + rank of the token's rank's ``partials``: with 128-bit
stores through the NVSHMEM peer pointer on the same node, else into this warp's staging row and then
``put_warp``. The grid is ``REDUCED_GRID_FACTOR`` x num_sms CTAs (kernels/module.py): more warps, more
loads in flight. The source tag ``recv_src[p]`` = (src_rank * M + t) * K + k names the token.

Completion: every thread ``quiet``s and fences; the last CTA to finish raises ``combine_signal[rank]``
on every peer to 2 * epoch (phase 2, kernels/partial_sum.py, waits for it). The epoch is advanced by
phase 2.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64
from nvshmem.core.device.cute.mem import nvshmem_ptr

from cute_ep.kernels.config import COMBINE_WARPS_PER_CTA, MAX_TOPK, OP_COMBINE, VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import SIGNAL_SET, fence_sys, ld_volatile_i32, row_view, signal_and_wait_peers
from cute_ep.kernels.rowsum import weighted_sum_rows


class ReducePushKernel:
    """Phase 1 of the reduced combine (see the module docstring); every size is a run-time argument."""

    threads = COMBINE_WARPS_PER_CTA * WARP

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        recv_y: cute.Tensor,
        recv_w: cute.Tensor,
        recv_src: cute.Tensor,
        recv_from: cute.Tensor,
        recv_group: cute.Tensor,
        partials: cute.Tensor,
        stage: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        num_recv: cute.Tensor,
        rank: Int32,
        world_size: Int32,
        local_world_size: Int32,
        topk: Int32,
        max_tokens: Int32,
        num_ctas: Int32,
        timeout_ms: Int32,
        stream,
    ):
        self.kernel(
            recv_y, recv_w, recv_src, recv_from, recv_group, partials, stage, signals, epochs, done, fault,
            num_recv, rank, world_size, local_world_size, topk, max_tokens, timeout_ms,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        recv_y: cute.Tensor,
        recv_w: cute.Tensor,
        recv_src: cute.Tensor,
        recv_from: cute.Tensor,
        recv_group: cute.Tensor,
        partials: cute.Tensor,
        stage: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        num_recv: cute.Tensor,
        rank: Int32,
        world_size: Int32,
        local_world_size: Int32,
        topk: Int32,
        max_tokens: Int32,
        timeout_ms: Int32,
    ):
        R = world_size
        L = local_world_size
        K = topk
        M = max_tokens
        dtype = recv_y.element_type
        H = recv_y.shape[1]
        C = recv_y.shape[0]
        V = VECTOR_BYTES // (dtype.width // 8)
        NV = H // V
        ROW_BYTES = Int64(H) * (dtype.width // 8)
        WPC = COMBINE_WARPS_PER_CTA
        NCTA, _, _ = cute.arch.grid_dim()
        NWARPS = NCTA * WPC

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        gwarp = bid * WPC + warp
        epoch = epochs[2] + Int64(1)

        smem = cutlass.memory.SmemAllocator()
        row_addr = smem.allocate_tensor(Int64, cute.make_layout(WPC * MAX_TOPK), 16)
        weight = smem.allocate_tensor(Float32, cute.make_layout(WPC * MAX_TOPK), 16)
        my_addr = cute.make_tensor(row_addr.iterator + warp * MAX_TOPK, cute.make_layout(MAX_TOPK))
        my_weight = cute.make_tensor(weight.iterator + warp * MAX_TOPK, cute.make_layout(MAX_TOPK))

        fault_addr = fault.iterator.toint()
        signal_and_wait_peers(signals, Int32(2), rank, R, epoch * 2 - 1, timeout_ms, Int32(OP_COMBINE), epoch,
                              fault, Int32(1))
        live = ld_volatile_i32(fault_addr) == Int32(0)
        work = Int32(0)
        if live:
            work = num_recv[0]
            if work > C:
                work = C

        parts = Int32(1)
        if R == L:
            if work > 0:
                parts = NWARPS // work
            max_parts = (NV + WARP - 1) // WARP
            if parts > max_parts:
                parts = max_parts
            if parts < 1:
                parts = Int32(1)
        span = (NV + parts - 1) // parts

        recv_y_base = recv_y.iterator.toint()
        partials_base = partials.iterator.toint()
        stage_row = stage.iterator.toint() + Int64(gwarp) * ROW_BYTES  # one per warp (EpConfig.stage_rows)
        my_node = rank // L

        for u in range(gwarp, work * parts, NWARPS):
            p = u // parts
            v_begin = (u % parts) * span
            v_end = v_begin + span
            if v_end > NV:
                v_end = NV
            f = recv_from[p]
            src = recv_src[p]
            owner = src // (M * K)
            if f <= Int32(-2):
                if owner < R:
                    t = (src // K) % M
                    n = Int32(-1) - f
                    if n > K:
                        n = K
                    # The group's kept rows, ascending k: the primary, then the later members.
                    cnt = Int32(0)
                    for mm in range(n):
                        s = p
                        if mm > 0:
                            s = recv_group[p * K + mm]
                        if s >= 0:
                            if s < C:
                                if lane == 0:
                                    my_addr[cnt] = recv_y_base + Int64(s) * ROW_BYTES
                                    my_weight[cnt] = recv_w[s]
                                cnt = cnt + 1
                    cute.arch.sync_warp()
                    row = Int64(t * R + rank) * ROW_BYTES  # this rank's partial of token t
                    if owner // L == my_node:
                        weighted_sum_rows(dtype, my_addr, my_weight, cnt, v_begin, v_end, lane,
                                          nvshmem_ptr(partials_base, owner) + row)
                    else:
                        weighted_sum_rows(dtype, my_addr, my_weight, cnt, v_begin, v_end, lane, stage_row)
                        cute.arch.sync_warp()  # the put reads what every lane stored
                        nvshmem_cute.put_warp(
                            row_view(dtype, partials_base + row, H), row_view(dtype, stage_row, H), owner
                        )
                    cute.arch.sync_warp()  # the list is rewritten for the next group

        nvshmem_cute.quiet()
        fence_sys()  # this thread's peer-pointer stores, before the CTA's arrival below
        cute.arch.sync_threads()
        if tid == 0:
            fence_sys()
            arrived = cute.arch.atomic_add(done.iterator + 2, Int32(1))
            if arrived == NCTA - 1:
                done[2] = Int32(0)
                if ld_volatile_i32(fault_addr) == Int32(0):
                    fence_sys()
                    my_signal = cute.make_tensor(signals.iterator + (2 * R + rank), cute.make_layout(1))
                    for q in range(R):
                        nvshmem_cute.signal_op(my_signal, epoch * 2, SIGNAL_SET, q)
