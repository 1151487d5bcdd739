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
2. each CTA writes its count row into its row of ``layout_parts`` and adds it into the totals row there,
   then arrives (``done[DONE_LAYOUT]``); the last CTA to arrive is the leader. It announces in
   ``layout_done`` that every CTA's counts are in (2 * epoch - 1), puts the rank's count row into row
   ``rank`` of every peer's symmetric ``counts[R, E + 1 + R]`` with ``put_signal_warp`` (raising
   ``signals[SIGNAL_COUNT, rank]`` there) and waits until every peer's row has arrived (signal >= this
   call's epoch), at most ``timeout_ms`` per peer: a peer that never arrives is recorded in ``fault``
   (kernels.signals) and the call does not advance its epoch, so the host raises instead of hanging;
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
num_recv [1] int32 (rows this rank receives), input_fault [2] int32, epochs[OP_LAYOUT] advanced by one;
with own_routing, own_idx / own_w [T, K]: copies of topk_idx / topk_w (the dispatch handle's).
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
from cute_ep.kernels.ptx import fence_sys, ld_volatile_i32
from cute_ep.kernels.rows import element, element_addr
from cute_ep.kernels.signals import SIGNAL_SET, fault_free, last_cta_arrives, record_fault, wait_signal_ge

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
def count_pairs(pair_ids: cute.Tensor, token_pairs: cute.Tensor, hist: cute.Tensor, invalid: cute.Tensor,
                start: Int32, end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32):
    """Step 1 of the expert layout for the warp's pairs [start, end): a lane per pair, the token's earlier
    pairs (the repeated-id check) by global loads that the L1 serves."""
    for i in range(start + lane, end, WARP):
        bad = pair_fault(token_pairs, None, hist, i // K, i % K, pair_ids[i], warp, E, False)
        if bad != 0:
            cute.arch.atomic_add(invalid.iterator, Int32(1))


@cute.jit
def lane_token(token_pairs: cute.Tensor, base: Int32, lane: Int32, t_start: Int32, t_end: Int32, K: Int32,
               regs: cutlass.Constexpr):
    """The rank layout's walks take a lane per token, 32 tokens per warp step: the lane's token of the step
    starting at ``base`` as (t, live: t < t_end, its ids: ``token_regs`` when ``regs``, else None)."""
    t = base + lane
    live = t < t_end
    ids = None
    if cutlass.const_expr(regs):
        ids = token_regs(token_pairs, t, live, t_start, K)
    return t, live, ids


@cute.jit
def ranks_in_word(R: Int32, d0: Int32) -> Int32:
    """Destination ranks d0 .. d0 + n - 1 share a 32-bit word of ``rank_bits``: n = min(R - d0, 32)."""
    n = R - d0
    if n > WARP:
        n = WARP
    return n


@cute.jit
def count_tokens(token_pairs: cute.Tensor, hist: cute.Tensor, rhist: cute.Tensor, invalid: cute.Tensor,
                 t_start: Int32, t_end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32, El: Int32,
                 R: Int32, regs: cutlass.Constexpr):
    """Step 1 of the rank layout for the warp's tokens [t_start, t_end): a lane per token, 32 tokens per
    step. The lane checks its token's ids and counts its pairs per expert; a ballot per destination rank
    counts the step's tokens bound there (``rhist``, lane 0 of the warp keeps the running count).
    ``regs``: K <= TOKEN_REGS, the ids in registers."""
    for base in range(t_start, t_end, WARP):  # warp-uniform bounds: every lane votes
        t, live, ids = lane_token(token_pairs, base, lane, t_start, t_end, K, regs)
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
            for b in range(ranks_in_word(R, d0)):
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
        t, live, ids = lane_token(token_pairs, base, lane, t_start, t_end, K, regs)
        if live:
            for k in range(K):
                token_slots[t, k] = Int32(-1)
        for d0 in range(0, R, WARP):
            bits = rank_bits(token_pairs, ids, t, live, K, E, El, d0, regs)
            for b in range(ranks_in_word(R, d0)):
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


@cute.jit
def cta_tokens(num_tokens: Int32, cta: Int32, ncta: Int32):
    """Tokens [first, end) of CTA ``cta`` of ``ncta``: contiguous ranges in CTA order whose sizes differ by
    at most one. The layout's CTAs count and place these tokens, and a dispatch with the layout folded in
    sends them from the same CTA (so it reads only slots its own CTA wrote)."""
    first = Int32(Int64(num_tokens) * Int64(cta) // Int64(ncta))
    end = Int32(Int64(num_tokens) * Int64(cta + 1) // Int64(ncta))
    return first, end


PARTS_IN_FLIGHT = 16  # loads of earlier CTAs' counts a thread issues before it adds the first


@cute.jit
def sum_earlier_ctas(parts: cute.Tensor, col0: Int32, ncols: Int32, n: Int32, acc: cute.Tensor,
                     NT: cutlass.Constexpr):
    """``acc[i]`` (shared memory) = the sum of ``parts[c, col0 + i]`` over CTAs c < n, for i < ncols. Every
    thread of the CTA (NT threads) calls it; it ends with a CTA barrier.

    The CTAs of this launch wrote those rows (volatile loads). Why this shape: a CTA far down a grid of 132
    sums 131 rows per column; each column is split over NT // ncols threads (all of them for the rank
    layout's R columns), each with PARTS_IN_FLIGHT loads issued before the first is added, so the CTA waits
    for a few memory latencies rather than one per row."""
    tid, _, _ = cute.arch.thread_idx()
    per_col = NT // ncols
    if per_col < 1:
        per_col = Int32(1)
    for i in range(tid, ncols, NT):
        acc[i] = Int32(0)
    cute.arch.sync_threads()
    for item in range(tid, ncols * per_col, NT):
        col = item % ncols
        total = Int32(0)
        for c0 in range(item // ncols, n, per_col * PARTS_IN_FLIGHT):
            vals = []
            for j in cutlass.range_constexpr(PARTS_IN_FLIGHT):
                c = c0 + j * per_col
                if c >= n:
                    c = n - 1  # a valid address; its value is not counted
                vals.append(ld_volatile_i32(element_addr(parts, (c, col0 + col))))
            for j in cutlass.range_constexpr(PARTS_IN_FLIGHT):
                if c0 + j * per_col < n:
                    total = total + vals[j]
        if total != 0:
            cute.arch.atomic_add(acc.iterator + col, total)
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


class LayoutKernel(EpKernel):
    """The layout kernel (see the module docstring); every size is a run-time argument.

    ``num_sms`` CTAs of ``threads`` threads, as many as the dispatch kernel, which runs the same steps
    (``route``) in every CTA when the layout is folded into its launch."""

    by_rank = False  # compile-time: the rank layout's variant (kernels/rank_layout.py) is compiled apart
    threads = LAYOUT_THREADS

    @cute.kernel
    def kernel(self, p: EpParams):
        self.route(p)

    @cute.jit
    def route(self, p: EpParams):
        """Steps 1-4 of the module docstring, by every thread of every CTA of the launch; each CTA counts
        and places the tokens ``cta_tokens`` gives it. Ends with a CTA barrier after the CTA's slots."""
        R, E, K, El = p.world_size, p.num_experts, p.topk, p.experts_per_rank
        NT = self.threads
        by_rank = self.by_rank
        parts = p.layout_parts  # [num_sms + 2, E + 1 + R]: each CTA's count row, the totals, the bases
        TOTALS = p.num_sms  # the row the CTAs add their counts into (the leader reads and zeroes it)
        BASES = p.num_sms + 1  # the row of this rank's first slot (row) per column, from the leader
        ncols = E + 1 + R
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
            own_ids = cute.make_tensor(p.own_idx.iterator, cute.make_layout(num_pairs))
            own_w = cute.make_tensor(p.own_w.iterator, cute.make_layout(num_pairs))
            pair_w = cute.make_tensor(p.topk_w.iterator, cute.make_layout(num_pairs))
            for i in range(t_first * K + tid, t_end * K, NT):
                own_ids[i] = pair_ids[i]
                own_w[i] = pair_w[i]

        smem = cutlass.memory.SmemAllocator()
        # hist[w * E + e]: pairs of warp w routed to expert e; later the warp's running slot base.
        hist = smem.allocate_tensor(Int32, cute.make_layout(LAYOUT_SMEM_INTS), 16)
        # colsum[e]: rows all ranks send to expert e (the leader, after the exchange); the last E ints.
        colsum = cute.make_tensor(hist.iterator + (LAYOUT_SMEM_INTS - E), cute.make_layout(E))
        # As many histogram warps as fit the rest (E <= LAYOUT_SMEM_INTS // 2 is checked on the host; the
        # rank layout's per-warp token counts take R more ints per warp: 2 E + R <= LAYOUT_SMEM_INTS).
        per_warp = E
        if cutlass.const_expr(by_rank):
            per_warp = E + R
        NW = (LAYOUT_SMEM_INTS - E) // per_warp
        if NW > NT // WARP:
            NW = NT // WARP
        # rank layout: rhist[w * R + d]: warp w's tokens bound for rank d; later the warp's running row base.
        rhist = cute.make_tensor(hist.iterator + NW * E, cute.make_layout(NW * R))
        # flags[0]: this CTA's pairs with invalid ids; flags[1]: ranks that had some (after the exchange);
        # flags[2]: this CTA arrived last (it is the leader).
        flags = smem.allocate_tensor(Int32, cute.make_layout(3), 4)
        # scan[w]: the prefix scan's per-warp totals, then scan[NT // WARP] the column sums' total.
        scan = smem.allocate_tensor(Int32, cute.make_layout(WARP + 1), 4)

        epoch = p.epochs[OP_LAYOUT] + Int64(1)

        for i in range(tid, NW * per_warp, NT):
            hist[i] = Int32(0)
        if tid == 0:
            flags[0] = Int32(0)
        cute.arch.sync_threads()

        # Each warp takes a contiguous part of the CTA's range (any contiguous split gives the same slots):
        # pairs in the expert layout, whole tokens in the rank layout (a lane per token there).
        lo = t_first * K
        hi = t_end * K
        if cutlass.const_expr(by_rank):
            lo = t_first
            hi = t_end
        chunk = (hi - lo + NW - 1) // NW
        start = lo + warp * chunk
        end = start + chunk
        if end > hi:
            end = hi
        if warp >= NW:
            end = start  # no work for warps beyond the histograms

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

        # 2. the CTA's count row: into its row of parts, and added into the totals row
        for col in range(tid, ncols, NT):
            total = Int32(0)
            if col < E:
                for w in range(NW):
                    total = total + hist[w * E + col]
            if col == E:
                total = flags[0]
            if col > E:
                if cutlass.const_expr(by_rank):
                    for w in range(NW):
                        total = total + rhist[w * R + (col - E - 1)]
            parts[bid, col] = total
            if total != 0:
                cute.arch.atomic_add(parts.iterator + cute.crd2idx((TOTALS, col), parts.layout), total)
        cute.arch.sync_threads()
        if tid == 0:
            flags[2] = last_cta_arrives(p.done, DONE_LAYOUT)  # fences this CTA's counts first
            if flags[2] != 0:
                fence_sys()  # the other CTAs' counts before this CTA's reads of them, and before the release
                p.layout_done[0] = epoch * 2 - Int64(1)
        cute.arch.sync_threads()

        # 3. the last CTA to arrive (the leader: every CTA's counts are in) announces that in ``layout_done``
        # (2 * epoch - 1), then runs the count exchange and the offsets and publishes them (2 * epoch). The
        # other CTAs wait for the first value, sum the earlier CTAs' counts while the leader exchanges, and
        # wait for the second.
        leader = flags[2] != 0
        if leader:
            self.exchange_and_offsets(p, epoch, colsum, scan, flags)
        else:
            wait_for_leader(p, epoch * 2 - Int64(1), epoch)
        # The columns slots are placed by: experts (per-warp counts in hist, parts' columns 0 .. E - 1), or in
        # the rank layout destination ranks (rhist, parts' columns E + 1 .. E + R).
        base_of, col0, ncol = hist, Int32(0), E
        if cutlass.const_expr(by_rank):
            base_of, col0, ncol = rhist, E + 1, R
        # Each CTA's warps' first slots (rows) relative to this rank's first one per column: the earlier
        # CTAs' counts (summed into colsum: the leader is done with it by now), then the earlier warps'.
        sum_earlier_ctas(parts, col0, ncol, bid, colsum, NT)
        for col in range(tid, ncol, NT):
            run = colsum[col]
            for w in range(NW):
                c = base_of[w * ncol + col]
                base_of[w * ncol + col] = run
                run = run + c
        if not leader:
            wait_for_leader(p, epoch * 2, epoch)
        cute.arch.sync_threads()
        if tid == 0:
            flags[1] = ld_volatile_i32(element_addr(p.input_fault, INPUT_FAULT_RANKS))
        cute.arch.sync_threads()
        accepted = flags[1] == 0
        refused = flags[1] != 0

        # 3c. the absolute bases: this rank's first slot of each expert (first row on each destination rank)
        for col in range(tid, ncol, NT):
            first = ld_volatile_i32(element_addr(parts, (BASES, col0 + col)))
            for w in range(NW):
                base_of[w * ncol + col] = base_of[w * ncol + col] + first
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
        cute.arch.sync_threads()  # the CTA's slots, before its warps send them (dispatch, layout folded in)

        if leader:
            if tid == 0:
                if fault_free(p.fault):  # a timed-out call does not count as run
                    p.epochs[OP_LAYOUT] = epoch

    @cute.jit
    def exchange_and_offsets(self, p: EpParams, epoch: Int64, colsum: cute.Tensor, scan: cute.Tensor,
                             flags: cute.Tensor):
        """Step 3 in the leader (the last CTA to arrive; every thread of it calls this): this rank's count
        row from the totals, the exchange with every peer, the verdict on the inputs, the offsets, and
        each column's first slot (row) of this rank in ``layout_parts[BASES]``; then ``layout_done``."""
        R, E, El, rank = p.world_size, p.num_experts, p.experts_per_rank, p.rank
        NT = self.threads
        by_rank = self.by_rank
        counts = p.counts
        parts = p.layout_parts
        TOTALS = p.num_sms
        BASES = p.num_sms + 1
        tid, _, _ = cute.arch.thread_idx()
        warp = tid // WARP

        # This rank's count row: the CTAs' sums (every CTA fenced its adds before it arrived). The totals
        # row is zeroed for the next launch.
        for col in range(tid, E + 1 + R, NT):
            at = element_addr(parts, (TOTALS, col))
            counts[rank, col] = ld_volatile_i32(at)
            parts[TOTALS, col] = Int32(0)
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
            flags[1] = ranks
            p.input_fault[INPUT_FAULT_RANKS] = ranks
            p.input_fault[INPUT_FAULT_FIRST] = first
        cute.arch.sync_threads()
        accepted = flags[1] == 0

        # Offsets. Each column sum over sources (count[s][e], written by peers: volatile loads) is read once,
        # in parallel, into shared memory; the walks below then run over shared memory. Capacity: expert e
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
                if cutlass.const_expr(by_rank):  # one row per (source, token) bound for this rank
                    for s in range(R):
                        tot_all = tot_all + ld_volatile_i32(element_addr(counts, (s, E + 1 + rank)))
                else:
                    tot_all = prefix_at(colsum, total, (rank + 1) * El, E) - colsum[rank * El]
            p.num_recv[0] = tot_all
        if cutlass.const_expr(by_rank):
            # This rank's first row on each destination d: the rows of lower source ranks come first.
            for d in range(tid, R, NT):
                run = Int32(0)
                for s in range(rank):
                    run = run + ld_volatile_i32(element_addr(counts, (s, E + 1 + d)))
                parts[BASES, E + 1 + d] = run
        cute.arch.sync_threads()
        if tid == 0:
            fence_sys()  # everything above, before the release the other CTAs wait for
            p.layout_done[0] = epoch * 2
