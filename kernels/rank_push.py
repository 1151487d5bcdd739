"""Rank-layout combine by push, phase 1 of 2 (variant "rank+reduced", kernels/variants.py): each received
row goes back to its token's rank as it is.

The rank layout's rows are one per (token, destination rank), already weighted and reduced over this
rank's experts by the caller, so what the reduced combine's phase 1 sums here (kernels/reduce_push.py) is
a copy: row q of the caller's y (``y``, or ``y[y_slot[q]]`` with ``y_gather``; ``recv_y`` when ``y_rows``
is 0), received from rank s for its token t (``recv_src[q]`` = s * M + t), is stored into row t * R + rank
of rank s's ``partials``. Phase 2 (``RankSumKernel``, kernels/rank_combine.py) sums a token's rows there
in ascending rank: the pull combine's sum over the same rows, bit for bit.

Why: the pull combine reads ``recv_y`` on every peer, so a caller's y held in another tensor is copied
there first (the staging kernel, or torch's copy: about 28 us per 4096 rows of 7168 bf16 on one H200);
here y is read where it is, by this rank only, and a store to a peer does not wait for an answer as a
load from one does.

Start barrier as the reduced combine's (a peer may still be summing its previous call's partial rows).
The rows pushed: the latest dispatch's ``num_recv`` (its source tags), at most the capacity and the rows
y holds (|``y_rows``|). A warp per (row, ``CHUNK_BYTES`` of it), grid-stride: stored through the peer
pointer on this node; to another node copied into this warp's staging row, then ``put_warp``. The last CTA
to finish raises ``signals[SIGNAL_COMBINE, rank]`` on every peer to 2 * epoch after the CTAs' sends are
complete (phase 2 waits for it); phase 2 advances the epoch.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.base import CombineFamily
from cute_ep.kernels.buffers import DONE_PUSH, SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import OP_COMBINE, REDUCED_GRID_FACTOR
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import CHUNK_BYTES, RowSpace, copy_bytes_warp, row_space, row_view
from cute_ep.kernels.signals import cta_arrives_last, fault_free, signal_and_wait_peers, signal_peers


class RankPushKernel(CombineFamily):
    """Phase 1 of the rank layout's push combine (see the module docstring); every size is a run-time
    argument."""

    grid_factor = REDUCED_GRID_FACTOR  # as the reduced combine's phase 1: its staging rows, one a warp
    ctas_per_sm = REDUCED_GRID_FACTOR

    @cute.kernel
    def kernel(self, p: EpParams):
        R, L, M, rank = p.world_size, p.local_world_size, p.max_tokens, p.rank
        lane, gwarp, NWARPS, _, _, _, ROW_BYTES, epoch = self.begin(p)
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        last = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(1), 4)  # arrived last

        signal_and_wait_peers(p, Int32(SIGNAL_COMBINE), epoch * 2 - 1, Int32(OP_COMBINE), epoch,
                              Int32(bid == 0))  # CTA 0 signals, every CTA waits
        rows = self.rows_pushed(p)
        given = p.recv_y.iterator.toint()
        if p.y_rows != 0:
            given = p.y.iterator.toint()
        y_rows = RowSpace(given, ROW_BYTES)
        partial_rows = row_space(p.partials, ROW_BYTES)
        stage_row = row_space(p.stage, ROW_BYTES).row(gwarp)  # one per warp (EpConfig.stage_rows)
        chunks = Int32((ROW_BYTES + CHUNK_BYTES - 1) // CHUNK_BYTES)

        for u in range(gwarp, rows * chunks, NWARPS):
            q = u // chunks
            at = (u - q * chunks) * CHUNK_BYTES
            size = Int32(ROW_BYTES) - at
            if size > CHUNK_BYTES:
                size = Int32(CHUNK_BYTES)
            src = p.recv_src[q]  # s * M + t
            owner = src // M
            if owner < R:
                src_row = Int64(q)
                if p.y_gather != 0:
                    src_row = p.y_slot[q]
                row = (src - owner * M) * R + rank  # token t's row from this rank
                if owner // L == rank // L:
                    copy_bytes_warp(self.dtype, y_rows.row(src_row) + at,
                                    partial_rows.on_peer(owner).row(row) + at, size, lane)
                else:
                    copy_bytes_warp(self.dtype, y_rows.row(src_row) + at, stage_row + at, size, lane)
                    cute.arch.sync_warp()  # the put reads what every lane stored
                    elems = size // (self.dtype.width // 8)
                    nvshmem_cute.put_warp(row_view(self.dtype, partial_rows.row(row) + at, elems),
                                          row_view(self.dtype, stage_row + at, elems), owner)
                    cute.arch.sync_warp()  # the staging row is rewritten for the next chunk

        if cta_arrives_last(p, Int32(DONE_PUSH), last, tid) != 0:
            signal_peers(p, Int32(SIGNAL_COMBINE), epoch * 2)  # every row of this rank is in place

    @cute.jit
    def rows_pushed(self, p: EpParams):
        """The rows to push: the latest dispatch's count, at most the capacity and y's rows; none after a
        fault."""
        n = Int32(0)
        if fault_free(p.fault):
            n = p.num_recv[0]
            if n > p.capacity:
                n = p.capacity
            if p.y_rows > 0:
                if n > p.y_rows:
                    n = p.y_rows
            if p.y_rows < 0:
                if n > -p.y_rows:
                    n = -p.y_rows
        return n


profiler_name(RankPushKernel.kernel, "rank_push")
