"""Rank-layout combine kernel: out[t] = the sum over t's destination ranks r, ascending, of y_r[row of t].

The rank layout (``dispatch(..., layout="rank")``) gives every (token, destination rank) one row, and the
caller hands combine one output row per received row, already weighted and reduced over that rank's
experts (DeepEP's semantics). This is the pull combine (kernels/combine.py: start barrier, staging of
rows on other nodes, row split, ``weighted_sum_rows``, completion) with another routing list: one
entry per destination rank (at the token's first pair for it, whose ``scatter`` entry is the row),
weight 1, in ascending rank. ``weighted_sum_rows`` accumulates in fp32 from 0 with separately rounded
multiply and add, so the result is the fp32 sum in rank order rounded once
(``cute_ep.reference.reference_combine_rank_layout``), bit for bit.

Compiled as its own kernel rather than a run-time branch of the pull combine: the branch's code cost
the pull combine registers (307.9 us against 238.7 us at 4096 tokens on one H200).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.combine import CombineKernel
from cute_ep.kernels.config import WARP
from cute_ep.kernels.naming import profiler_name


class RankCombineKernel(CombineKernel):
    """The rank-layout combine (see the module docstring)."""

    by_rank = True

    @cute.kernel
    def kernel(self, p: EpParams):
        self.pull(p)

    @cute.jit
    def rank_lanes(self, p: EpParams, t: Int32, lane: Int32):
        """Token t's pairs across the lanes, once per token (K <= WARP; else (-1, 0)): (d, lead) of lane
        j's pair (t, j): its destination rank (-1: none, or j >= K) and 1 if it is the token's first pair
        bound for d. Every lane calls it."""
        K, El = p.topk, p.experts_per_rank
        d = Int32(-1)
        lead = Int32(0)
        if K <= WARP:
            if lane < K:
                d = self.rank_of_pair(p, t, lane, El)
            for k in range(K):
                same = cute.arch.vote_ballot_sync(d == cute.arch.shuffle_sync(d, k))
                if lane == k:
                    if d >= 0:
                        if Int32(cute.arch.clz(cute.arch.brev(same))) == k:
                            lead = Int32(1)
        return d, lead

    @cute.jit
    def rank_place(self, p: EpParams, t: Int32, k: Int32, d: Int32, lead: Int32):
        """For a valid pair (t, k): (1, place) if k is the token's first pair bound for its rank, place
        being how many lower ranks the token is bound for (its position in the sum); else (0, 0).
        ``d``, ``lead``: this lane's from ``rank_lanes`` (K <= WARP: a shuffle and a ballot instead of
        O(K^2) loads per pair, which were most of the rank combine at 4096 tokens and 24 SMs)."""
        K, El = p.topk, p.experts_per_rank
        first = Int32(1)
        place = Int32(0)
        if K <= WARP:
            dk = cute.arch.shuffle_sync(d, k)
            first = cute.arch.shuffle_sync(lead, k)
            lower = Int32(0)
            if lead != 0:
                if d < dk:
                    lower = Int32(1)
            place = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(lower != 0)))
        else:
            dk = p.topk_idx[t, k] // El
            for j in range(K):
                dj = self.rank_of_pair(p, t, j, El)
                if dj == dk:
                    if j < k:
                        first = Int32(0)
                if dj >= 0:
                    if dj < dk:
                        lead_j = Int32(1)  # count rank dj once: at its first pair
                        for i in range(j):
                            if self.rank_of_pair(p, t, i, El) == dj:
                                lead_j = Int32(0)
                        place = place + lead_j
        if first == 0:
            place = Int32(0)
        return first, place

    @cute.jit
    def rank_of_pair(self, p: EpParams, t: Int32, j: Int32, El: Int32) -> Int32:
        """The destination rank of pair (t, j), or -1 if it has none (id -1, or no row)."""
        d = Int32(-1)
        e = p.topk_idx[t, j]
        if e >= 0:
            if p.scatter[t, j] >= 0:
                d = e // El
        return d


profiler_name(RankCombineKernel.kernel, "rank_combine")


class RankSumKernel(RankCombineKernel):
    """Phase 2 of the rank layout's push combine (variant "rank+reduced"): the rank combine's sum over the
    rows the token's destination ranks pushed into this rank's ``partials`` (kernels/rank_push.py), row
    t * R + d from rank d, and this rank's own row read from y (``given_row``), after every peer's push has
    raised ``SIGNAL_COMBINE`` to 2 * epoch; the list, order and rounding of the pull, so the same result
    bit for bit."""

    pushed = True

    @cute.kernel
    def kernel(self, p: EpParams):
        self.pull(p)


profiler_name(RankSumKernel.kernel, "rank_sum")
