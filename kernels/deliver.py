"""Delivery kernel: the rows a dispatch received, copied out of the kernels' buffer into the caller's
tensors, each row's bytes split into up to three parts.

Launched after the dispatch kernels of a dispatch whose ``deliver_rows`` is not 0, in the same launch of
the module and on the same stream, so every row is in place (the dispatch kernel ends once every peer's
rows have arrived). Rows [0, n) of ``recv_x``, n = ``deliver_rows`` (at most the capacity; none after a
fault): bytes [0, deliver_end0) of row r go to row r of ``deliver0``, [deliver_end0, deliver_end1) to
``deliver1``, [deliver_end1, deliver_end2) to ``deliver2``; each tensor's rows are its part's width apart,
and a part whose end is its start is absent.

Why: a front whose caller keeps what it received (DeepEP's normal mode: the values, the FP8 scales, the
top-k ids and weights, each a tensor of its own, while the next dispatch overwrites the buffer) needs the
rows out of the buffer. Copied by torch, each part was an operation of its own, about 10 us of host time
per call on an H200 host, and a kernel boundary more.

A warp per (row, part, 4 KiB of the part), grid-stride; 128-bit pieces where the part's offset, width and
tensor allow (the values), 4-byte words otherwise (scales, ids, weights: widths of 4 bytes a column).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.config import WARP
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import ROW_COPY_UNROLL, copy_bytes_warp, row_space
from cute_ep.kernels.signals import fault_free

# Bytes a warp copies per unit of work: one unrolled round of the row copy (ROW_COPY_UNROLL 128-bit pieces a
# lane), so that the rows' last round does not leave most warps idle (4096 rows are 2.7 a warp of 1536).
CHUNK_BYTES = ROW_COPY_UNROLL * WARP * 16
# CTAs of 512 threads per SM of the op's budget for the local row copies around a dispatch (this kernel and
# kernels/assemble.py; they replace torch copies, which took the whole GPU): with 4, 96 CTAs at a 24-SM
# budget, 4096 rows of 7168 bf16 took 30.5 us against torch's 27.9 for the same bytes (one H200).
ROW_COPY_CTAS_PER_SM = 8


class DeliverKernel(EpKernel):
    """The delivery kernel (see the module docstring); every size is a run-time argument."""

    threads = 512

    def grid_ctas(self, p: EpParams):
        return p.num_sms * ROW_COPY_CTAS_PER_SM

    @cute.kernel
    def kernel(self, p: EpParams):
        row_bytes = p.hidden * (self.dtype.width // 8)
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        received = row_space(p.recv_x, row_bytes)
        n = Int32(0)
        if fault_free(p.fault):
            n = p.deliver_rows
            if n > p.capacity:
                n = p.capacity
        begin = Int32(0)
        for out, end in ((p.deliver0, p.deliver_end0), (p.deliver1, p.deliver_end1),
                         (p.deliver2, p.deliver_end2)):
            width = end - begin
            if width > 0:
                parts = row_space(out, width)
                chunks = (width + CHUNK_BYTES - 1) // CHUNK_BYTES
                for u in range(bid * WPC + tid // WARP, n * chunks, NCTA * WPC):
                    r = u // chunks
                    at = (u - r * chunks) * CHUNK_BYTES
                    size = width - at
                    if size > CHUNK_BYTES:
                        size = CHUNK_BYTES
                    copy_bytes_warp(self.dtype, received.row(r) + begin + at, parts.row(r) + at, size,
                                    tid % WARP)
            begin = end


profiler_name(DeliverKernel.kernel, "deliver")
