"""Reduced combine, phase 1 of 2, on every expert's rank: sum each token's rows here into one partial
row and push it to the token's rank.

Why: the pull combine moves every (token, k) row across the link. Summing a token's rows on the rank
that holds them first moves one row per (token, rank) instead: with top-8 over 2 ranks, about 1 row per
token crosses the link instead of 4. Each partial is rounded to the row dtype, so the result differs
from the pull combine's by that rounding (``cute_ep.reference.reference_combine_reduced`` is the
bit-exact reference).

Input: the groups dispatch recorded (kernels/dispatch.py, ``groups``): a received slot p whose
``recv_from[p]`` is -1 - n (n >= 1) is the primary of a group of n pairs of one token, whose later
members are ``recv_group[p, m]`` (m in [1, n), -1 where the pair was dropped for capacity).

Start barrier: a rank writes partial rows into its peers' ``partials``, which a peer may still be
reading in its previous combine's phase 2, so every rank first raises ``signals[SIGNAL_COMBINE, rank]``
on every peer to 2 * epoch - 1 and waits for all of theirs (``signal_and_wait_peers``, bounded).

A warp per group (persistent grid-stride loop over the received slots; the row is split over idle warps
when there are fewer groups than warps and every peer is on this node): the members' (row, weight) in
ascending k go to a per-warp list; ``weighted_sum_rows`` computes the partial (fp32, ascending k, then
the row dtype) and stores it into row t * R + rank of the token's rank's ``partials``: with 128-bit
stores through the NVSHMEM peer pointer on the same node, else into this warp's staging row and then
``put_warp``. The grid is ``REDUCED_GRID_FACTOR`` x num_sms CTAs (kernels/module.py): more warps, more
loads in flight. The source tag ``recv_src[p]`` = (src_rank * M + t) * K + k names the token.

Completion: each CTA's arrival is counted after its sends (``cta_arrives_last``); the last CTA raises
``signals[SIGNAL_COMBINE, rank]`` on every peer to 2 * epoch (phase 2, kernels/partial_sum.py, waits
for it). The epoch is advanced by phase 2.
"""

from __future__ import annotations

import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32

from cute_ep.kernels.base import CombineFamily
from cute_ep.kernels.buffers import DONE_PUSH, SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import REDUCED_GRID_FACTOR
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import row_space, row_view
from cute_ep.kernels.rowsum import weighted_sum_rows
from cute_ep.kernels.signals import cta_arrives_last, fault_free, signal_peers


class ReducePushKernel(CombineFamily):
    """Phase 1 of the reduced combine (see the module docstring); every size is a run-time argument."""

    grid_factor = REDUCED_GRID_FACTOR
    ctas_per_sm = REDUCED_GRID_FACTOR  # the grid is REDUCED_GRID_FACTOR CTAs per SM of the budget
    # (so 128 registers a thread: the row sum keeps at most 4 pieces per lane, kernels/rowsum.py)

    @cute.kernel
    def kernel(self, p: EpParams):
        R, L, K, M, rank = p.world_size, p.local_world_size, p.topk, p.max_tokens, p.rank
        C, H = p.capacity, p.hidden
        recv_y, dtype = p.recv_y, self.dtype
        # my_addr / my_weight: the members of the current group, ascending k
        lane, gwarp, NWARPS, my_addr, my_weight, NV, ROW_BYTES, epoch = self.begin(p)
        tid, _, _ = cute.arch.thread_idx()
        last = self.start_push(p, epoch)  # the start barrier; the flag cta_arrives_last answers in
        work = Int32(0)
        if fault_free(p.fault):
            work = p.num_recv[0]
            if work > C:
                work = C
        parts, span = self.row_split(work, NV, NWARPS, Int32(R == L))

        recv_y_rows, partial_rows = row_space(recv_y, ROW_BYTES), row_space(p.partials, ROW_BYTES)
        stage_row = row_space(p.stage, ROW_BYTES).row(gwarp)  # one per warp (EpConfig.stage_rows)
        my_node = rank // L

        for u in range(gwarp, work * parts, NWARPS):
            q, v_begin, v_end = self.part_of(u, parts, span, NV)  # q: a received slot
            f = p.recv_from[q]
            src = p.recv_src[q]
            owner = src // (M * K)
            if f <= Int32(-2):
                if owner < R:
                    t = (src // K) % M
                    n = Int32(-1) - f
                    if n > K:
                        n = K
                    # The group's kept rows, ascending k: the primary, then the later members.
                    cnt = Int32(0)
                    for mm in range(n):
                        s = q
                        if mm > 0:
                            s = p.recv_group[q, mm]
                        if s >= 0:
                            if s < C:
                                if lane == 0:
                                    my_addr[cnt] = recv_y_rows.row(s)
                                    my_weight[cnt] = p.recv_w[s]
                                cnt = cnt + 1
                    cute.arch.sync_warp()
                    row = t * R + rank  # this rank's partial of token t
                    if owner // L == my_node:
                        weighted_sum_rows(dtype, my_addr, my_weight, cnt, v_begin, v_end, lane,
                                          partial_rows.on_peer(owner).row(row), max_pieces=4,
                                          dst_is_local=False)
                    else:
                        weighted_sum_rows(dtype, my_addr, my_weight, cnt, v_begin, v_end, lane, stage_row,
                                          max_pieces=4)
                        cute.arch.sync_warp()  # the put reads what every lane stored
                        nvshmem_cute.put_warp(
                            row_view(dtype, partial_rows.row(row), H), row_view(dtype, stage_row, H), owner
                        )
                    cute.arch.sync_warp()  # the list is rewritten for the next group

        if cta_arrives_last(p, Int32(DONE_PUSH), last, tid) != 0:
            signal_peers(p, Int32(SIGNAL_COMBINE), epoch * 2)  # every partial row of this rank is out


profiler_name(ReducePushKernel.kernel, "reduce_push")
