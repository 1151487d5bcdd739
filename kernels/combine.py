"""Combine kernel: out[t] = sum over k (ascending) of topk_w[t, k] * recv_y[owner][slot(t, k)].

Start: every rank's expert outputs (symmetric ``recv_y``) must be written before anyone reads them,
so CTA 0 raises ``combine_signal[rank]`` on every peer to this call's epoch and every CTA waits until
all peers have raised theirs.

A warp per local token (persistent grid-stride loop):
- for each k whose owner is on ANOTHER node (node = rank // local_world_size), ``get_warp`` the whole
  row ONCE into this warp's staging row ``stage[warp, k]``;
- then, 128 bits per lane at a time along the hidden dimension, each k's piece is read either through
  the owner's NVSHMEM peer pointer (same node; volatile system-scope loads) or from the staging row,
  and accumulated in fp32 in ascending k with separately rounded multiply and add — the order of
  ``validators.reference.reference_combine``, so the result is bit-identical — and stored in the
  input dtype.
The last CTA to finish advances epochs[2].
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64
from nvshmem.core.device.cute.mem import nvshmem_ptr

from cute_ep.kernels.config import COMBINE_WARPS_PER_CTA, MAX_TOPK, VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import CMP_GE, SIGNAL_SET, add_rn, elem_view, fence_sys, gmem_tensor, mul_rn


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
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        hidden: Int32,
        num_ctas: Int32,
        stream,
    ):
        self.kernel(
            out, topk_idx, topk_w, scatter, recv_y, stage, signals, epochs, done, rank, num_tokens,
            world_size, local_world_size, num_experts, topk, hidden,
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
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        hidden: Int32,
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

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        gwarp = bid * WPC + warp
        epoch = epochs[2] + Int64(1)

        # Per-warp routing of the current token: where each k's row is read from, its weight, validity.
        smem = cutlass.memory.SmemAllocator()
        row_addr = smem.allocate_tensor(Int64, cute.make_layout(WPC * MAX_TOPK), 16)
        weight = smem.allocate_tensor(Float32, cute.make_layout(WPC * MAX_TOPK), 16)
        valid = smem.allocate_tensor(Int32, cute.make_layout(WPC * MAX_TOPK), 16)
        mine = warp * MAX_TOPK

        # Start barrier: all ranks' expert outputs are in place.
        if bid == 0:
            if tid < R:
                fence_sys()
                nvshmem_cute.signal_op(
                    cute.make_tensor(signals.iterator + (2 * R + rank), cute.make_layout(1)),
                    epoch, SIGNAL_SET, tid,
                )
        if tid < R:
            nvshmem_cute.signal_wait(
                cute.make_tensor(signals.iterator + (2 * R + tid), cute.make_layout(1)), CMP_GE, epoch
            )
        cute.arch.sync_threads()

        load = cute.make_copy_atom(
            cute.nvgpu.CopyG2ROp(),
            dtype,
            num_bits_per_copy=128,
            memory_order=cute.nvgpu.MemoryOrder.VOLATILE,
            memory_scope=cute.nvgpu.MemoryScope.SYS,
        )
        recv_y_base = recv_y.iterator.toint()
        stage_base = stage.iterator.toint()
        out_base = out.iterator.toint()
        my_node = rank // L

        for t in range(gwarp, num_tokens, NCTA * WPC):
            # Routing of token t; rows on other nodes are fetched whole, once, into the staging rows.
            for k in range(K):
                e = topk_idx[t * K + k]
                if lane == 0:
                    valid[mine + k] = Int32(0)
                    weight[mine + k] = topk_w[t * K + k]
                if e >= 0:
                    d = e // El
                    slot = scatter[t * K + k]
                    addr = Int64(0)
                    if d // L != my_node:
                        srow = gwarp * K + k
                        nvshmem_cute.get_warp(elem_view(stage[srow, None]), elem_view(recv_y[slot, None]), d)
                        addr = stage_base + Int64(srow) * ROW_BYTES
                    else:
                        addr = nvshmem_ptr(recv_y_base, d) + Int64(slot) * ROW_BYTES
                    if lane == 0:
                        valid[mine + k] = Int32(1)
                        row_addr[mine + k] = addr
            cute.arch.sync_warp()

            for v in range(lane, NV, WARP):
                acc = cute.make_rmem_tensor(cute.make_layout(V), Float32)
                acc.fill(0.0)
                for k in range(K):
                    if valid[mine + k] != 0:
                        frag = cute.make_rmem_tensor(cute.make_layout(V), dtype)
                        src = gmem_tensor(dtype, row_addr[mine + k] + Int64(v * VECTOR_BYTES),
                                          cute.make_layout(V), VECTOR_BYTES)
                        cute.copy(load, src, frag)
                        vals = frag.load().to(Float32)
                        wk = weight[mine + k]
                        for i in cutlass.range_constexpr(V):
                            acc[i] = add_rn(acc[i], mul_rn(wk, vals[i]))
                res = cute.make_rmem_tensor(cute.make_layout(V), dtype)
                res.store(acc.load().to(dtype))
                dst = gmem_tensor(dtype, out_base + Int64(t) * ROW_BYTES + Int64(v * VECTOR_BYTES),
                                  cute.make_layout(V), VECTOR_BYTES)
                cute.autovec_copy(res, dst)
            cute.arch.sync_warp()

        cute.arch.sync_threads()
        if tid == 0:
            arrived = cute.arch.atomic_add(done.iterator + 1, Int32(1))
            if arrived == NCTA - 1:
                done[1] = Int32(0)
                epochs[2] = epoch
