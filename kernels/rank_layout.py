"""Rank-layout layout kernel: the layout kernel (kernels/layout.py) compiled with ``by_rank``.

It takes a lane per token instead of per pair: counts each warp's tokens per destination rank with a
ballot per rank and gives each (token, destination rank) one row. Compiled apart rather than as a
run-time branch so that the expert layout's kernel carries none of it: as one kernel with a run-time
branch, the expert layout's kernel went from 79.1 to 137.6 us at 4096 tokens (2x H200) when an earlier
form of the rank steps (shuffles per pair) was added.

How its CTAs learn where their rows go (``meet``): a row's place on rank d is the rows lower source ranks send
to d, then this rank's earlier CTAs' rows for d. Every CTA puts its own tokens per destination rank and its
invalid pairs, each word tagged with the layout epoch, into ``layout_words`` on every rank, and waits for
every CTA's words of every rank. So no CTA waits for another CTA of its rank to gather the counts and hand
them out (the expert layout's leader, whose exchange and offsets a decode dispatch waited for: 7 us at EP2,
docs/results.md). The count row of ``counts`` still travels, by the leader (the last CTA to arrive) once its
words are in, for ``tokens_per_expert`` and the push combine (kernels/rank_push.py): in a dispatch one warp of
the leader puts it after its own tokens (at decode it has none: it puts while the others send), and the
leader awaits the peers' after its CTA's arrival; no other CTA waits for it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.config import OP_LAYOUT, WARP
from cute_ep.kernels.layout import (
    LayoutKernel,
    await_count_rows,
    input_verdict,
    leader_done,
    put_count_row,
    warp_bases,
)
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.ptx import global_timer_ns, ld_volatile_i32, ld_volatile_i64
from cute_ep.kernels.rows import element, element_addr
from cute_ep.kernels.signals import SIGNAL_SET, fault_free, record_fault


@cute.jit
def announce_cta_counts(p: EpParams, rhist: cute.Tensor, flags: cute.Tensor, NW: Int32, epoch: Int64,
                        tid: Int32, NT: cutlass.Constexpr):
    """Every thread: this CTA's tokens bound for each rank d (its histogram warps' ``rhist`` summed) and
    its invalid pairs (flags[0]), as ``(epoch << 32) | n``, into ``layout_words[epoch % 2, rank, CTA, d]``
    (d = R: the invalid pairs) on every rank, this one included; nothing after a fault."""
    R = p.world_size
    bid, _, _ = cute.arch.block_idx()
    parity = Int32(epoch % Int64(2))
    if fault_free(p.fault):
        for j in range(tid, R * (R + 1), NT):
            q = j // (R + 1)
            d = j % (R + 1)
            n = flags[0]
            if d < R:
                n = Int32(0)
                for w in range(NW):
                    n = n + rhist[w * R + d]
            word = element(p.layout_words, (parity, p.rank, bid, d))
            nvshmem_cute.signal_op(word, (epoch << 32) | Int64(n), SIGNAL_SET, q)


@cute.jit
def await_cta_counts(p: EpParams, sums: cute.Tensor, epoch: Int64, tid: Int32, NT: cutlass.Constexpr):
    """Every thread, a row of ``layout_words`` (source rank s, CTA c) at a time: a bounded wait until all
    R + 1 words carry this epoch (a source that never writes them is recorded in ``fault``), then into
    shared memory: ``sums[d]`` the rows this CTA's first row on rank d comes after (lower source ranks'
    and this rank's earlier CTAs'), ``sums[R + s]`` source s's invalid pairs, ``sums[2R]`` the rows this
    rank receives. ``sums`` is zeroed by the caller; ends with a CTA barrier."""
    R, rank = p.world_size, p.rank
    bid, _, _ = cute.arch.block_idx()
    NCTA, _, _ = cute.arch.grid_dim()
    parity = Int32(epoch % Int64(2))
    timeout_ns = Int64(p.timeout_ms) * 1000000
    if fault_free(p.fault):
        for j in range(tid, R * NCTA, NT):
            s = j // NCTA
            c = j % NCTA
            # Why volatile loads of the whole row at once: they stay in flight together; each word is
            # complete in itself (the epoch in its high half), so no load has to be ordered after another.
            state = Int32(0)  # 0: waiting, 1: every word in, 2: timed out
            start = global_timer_ns()
            while state == Int32(0):
                missing = Int32(0)
                for d in range(R + 1):
                    if ld_volatile_i64(element_addr(p.layout_words, (parity, s, c, d))) >> 32 != epoch:
                        missing = missing + 1
                if missing == 0:
                    state = Int32(1)
                else:
                    if global_timer_ns() - start > timeout_ns:
                        state = Int32(2)
            if state == Int32(2):
                record_fault(p.fault, Int32(OP_LAYOUT), s, epoch)
            else:
                before = Int32(0)  # rows of lower source ranks, then of this rank's earlier CTAs
                if s < rank:
                    before = Int32(1)
                if s == rank:
                    if c < bid:
                        before = Int32(1)
                for d in range(R + 1):
                    word = ld_volatile_i64(element_addr(p.layout_words, (parity, s, c, d)))
                    n = Int32(word & Int64(0xFFFFFFFF))
                    if n != 0:
                        if d == R:
                            cute.arch.atomic_add(sums.iterator + R + s, n)
                        else:
                            if before != 0:
                                cute.arch.atomic_add(sums.iterator + d, n)
                            if d == rank:
                                cute.arch.atomic_add(sums.iterator + 2 * R, n)
    cute.arch.sync_threads()


@cute.jit
def cta_verdict(p: EpParams, sums: cute.Tensor, flags: cute.Tensor, bid: Int32):
    """One thread of every CTA, once every CTA's words are in: how many ranks sent invalid pairs and the
    lowest (``sums[R + s]``), into flags[1] and ``input_fault`` (every CTA writes the same values, so each
    reads its own before it sends); CTA 0 also writes ``num_recv`` (0 for a refused call)."""
    R = p.world_size
    invalid = cute.make_tensor(sums.iterator + R, cute.make_layout((R, 1)))  # source s's at [s, 0]
    ranks = input_verdict(p, flags, invalid, Int32(0), False)
    if bid == 0:
        rows = sums[2 * R]
        if ranks != 0:
            rows = Int32(0)
        p.num_recv[0] = rows


class RankLayoutKernel(LayoutKernel):
    """The rank layout's layout kernel (see the module docstring)."""

    by_rank = True

    @cute.kernel
    def kernel(self, p: EpParams):
        self.route(p)

    @cute.jit
    def meet(self, p: EpParams, hist: cute.Tensor, colsum: cute.Tensor, rhist: cute.Tensor,
             flags: cute.Tensor, scan: cute.Tensor, NW: Int32, epoch: Int64, t_first: Int32, t_end: Int32,
             warp: Int32, lane: Int32):
        """Steps 2 and 3 of the rank layout, by every thread of every CTA (the module docstring): the CTA's
        words out, its count row published (the last CTA to arrive leads), an FP8 dispatch's first token
        per warp cast (``ahead``), every CTA's words awaited; then the verdict (flags[1]), CTA 0's layout
        epoch and status mirror (``leader_done``), the leader's count row made and out (a dispatch's leader
        puts it in ``before_arrival``), and each histogram warp's first row per destination rank in
        ``rhist``. Returns (this CTA leads, ``ahead``'s result)."""
        R = p.world_size
        NT = self.threads
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        announce_cta_counts(p, rhist, flags, NW, epoch, tid, NT)
        self.publish_counts(p, hist, rhist, flags, NW, epoch)
        leader = flags[2] != 0
        got_ahead = Int32(0)
        if cutlass.const_expr(self.ahead is not None):
            got_ahead = self.ahead(p, Int64(-1), t_first, t_end, warp, lane)
        # The sums go where the expert histograms were (published by now): 2 R + 1 <= NW * E ints for every
        # world size up to MAX_WORLD_SIZE (kernels/config.py), whatever the experts per rank.
        sums = hist
        for i in range(tid, 2 * R + 1, NT):
            sums[i] = Int32(0)
        cute.arch.sync_threads()
        await_cta_counts(p, sums, epoch, tid, NT)
        if tid == 0:
            cta_verdict(p, sums, flags, bid)
        cute.arch.sync_threads()
        if bid == 0:
            leader_done(p, epoch, tid)  # every CTA of this rank read the epoch before its words went out
        if leader:
            # After the words: every peer has entered this call, so its previous call is done with its
            # count rows (kernels/layout.py: the order between calls).
            self.count_row_from_totals(p, tid)
            if cutlass.const_expr(not self.sends_after):  # a dispatch's leader puts it in ``before_arrival``
                put_count_row(p, epoch, warp, NT // WARP)
        warp_bases(sums, rhist, R, NW, tid, NT)
        cute.arch.sync_threads()
        return leader, got_ahead

    @cute.jit
    def after_place(self, p: EpParams, leader, epoch: Int64, accepted: Int32, tid: Int32):
        """The leader, every thread, once its CTA's slots are placed: ``finish`` (a dispatch, with
        ``sends_after``, instead puts the count row in ``before_arrival`` and calls ``finish`` after its
        CTA's arrival)."""
        if cutlass.const_expr(not self.sends_after):
            if leader:
                self.finish(p, epoch, accepted, tid)

    @cute.jit
    def before_arrival(self, p: EpParams, epoch: Int64, tid: Int32):
        """A dispatch's leader, every thread, after its own sends: the count row out to every peer by the
        CTA's last warp, the one the send loop gives the fewest tokens (at 128 tokens none, so it puts at
        once). Why after the send loop: put before it, the decode dispatch was faster, but there its code
        made ptxas spill in this kernel (36 bytes against 4) and cost the FP8 dispatch with many tokens,
        which never runs it. EP2, 2x H200, 24 SMs: FP8 at 4096 / 8192 tokens 169 / 306 us here against
        183 / 336 before the loop; 128 tokens 26.1 us against 24.6 (docs/results.md)."""
        if tid // WARP == self.threads // WARP - 1:
            put_count_row(p, epoch, Int32(0), 1)

    @cute.jit
    def finish(self, p: EpParams, epoch: Int64, accepted: Int32, tid: Int32):
        """The leader, every thread: every peer's count row awaited, then ``tokens_per_expert`` (a local
        expert's column summed over the sources; 0 for a refused call). Why after the leader's sends and
        its CTA's arrival in a dispatch: the peers' rows travel meanwhile, and the last CTA's completion
        signal does not wait for the leader's wait and sum (up to 1.3 us after its sends, EP2, 128
        tokens)."""
        R, El, rank = p.world_size, p.experts_per_rank, p.rank
        await_count_rows(p, epoch, tid, self.threads)
        for le in range(tid, El, self.threads):
            rows = Int32(0)
            if accepted != 0:
                for s in range(R):
                    rows = rows + ld_volatile_i32(element_addr(p.counts, (s, rank * El + le)))
            p.tokens_per_expert[le] = rows


profiler_name(RankLayoutKernel.kernel, "rank_layout")
