"""Reduced combine, phase 2 of 2, on the token's rank: out[t] = the sum of token t's partial rows.

Waits until every peer has raised ``signals[SIGNAL_COMBINE, peer]`` to 2 * epoch (its phase 1,
kernels/reduce_push.py, has pushed all its partial rows; bounded, a peer that never arrives is
recorded in ``fault``). Then a warp per (token, part of the row) (parts only when there are fewer
tokens than warps: every read here is local) lists the partial rows ``partials[t * R + d]`` of the
ranks d holding at least one kept pair of the token, in the order of each rank's first kept k, and
sums them in fp32 with weight 1 (``weighted_sum_rows``: 1 * p is exact, so this is the plain fp32 sum
in that order), then stores the row dtype: the order of ``cute_ep.reference.reference_combine_reduced``.
A token with no kept pair gets zeros. The last CTA to finish advances epochs[OP_COMBINE].
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_ep.kernels.base import CombineFamily
from cute_ep.kernels.buffers import DONE_COMBINE, SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import OP_COMBINE, REDUCED_GRID_FACTOR
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import row_space
from cute_ep.kernels.rowsum import weighted_sum_rows
from cute_ep.kernels.signals import fault_free, signal_and_wait_peers


class PartialSumKernel(CombineFamily):
    """Phase 2 of the reduced combine (see the module docstring); every size is a run-time argument."""

    grid_factor = REDUCED_GRID_FACTOR
    ctas_per_sm = REDUCED_GRID_FACTOR  # the grid is REDUCED_GRID_FACTOR CTAs per SM of the budget
    # (so 128 registers a thread: the row sum keeps at most 4 pieces per lane, kernels/rowsum.py)

    @cute.kernel
    def kernel(self, p: EpParams):
        R, K, El = p.world_size, p.topk, p.experts_per_rank
        partials, dtype = p.partials, self.dtype
        # my_addr / my_weight: the token's partial rows, in summation order
        lane, gwarp, NWARPS, my_addr, my_weight, NV, ROW_BYTES, epoch = self.begin(p)

        # Wait only: every peer's phase 1 raised its signal to 2 * epoch after its last partial row.
        signal_and_wait_peers(p, Int32(SIGNAL_COMBINE), epoch * 2, Int32(OP_COMBINE), epoch, Int32(0))
        work = Int32(0)
        if fault_free(p.fault):
            work = p.num_tokens
        parts, span = self.row_split(work, NV, NWARPS, Int32(1))  # every read here is local

        partial_rows, out_rows = row_space(partials, ROW_BYTES), row_space(p.out, ROW_BYTES)

        for u in range(gwarp, work * parts, NWARPS):
            t, v_begin, v_end = self.part_of(u, parts, span, NV)
            # A rank's partial enters at its first kept k (kept: id >= 0 and slot >= 0).
            n = Int32(0)
            for k in range(K):
                e = p.topk_idx[t, k]
                if e >= 0:
                    if p.scatter[t, k] >= 0:
                        d = e // El
                        first = Int32(1)
                        for k2 in range(k):
                            e2 = p.topk_idx[t, k2]
                            if e2 >= 0:
                                if e2 // El == d:
                                    if p.scatter[t, k2] >= 0:
                                        first = Int32(0)
                        if first != 0:
                            if lane == 0:
                                my_addr[n] = partial_rows.row(t * R + d)
                                my_weight[n] = Float32(1.0)
                            n = n + 1
            cute.arch.sync_warp()
            weighted_sum_rows(dtype, my_addr, my_weight, n, v_begin, v_end, lane, out_rows.row(t),
                              max_pieces=4)
            cute.arch.sync_warp()

        self.finish(p, Int32(DONE_COMBINE), epoch)


profiler_name(PartialSumKernel.kernel, "partial_sum")
