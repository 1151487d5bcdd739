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
   same expert (``match_sync``, one instruction), so the order inside an (expert, source) group is the
   (t, k) order, deterministically.

Capacity: an expert keeps its first ``expert_capacity`` rows in that order (source 0's first, each
source's in (t, k) order); a pair whose slot would be at or past its expert's ``send_limit`` is dropped
(scatter -1), and every rank adds the rows each expert dropped to ``dropped[e]`` (every rank sees
every count, so every rank counts the same; the host reads and resets it).

Rank layout (``RankLayoutKernel``, kernels/rank_layout.py: this kernel compiled with ``by_rank``;
DeepEP's receive layout: one row per (source rank, token) bound for a rank): a lane per token instead of
per pair, 32 tokens per warp step. Step 1 also counts, per warp, the tokens bound for each rank (a ballot
per rank over the step's tokens); they travel in columns E + 1 + d of the count row; num_recv is the
column of this rank summed over the sources. Step 4 gives each (token, destination rank) a row there
(lower source ranks first, then this rank's tokens in order: the warp's running base plus the earlier
lanes in the rank's ballot), and every pair of the token bound for that rank takes it. With a lane per
pair and the token's earlier pairs found by global loads this kernel took 301 us at 4096 tokens on 2x
H200, 229 us with shuffles (the expert layout's: 79 us).
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
def count_pairs(pair_ids: cute.Tensor, hist: cute.Tensor, invalid: cute.Tensor, start: Int32, end: Int32,
                warp: Int32, lane: Int32, E: Int32, K: Int32):
    """Step 1 of the expert layout for the warp's pairs [start, end): a lane per pair, the token's earlier
    pairs (the repeated-id check) by global loads that the L1 serves."""
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
                for j in range(i - i % K, i):
                    if pair_ids[j] == e:
                        bad = Int32(1)
        if bad != 0:
            cute.arch.atomic_add(invalid.iterator, Int32(1))


# A token's ids are held in registers when K <= TOKEN_REGS (loaded together, one memory latency per warp
# step); larger K reads them one at a time from global memory (through the L1).
TOKEN_REGS = 8


@cute.jit
def valid_id(e: Int32, E: Int32) -> Int32:
    """``e`` if it names an expert (0 <= e < E), else -1."""
    v = e
    if e >= E:
        v = Int32(-1)
    if e < 0:
        v = Int32(-1)
    return v


@cute.jit
def token_regs(token_pairs: cute.Tensor, t: Int32, live: cutlass.Boolean, t_safe: Int32, K: Int32):
    """Token t's K <= TOKEN_REGS raw ids as a list of TOKEN_REGS values (-1 past K or when not ``live``).
    Every load is issued (at a clamped, valid address: token ``t_safe``, pair K - 1), so all are in flight
    at once."""
    ids = []
    for k in cutlass.range_constexpr(TOKEN_REGS):
        kk = Int32(k)
        if kk >= K:
            kk = K - 1
        tt = t
        if not live:
            tt = t_safe
        v = token_pairs[tt, kk]
        if not live:
            v = Int32(-1)
        if kk != k:
            v = Int32(-1)
        ids.append(v)
    return ids


@cute.jit
def rank_bit(bits: Int32, raw: Int32, E: Int32, El: Int32, d0: Int32) -> Int32:
    """``bits`` with the bit of raw id ``raw``'s rank set (if it names an expert on ranks d0 .. d0 + 31)."""
    out = bits
    e = valid_id(raw, E)
    if e >= 0:
        b = e // El - d0
        if b >= 0:
            if b < WARP:
                out = bits | (Int32(1) << b)
    return out


@cute.jit
def rank_bits(token_pairs: cute.Tensor, ids, t: Int32, live: cutlass.Boolean, K: Int32, E: Int32, El: Int32,
              d0: Int32, regs: cutlass.Constexpr) -> Int32:
    """Bit b set: token t (when ``live``) has an expert on rank d0 + b (0 <= b < 32). ``regs``: its ids
    are the registers ``ids`` (token_regs), else they are read from ``token_pairs``."""
    bits = Int32(0)
    if live:
        if cutlass.const_expr(regs):
            for k in cutlass.range_constexpr(TOKEN_REGS):
                bits = rank_bit(bits, ids[k], E, El, d0)
        else:
            for k in range(K):
                bits = rank_bit(bits, token_pairs[t, k], E, El, d0)
    return bits


@cute.jit
def pair_fault(token_pairs: cute.Tensor, ids, hist: cute.Tensor, t: Int32, k, raw: Int32, warp: Int32,
               E: Int32, regs: cutlass.Constexpr) -> Int32:
    """Counts pair k of token t (raw id ``raw``) in the warp's histogram and returns 1 if it is invalid:
    outside [-1, E), or an expert an earlier pair of the token already named. ``regs``: k is a
    compile-time index into the registers ``ids``."""
    bad = Int32(0)
    if raw < -1:
        bad = Int32(1)
    if raw >= E:
        bad = Int32(1)
    if raw >= 0:
        if raw < E:
            cute.arch.atomic_add(hist.iterator + (warp * E + raw), Int32(1))
            if cutlass.const_expr(regs):
                for j in cutlass.range_constexpr(k):
                    if ids[j] == raw:
                        bad = Int32(1)
            else:
                for j in range(k):
                    if token_pairs[t, j] == raw:
                        bad = Int32(1)
    return bad


@cute.jit
def count_tokens(token_pairs: cute.Tensor, hist: cute.Tensor, rhist: cute.Tensor, invalid: cute.Tensor,
                 t_start: Int32, t_end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32, El: Int32,
                 R: Int32, regs: cutlass.Constexpr):
    """Step 1 of the rank layout for the warp's tokens [t_start, t_end): a lane per token, 32 tokens per
    step. The lane checks its token's ids and counts its pairs per expert; a ballot per destination rank
    counts the step's tokens bound there (``rhist``, lane 0 of the warp keeps the running count).
    ``regs``: K <= TOKEN_REGS, the ids in registers."""
    for base in range(t_start, t_end, WARP):  # warp-uniform bounds: every lane votes
        t = base + lane
        live = t < t_end
        ids = None
        if cutlass.const_expr(regs):
            ids = token_regs(token_pairs, t, live, t_start, K)
        bad = Int32(0)
        if live:
            if cutlass.const_expr(regs):
                for k in cutlass.range_constexpr(TOKEN_REGS):
                    bad = bad + pair_fault(token_pairs, ids, hist, t, k, ids[k], warp, E, True)
            else:
                for k in range(K):
                    bad = bad + pair_fault(token_pairs, ids, hist, t, k, token_pairs[t, k], warp, E, False)
        if bad != 0:
            cute.arch.atomic_add(invalid.iterator, bad)
        for d0 in range(0, R, WARP):
            bits = rank_bits(token_pairs, ids, t, live, K, E, El, d0, regs)
            nb = R - d0
            if nb > WARP:
                nb = WARP
            for b in range(nb):
                ballot = cute.arch.vote_ballot_sync(((bits >> b) & 1) != 0)
                if lane == 0:
                    rhist[warp * R + d0 + b] = rhist[warp * R + d0 + b] + cute.arch.popc(ballot)


@cute.jit
def place_pair(token_slots: cute.Tensor, t: Int32, k, raw: Int32, d: Int32, row: Int32, E: Int32, El: Int32):
    """Pair k of token t takes ``row`` if its raw id ``raw`` names an expert on rank d."""
    e = valid_id(raw, E)
    if e >= 0:
        if e // El == d:
            token_slots[t, k] = row


@cute.jit
def place_tokens(token_pairs: cute.Tensor, token_slots: cute.Tensor, rhist: cute.Tensor, t_start: Int32,
                 t_end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32, El: Int32, R: Int32,
                 accepted: cutlass.Boolean, regs: cutlass.Constexpr):
    """Step 4 of the rank layout: a lane per token, 32 tokens per step. For each destination rank d, a
    ballot of the step's tokens bound for d: a token's row on d is the warp's running row base
    (``rhist``) plus the tokens of earlier lanes bound for d, and every pair of the token on d takes that
    row. Pairs with no valid id, and every pair of a refused call, get -1. ``regs`` as in count_tokens."""
    lt = cute.arch.lanemask_lt()
    for base in range(t_start, t_end, WARP):  # warp-uniform bounds: every lane votes
        t = base + lane
        live = t < t_end
        ids = None
        if cutlass.const_expr(regs):
            ids = token_regs(token_pairs, t, live, t_start, K)
        if live:
            for k in range(K):
                token_slots[t, k] = Int32(-1)
        for d0 in range(0, R, WARP):
            bits = rank_bits(token_pairs, ids, t, live, K, E, El, d0, regs)
            nb = R - d0
            if nb > WARP:
                nb = WARP
            for b in range(nb):
                d = d0 + b
                bound = ((bits >> b) & 1) != 0
                ballot = cute.arch.vote_ballot_sync(bound)
                row_base = rhist[warp * R + d]
                if bound:
                    if accepted:
                        row = row_base + cute.arch.popc(Int32(ballot) & Int32(lt))
                        if cutlass.const_expr(regs):
                            for k in cutlass.range_constexpr(TOKEN_REGS):
                                place_pair(token_slots, t, k, ids[k], d, row, E, El)
                        else:
                            for k in range(K):
                                place_pair(token_slots, t, k, token_pairs[t, k], d, row, E, El)
                cute.arch.sync_warp()  # every lane read the base before lane 0 moves it
                if lane == 0:
                    rhist[warp * R + d] = row_base + cute.arch.popc(ballot)
                cute.arch.sync_warp()


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

        # Each warp takes a contiguous range (any contiguous split gives the same slots): pairs in the expert
        # layout, whole tokens in the rank layout (a lane per token there).
        chunk = (num_pairs + NW - 1) // NW
        limit = num_pairs
        if cutlass.const_expr(by_rank):
            chunk = (p.num_tokens + NW - 1) // NW
            limit = p.num_tokens
        start = warp * chunk
        end = start + chunk
        if end > limit:
            end = limit
        if warp >= NW:
            end = start  # no work for warps beyond the histograms

        # 1. per-warp histograms, and the ids' values, checked here instead of on the host (which would cost
        # a host sync): every id in [-1, E), no expert twice in a token (a pair is compared with the token's
        # earlier ones). Ids outside the range stay out of everything below (they would index shared
        # memory); a call with an invalid pair anywhere moves no data.
        if cutlass.const_expr(by_rank):
            if K <= TOKEN_REGS:
                count_tokens(p.topk_idx, hist, rhist, invalid, start, end, warp, lane, E, K, El, R, True)
            else:
                count_tokens(p.topk_idx, hist, rhist, invalid, start, end, warp, lane, E, K, El, R, False)
        else:
            count_pairs(pair_ids, hist, invalid, start, end, warp, lane, E, K)
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
            if cutlass.const_expr(not by_rank):  # the warps' running slot bases (step 4, expert layout)
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

        # 4. scatter slots. Expert layout: 32 pairs per warp step in row-major order; a pair's slot is its
        # warp's running base for the expert plus the earlier lanes with the same expert (``match_sync``
        # finds them in one instruction; 32 shuffles did before). Rank layout: a lane per token
        # (``place_tokens``).
        if cutlass.const_expr(by_rank):
            ids, slots = p.topk_idx, p.scatter
            if K <= TOKEN_REGS:
                place_tokens(ids, slots, rhist, start, end, warp, lane, E, K, El, R, accepted, True)
            else:
                place_tokens(ids, slots, rhist, start, end, warp, lane, E, K, El, R, accepted, False)
        else:
            lt = cute.arch.lanemask_lt()
            gt = cute.arch.lanemask_gt()
            for base in range(start, end, WARP):  # warp-uniform bounds: every lane takes part in the match
                i = base + lane
                e = Int32(-1)
                if i < end:
                    e = pair_ids[i]
                    if e >= E:
                        e = Int32(-1)  # invalid (the call is refused): no slot, and no shared-memory index
                    if e < -1:
                        e = Int32(-1)
                same = Int32(cute.arch.match_sync(cute.arch.FULL_MASK, e))  # lanes holding this expert
                before = cute.arch.popc(same & Int32(lt))
                slot = Int32(-1)
                if e >= 0:
                    slot = hist[warp * E + e] + before
                    if slot >= p.send_limit[e]:
                        slot = Int32(-1)  # dropped: beyond the expert's capacity
                if refused:
                    slot = Int32(-1)
                if i < end:
                    pair_slots[i] = slot
                cute.arch.sync_warp()  # every lane read its base before the expert's last lane moves it
                if e >= 0:
                    if (same & Int32(gt)) == 0:
                        hist[warp * E + e] = hist[warp * E + e] + before + 1
                cute.arch.sync_warp()

        if tid == 0:
            if fault_free(p.fault):  # a timed-out call does not count as run
                p.epochs[OP_LAYOUT] = epoch
