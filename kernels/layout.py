"""Layout kernel: tokens per expert, the count exchange between ranks, receive offsets, scatter slots.

``num_sms`` CTAs per rank, each owning a contiguous range of tokens (``cta_tokens``): a kernel of its own,
or, for batches of at most ``layout_in_dispatch`` tokens, the first part of every CTA of the dispatch
launch (``route``; kernels/dispatch.py), which then sends the same tokens.
1. per-warp histograms of the CTA's (t, k) pairs per expert (shared-memory atomics), and the ids'
   values: each in [-1, E) and no expert twice in a token (checked here rather than on the host, which
   would cost a host sync). The count of invalid pairs travels with the count row (column E), so every
   rank learns that some rank's inputs were invalid and refuses the call alike: ``input_fault`` names how
   many ranks and the lowest, nothing is received, no slot is given, and the dispatch kernel moves no
   data; the epochs still advance, so the buffer stays usable and the host raises;
2. (the expert layout; the rank layout's steps 2 and 3 are below) each CTA writes its count row into its
   row of ``layout_parts`` and adds it into the totals row there, then arrives (``done[DONE_LAYOUT]``);
   the last CTA to arrive is the leader. It announces in ``layout_done`` that every CTA's counts are in
   (2 * epoch - 1), puts the rank's count row into row ``rank`` of every peer's symmetric
   ``counts[R, E + 1 + R]`` with ``put_signal_warp`` (raising ``signals[SIGNAL_COUNT, rank]`` there)
   and waits until every peer's row has arrived (signal >= this call's epoch), at most ``timeout_ms``
   per peer: a peer that never arrives is recorded in ``fault`` (kernels.signals) and the call does not
   advance its epoch, so the host raises instead of hanging;
3. the leader computes the expert-major offsets: the slot range of (dst rank d, local expert l, source s)
   starts at the sum of count[s'][d*El + l'] over (l', s') before (l, s) in l-major order — identical to
   ``cute_ep.reference.reference_layout`` (the sums over experts come from one CTA-wide prefix scan of
   the column sums) — writes this rank's first slot per expert into ``layout_parts`` and publishes
   (2 * epoch). Meanwhile every other CTA sums the earlier CTAs' counts (its first slot relative to this
   rank's) and then waits for the leader's offsets;
4. scatter slots: each warp walks its contiguous part of the CTA's pairs in row-major order, 32 at a time;
   a lane's slot is its warp's running base for the expert plus the number of earlier lanes with the same
   expert (``match_sync``, one instruction), so the order inside an (expert, source) group is the (t, k)
   order, deterministically.
Why many CTAs: one CTA of 1024 threads walked all T * K pairs; at 4096 tokens the walks took 65 us of the
expert layout's kernel on one H200 (58 us in the rank layout's), and a dispatch waited for them.

Capacity: an expert keeps its first ``expert_capacity`` rows in that order (source 0's first, each
source's in (t, k) order); a pair whose slot would be at or past its expert's ``send_limit`` is dropped
(scatter -1), and every rank adds the rows each expert dropped to ``dropped[e]`` (every rank sees
every count, so every rank counts the same; the host reads and resets it).

Rank layout (``RankLayoutKernel``, kernels/rank_layout.py: this kernel compiled with ``by_rank``;
DeepEP's receive layout: one row per (source rank, token) bound for a rank): a lane per token instead of
per pair, 32 tokens per warp step. Step 1 also counts, per warp, the tokens bound for each rank (a ballot
per rank over the step's tokens). Steps 2 and 3 (``RankLayoutKernel.meet``): every CTA puts its tokens
per destination rank and its invalid pairs, tagged with the epoch, into ``layout_words`` on every rank and
waits for every CTA's; from them it has its first row on each destination, the verdict and num_recv (the
column of this rank summed over the sources), with no leader in between. The count row still travels, its
columns E + 1 + d holding the tokens per destination rank, for tokens_per_expert and the push combine.
Step 4 gives each (token, destination rank) a row there (lower source ranks first, then this rank's tokens
in order: the warp's running base plus the earlier lanes in the rank's ballot), and every pair of the token
bound for that rank takes it. With a lane per pair and the token's earlier pairs found by global loads
this kernel took 301 us at 4096 tokens on 2x H200, 229 us with shuffles (the expert layout's: 79 us).
tokens_per_expert is a local expert's column of the count rows summed over the sources (that layout has
no expert capacity); no expert-major slot bases are written (send_offsets, cursor, send_limit stay the
expert layout's).

Outputs (device): scatter [T*K] int32 (-1: id -1 or dropped); in the expert layout send_offsets [E] and
cursor [E] int32 (first slot of this rank's rows for each expert; cursor is the atomic-mode allocator),
send_limit [E] int32 (end of each expert's kept slots); dropped [E] int32 (accumulated),
tokens_per_expert [E/R] and num_recv [1] int32 (rows this rank receives), input_fault [2] int32,
epochs[OP_LAYOUT] advanced by one; with own_routing, own_idx / own_w [T, K]: copies of topk_idx / topk_w
(the dispatch handle's). Host: with ``mirror_seq`` (a synced dispatch), the leader's last step (the rank
layout: CTA 0's, once the words are in) copies the status block into pinned host memory
(``mirror_status``): the host has the count, the verdict and the drops while the dispatch's rows still
move.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import DONE_LAYOUT, INPUT_FAULT_FIRST, INPUT_FAULT_RANKS, SIGNAL_COUNT, EpParams
from cute_ep.kernels.config import LAYOUT_SMEM_INTS, LAYOUT_THREADS, OP_LAYOUT, WARP
from cute_ep.kernels.layout_warps import TOKEN_REGS, count_pairs, count_tokens, place_pairs, place_tokens
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.ptx import fence_sys, ld_volatile_i32
from cute_ep.kernels.rows import element, element_addr
from cute_ep.kernels.scan import exclusive_scan_cta, prefix_at, sum_earlier_ctas
from cute_ep.kernels.signals import (
    SIGNAL_SET,
    fault_free,
    last_cta_arrives,
    record_fault,
    signal_and_wait_peers,
    signal_peers,
    wait_signal_ge,
)


@cute.jit
def copy_own_routing(p: EpParams, pair_ids: cute.Tensor, first: Int32, end: Int32, NT: cutlass.Constexpr):
    """Pairs [first, end) stepping by NT (a thread's share of its CTA's) of ``topk_idx`` / ``topk_w`` into
    ``own_idx`` / ``own_w``, the dispatch handle's own copy of the routing."""
    n = p.num_tokens * p.topk
    own_ids = cute.make_tensor(p.own_idx.iterator, cute.make_layout(n))
    own_w = cute.make_tensor(p.own_w.iterator, cute.make_layout(n))
    pair_w = cute.make_tensor(p.topk_w.iterator, cute.make_layout(n))
    for i in range(first, end, NT):
        own_ids[i] = pair_ids[i]
        own_w[i] = pair_w[i]


@cute.jit
def relative_warp_bases(parts: cute.Tensor, base_of: cute.Tensor, E: Int32, NW: Int32, bid: Int32,
                        colsum: cute.Tensor, tid: Int32, NT: cutlass.Constexpr):
    """The expert layout: each histogram warp's first slot per expert, relative to this rank's first one,
    replacing its count in ``base_of[w * E + e]``: the earlier CTAs' counts of the expert (``parts``' first
    E columns, summed into ``colsum``), then the CTA's earlier warps'."""
    sum_earlier_ctas(parts, Int32(0), E, bid, colsum, NT)
    warp_bases(colsum, base_of, E, NW, tid, NT)


@cute.jit
def warp_bases(first: cute.Tensor, base_of: cute.Tensor, ncol: Int32, NW: Int32, tid: Int32,
               NT: cutlass.Constexpr):
    """Each histogram warp's count per column in ``base_of[w * ncol + col]`` replaced by its first slot
    (row): ``first[col]`` (the CTA's first) plus the CTA's earlier warps' counts."""
    for col in range(tid, ncol, NT):
        run = first[col]
        for w in range(NW):
            c = base_of[w * ncol + col]
            base_of[w * ncol + col] = run
            run = run + c


@cute.jit
def cta_tokens(num_tokens: Int32, cta: Int32, ncta: Int32):
    """Tokens [first, end) of CTA ``cta`` of ``ncta``: contiguous ranges in CTA order whose sizes differ by
    at most one. The layout's CTAs count and place these tokens, and a dispatch with the layout folded in
    sends them from the same CTA (so it reads only slots its own CTA wrote)."""
    first = Int32(Int64(num_tokens) * Int64(cta) // Int64(ncta))
    end = Int32(Int64(num_tokens) * Int64(cta + 1) // Int64(ncta))
    return first, end


@cute.jit
def absolute_warp_bases(parts: cute.Tensor, BASES: Int32, base_of: cute.Tensor, E: Int32, NW: Int32,
                        tid: Int32, NT: cutlass.Constexpr):
    """The expert layout: every histogram warp's first slot per expert, relative to this rank's first
    (``base_of``), made absolute with the leader's bases (row ``BASES`` of ``parts``); ends with a CTA
    barrier."""
    for e in range(tid, E, NT):
        first = ld_volatile_i32(element_addr(parts, (BASES, e)))
        for w in range(NW):
            base_of[w * E + e] = base_of[w * E + e] + first
    cute.arch.sync_threads()


@cute.jit
def wait_for_leader(p: EpParams, value: Int64, epoch: Int64):
    """Thread 0 waits until ``layout_done`` reaches ``value`` (the leader's announcements), then a CTA
    barrier. The leader always gets there, within its own bounded waits for the peers' counts (one
    timeout_ms each), and a peer's timeout must be recorded there, not here: this bound is twice that and a
    second, only against a hang (a CTA of the launch never scheduled)."""
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
        timeout_ns = Int64(p.timeout_ms) * 2000000 + Int64(1000000000)
        if wait_signal_ge(element_addr(p.layout_done, 0), value, timeout_ns) == 0:
            record_fault(p.fault, Int32(OP_LAYOUT), p.rank, epoch)
    cute.arch.sync_threads()


@cute.jit
def exchange_counts(p: EpParams, epoch: Int64, tid: Int32, warp: Int32, NT: cutlass.Constexpr):
    """The leader's count exchange (every thread of it calls this; it ends with a CTA barrier): this
    rank's row of ``counts`` to every peer (``put_count_row``), then a bounded wait for every peer's row
    here (``await_count_rows``)."""
    put_count_row(p, epoch, warp, NT // WARP)
    await_count_rows(p, epoch, tid, NT)


@cute.jit
def put_count_row(p: EpParams, epoch: Int64, warp: Int32, warps: cutlass.Constexpr):
    """Warp ``warp`` of ``warps`` of the leader (every peer once over them): this rank's row of ``counts``
    into row ``rank`` of every peer's, raising ``signals[SIGNAL_COUNT, rank]`` there. After a fault (an
    earlier timed-out wait) nothing is sent."""
    R, rank = p.world_size, p.rank
    my_row = p.counts[rank, None]
    my_signal = element(p.signals, (SIGNAL_COUNT, rank))
    if fault_free(p.fault):
        for q in range(warp, R, warps):
            if q != rank:
                nvshmem_cute.put_signal_warp(my_row, my_row, my_signal, epoch, SIGNAL_SET, q)


@cute.jit
def await_count_rows(p: EpParams, epoch: Int64, tid: Int32, NT: cutlass.Constexpr):
    """Every thread of the leader: a bounded wait for every peer's count row here (a peer that never
    arrives is recorded in ``fault``; after a fault nothing is awaited); ends with a CTA barrier."""
    R, rank = p.world_size, p.rank
    if fault_free(p.fault):
        for q in range(tid, R, NT):
            if q != rank:
                arrived = wait_signal_ge(element_addr(p.signals, (SIGNAL_COUNT, q)), epoch,
                                         Int64(p.timeout_ms) * 1000000)
                if arrived == 0:
                    record_fault(p.fault, Int32(OP_LAYOUT), q, epoch)
    cute.arch.sync_threads()


@cute.jit
def announce_entry(p: EpParams) -> Int64:
    """The layout's part of a routed dispatch (``routed``: the slots and counts of the buffer's latest layout,
    reused; DeepEP's cached dispatch), first half: no counts, but the rows may land only in receive buffers
    whose ranks have entered this call (each may still read its rows of the previous one, and a layout's
    count exchange is what orders that otherwise). CTA 0 raises ``signals[SIGNAL_COUNT, rank]`` on every
    rank to this call's layout epoch, which it returns (every CTA gets it); ``await_entry`` is the second
    half. The dispatch's last CTA advances the layout epoch. Every thread of every CTA calls it."""
    bid, _, _ = cute.arch.block_idx()
    epoch = p.epochs[OP_LAYOUT] + Int64(1)
    if bid == 0:
        signal_peers(p, Int32(SIGNAL_COUNT), epoch)
    return epoch


@cute.jit
def await_entry(p: EpParams, epoch: Int64):
    """A routed dispatch's second half (``announce_entry``): every CTA waits until every rank has entered
    the call (bounded; a peer that never arrives is recorded as the layout's fault). Every thread of every
    CTA calls it; it ends with a CTA barrier."""
    signal_and_wait_peers(p, Int32(SIGNAL_COUNT), epoch, Int32(OP_LAYOUT), epoch, Int32(0))


@cute.jit
def input_verdict(p: EpParams, flags: cute.Tensor, invalid: cute.Tensor, col: Int32,
                  peers_wrote: cutlass.Constexpr):
    """One thread: how many ranks sent invalid pairs (``invalid[s, col]``, source s's; with ``peers_wrote``
    in memory peers wrote, read with volatile loads) and the lowest, into ``flags[1]`` and
    ``input_fault``; returns how many."""
    ranks = Int32(0)
    first = Int32(-1)
    for s in range(p.world_size):
        n = Int32(0)
        if cutlass.const_expr(peers_wrote):
            n = ld_volatile_i32(element_addr(invalid, (s, col)))
        else:
            n = invalid[s, col]
        if n != 0:
            if ranks == 0:
                first = s
            ranks = ranks + 1
    flags[1] = ranks
    p.input_fault[INPUT_FAULT_RANKS] = ranks
    p.input_fault[INPUT_FAULT_FIRST] = first
    return ranks


@cute.jit
def mirror_status(p: EpParams, lane: Int32):
    """A synced dispatch's status for the host (``mirror_seq`` not 0), by one warp of the layout's leader
    (the rank layout: of CTA 0) once this call's count, verdict, drops and layout epoch are final: the
    status block into ``status_mirror`` (pinned host memory), then ``mirror_seq`` into its last word,
    which the host polls (``StatusBlock.wait_mirror``; no copy, no stream sync). Why here and not after
    the dispatch: the host returns while the rows still move, as it would after DeepEP's count
    notification; the stream orders every later read of them. The mirrored dispatch epoch is the previous
    call's. Other CTAs may write fault words: volatile loads."""
    W = p.status_words
    words = cute.make_tensor(cute.recast_ptr(p.epochs.iterator, dtype=Int32), cute.make_layout(W))
    mirror = p.status_mirror
    cute.arch.sync_warp()  # lane 0's layout epoch, above, before the lanes read it
    for i in range(lane, W, WARP):
        mirror[i] = ld_volatile_i32(element_addr(words, i))
    fence_sys()  # each lane's words before the warp barrier, and so before lane 0's flag
    cute.arch.sync_warp()
    if lane == 0:
        mirror[W] = p.mirror_seq


@cute.jit
def leader_done(p: EpParams, epoch: Int64, tid: Int32):
    """The leader (the rank layout: CTA 0, once every CTA's words are in), every thread: the layout's epoch
    advanced (a timed-out call does not count as run), then for a synced dispatch the status mirrored to
    the host by warp 0 (``mirror_status``); the other warps go on to send (a layout folded into the
    dispatch)."""
    if tid == 0:
        if fault_free(p.fault):
            p.epochs[OP_LAYOUT] = epoch
    if p.mirror_seq != 0:
        if tid < WARP:
            mirror_status(p, tid)


class LayoutKernel(EpKernel):
    """The layout kernel (see the module docstring); every size is a run-time argument.

    ``num_sms`` CTAs of ``threads`` threads, as many as the dispatch kernel, which runs the same steps
    (``route``) in every CTA when the layout is folded into its launch."""

    by_rank = False  # compile-time: the rank layout's variant (kernels/rank_layout.py) is compiled apart
    threads = LAYOUT_THREADS
    # Compile-time: the CTA sends its tokens after ``route`` (a dispatch with the layout folded in), and
    # calls ``finish`` after them: the rank layout's leader then awaits the peers' count rows there.
    sends_after = False
    # Compile-time: work for a CTA while it waits for the leader's offsets, ``ahead(p, value, t_first,
    # t_end, warp, lane) -> Int32`` until ``layout_done`` reaches value, its result returned by ``route``
    # (a dispatch with the layout folded in casts its FP8 rows there: DispatchKernel.cast_ahead).
    ahead = None

    @cute.kernel
    def kernel(self, p: EpParams):
        self.route(p)

    @cute.jit
    def route(self, p: EpParams):
        """Steps 1-4 of the module docstring, by every thread of every CTA; each CTA counts and places the
        tokens ``cta_tokens`` gives it, ends with a CTA barrier. Returns (``ahead``'s result (else 0), 1 in
        the leader (else 0), the layout epoch, 1 if the call's inputs were accepted (else 0)): what
        ``finish`` takes."""
        R, E, K, El = p.world_size, p.num_experts, p.topk, p.experts_per_rank
        NT = self.threads
        by_rank = self.by_rank
        num_pairs = p.num_tokens * K
        pair_ids = cute.make_tensor(p.topk_idx.iterator, cute.make_layout(num_pairs))
        pair_slots = cute.make_tensor(p.scatter.iterator, cute.make_layout(num_pairs))

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        NCTA, _, _ = cute.arch.grid_dim()
        warp = tid // WARP
        lane = tid % WARP
        t_first, t_end = cta_tokens(p.num_tokens, bid, NCTA)

        # The dispatch handle's own copy of the CTA's routing (own_routing: ``dispatch()``; a caller may edit
        # its tensors before combine), here rather than by host-enqueued copies, which cost a driver call
        # each and run after the kernels, before the status read.
        if p.own_routing != 0:
            copy_own_routing(p, pair_ids, t_first * K + tid, t_end * K, NT)

        # As many histogram warps as fit the shared memory (``shared_counts``) beside the column sums.
        per_warp = E
        if cutlass.const_expr(by_rank):
            per_warp = E + R  # each warp's counts per expert, then per destination rank
        NW = (LAYOUT_SMEM_INTS - E) // per_warp
        if NW > NT // WARP:
            NW = NT // WARP
        epoch = p.epochs[OP_LAYOUT] + Int64(1)
        hist, colsum, rhist, flags, scan = self.shared_counts(E, R, NW, per_warp, tid)
        start, end = self.warp_part(t_first, t_end, K, NW, warp)

        # 1. per-warp histograms, and the ids' values, checked here instead of on the host (which would cost
        # a host sync): every id in [-1, E), no expert twice in a token (a pair is compared with the token's
        # earlier ones). Ids outside the range stay out of everything below (they would index shared
        # memory); a call with an invalid pair anywhere moves no data.
        if cutlass.const_expr(by_rank):
            if K <= TOKEN_REGS:
                count_tokens(p.topk_idx, hist, rhist, flags, start, end, warp, lane, E, K, El, R, True)
            else:
                count_tokens(p.topk_idx, hist, rhist, flags, start, end, warp, lane, E, K, El, R, False)
        else:
            count_pairs(pair_ids, p.topk_idx, hist, flags, start, end, warp, lane, E, K)
        cute.arch.sync_threads()
        # 2.-3. the counts met: the verdict on the inputs in flags[1], each histogram warp's first slot (row)
        # per column made absolute in place (``meet``; the rank layout's in kernels/rank_layout.py)
        leader, got_ahead = self.meet(p, hist, colsum, rhist, flags, scan, NW, epoch, t_first, t_end, warp,
                                      lane)
        accepted = flags[1] == 0
        refused = flags[1] != 0

        # 4. scatter slots: a lane per pair (expert layout) or per token (rank layout, ``place_tokens``)
        if cutlass.const_expr(by_rank):
            ids, slots = p.topk_idx, p.scatter
            if K <= TOKEN_REGS:
                place_tokens(ids, slots, rhist, start, end, warp, lane, E, K, El, R, accepted, True)
            else:
                place_tokens(ids, slots, rhist, start, end, warp, lane, E, K, El, R, accepted, False)
        else:
            place_pairs(pair_ids, pair_slots, hist, p.send_limit, start, end, warp, lane, E, refused)
        cute.arch.sync_threads()  # the CTA's slots, before its warps send them (dispatch, layout folded in)
        lead, ok = Int32(0), Int32(0)
        if leader:
            lead = Int32(1)
        if accepted:
            ok = Int32(1)
        self.after_place(p, leader, epoch, ok, tid)
        return got_ahead, lead, epoch, ok

    @cute.jit
    def meet(self, p: EpParams, hist: cute.Tensor, colsum: cute.Tensor, rhist: cute.Tensor,
             flags: cute.Tensor, scan: cute.Tensor, NW: Int32, epoch: Int64, t_first: Int32, t_end: Int32,
             warp: Int32, lane: Int32):
        """Steps 2 and 3 of the expert layout, by every thread of every CTA: the CTA's count row published
        (the last CTA to arrive leads); the leader announces that in ``layout_done`` (2 * epoch - 1), runs
        the count exchange and the offsets and publishes them (2 * epoch); the other CTAs wait for the first
        value, sum the earlier CTAs' counts while the leader exchanges, and wait for the second (casting
        ``ahead`` meanwhile). Ends with the verdict in flags[1] and each histogram warp's first slot per
        expert absolute in ``hist``; returns (this CTA leads, ``ahead``'s result)."""
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        E = p.num_experts
        parts = p.layout_parts  # [num_sms + 2, E + 1 + R]: each CTA's count row, the totals, the bases
        self.publish_counts(p, hist, rhist, flags, NW, epoch)
        leader = flags[2] != 0
        if leader:
            self.exchange_and_offsets(p, epoch, colsum, scan, flags)
        else:
            wait_for_leader(p, epoch * 2 - Int64(1), epoch)
        # Each CTA's warps' first slots relative to this rank's first one per expert (colsum: the leader is
        # done with it by now).
        relative_warp_bases(parts, hist, E, NW, bid, colsum, tid, self.threads)
        got_ahead = Int32(0)
        if not leader:
            if cutlass.const_expr(self.ahead is not None):
                got_ahead = self.ahead(p, epoch * 2, t_first, t_end, warp, lane)
            wait_for_leader(p, epoch * 2, epoch)
        cute.arch.sync_threads()
        if tid == 0:
            flags[1] = ld_volatile_i32(element_addr(p.input_fault, INPUT_FAULT_RANKS))
        # 3c. the absolute bases: this rank's first slot of each expert (ends with a CTA barrier)
        absolute_warp_bases(parts, p.num_sms + 1, hist, E, NW, tid, self.threads)
        return leader, got_ahead

    @cute.jit
    def after_place(self, p: EpParams, leader, epoch: Int64, accepted: Int32, tid: Int32):
        """The leader, every thread, once its CTA's slots are placed: the layout's epoch, the status mirror
        (``leader_done``)."""
        if leader:
            leader_done(p, epoch, tid)

    @cute.jit
    def before_arrival(self, p: EpParams, epoch: Int64, tid: Int32):
        """The leader, every thread, after its CTA's sends and before its arrival (``sends_after``): nothing
        in this layout."""
        pass

    @cute.jit
    def finish(self, p: EpParams, epoch: Int64, accepted: Int32, tid: Int32):
        """The leader, every thread, after its CTA's sends (``sends_after``): nothing left in this layout."""
        pass

    @cute.jit
    def shared_counts(self, E: Int32, R: Int32, NW: Int32, per_warp: Int32, tid: Int32):
        """The CTA's shared memory for the counts of ``NW`` histogram warps, (hist, colsum, rhist, flags,
        scan), the counts (``per_warp`` ints a warp) and flags[0] zeroed. Every thread calls it; it ends
        with a CTA barrier.

        hist[w * E + e]: pairs of histogram warp w routed to expert e; later the warp's running slot base.
        colsum[e]: rows all ranks send to expert e (the leader, after the exchange); hist's last E ints.
        NW warps fit the rest (E <= LAYOUT_SMEM_INTS // 2 is checked on the host; the rank layout's per-warp
        token counts take R more ints per warp: 2 E + R <= LAYOUT_SMEM_INTS).
        rhist[w * R + d] (rank layout): warp w's tokens bound for rank d; later the warp's running row base.
        flags[0]: this CTA's pairs with invalid ids; flags[1]: ranks that had some (after the exchange);
        flags[2]: this CTA arrived last (it is the leader).
        scan[w]: the prefix scan's per-warp totals, then scan[NT // WARP] the column sums' total."""
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(LAYOUT_SMEM_INTS), 16)
        colsum = cute.make_tensor(hist.iterator + (LAYOUT_SMEM_INTS - E), cute.make_layout(E))
        rhist = cute.make_tensor(hist.iterator + NW * E, cute.make_layout(NW * R))
        flags = smem.allocate_tensor(Int32, cute.make_layout(3), 4)
        scan = smem.allocate_tensor(Int32, cute.make_layout(WARP + 1), 4)
        for i in range(tid, NW * per_warp, self.threads):
            hist[i] = Int32(0)
        if tid == 0:
            flags[0] = Int32(0)
        cute.arch.sync_threads()
        return hist, colsum, rhist, flags, scan

    @cute.jit
    def warp_part(self, t_first: Int32, t_end: Int32, K: Int32, NW: Int32, warp: Int32):
        """The warp's contiguous part [start, end) of the CTA's range (any contiguous split gives the same
        slots): pairs in the expert layout, whole tokens in the rank layout (a lane per token there); empty
        for warps beyond the histograms."""
        lo = t_first * K
        hi = t_end * K
        if cutlass.const_expr(self.by_rank):
            lo = t_first
            hi = t_end
        chunk = (hi - lo + NW - 1) // NW
        start = lo + warp * chunk
        end = start + chunk
        if end > hi:
            end = hi
        if warp >= NW:
            end = start  # no work for warps beyond the histograms
        return start, end

    @cute.jit
    def publish_counts(self, p: EpParams, hist: cute.Tensor, rhist: cute.Tensor, flags: cute.Tensor,
                       NW: Int32, epoch: Int64):
        """Step 2: the CTA's count row (experts, invalid pairs, and in the rank layout destination ranks)
        into its row of ``layout_parts`` (the expert layout: the rank layout reads only the totals) and
        added into the totals row; then the CTA arrives, and the last to arrive (``flags[2]``) announces in
        ``layout_done`` that every CTA's counts are in (the expert layout; in the rank layout only the
        leader reads them, see below). Every thread calls it; it ends with a CTA barrier."""
        R, E = p.world_size, p.num_experts
        NT = self.threads
        parts = p.layout_parts
        TOTALS = p.num_sms  # the row the CTAs add their counts into (the leader reads and zeroes it)
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        for col in range(tid, E + 1 + R, NT):
            total = Int32(0)
            if col < E:
                for w in range(NW):
                    total = total + hist[w * E + col]
            if col == E:
                total = flags[0]
            if col > E:
                if cutlass.const_expr(self.by_rank):
                    for w in range(NW):
                        total = total + rhist[w * R + (col - E - 1)]
            if cutlass.const_expr(not self.by_rank):  # the rank layout reads only the totals
                parts[bid, col] = total
            if total != 0:
                cute.arch.atomic_add(parts.iterator + cute.crd2idx((TOTALS, col), parts.layout), total)
        cute.arch.sync_threads()
        if tid == 0:
            if cutlass.const_expr(self.by_rank):
                # Only the leader reads the counts, on this GPU (it puts the row to the peers later, after
                # its own system fence), and no CTA waits for layout_done: GPU-scope fences. EP2, 24 SMs,
                # 128 tokens: the dispatch took 27.3-27.5 us against 28.3-28.4 with the system fence.
                flags[2] = last_cta_arrives(p.done, DONE_LAYOUT, False)
                if flags[2] != 0:
                    cute.arch.fence_acq_rel_gpu()
            else:
                flags[2] = last_cta_arrives(p.done, DONE_LAYOUT)  # fences this CTA's counts first
                if flags[2] != 0:
                    fence_sys()  # the other CTAs' counts before this CTA's reads of them, and the release
                    p.layout_done[0] = epoch * 2 - Int64(1)
        cute.arch.sync_threads()

    @cute.jit
    def exchange_and_offsets(self, p: EpParams, epoch: Int64, colsum: cute.Tensor, scan: cute.Tensor,
                             flags: cute.Tensor):
        """Step 3 in the expert layout's leader (the last CTA to arrive; every thread of it calls this):
        this rank's count row from the totals, the exchange with every peer, the verdict on the inputs, the
        offsets, and each expert's first slot of this rank in ``layout_parts[BASES]``; then
        ``layout_done``."""
        tid, _, _ = cute.arch.thread_idx()
        self.count_row_from_totals(p, tid)
        exchange_counts(p, epoch, tid, tid // WARP, self.threads)
        # The verdict on the inputs: every rank's invalid pairs arrived with its count row, so every rank
        # refuses the call alike (the host raises; the kernels move no data; the epochs still advance).
        if tid == 0:
            input_verdict(p, flags, p.counts, p.num_experts, True)  # column E: a source's invalid pairs
        cute.arch.sync_threads()
        self.expert_offsets(p, colsum, scan, flags[1] == 0, tid)
        cute.arch.sync_threads()
        if tid == 0:
            fence_sys()  # everything above, before the release the other CTAs wait for
            p.layout_done[0] = epoch * 2

    @cute.jit
    def count_row_from_totals(self, p: EpParams, tid: Int32):
        """The leader, every thread: this rank's row of ``counts`` from the CTAs' sums in the totals row of
        ``layout_parts`` (every CTA fenced its adds before it arrived), which is zeroed for the next launch;
        ends with a CTA barrier."""
        TOTALS = p.num_sms
        for col in range(tid, p.num_experts + 1 + p.world_size, self.threads):
            p.counts[p.rank, col] = ld_volatile_i32(element_addr(p.layout_parts, (TOTALS, col)))
            p.layout_parts[TOTALS, col] = Int32(0)
        cute.arch.sync_threads()

    @cute.jit
    def expert_offsets(self, p: EpParams, colsum: cute.Tensor, scan: cute.Tensor, accepted, tid: Int32):
        """Step 3's offsets in the expert layout (the leader, every thread, after the exchange): the
        expert-major slots' bases, capacity limits and drops, tokens_per_expert and num_recv."""
        R, E, El, rank = p.world_size, p.num_experts, p.experts_per_rank, p.rank
        NT = self.threads
        counts = p.counts
        parts = p.layout_parts
        BASES = p.num_sms + 1
        # Each column sum over sources (count[s][e], written by peers: volatile loads) is read once, in
        # parallel, into shared memory; the walks below then run over shared memory. Capacity: expert e
        # keeps its first expert_capacity rows (sources in rank order); the column sum is clamped, and every
        # rank counts the same drops (all ranks see all counts).
        live = fault_free(p.fault)
        for e in range(tid, E, NT):
            tot = Int32(0)
            mine_before = Int32(0)
            for s in range(R):
                c = ld_volatile_i32(element_addr(counts, (s, e)))
                if s < rank:
                    mine_before = mine_before + c
                tot = tot + c
            if tot > p.expert_capacity:
                if live:
                    if accepted:  # one writer per e; the host resets; a refused call drops nothing
                        p.dropped[e] = p.dropped[e] + (tot - p.expert_capacity)
                tot = p.expert_capacity
            colsum[e] = tot
            p.send_offsets[e] = mine_before  # this rank's start inside the (expert, source) groups
        cute.arch.sync_threads()
        # colsum becomes its exclusive prefix sums over all experts, P[e] (P[E], the total, in
        # scan[NT // WARP]); expert e's first slot on its owner d is then P[e] - P[d * El] and its kept
        # rows P[e + 1] - P[e]. Why a CTA-wide scan: a serial walk per expert over its owner's earlier
        # experts (up to El - 1 steps, and El for num_recv) was the larger part of the layout's fixed cost.
        exclusive_scan_cta(colsum, E, scan, NT)
        total = scan[NT // WARP]
        for e in range(tid, E, NT):
            owner_first = colsum[e // El * El]
            first_slot = colsum[e] - owner_first  # the expert's first slot on its owner
            off = first_slot + p.send_offsets[e]
            p.send_offsets[e] = off
            p.cursor[e] = off
            parts[BASES, e] = off
            # slots >= this are beyond the expert's capacity
            p.send_limit[e] = prefix_at(colsum, total, e + 1, E) - owner_first
        for le in range(tid, El, NT):
            rows = Int32(0)  # a refused call receives nothing
            if accepted:
                rows = prefix_at(colsum, total, rank * El + le + 1, E) - colsum[rank * El + le]
            p.tokens_per_expert[le] = rows
        if tid == 0:
            tot_all = Int32(0)
            if accepted:
                tot_all = prefix_at(colsum, total, (rank + 1) * El, E) - colsum[rank * El]
            p.num_recv[0] = tot_all


profiler_name(LayoutKernel.kernel, "layout")
