"""Reduced combine, phase 2 of 2, on the token's rank: out[t] = the sum of token t's partial rows.

Waits until every peer has raised ``combine_signal`` to 2 * epoch (its phase 1, kernels/reduce_push.py,
has pushed all its partial rows; bounded, a peer that never arrives is recorded in ``fault``). Then a
warp per (token, part of the row) (parts only when there are fewer tokens than warps: every read here
is local) lists the partial rows ``partials[t * R + d]`` of the ranks d holding at least one kept pair
of the token, in the order of each rank's first kept k, and sums them in fp32 with weight 1
(``weighted_sum_rows``: 1 * p is exact, so this is the plain fp32 sum in that order), then stores the
row dtype — the order of ``cute_ep.reference.reference_combine_reduced``. A token with no kept pair
gets zeros. The last CTA to finish advances epochs[2].
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.config import COMBINE_WARPS_PER_CTA, MAX_TOPK, OP_COMBINE, VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import ld_volatile_i32, signal_and_wait_peers
from cute_ep.kernels.rowsum import weighted_sum_rows


class PartialSumKernel:
    """Phase 2 of the reduced combine (see the module docstring); every size is a run-time argument."""

    threads = COMBINE_WARPS_PER_CTA * WARP

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        out: cute.Tensor,
        topk_idx: cute.Tensor,
        scatter: cute.Tensor,
        partials: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        num_ctas: Int32,
        timeout_ms: Int32,
        stream,
    ):
        self.kernel(
            out, topk_idx, scatter, partials, signals, epochs, done, fault, rank, num_tokens, world_size,
            num_experts, topk, timeout_ms,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        out: cute.Tensor,
        topk_idx: cute.Tensor,
        scatter: cute.Tensor,
        partials: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        timeout_ms: Int32,
    ):
        R = world_size
        K = topk
        El = num_experts // world_size
        dtype = partials.element_type
        H = partials.shape[1]
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
        # Wait only: every peer's phase 1 raised row 2 to 2 * epoch after its last partial row.
        signal_and_wait_peers(signals, Int32(2), rank, R, epoch * 2, timeout_ms, Int32(OP_COMBINE), epoch,
                              fault, Int32(0))
        live = ld_volatile_i32(fault_addr) == Int32(0)
        work = Int32(0)
        if live:
            work = num_tokens

        parts = Int32(1)
        if work > 0:
            parts = NWARPS // work
        max_parts = (NV + WARP - 1) // WARP
        if parts > max_parts:
            parts = max_parts
        if parts < 1:
            parts = Int32(1)
        span = (NV + parts - 1) // parts

        partials_base = partials.iterator.toint()
        out_base = out.iterator.toint()

        for u in range(gwarp, work * parts, NWARPS):
            t = u // parts
            v_begin = (u % parts) * span
            v_end = v_begin + span
            if v_end > NV:
                v_end = NV
            # A rank's partial enters at its first kept k (kept: id >= 0 and slot >= 0).
            n = Int32(0)
            for k in range(K):
                e = topk_idx[t * K + k]
                if e >= 0:
                    if scatter[t * K + k] >= 0:
                        d = e // El
                        first = Int32(1)
                        for k2 in range(k):
                            e2 = topk_idx[t * K + k2]
                            if e2 >= 0:
                                if e2 // El == d:
                                    if scatter[t * K + k2] >= 0:
                                        first = Int32(0)
                        if first != 0:
                            if lane == 0:
                                my_addr[n] = partials_base + Int64(t * R + d) * ROW_BYTES
                                my_weight[n] = Float32(1.0)
                            n = n + 1
            cute.arch.sync_warp()
            dst = out_base + Int64(t) * ROW_BYTES
            weighted_sum_rows(dtype, my_addr, my_weight, n, v_begin, v_end, lane, dst)
            cute.arch.sync_warp()

        cute.arch.sync_threads()
        if tid == 0:
            arrived = cute.arch.atomic_add(done.iterator + 1, Int32(1))
            if arrived == NCTA - 1:
                done[1] = Int32(0)
                if ld_volatile_i32(fault_addr) == Int32(0):  # a timed-out call does not count as run
                    epochs[2] = epoch
