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

from cute_ep.kernels.base import RowCopyKernel
from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import copy_rows_warps, row_space
from cute_ep.kernels.signals import fault_free


class DeliverKernel(RowCopyKernel):
    """The delivery kernel (see the module docstring); every size is a run-time argument."""

    @cute.kernel
    def kernel(self, p: EpParams):
        warp, num_warps, lane = self.warps()
        received = row_space(p.recv_x, p.hidden * (self.dtype.width // 8))
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
                copy_rows_warps(self.dtype, received.from_byte(begin), row_space(out, width), n, width, warp,
                                num_warps, lane)
            begin = end


profiler_name(DeliverKernel.kernel, "deliver")
