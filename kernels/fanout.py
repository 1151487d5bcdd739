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
from cutlass import Int32

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.config import VECTOR_BYTES, WARP
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import copy_row_warp, row_space
from cute_ep.kernels.signals import fault_free


class FanoutKernel(EpKernel):
    """The fan-out kernel (see the module docstring); every size is a run-time argument."""

    # 16 warps per CTA: a warp copies one row with 8 pieces per lane in flight, so the bytes in flight per
    # SM grow with the warps. EP2 on 2x H200, expert layout, 24 SMs, dispatch call at 4096 / 8192 tokens:
    # 8 warps 490.2 / 953.1 us, 16 warps 448.4 / 841.8, 32 warps 532.5 / 838.8 (one run).
    threads = 16 * WARP

    @cute.kernel
    def kernel(self, p: EpParams):
        dtype = p.recv_x.element_type
        row_bytes = p.hidden * (dtype.width // 8)
        if p.fp8 != 0:
            row_bytes = p.fp8_row_bytes  # packed FP8 rows in the same memory
        NV = row_bytes // VECTOR_BYTES
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % WARP
        recv_x = row_space(p.recv_x, row_bytes)
        C = p.capacity
        # After a fault num_recv and recv_from may be stale or partial: copy nothing. The bounds are
        # checked anyway, so no value read here can send a copy outside the buffer.
        n = Int32(0)
        if fault_free(p.fault):
            n = p.num_recv[0]
            if n > C:
                n = C
        for s in range(bid * WPC + tid // WARP, n, NCTA * WPC):
            f = p.recv_from[s]
            if f >= Int32(0):
                if f < C:
                    copy_row_warp(dtype, recv_x.row(f), recv_x.row(s), NV, lane)


profiler_name(FanoutKernel.kernel, "fanout")
