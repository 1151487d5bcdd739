"""Rank-layout combine by push, phase 1 of 2 (variant "rank+reduced", kernels/variants.py): each received
row goes back to its token's rank as it is.

The rank layout's rows are one per (token, destination rank), already weighted and reduced over this
rank's experts by the caller, so what the reduced combine's phase 1 sums here (kernels/reduce_push.py) is
a copy: row q of the caller's y (``y``, or ``y[y_slot[q]]`` with ``y_gather``; ``recv_y`` when ``y_rows``
is 0), received from rank s != this rank for its token t (``recv_src[q]`` = s * M + t), is stored into row
t * R + rank of rank s's ``partials``. Phase 2 (``RankSumKernel``, kernels/rank_combine.py) sums a token's
rows there in ascending rank, its own rank's read from y where they are (so they are not copied): the pull
combine's sum over the same rows, bit for bit.

Why: the pull combine reads ``recv_y`` on every peer, so a caller's y held in another tensor is copied
there first (the staging kernel, or torch's copy: about 28 us per 4096 rows of 7168 bf16 on one H200);
here y is read where it is, by this rank only, and a store to a peer does not wait for an answer as a
load from one does.

Start barrier as the reduced combine's (a peer may still be summing its previous call's partial rows).
The rows pushed: the latest dispatch's ``num_recv`` (its source tags), at most the capacity and the rows
y holds (|``y_rows``|), but for the block this rank received from itself (``own_block``, from the layout's
counts). A warp per (row, ``CHUNK_BYTES`` of it), grid-stride: stored through the peer
pointer on this node; to another node copied into this warp's staging row, then ``put_warp``. The last CTA
to finish raises ``signals[SIGNAL_COMBINE, rank]`` on every peer to 2 * epoch after the CTAs' sends are
complete (phase 2 waits for it); phase 2 advances the epoch.
"""

from __future__ import annotations

import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.base import CombineFamily
from cute_ep.kernels.buffers import DONE_PUSH, SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import REDUCED_GRID_FACTOR
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import CHUNK_BYTES, RowSpace, copy_bytes_warp, row_space, row_view
from cute_ep.kernels.signals import cta_arrives_last, fault_free, signal_peers


class RankPushKernel(CombineFamily):
    """Phase 1 of the rank layout's push combine (see the module docstring); every size is a run-time
    argument."""

    grid_factor = REDUCED_GRID_FACTOR  # as the reduced combine's phase 1: its staging rows, one a warp
    ctas_per_sm = REDUCED_GRID_FACTOR

    @cute.kernel
    def kernel(self, p: EpParams):
        R, M, rank = p.world_size, p.max_tokens, p.rank
        lane, gwarp, NWARPS, _, _, _, ROW_BYTES, epoch = self.begin(p)
        tid, _, _ = cute.arch.thread_idx()
        last = self.start_push(p, epoch)  # the start barrier; the flag cta_arrives_last answers in
        rows = self.rows_pushed(p)
        own_begin, own_rows = self.own_block(p, rows)
        partial_rows = row_space(p.partials, ROW_BYTES)
        stage_row = row_space(p.stage, ROW_BYTES).row(gwarp)  # one per warp (EpConfig.stage_rows)
        chunks = Int32((ROW_BYTES + CHUNK_BYTES - 1) // CHUNK_BYTES)

        # The rows of other ranks only: a unit of this rank's own block would cost a warp a load's latency
        # to skip (28 us of a one-rank combine of 4096 rows on one H200, where every row is its own).
        for u in range(gwarp, (rows - own_rows) * chunks, NWARPS):
            q = u // chunks
            at = (u - q * chunks) * CHUNK_BYTES
            if q >= own_begin:
                q = q + own_rows
            size = Int32(ROW_BYTES) - at
            if size > CHUNK_BYTES:
                size = Int32(CHUNK_BYTES)
            src = p.recv_src[q]  # s * M + t
            owner = src // M
            if owner < R:
                if owner != rank:  # this rank's own rows are summed where they are (RankSumKernel)
                    src_addr = self.given_row(p, ROW_BYTES, q) + at
                    row = (src - owner * M) * R + rank  # token t's row from this rank
                    self.push_part(p, src_addr, partial_rows, row, at, size, owner, stage_row, lane)

        if cta_arrives_last(p, Int32(DONE_PUSH), last, tid) != 0:
            signal_peers(p, Int32(SIGNAL_COMBINE), epoch * 2)  # every row of this rank is in place

    @cute.jit
    def push_part(self, p: EpParams, src_addr: Int64, partial_rows: RowSpace, row: Int32, at: Int32,
                  size: Int32, owner: Int32, stage_row: Int64, lane: Int32):
        """Bytes [at, at + size) of a row, from ``src_addr`` into row ``row`` of rank ``owner``'s
        ``partials``: through its peer pointer on this node, else through this warp's staging row and
        ``put_warp`` (every lane calls it)."""
        L = p.local_world_size
        if owner // L == p.rank // L:
            copy_bytes_warp(self.dtype, src_addr, partial_rows.on_peer(owner).row(row) + at, size, lane)
        else:
            copy_bytes_warp(self.dtype, src_addr, stage_row + at, size, lane)
            cute.arch.sync_warp()  # the put reads what every lane stored
            elems = size // (self.dtype.width // 8)
            nvshmem_cute.put_warp(row_view(self.dtype, partial_rows.row(row) + at, elems),
                                  row_view(self.dtype, stage_row + at, elems), owner)
            cute.arch.sync_warp()  # the staging row is rewritten for the next chunk

    @cute.jit
    def own_block(self, p: EpParams, rows: Int32):
        """(first row, rows) of the block this rank received from itself, within the first ``rows``: the
        rank layout's rows are source-major, so it follows the rows of the lower source ranks (the
        layout's counts, column E + 1 + rank of each source's row)."""
        col = p.num_experts + 1 + p.rank
        begin = Int32(0)
        for s in range(p.rank):
            begin = begin + p.counts[s, col]
        n = p.counts[p.rank, col]
        if begin > rows:
            begin = rows
        if n > rows - begin:
            n = rows - begin
        return begin, n

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
