"""Assembly kernel: the rows a dispatch sends, put together from the caller's values and their per-row
words (FP8 values and their scales), before the dispatch kernels of the same launch read them.

Launched first in a dispatch whose ``assemble_rows`` is not 0, on the same stream. For each of the first
``assemble_rows`` tokens t (at most ``num_tokens``; none after a fault) row t of ``x`` becomes: bytes [0,
``assemble_end0``) from row t of ``assemble0`` (rows ``assemble_end0`` bytes apart), then
(``assemble_end1`` - ``assemble_end0``) / 4 words j from ``assemble1`` at word t * ``assemble_stride_t`` + j
* ``assemble_stride_j`` (any strides: DeepEP's FP8 scales come column-major), then zero words to the row's
end. Why: in torch the same row was an allocation and two copies per call (about 70 us of host time on an
H200 host), or one ``torch.cat`` whose strided input took 32 us of GPU time where the same bytes
contiguous took 16 (4096 rows of 7168 FP8 values and 56 scales).

A warp per (row, 4 KiB of its values) for the values (``rows.copy_rows_warps``, as the delivery kernel
copies); then a warp per row gathers its words and zeroes the padding.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from cute_ep.kernels.base import RowCopyKernel
from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import copy_rows_warps, gather_words_warp, row_space
from cute_ep.kernels.signals import fault_free


class AssembleKernel(RowCopyKernel):
    """The assembly kernel (see the module docstring); every size is a run-time argument."""

    @cute.kernel
    def kernel(self, p: EpParams):
        warp, num_warps, lane = self.warps()
        row_bytes = p.hidden * (self.dtype.width // 8)
        rows = row_space(p.x, row_bytes)
        n = Int32(0)
        if fault_free(p.fault):
            n = p.assemble_rows
            if n > p.num_tokens:
                n = p.num_tokens
        width = p.assemble_end0
        copy_rows_warps(self.dtype, row_space(p.assemble0, width), rows, n, width, warp, num_warps, lane)
        words = (p.assemble_end1 - width) // 4
        pad = (row_bytes - p.assemble_end1) // 4
        # the words as the caller laid them out: [tokens, words] with its strides
        given = cute.make_tensor(p.assemble1.iterator, cute.make_layout(
            (p.num_tokens, words), stride=(p.assemble_stride_t, p.assemble_stride_j)))
        if words + pad > 0:
            for r in range(warp, n, num_warps):
                gather_words_warp(given[r, None], rows.row(r) + width, words, pad, lane)


profiler_name(AssembleKernel.kernel, "assemble")
