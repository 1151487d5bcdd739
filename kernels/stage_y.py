"""Staging kernel: the caller's expert outputs ``y`` into the symmetric ``recv_y`` combine reads.

Launched first in a combine whose ``y_rows`` is not 0 (the caller's y is not ``recv_y`` itself) and whose
variant reads ``recv_y`` (kernels/variants.py, ``reads_y``), on the same stream, so every row is in place
before the combine kernel raises its start signal to the peers.
Rows [0, n) are copied, a warp per row (grid-stride): n = ``y_rows`` when positive; when negative the
latest dispatch's ``num_recv``, at most ``-y_rows``. Row r comes from row r of y, or with ``y_gather``
from row ``y_slot[r]`` (so the low-latency combine reads DeepEP's padded layout, only the rows
received). Why on the device: after a sync-free dispatch the host does not know the count, and y covers
the worst case (every row the buffer could receive), mostly rows nobody received; a host-side copy moved
them all. n is clamped to the capacity, and nothing is copied after a fault.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.config import VECTOR_BYTES, WARP
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import copy_row_warp, row_space
from cute_ep.kernels.signals import fault_free


class StageYKernel(EpKernel):
    """The staging kernel (see the module docstring); every size is a run-time argument."""

    threads = 512

    def grid_ctas(self, p: EpParams):
        """Four CTAs per SM of the budget (a local copy before the combine; torch's copy it replaces took
        any SM). Measured: with 2 per SM 32768 rows of 7168 bf16 took ~260 us against torch's 222 for the
        same rows (one H200); with 4 per SM about 32800 rows added ~258 us to a combine at 4 ranks (4x
        H200), where torch's copy of 131072 rows took 882 us."""
        return p.num_sms * 4

    @cute.kernel
    def kernel(self, p: EpParams):
        dtype = self.dtype
        row_bytes = p.hidden * (dtype.width // 8)
        NV = row_bytes // VECTOR_BYTES
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        given, staged = row_space(p.y, row_bytes), row_space(p.recv_y, row_bytes)
        n = Int32(0)
        if fault_free(p.fault):
            n = p.y_rows
            if n < 0:  # the device's count of the latest dispatch, within the caller's rows
                n = p.num_recv[0]
                if n > -p.y_rows:
                    n = -p.y_rows
            if n > p.capacity:
                n = p.capacity
        for r in range(bid * WPC + tid // WARP, n, NCTA * WPC):
            src = Int64(r)
            if p.y_gather != 0:
                src = p.y_slot[r]
            copy_row_warp(dtype, given.row(src), staged.row(r), NV, tid % WARP)


profiler_name(StageYKernel.kernel, "stage_y")
