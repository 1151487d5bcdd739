"""Combine kernel ("pull"): out[t] = sum over k (ascending) of topk_w[t, k] * recv_y[owner][slot(t, k)].

Start: every rank's expert outputs (symmetric ``recv_y``) must be written before anyone reads them,
so CTA 0 raises ``combine_signal[rank]`` on every peer to 2 * epoch - 1 (``epoch``: this call's number)
and every CTA waits until all peers have raised theirs (``kernels.ptx.signal_and_wait_peers``).

A warp per (local token, part of the hidden dimension) (persistent grid-stride loop). A token's row is
split into parts only when there are fewer tokens than warps and every peer is on this node (decode
batches), so that all warps work; otherwise a part is the whole row.
- for each k whose owner is on ANOTHER node (node = rank // local_world_size), ``get_warp`` the whole
  row ONCE into this warp's staging row ``stage[warp, k]``;
- the valid k (expert id >= 0 and slot >= 0: not dropped for capacity) are compacted, in ascending k,
  into a per-warp list of (row address,
  weight): the owner's NVSHMEM peer pointer (same node) or the staging row;
- then, 128 bits per lane at a time along the hidden dimension, the list is walked in groups of 8 (then
  4, then 1): a group's loads are all issued before the first is used (one remote load in flight per
  warp left combine latency-bound), and accumulated in fp32 in ascending k with separately rounded
  multiply and add — the order of ``cute_ep.reference.reference_combine``, so the result is
  bit-identical — and stored in the input dtype (``kernels.rowsum.weighted_sum_rows``).
The last CTA to finish advances epochs[2].
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64
from nvshmem.core.device.cute.mem import nvshmem_ptr

from cute_ep.kernels.config import COMBINE_WARPS_PER_CTA, MAX_TOPK, OP_COMBINE, VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import elem_view, ld_volatile_i32, signal_and_wait_peers
from cute_ep.kernels.rowsum import weighted_sum_rows


class CombineKernel:
    """The combine kernel (see the module docstring); every size is a run-time argument."""

    threads = COMBINE_WARPS_PER_CTA * WARP

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        out: cute.Tensor,
        topk_idx: cute.Tensor,
        topk_w: cute.Tensor,
        scatter: cute.Tensor,
        recv_y: cute.Tensor,
        stage: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        hidden: Int32,
        num_ctas: Int32,
        timeout_ms: Int32,
        stream,
    ):
        self.kernel(
            out, topk_idx, topk_w, scatter, recv_y, stage, signals, epochs, done, fault, rank, num_tokens,
            world_size, local_world_size, num_experts, topk, hidden, timeout_ms,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        out: cute.Tensor,
        topk_idx: cute.Tensor,
        topk_w: cute.Tensor,
        scatter: cute.Tensor,
        recv_y: cute.Tensor,
        stage: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        fault: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        hidden: Int32,
        timeout_ms: Int32,
    ):
        R = world_size
        L = local_world_size
        K = topk
        El = num_experts // world_size
        dtype = recv_y.element_type
        V = VECTOR_BYTES // (dtype.width // 8)  # elements per 128-bit piece
        NV = hidden // V  # pieces per row
        ROW_BYTES = Int64(hidden) * (dtype.width // 8)
        WPC = COMBINE_WARPS_PER_CTA
        NCTA, _, _ = cute.arch.grid_dim()
        NWARPS = NCTA * WPC

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        gwarp = bid * WPC + warp
        epoch = epochs[2] + Int64(1)

        # Per-warp compacted routing of the current token: row address and weight of each valid k.
        smem = cutlass.memory.SmemAllocator()
        row_addr = smem.allocate_tensor(Int64, cute.make_layout(WPC * MAX_TOPK), 16)
        weight = smem.allocate_tensor(Float32, cute.make_layout(WPC * MAX_TOPK), 16)
        my_addr = cute.make_tensor(row_addr.iterator + warp * MAX_TOPK, cute.make_layout(MAX_TOPK))
        my_weight = cute.make_tensor(weight.iterator + warp * MAX_TOPK, cute.make_layout(MAX_TOPK))

        # Start barrier: all ranks' expert outputs are in place (each peer waited for at most
        # timeout_ms; one that never arrives is recorded in ``fault`` and nothing is read). Combine's
        # signal row carries 2 * epoch - 1 at the start of call ``epoch`` (the reduced combine also
        # raises 2 * epoch when its partial rows are out).
        fault_addr = fault.iterator.toint()
        signal_and_wait_peers(signals, Int32(2), rank, R, epoch * 2 - 1, timeout_ms, Int32(OP_COMBINE), epoch,
                              fault, Int32(1))
        live = ld_volatile_i32(fault_addr) == Int32(0)
        work = Int32(0)
        if live:
            work = num_tokens

        recv_y_base = recv_y.iterator.toint()
        stage_base = stage.iterator.toint()
        out_base = out.iterator.toint()
        my_node = rank // L

        # Parts per token: split rows across idle warps only when no row needs staging (one node).
        parts = Int32(1)
        if R == L:
            if num_tokens > 0:
                parts = NWARPS // num_tokens
            max_parts = (NV + WARP - 1) // WARP
            if parts > max_parts:
                parts = max_parts
            if parts < 1:
                parts = Int32(1)
        span = (NV + parts - 1) // parts  # pieces per part

        for u in range(gwarp, work * parts, NWARPS):
            t = u // parts
            v_begin = (u % parts) * span
            v_end = v_begin + span
            if v_end > NV:
                v_end = NV
            # Routing of token t; rows on other nodes are fetched whole, once, into the staging rows.
            n = Int32(0)
            for k in range(K):
                e = topk_idx[t * K + k]
                slot = scatter[t * K + k]  # -1: dropped beyond the expert's capacity (or id -1)
                valid = Int32(0)  # a handle may mask pairs with id -1 (autograd's one-k combines)
                if e >= 0:
                    if slot >= 0:
                        valid = Int32(1)
                if valid != 0:
                    d = e // El
                    addr = Int64(0)
                    if d // L != my_node:
                        srow = gwarp * K + k
                        nvshmem_cute.get_warp(elem_view(stage[srow, None]), elem_view(recv_y[slot, None]), d)
                        addr = stage_base + Int64(srow) * ROW_BYTES
                    else:
                        addr = nvshmem_ptr(recv_y_base, d) + Int64(slot) * ROW_BYTES
                    if lane == 0:
                        my_addr[n] = addr
                        my_weight[n] = topk_w[t * K + k]
                    n = n + 1
            cute.arch.sync_warp()

            weighted_sum_rows(dtype, my_addr, my_weight, n, v_begin, v_end, lane,
                              out_base + Int64(t) * ROW_BYTES)
            cute.arch.sync_warp()

        cute.arch.sync_threads()
        if tid == 0:
            arrived = cute.arch.atomic_add(done.iterator + 1, Int32(1))
            if arrived == NCTA - 1:
                done[1] = Int32(0)
                if ld_volatile_i32(fault_addr) == Int32(0):  # a timed-out call does not count as run
                    epochs[2] = epoch
