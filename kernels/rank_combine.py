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


class RankCombineKernel(CombineKernel):
    """The rank-layout combine (see the module docstring)."""

    by_rank = True

    @cute.jit
    def rank_place(self, p: EpParams, t: Int32, k: Int32):
        """For a valid pair (t, k): (1, place) if k is the token's first pair bound for its rank, place
        being how many lower ranks the token is bound for (its position in the sum); else (0, 0)."""
        K, El = p.topk, p.experts_per_rank
        d = p.topk_idx[t, k] // El
        first = Int32(1)
        place = Int32(0)
        for j in range(K):
            dj = self.rank_of_pair(p, t, j, El)
            if dj == d:
                if j < k:
                    first = Int32(0)
            if dj >= 0:
                if dj < d:
                    lead = Int32(1)  # count rank dj once: at its first pair
                    for i in range(j):
                        if self.rank_of_pair(p, t, i, El) == dj:
                            lead = Int32(0)
                    place = place + lead
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
