"""The layout's per-warp steps (kernels/layout.py, whose docstring states the protocol): step 1, a warp
counts its part of the CTA's pairs per expert (and in the rank layout its tokens per destination rank)
and checks their ids; step 4, a warp gives its pairs their slots (tokens their rows). The expert layout
takes a lane per (token, k) pair, the rank layout a lane per token, 32 at a time."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_ep.kernels.config import WARP

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
def rank_of(raw: Int32, E: Int32, inv_El: Float32) -> Int32:
    """The rank owning raw id ``raw``'s expert (ranks own El experts each, in order; ``inv_El``: 1 / El in
    fp32), or -1 if it names none. Why not ``e // El``: an integer division by a run-time value is some
    twenty instructions, and these walks run their code once per launch, waiting on its fetch. In fp32
    (e + 0.5) * inv_El is at least 0.5 / El away from an integer, off by less than E / El * 2^-22, so its
    truncation is e // El for E < 2^21 (kernels.config.MAX_EXPERTS is 6144; checked for every E, El up to
    it in tests/test_layout_warps.py)."""
    d = Int32(-1)
    e = valid_id(raw, E)
    if e >= 0:
        d = Int32((Float32(e) + Float32(0.5)) * inv_El)
    return d


@cute.jit
def rank_bits(token_pairs: cute.Tensor, dests, t: Int32, live: cutlass.Boolean, K: Int32, E: Int32,
              inv_El: Float32, d0: Int32, regs: cutlass.Constexpr) -> Int32:
    """Bit b set: token t (when ``live``) has an expert on rank d0 + b (0 <= b < 32). ``regs``: its ids'
    ranks are the registers ``dests`` (``lane_token``), else they come from ``token_pairs``."""
    bits = Int32(0)
    if live:
        if cutlass.const_expr(regs):
            for k in cutlass.range_constexpr(TOKEN_REGS):
                bits = bits | rank_bit(dests[k], d0)
        else:
            for k in range(K):
                bits = bits | rank_bit(rank_of(token_pairs[t, k], E, inv_El), d0)
    return bits


@cute.jit
def rank_bit(d: Int32, d0: Int32) -> Int32:
    """The bit of rank d in the word of ranks d0 .. d0 + 31 (0 if d is not among them, or -1)."""
    bit = Int32(0)
    b = d - d0
    if d >= 0:
        if b >= 0:
            if b < WARP:
                bit = Int32(1) << b
    return bit


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
               E: Int32, inv_El: Float32, regs: cutlass.Constexpr):
    """The rank layout's walks take a lane per token, 32 tokens per warp step: the lane's token of the step
    starting at ``base`` as (t, live: t < t_end, ids, dests), with ``regs`` its raw ids (``token_regs``)
    and each one's rank (``rank_of``, found once per id rather than once per id and rank), else None."""
    t = base + lane
    live = t < t_end
    ids = None
    dests = None
    if cutlass.const_expr(regs):
        ids = token_regs(token_pairs, t, live, t_start, K)
        dests = []
        for k in cutlass.range_constexpr(TOKEN_REGS):
            dests.append(rank_of(ids[k], E, inv_El))
    return t, live, ids, dests


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
    inv_El = Float32(1.0) / Float32(El)
    for base in range(t_start, t_end, WARP):  # warp-uniform bounds: every lane votes
        t, live, ids, dests = lane_token(token_pairs, base, lane, t_start, t_end, K, E, inv_El, regs)
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
            bits = rank_bits(token_pairs, dests, t, live, K, E, inv_El, d0, regs)
            for b in range(ranks_in_word(R, d0)):
                ballot = cute.arch.vote_ballot_sync(((bits >> b) & 1) != 0)
                if lane == 0:
                    rhist[warp * R + d0 + b] = rhist[warp * R + d0 + b] + cute.arch.popc(ballot)


@cute.jit
def place_tokens(token_pairs: cute.Tensor, token_slots: cute.Tensor, rhist: cute.Tensor, t_start: Int32,
                 t_end: Int32, warp: Int32, lane: Int32, E: Int32, K: Int32, El: Int32, R: Int32,
                 accepted: cutlass.Boolean, regs: cutlass.Constexpr):
    """Step 4 of the rank layout: a lane per token, 32 tokens per step. For each destination rank d, a
    ballot of the step's tokens bound for d: a token's row on d is the warp's running row base
    (``rhist``) plus the tokens of earlier lanes bound for d, and every pair of the token on d takes that
    row. Pairs with no valid id, and every pair of a refused call, get -1. ``regs`` as in count_tokens.
    Why each id's rank is found once, without an integer division (``lane_token``, ``rank_of``): with a
    division per id and rank, and -1 written before every slot, this step took 3.4 us for one token on an
    H200, against 0.4 us for the expert layout's pairs."""
    lt = cute.arch.lanemask_lt()
    inv_El = Float32(1.0) / Float32(El)
    for base in range(t_start, t_end, WARP):  # warp-uniform bounds: every lane votes
        t, live, ids, dests = lane_token(token_pairs, base, lane, t_start, t_end, K, E, inv_El, regs)
        if live:
            if cutlass.const_expr(regs):  # -1 where no rank below will place the pair
                for k in cutlass.range_constexpr(TOKEN_REGS):
                    if Int32(k) < K:
                        if dests[k] < 0:
                            token_slots[t, k] = Int32(-1)
                        if not accepted:
                            token_slots[t, k] = Int32(-1)
            else:
                for k in range(K):
                    token_slots[t, k] = Int32(-1)
        for d0 in range(0, R, WARP):
            bits = rank_bits(token_pairs, dests, t, live, K, E, inv_El, d0, regs)
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
                                if dests[k] == d:
                                    token_slots[t, k] = row
                        else:
                            for k in range(K):
                                if rank_of(token_pairs[t, k], E, inv_El) == d:
                                    token_slots[t, k] = row
                cute.arch.sync_warp()  # every lane read the base before lane 0 moves it
                if lane == 0:
                    rhist[warp * R + d] = row_base + cute.arch.popc(ballot)
                cute.arch.sync_warp()


@cute.jit
def place_pairs(pair_ids: cute.Tensor, pair_slots: cute.Tensor, hist: cute.Tensor, send_limit: cute.Tensor,
                start: Int32, end: Int32, warp: Int32, lane: Int32, E: Int32, refused: cutlass.Boolean):
    """Step 4 of the expert layout for the warp's pairs [start, end): 32 pairs per warp step in row-major
    order; a pair's slot is its warp's running base for the expert (``hist``) plus the earlier lanes with
    the same expert (``match_sync`` finds them in one instruction; 32 shuffles did before). -1 for pairs
    without a valid id, beyond the expert's ``send_limit`` (capacity), or of a refused call."""
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
            if slot >= send_limit[e]:
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
