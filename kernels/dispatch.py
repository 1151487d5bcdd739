"""Dispatch kernel: every (token, k) row goes to the rank that owns expert topk_idx[t, k].

A warp per token (persistent grid-stride loop). For each k: skip -1; find the slot (precomputed
``scatter`` in MODE_SCATTER, or an atomic add on this rank's per-expert cursor in MODE_ATOMIC, written
back into ``scatter`` for combine); ``put_warp`` the row into the owner's symmetric ``recv_x[slot]``;
lane 0 ``p``-puts the fp32 weight into ``recv_w[slot]`` and the source tag
(rank * max_tokens + t) * K + k into ``recv_src[slot]``.

Completion: each thread ``quiet``s its puts; the last CTA to finish (a self-resetting arrival
counter) raises ``dispatch_signal[rank]`` on every peer to this call's epoch, then waits until every
peer has raised its own on this rank. So when the kernel ends, this rank's receive buffer is
complete, and everything later on the stream may read it.
"""

from __future__ import annotations

import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.config import MODE_ATOMIC, WARP
from cute_ep.kernels.ptx import CMP_GE, SIGNAL_SET, elem_view, fence_sys


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
        recv_x: cute.Tensor,
        recv_w: cute.Tensor,
        recv_src: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        mode: Int32,
        world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        max_tokens: Int32,
        num_ctas: Int32,
        stream,
    ):
        self.kernel(
            x, topk_idx, topk_w, scatter, cursor, recv_x, recv_w, recv_src, signals, epochs, done,
            rank, num_tokens, mode, world_size, num_experts, topk, max_tokens,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        topk_idx: cute.Tensor,
        topk_w: cute.Tensor,
        scatter: cute.Tensor,
        cursor: cute.Tensor,
        recv_x: cute.Tensor,
        recv_w: cute.Tensor,
        recv_src: cute.Tensor,
        signals: cute.Tensor,
        epochs: cute.Tensor,
        done: cute.Tensor,
        rank: Int32,
        num_tokens: Int32,
        mode: Int32,
        world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        max_tokens: Int32,
    ):
        R = world_size
        K = topk
        El = num_experts // world_size
        M = max_tokens
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        epoch = epochs[1] + Int64(1)

        for t in range(bid * WPC + warp, num_tokens, NCTA * WPC):
            src_row = elem_view(x[t, None])
            for k in range(K):
                e = topk_idx[t * K + k]
                if e >= 0:
                    d = e // El
                    slot = Int32(0)
                    if mode == MODE_ATOMIC:
                        got = Int32(0)
                        if lane == 0:
                            got = cute.arch.atomic_add(cursor.iterator + e, Int32(1))
                            scatter[t * K + k] = got
                        slot = cute.arch.shuffle_sync(got, 0)
                    else:
                        slot = scatter[t * K + k]
                    nvshmem_cute.put_warp(elem_view(recv_x[slot, None]), src_row, d)
                    if lane == 0:
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
        nvshmem_cute.quiet()
        cute.arch.sync_threads()

        if tid == 0:
            fence_sys()
            arrived = cute.arch.atomic_add(done.iterator, Int32(1))
            if arrived == NCTA - 1:
                # Last CTA: every CTA's puts are complete; announce them, then wait for the peers'.
                done[0] = Int32(0)
                fence_sys()
                my_signal = cute.make_tensor(signals.iterator + (R + rank), cute.make_layout(1))
                for p in range(R):
                    nvshmem_cute.signal_op(my_signal, epoch, SIGNAL_SET, p)
                for p in range(R):
                    nvshmem_cute.signal_wait(
                        cute.make_tensor(signals.iterator + (R + p), cute.make_layout(1)), CMP_GE, epoch
                    )
                epochs[1] = epoch
