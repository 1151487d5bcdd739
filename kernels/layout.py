"""Layout kernel: tokens per expert, the count exchange between ranks, receive offsets, scatter slots.

One CTA per rank (the work is a few histogram passes over T*K expert ids): a kernel of its own, or, for
batches of at most ``layout_in_dispatch`` tokens, the first CTA of the dispatch launch (``route``, with
that CTA's 256 threads; kernels/dispatch.py):
1. per-warp histograms of this rank's (t, k) pairs per expert (shared-memory atomics), and the ids'
   values: each in [-1, E) and no expert twice in a token (checked here rather than on the host, which
   would cost a host sync). The count of invalid pairs travels with the count row (column E), so every
   rank learns that some rank's inputs were invalid and refuses the call alike: ``input_fault`` names how
   many ranks and the lowest, nothing is received, no slot is given, and the dispatch kernel moves no
   data; the epochs still advance, so the buffer stays usable and the host raises;
2. the rank's count row goes into row ``rank`` of every peer's symmetric ``counts[R, E + 1]`` with
   ``put_signal_warp``, raising ``signals[SIGNAL_COUNT, rank]`` there,
   and the kernel waits until every peer's row has arrived (signal >= this call's epoch), at most
   ``timeout_ms`` per peer: a peer that never arrives is recorded in ``fault`` (kernels.ptx) and the
   call does not advance its epoch, so the host raises instead of hanging;
3. expert-major offsets: the slot range of (dst rank d, local expert l, source s) starts at the sum of
   count[s'][d*El + l'] over (l', s') before (l, s) in l-major order — identical to
   ``cute_ep.reference.reference_layout`` (the sums over experts come from one CTA-wide prefix scan of
   the column sums);
4. scatter slots: each warp walks its contiguous range of pairs in row-major order, 32 at a time; a
   lane's slot is its warp's running base for the expert plus the number of earlier lanes with the
   same expert (found with shuffles), so the order inside an (expert, source) group is the (t, k)
   order, deterministically.

In the rank layout with K <= 32 (``token_lanes``) steps 1 and 4 take whole tokens per warp step
(32 // K * K pairs), and a pair learns about its token's earlier pairs (a repeated id; the first pair
bound for its rank) by shuffles, not by K global loads per pair; a later pair then takes its first
pair's row by a shuffle in step 4 (step 5 only runs for K > 32). With the loads the rank layout's kernel
took 301 us at 4096 tokens on 2x H200 (the expert layout's: 79 us).

Capacity: an expert keeps its first ``expert_capacity`` rows in that order (source 0's first, each
source's in (t, k) order); a pair whose slot would be at or past its expert's ``send_limit`` is dropped
(scatter -1), and every rank adds the rows each expert dropped to ``dropped[e]`` (every rank sees
every count, so every rank counts the same; the host reads and resets it).

Rank layout (``RankLayoutKernel``, kernels/rank_layout.py: this kernel compiled with ``by_rank``;
DeepEP's receive layout: one row per (source rank, token) bound for a rank): step 1 also counts, per
warp, the tokens bound for each rank (at the token's first pair for it); they travel in columns E + 1 + d
of the count row; num_recv is the column of this rank summed over the sources; the slots of step 4 are
rows on the destination rank (lower source ranks first, then this rank's tokens in order), and a token's
later pairs for the same rank take its first pair's row (step 4 or 5).
Expert counts and tokens_per_expert are as in the expert layout (that layout has no expert capacity).

Outputs (device): scatter [T*K] int32 (-1: id -1 or dropped), send_offsets [E] and cursor [E] int32
(first slot of this rank's rows for each expert; cursor is the atomic-mode allocator), send_limit [E]
int32 (end of each expert's kept slots), dropped [E] int32 (accumulated), tokens_per_expert [E/R] and
num_recv [1] int32 (rows this rank receives), input_fault [2] int32, epochs[OP_LAYOUT] advanced by one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import INPUT_FAULT_FIRST, INPUT_FAULT_RANKS, SIGNAL_COUNT, EpParams
from cute_ep.kernels.config import LAYOUT_SMEM_INTS, OP_LAYOUT, WARP
from cute_ep.kernels.ptx import (
    SIGNAL_SET,
    element,
    element_addr,
    fault_free,
    ld_volatile_i32,
    record_fault,
    wait_signal_ge,
)


@cute.jit
def first_for_rank(pair_ids: cute.Tensor, i: Int32, K: Int32, El: Int32) -> Int32:
    """1 if pair i (a valid id) is its token's first pair bound for its expert's rank, else 0."""
    d = pair_ids[i] // El
    first = Int32(1)
    for j in range(i - i % K, i):
        ej = pair_ids[j]
        if ej >= 0:
            if ej // El == d:
                first = Int32(0)
    return first


@cute.jit
def token_lanes(e: Int32, lane: Int32, K: Int32, El: Int32):
    """For a warp step that holds whole tokens (K <= WARP; lane l holds pair l % K of the token in lanes
    [l - l % K, l - l % K + K)), with e this lane's expert id (-1: none or invalid): (dup, lead) — dup 1
    if an earlier pair of the token has the same id, lead the place in the token of its first pair bound
    for this pair's rank (-1 for e < 0). Shuffles instead of K global loads per pair; every lane calls it
    (lanes past the tokens pass e = -1)."""
    g0 = lane - lane % K
    k = lane % K
    d = Int32(-1)
    if e >= 0:
        d = e // El
    dup = Int32(0)
    lead = Int32(-1)
    for j in range(K):
        ej = cute.arch.shuffle_sync(e, g0 + j)
        dj = Int32(-1)
        if ej >= 0:
            dj = ej // El
        if d >= 0:
            if j < k:
                if ej == e:
                    dup = Int32(1)
            if lead < 0:
                if dj == d:
                    lead = j
    return dup, lead


@cute.jit
def count_pairs(pair_ids: cute.Tensor, hist: cute.Tensor, rhist: cute.Tensor, invalid: cute.Tensor,
                start: Int32, end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32, El: Int32, R: Int32,
                by_rank: cutlass.Constexpr):
    """Step 1 for the warp's pairs [start, end), any K: a lane per pair, the token's earlier pairs by
    global loads."""
    for i in range(start + lane, end, WARP):
        e = pair_ids[i]
        bad = Int32(0)
        if e < -1:
            bad = Int32(1)
        if e >= E:
            bad = Int32(1)
        if e >= 0:
            if e < E:
                cute.arch.atomic_add(hist.iterator + (warp * E + e), Int32(1))
                if cutlass.const_expr(by_rank):
                    if first_for_rank(pair_ids, i, K, El) != 0:
                        cute.arch.atomic_add(rhist.iterator + (warp * R + e // El), Int32(1))
                for j in range(i - i % K, i):
                    if pair_ids[j] == e:
                        bad = Int32(1)
        if bad != 0:
            cute.arch.atomic_add(invalid.iterator, Int32(1))


@cute.jit
def count_pairs_by_lanes(pair_ids: cute.Tensor, hist: cute.Tensor, rhist: cute.Tensor, invalid: cute.Tensor,
                         start: Int32, end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32, El: Int32,
                         R: Int32):
    """Step 1 of the rank layout with K <= WARP (``start`` at a token): steps of whole tokens, a token's
    earlier pairs by shuffles (``token_lanes``)."""
    G = WARP // K * K
    for base in range(start, end, G):  # warp-uniform bounds: all lanes shuffle together
        i = base + lane
        raw = Int32(-1)
        if lane < G:
            if i < end:
                raw = pair_ids[i]
        e = raw
        if raw >= E:
            e = Int32(-1)
        dup, lead = token_lanes(e, lane, K, El)
        bad = dup
        if raw < -1:
            bad = Int32(1)
        if raw >= E:
            bad = Int32(1)
        if e >= 0:
            cute.arch.atomic_add(hist.iterator + (warp * E + e), Int32(1))
            if lead == lane % K:
                cute.arch.atomic_add(rhist.iterator + (warp * R + e // El), Int32(1))
        if bad != 0:
            cute.arch.atomic_add(invalid.iterator, Int32(1))


@cute.jit
def exclusive_scan_cta(vals: cute.Tensor, n: Int32, scratch: cute.Tensor, NT: cutlass.Constexpr):
    """``vals[0:n]`` (shared memory) becomes its exclusive prefix sums and ``scratch[NT // WARP]`` their
    total; ``scratch`` holds NT // WARP + 1 ints of shared memory. Every thread of the CTA (NT threads,
    at most 32 warps) calls it; it ends with a CTA barrier.

    Each thread sums a contiguous chunk, each warp scans its threads' chunk sums with shuffles, warp 0
    scans the warp totals, and each thread writes its chunk's prefixes."""
    tid, _, _ = cute.arch.thread_idx()
    warp = tid // WARP
    lane = tid % WARP
    NWT = NT // WARP
    per = (n + NT - 1) // NT
    lo = tid * per
    hi = lo + per
    if hi > n:
        hi = n
    own = Int32(0)
    for i in range(lo, hi):
        own = own + vals[i]
    incl = own  # inclusive scan of the chunk sums across the warp
    for k in cutlass.range_constexpr(5):
        got = cute.arch.shuffle_sync_up(incl, 1 << k)
        if lane >= (1 << k):
            incl = incl + got
    if lane == WARP - 1:
        scratch[warp] = incl
    cute.arch.sync_threads()
    if warp == 0:
        wt = Int32(0)
        if lane < NWT:
            wt = scratch[lane]
        winc = wt
        for k in cutlass.range_constexpr(5):
            got = cute.arch.shuffle_sync_up(winc, 1 << k)
            if lane >= (1 << k):
                winc = winc + got
        if lane < NWT:
            scratch[lane] = winc - wt  # the warps before this one
        if lane == WARP - 1:
            scratch[NWT] = winc
    cute.arch.sync_threads()
    run = scratch[warp] + incl - own
    for i in range(lo, hi):
        c = vals[i]
        vals[i] = run
        run = run + c
    cute.arch.sync_threads()


@cute.jit
def prefix_at(prefix: cute.Tensor, total: Int32, i: Int32, n: Int32) -> Int32:
    """Entry ``i`` (0 <= i <= n) of exclusive prefix sums held as ``prefix[0:n]`` and their ``total``."""
    v = total
    if i < n:
        v = prefix[i]
    return v


class LayoutKernel(EpKernel):
    """The layout kernel (see the module docstring); every size is a run-time argument.

    ``threads``: the CTA's size. The kernel is one CTA of 1024; the dispatch kernel runs the same steps
    (``route``) in its first CTA of 256 threads when the layout is folded into its launch."""

    by_rank = False  # compile-time: the rank layout's variant (kernels/rank_layout.py) is compiled apart

    def __init__(self, dtype, threads: int = 32 * WARP) -> None:
        super().__init__(dtype)
        self.threads = threads

    def grid_ctas(self, p: EpParams):
        return 1  # one CTA: a few histogram passes over T * K ids

    @cute.kernel
    def kernel(self, p: EpParams):
        self.route(p)

    @cute.jit
    def route(self, p: EpParams):
        """Steps 1-5 of the module docstring, by every thread of one CTA of ``self.threads``."""
        R, E, K, El, rank = p.world_size, p.num_experts, p.topk, p.experts_per_rank, p.rank
        NT = self.threads
        # [R, E + 1 + R]: row s is source rank s's count row, column E its invalid pairs, columns E + 1 + d
        # its tokens bound for rank d (the rank layout's rows)
        counts = p.counts
        by_rank = self.by_rank
        # The pairs in row-major (t, k) order: the histogram and slot walks split them into ranges.
        num_pairs = p.num_tokens * K
        pair_ids = cute.make_tensor(p.topk_idx.iterator, cute.make_layout(num_pairs))
        pair_slots = cute.make_tensor(p.scatter.iterator, cute.make_layout(num_pairs))

        tid, _, _ = cute.arch.thread_idx()
        warp = tid // WARP
        lane = tid % WARP

        smem = cutlass.memory.SmemAllocator()
        # hist[w * E + e]: pairs of warp w routed to expert e; later the warp's running slot base.
        hist = smem.allocate_tensor(Int32, cute.make_layout(LAYOUT_SMEM_INTS), 16)
        # colsum[e]: rows all ranks send to expert e (after the exchange); it takes the last E ints.
        colsum = cute.make_tensor(hist.iterator + (LAYOUT_SMEM_INTS - E), cute.make_layout(E))
        # As many histogram warps as fit the rest (E <= LAYOUT_SMEM_INTS // 2 is checked on the host; the
        # rank layout's per-warp token counts take R more ints per warp: 2 E + R <= LAYOUT_SMEM_INTS).
        per_warp = E
        if cutlass.const_expr(by_rank):
            per_warp = E + R
        NW = (LAYOUT_SMEM_INTS - E) // per_warp
        if NW > NT // WARP:
            NW = NT // WARP
        # rank layout: rhist[w * R + d]: tokens of warp w's pairs bound for rank d (counted at the token's
        # first pair for d, its "primary"); later the warp's running row base on d.
        rhist = cute.make_tensor(hist.iterator + NW * E, cute.make_layout(NW * R))

        # invalid[0]: this rank's pairs with invalid ids; invalid[1]: ranks that had some (after the
        # exchange), so that every thread of the CTA sees the verdict.
        invalid = smem.allocate_tensor(Int32, cute.make_layout(2), 4)
        # scan[w]: the prefix scan's per-warp totals, then scan[NT // WARP] the column sums' total.
        scan = smem.allocate_tensor(Int32, cute.make_layout(WARP + 1), 4)

        epoch = p.epochs[OP_LAYOUT] + Int64(1)

        for i in range(tid, NW * per_warp, NT):
            hist[i] = Int32(0)
        if tid == 0:
            invalid[0] = Int32(0)
        cute.arch.sync_threads()

        chunk = (num_pairs + NW - 1) // NW
        if cutlass.const_expr(by_rank):
            # whole tokens per warp (any contiguous split gives the same slots): with K <= WARP a step of
            # 32 // K * K pairs then holds whole tokens, and a pair finds its token's others by shuffles
            chunk = (p.num_tokens + NW - 1) // NW * K
        start = warp * chunk
        end = start + chunk
        if end > num_pairs:
            end = num_pairs
        if warp >= NW:
            end = start  # no pairs for warps beyond the histograms

        # 1. per-warp histograms, and the ids' values, checked here instead of on the host (which would cost
        # a host sync): every id in [-1, E), no expert twice in a token (a lane compares its pair with the
        # token's earlier ones). Ids outside the range stay out of everything below (they would index
        # shared memory); a call with an invalid pair anywhere moves no data.
        if cutlass.const_expr(by_rank):
            if K <= WARP:
                count_pairs_by_lanes(pair_ids, hist, rhist, invalid, start, end, warp, lane, E, K, El, R)
            else:
                count_pairs(pair_ids, hist, rhist, invalid, start, end, warp, lane, E, K, El, R, True)
        else:
            count_pairs(pair_ids, hist, rhist, invalid, start, end, warp, lane, E, K, El, R, False)
        cute.arch.sync_threads()
        # 2. this rank's count row (and its invalid pairs), then the exchange
        for e in range(tid, E, NT):
            total = Int32(0)
            for w in range(NW):
                total = total + hist[w * E + e]
            counts[rank, e] = total
        if tid == 0:
            counts[rank, E] = invalid[0]
        for d in range(tid, R, NT):
            total = Int32(0)
            if cutlass.const_expr(by_rank):
                for w in range(NW):
                    total = total + rhist[w * R + d]
            counts[rank, E + 1 + d] = total
        cute.arch.sync_threads()

        my_row = counts[rank, None]
        NWT = NT // WARP
        my_signal = element(p.signals, (SIGNAL_COUNT, rank))
        # After a fault (an earlier timed-out wait) this buffer exchanges nothing more.
        if fault_free(p.fault):
            for q in range(warp, R, NWT):
                if q != rank:
                    nvshmem_cute.put_signal_warp(my_row, my_row, my_signal, epoch, SIGNAL_SET, q)
            for q in range(tid, R, NT):
                if q != rank:
                    arrived = wait_signal_ge(element_addr(p.signals, (SIGNAL_COUNT, q)), epoch,
                                             Int64(p.timeout_ms) * 1000000)
                    if arrived == 0:
                        record_fault(p.fault, Int32(OP_LAYOUT), q, epoch)
        cute.arch.sync_threads()

        # The verdict on the inputs: every rank's invalid pairs arrived with its count row, so every rank
        # refuses the call alike (the host raises; the kernels move no data; the epochs still advance).
        if tid == 0:
            ranks = Int32(0)
            first = Int32(-1)
            for s in range(R):
                if ld_volatile_i32(element_addr(counts, (s, E))) != 0:
                    if ranks == 0:
                        first = s
                    ranks = ranks + 1
            invalid[1] = ranks
            p.input_fault[INPUT_FAULT_RANKS] = ranks
            p.input_fault[INPUT_FAULT_FIRST] = first
        cute.arch.sync_threads()
        accepted = invalid[1] == 0
        refused = invalid[1] != 0

        # 3. offsets. Each column sum over sources (count[s][e], written by peers: volatile loads) is
        # read once, in parallel, into shared memory; the serial walks below then run over shared memory.
        # (Reading the peers' counts inside those walks cost ~100 us per call at E=256.)
        # Capacity: expert e keeps its first expert_capacity rows (sources in rank order); the column
        # sum is clamped, and every rank counts the same drops (all ranks see all counts).
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
            # slots >= this are beyond the expert's capacity
            p.send_limit[e] = prefix_at(colsum, total, e + 1, E) - owner_first
            run = off
            for w in range(NW):
                c = hist[w * E + e]
                hist[w * E + e] = run
                run = run + c
        for le in range(tid, El, NT):
            rows = Int32(0)  # a refused call receives nothing
            if accepted:
                rows = prefix_at(colsum, total, rank * El + le + 1, E) - colsum[rank * El + le]
            p.tokens_per_expert[le] = rows
        if tid == 0:
            tot_all = Int32(0)
            if accepted:
                if cutlass.const_expr(by_rank):  # one row per (source, token) bound for this rank
                    for s in range(R):
                        tot_all = tot_all + ld_volatile_i32(element_addr(counts, (s, E + 1 + rank)))
                else:
                    tot_all = prefix_at(colsum, total, (rank + 1) * El, E) - colsum[rank * El]
            p.num_recv[0] = tot_all
        if cutlass.const_expr(by_rank):
            # Row bases on each destination d: the rows of lower source ranks come first, then this rank's
            # tokens in order, so warp w starts after the earlier warps' tokens.
            for d in range(tid, R, NT):
                run = Int32(0)
                for s in range(rank):
                    run = run + ld_volatile_i32(element_addr(counts, (s, E + 1 + d)))
                for w in range(NW):
                    c = rhist[w * R + d]
                    rhist[w * R + d] = run
                    run = run + c
        cute.arch.sync_threads()

        # 4. scatter slots, 32 pairs per step in row-major order (the rank layout with K <= WARP: whole
        # tokens per step, 32 // K * K pairs)
        step = Int32(WARP)
        lanes = K < 0  # the rank layout with K <= WARP: a token's pairs meet by shuffles
        if cutlass.const_expr(by_rank):
            lanes = K <= WARP
            if lanes:
                step = WARP // K * K
        lead_lane = lane  # (lanes) the lane of this pair's token's first pair bound for its rank
        for base in range(start, end, step):  # warp-uniform bounds: all lanes shuffle together
            i = base + lane
            e = Int32(-1)
            if lane < step:
                if i < end:
                    e = pair_ids[i]
                    if e >= E:
                        e = Int32(-1)  # invalid (the call is refused): no slot, and no shared-memory index
                    if e < -1:
                        e = Int32(-1)
            # The key the slots are counted under: the expert, or in the rank layout the destination rank
            # of a token's first pair for it (later pairs take that pair's row below).
            key = e
            if cutlass.const_expr(by_rank):
                if lanes:
                    _, lead = token_lanes(e, lane, K, El)
                    if e >= 0:
                        key = Int32(-1)
                        if lead == lane % K:
                            key = e // El
                        lead_lane = lane - lane % K + lead
                else:
                    if e >= 0:
                        key = Int32(-1)
                        if first_for_rank(pair_ids, i, K, El) != 0:
                            key = e // El
            before = Int32(0)
            later = Int32(0)
            for j in cutlass.range_constexpr(WARP):
                kj = cute.arch.shuffle_sync(key, j)
                if kj == key:
                    if j < lane:
                        before = before + 1
                    if j > lane:
                        later = later + 1
            # The warp's running base of the key: in hist (experts) or in rhist (ranks, after hist).
            at = warp * E + key
            if cutlass.const_expr(by_rank):
                at = NW * E + warp * R + key
            slot = Int32(-1)
            if key >= 0:
                slot = hist[at] + before
                if cutlass.const_expr(not by_rank):
                    if slot >= p.send_limit[e]:
                        slot = Int32(-1)  # dropped: beyond the expert's capacity
            if cutlass.const_expr(by_rank):
                if lanes:
                    lead_slot = cute.arch.shuffle_sync(slot, lead_lane)
                    if e >= 0:
                        if key < 0:
                            slot = lead_slot  # a later pair for the rank: its token's row there
            if refused:
                slot = Int32(-1)
            if lane < step:
                if i < end:
                    pair_slots[i] = slot
            cute.arch.sync_warp()
            if key >= 0:
                if later == 0:
                    hist[at] = hist[at] + before + 1
            cute.arch.sync_warp()

        # 5. rank layout with K > WARP: a token's later pairs for a rank share the row of its first pair for
        # that rank (written above, possibly by another warp: after the CTA barrier).
        if cutlass.const_expr(by_rank):
            if K > WARP:
                cute.arch.sync_threads()
                for i in range(start + lane, end, WARP):
                    e = pair_ids[i]
                    if e >= 0:
                        if e < E:
                            if accepted:
                                for j in range(i - i % K, i):
                                    if pair_slots[i] == Int32(-1):
                                        ej = pair_ids[j]
                                        if ej >= 0:
                                            if ej // El == e // El:
                                                pair_slots[i] = pair_slots[j]

        if tid == 0:
            if fault_free(p.fault):  # a timed-out call does not count as run
                p.epochs[OP_LAYOUT] = epoch
