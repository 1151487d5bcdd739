"""Fan-out kernel: the receiver's half of dispatch's rank de-duplication.

A token bound for several experts of one rank crosses the link once, into the slot of its first such
(token, k) pair; every other pair's slot ``s`` holds ``recv_from[s]``, the slot its row arrived in
(-1 for the slot that received the row itself). Launched right after the dispatch kernel on the same
stream (dispatch ends only when every peer's rows and ``recv_from`` entries have arrived), a warp per
slot in [0, num_recv) copies ``recv_x[recv_from[s]]`` into ``recv_x[s]``: local memory, no link. Rows
are ``row_bytes`` apart: a row of the buffer's dtype, or a packed FP8 row (kernels/quantize.py) in the
same memory.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64

from cute_ep.kernels.config import VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import copy_row_warp, ld_volatile_i32


class FanoutKernel:
    """The fan-out kernel (see the module docstring); every size is a run-time argument."""

    threads = 256

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    @cute.jit
    def __call__(self, recv_x: cute.Tensor, recv_from: cute.Tensor, num_recv: cute.Tensor, fault: cute.Tensor,
                 row_bytes: Int32, num_ctas: Int32, stream):
        self.kernel(recv_x, recv_from, num_recv, fault, row_bytes).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, recv_x: cute.Tensor, recv_from: cute.Tensor, num_recv: cute.Tensor, fault: cute.Tensor,
               row_bytes: Int32):
        dtype = recv_x.element_type
        ROW_BYTES = Int64(row_bytes)  # rows are row_bytes apart: a full row, or a packed FP8 row
        NV = row_bytes // VECTOR_BYTES
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % WARP
        base = recv_x.iterator.toint()
        C = recv_x.shape[0]
        # After a fault num_recv and recv_from may be stale or partial: copy nothing. The bounds are
        # checked anyway, so no value read here can send a copy outside the buffer.
        n = Int32(0)
        if ld_volatile_i32(fault.iterator.toint()) == Int32(0):
            n = num_recv[0]
            if n > C:
                n = C
        for s in range(bid * WPC + tid // WARP, n, NCTA * WPC):
            f = recv_from[s]
            if f >= Int32(0):
                if f < C:
                    copy_row_warp(dtype, base + Int64(f) * ROW_BYTES, base + Int64(s) * ROW_BYTES, NV, lane)
