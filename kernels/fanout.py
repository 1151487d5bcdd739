"""Fan-out kernel: the receiver's half of dispatch's rank de-duplication.

Under dedup a token bound for several experts of one rank crosses the link once, into the slot of its first
such (token, k) pair, the group's primary; the dispatch lists the group's later members under it
(``recv_from[q]`` = -1 - n for a primary q of n pairs, ``recv_group[q, m]`` for m in [1, n): the member's
slot, -1 if it was dropped for capacity; kernels/dispatch.py). A group on its own rank received every row
itself.

Launched right after the dispatch kernel on the same stream (dispatch ends only when every peer's rows and
records have arrived). With few received slots per warp (``FEW_SLOTS_PER_WARP``) a warp per slot copies a
member's row from its primary (its ``recv_from``, the primary's slot). Otherwise each warp reads the records
(``recv_from``, ``recv_src``) of 32 of its slots in one load round, lane j slot q0 + j * (the grid's
warps), and for each primary among them whose row came from another rank (its source tag outside this
rank's) loads the row once and stores it into every kept member: local memory, no link. Nothing to do
under the per-pair primitives, where every pair's row arrived itself.

Why by primaries: a warp per member slot read the primary's row once per member (about 3 reads of each row
that crossed the link at EP2, top-8 of 256), most of them from HBM since a group's slots lie in different
experts' ranges; a primary's members from one load of each piece is the dispatch's own copy pattern
(``copy_row_to_lanes``). Why 32 records a round: a warp that read one slot's record, then copied, then read
the next, waited a memory latency per slot. Rows are ``row_bytes`` apart: a row of the buffer's dtype, or a
packed FP8 row (kernels/quantize.py) in the same memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.config import ALGO_DEDUP, VECTOR_BYTES, WARP
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import copy_row_to_lanes, copy_row_warp, row_space
from cute_ep.kernels.signals import fault_free

# Up to this many received slots per warp of the grid (128 tokens of top-8 at EP2 on 24 SMs are about 2.7)
# the fan-out goes a warp per member slot (``copy_by_members``), beyond it by primaries. Why: with few rows a
# warp per primary stores its row ~3 times in turn while most warps idle; with many, a warp per member reads
# each row ~3 times, mostly from HBM. The expert-layout dispatch, us, by members against by primaries: one
# H200 with 2 ranks sharing it, 24 SMs, 128 tokens 47.2-47.7 against 50.3-50.6, 512 tokens (10.7 slots a
# warp) 97.2-98.1 against 97.9-98.4, 1024 tokens within 3 us with primaries ahead; 2x H200, 132 SMs, 4096
# tokens (15.5 slots a warp): 293.8 by members, 281.9 by primaries in the EP2 report before.
FEW_SLOTS_PER_WARP = 8


class FanoutKernel(EpKernel):
    """The fan-out kernel (see the module docstring); every size is a run-time argument."""

    # 16 warps per CTA: a warp copies a row with 8 pieces per lane in flight, so the bytes in flight per SM
    # grow with the warps. EP2 on 2x H200, expert layout, 24 SMs, dispatch call at 4096 / 8192 tokens, a
    # warp per member slot: 8 warps 490.2 / 953.1 us, 16 warps 448.4 / 841.8, 32 warps 532.5 / 838.8.
    threads = 16 * WARP
    # One CTA per SM by design: without the hint ptxas budgets 64 registers (two CTAs) and the warp per member
    # slot beside the walk by primaries spilled (4 bytes of stores and loads per thread).
    ctas_per_sm = 1

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
        # After a fault num_recv and recv_from may be stale or partial: copy nothing. The bounds are
        # checked anyway, so no value read here can send a copy outside the buffer.
        n = Int32(0)
        if fault_free(p.fault):
            n = p.num_recv[0]
            if n > p.capacity:
                n = p.capacity
        if p.algo != ALGO_DEDUP:  # only dedup sends a group's row once
            n = Int32(0)
        step = NCTA * WPC
        warp = bid * WPC + tid // WARP
        if n <= FEW_SLOTS_PER_WARP * step:
            self.copy_by_members(p, dtype, recv_x, warp, n, step, NV, lane)
        else:
            self.copy_by_primaries(p, dtype, recv_x, warp, n, step, NV, lane)

    @cute.jit
    def copy_by_members(self, p: EpParams, dtype: cutlass.Constexpr, recv_x, warp: Int32, n: Int32,
                        step: Int32, NV: Int32, lane: Int32):
        """Warp ``warp`` of the grid's ``step`` takes slots warp, warp + step, ... below n: a member whose
        row another rank sent to its primary (``recv_from`` = the primary's slot, >= 0) copies that row."""
        for s in range(warp, n, step):
            f = p.recv_from[s]
            if f >= Int32(0):
                if f < p.capacity:
                    copy_row_warp(dtype, recv_x.row(f), recv_x.row(s), NV, lane)

    @cute.jit
    def copy_by_primaries(self, p: EpParams, dtype: cutlass.Constexpr, recv_x, warp: Int32, n: Int32,
                          step: Int32, NV: Int32, lane: Int32):
        """Warp ``warp`` of the grid's ``step`` walks its slots below n 32 at a time and copies each primary's
        row whose source tag lies outside this rank's [lo, hi) (it came from another rank) into its
        members."""
        lo = p.rank * p.max_tokens * p.topk
        hi = lo + p.max_tokens * p.topk
        for q0 in range(warp, n, step * WARP):
            # Lane j reads the records of this warp's slot q0 + j * step: 32 of its slots in one load round.
            q = q0 + lane * step
            f, tag = Int32(-1), lo
            if q < n:
                f = p.recv_from[q]
                tag = p.recv_src[q]
            fans = Int32(0)
            if f <= Int32(-2):
                fans = Int32(1)
                if tag >= lo:
                    if tag < hi:
                        fans = Int32(0)  # this rank's own pairs received their rows themselves
            primaries = Int32(cute.arch.vote_ballot_sync(fans != 0))
            for _ in range(cute.arch.popc(primaries)):
                j = Int32(cute.arch.clz(cute.arch.brev(primaries)))  # the lowest primary left
                primaries = primaries & (primaries - 1)
                self.copy_to_members(p, dtype, recv_x, q0 + j * step, cute.arch.shuffle_sync(f, j), NV, lane)

    @cute.jit
    def copy_to_members(self, p: EpParams, dtype: cutlass.Constexpr, recv_x, q: Int32, f: Int32, NV: Int32,
                        lane: Int32):
        """The warp copies primary q's row (its ``recv_from`` f = -1 - n for a group of n pairs, its row from
        another rank) into each kept member of its list: lane j of each round holds member m0 + j."""
        members = Int32(-1) - f
        if members > p.topk:
            members = p.topk
        for m0 in range(0, members, WARP):
            m = m0 + lane
            dst = Int64(0)
            takes = Int32(0)
            if m >= Int32(1):
                if m < members:
                    s = p.recv_group[q, m]
                    if s >= Int32(0):
                        if s < p.capacity:
                            takes = Int32(1)
                            dst = recv_x.row(s)
            dests = Int32(cute.arch.vote_ballot_sync(takes != 0))
            if dests != 0:
                copy_row_to_lanes(dtype, recv_x.row(q), dst, dests, NV, lane)

profiler_name(FanoutKernel.kernel, "fanout")
