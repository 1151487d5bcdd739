"""Combine kernel ("pull"): out[t] = sum over k (ascending) of topk_w[t, k] * recv_y[owner][slot(t, k)].

Start: every rank's expert outputs (symmetric ``recv_y``) must be written before anyone reads them,
so CTA 0 raises ``signals[SIGNAL_COMBINE, rank]`` on every peer to 2 * epoch - 1 (``epoch``: this call's
number) and every CTA waits until all peers have raised theirs (``kernels.signals.signal_and_wait_peers``).

A warp per (local token, part of the hidden dimension) (persistent grid-stride loop). A token's row is
split into parts only when there are fewer tokens than warps and every peer is on this node (decode
batches), so that all warps work; otherwise a part is the whole row.
- for each k whose owner is on ANOTHER node (node = rank // local_world_size), ``get_warp`` the whole
  row ONCE into this warp's staging row ``stage[warp * K + k]``;
- the valid k (expert id >= 0 and slot >= 0: not dropped for capacity) are compacted, in ascending k,
  into the warp's routing list of (row address, weight): the owner's NVSHMEM peer pointer (same node)
  or the staging row;
- ``kernels.rowsum.weighted_sum_rows`` sums the list: each lane holds 2 pieces of 128 bits, rows are
  taken in groups of 8 (then 4, 2, 1) whose loads are all issued before the first is used (one remote
  load in flight per warp left combine latency-bound), accumulated in fp32 in ascending k with
  separately rounded multiply and add (the order of ``cute_ep.reference.reference_combine``, so the
  result is bit-identical), and stored in the input dtype.
Rank layout (``RankCombineKernel``, kernels/rank_combine.py, the same kernel compiled apart so that
the pull combine carries none of its code): the list holds one row per destination rank of the token (at its
first pair for that rank), weight 1, in ascending rank: the caller's rows are already weighted and
reduced, and the sum is the plain fp32 sum in rank order (``reference_combine_rank_layout``). Compiled a
third time (``RankSumKernel``) it sums the same rows from ``partials``, where the peers pushed them
(kernels/rank_push.py), and this rank's own from y, after waiting for the pushes instead of the start
barrier.
The last CTA to finish advances epochs[OP_COMBINE] (``CombineFamily.finish``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.base import CombineFamily
from cute_ep.kernels.buffers import DONE_COMBINE, SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import OP_COMBINE, PULL_COMBINE_WARPS_PER_CTA, WARP
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import elem_view, row_space
from cute_ep.kernels.rowsum import weighted_sum_rows
from cute_ep.kernels.signals import fault_free, signal_and_wait_peers


class CombineKernel(CombineFamily):
    """The pull combine kernel (see the module docstring); every size is a run-time argument."""

    by_rank = False  # compile-time: RankCombineKernel (kernels/rank_combine.py) sums the rank layout
    pushed = False  # compile-time: RankSumKernel sums the rows peers pushed here (kernels/rank_push.py)
    warps_per_cta = PULL_COMBINE_WARPS_PER_CTA  # twice the other combines': more bytes in flight
    threads = PULL_COMBINE_WARPS_PER_CTA * WARP
    ctas_per_sm = 1  # ptxas budgets 65536 / threads = 128 registers, what the sum took at 8 warps

    @cute.kernel
    def kernel(self, p: EpParams):
        self.pull(p)

    @cute.jit
    def pull(self, p: EpParams):
        """The kernel's body, by every thread of every CTA (the module docstring); the rank layout's
        combine (kernels/rank_combine.py) runs it too, under its own name."""
        R, L, K, El = p.world_size, p.local_world_size, p.topk, p.experts_per_rank
        recv_y, dtype = p.recv_y, self.dtype
        # my_addr / my_weight: the valid k of the current token, ascending
        lane, gwarp, NWARPS, my_addr, my_weight, NV, ROW_BYTES, epoch = self.begin(p)
        bid, _, _ = cute.arch.block_idx()

        # Start barrier: all ranks' expert outputs are in place (each peer waited for at most
        # timeout_ms; one that never arrives is recorded in ``fault`` and nothing is read). Combine's
        # signal row carries 2 * epoch - 1 at the start of call ``epoch`` (the reduced combine also
        # raises 2 * epoch when its partial rows are out).
        if cutlass.const_expr(self.pushed):  # wait only: every peer's push raised 2 * epoch after its rows
            signal_and_wait_peers(p, Int32(SIGNAL_COMBINE), epoch * 2, Int32(OP_COMBINE), epoch, Int32(0))
        else:
            signal_and_wait_peers(p, Int32(SIGNAL_COMBINE), epoch * 2 - 1, Int32(OP_COMBINE), epoch,
                                  Int32(bid == 0))  # CTA 0 signals, every CTA waits
        work = Int32(0)
        if fault_free(p.fault):
            work = p.num_tokens

        recv_y_rows, stage_rows = row_space(recv_y, ROW_BYTES), row_space(p.stage, ROW_BYTES)
        out_rows, partial_rows = row_space(p.out, ROW_BYTES), row_space(p.partials, ROW_BYTES)
        my_node = p.rank // L
        # Split rows across idle warps only when no row needs staging (one node; pushed rows are here).
        parts, span = self.row_split(work, NV, NWARPS, Int32(R == L or self.pushed))

        for u in range(gwarp, work * parts, NWARPS):
            t, v_begin, v_end = self.part_of(u, parts, span, NV)
            # Routing of token t; rows on other nodes are fetched whole, once, into the staging rows.
            n = Int32(0)
            rank_d = Int32(-1)  # rank layout: this lane's pair of token t across the lanes (rank_lanes)
            rank_lead = Int32(0)
            if cutlass.const_expr(self.by_rank):
                rank_d, rank_lead = self.rank_lanes(p, t, lane)
            for k in range(K):
                e = p.topk_idx[t, k]
                slot = p.scatter[t, k]  # -1: dropped beyond the expert's capacity (or id -1)
                valid = Int32(0)  # a handle may mask pairs with id -1 (autograd's one-k combines)
                if e >= 0:
                    if slot >= 0:
                        valid = Int32(1)
                # Rank layout: one row per destination rank (at the token's first pair for it), weight 1,
                # summed in ascending rank: its place in the list is the number of lower ranks named.
                at = n
                weight = Float32(1.0)
                if cutlass.const_expr(self.by_rank):
                    if valid != 0:
                        valid, at = self.rank_place(p, t, k, rank_d, rank_lead)
                else:
                    weight = p.topk_w[t, k]
                if valid != 0:
                    d = e // El
                    addr = Int64(0)
                    if cutlass.const_expr(self.pushed):
                        addr = partial_rows.row(t * R + d)  # rank d's row of token t, pushed here
                        if d == p.rank:  # this rank's own row: in y where the caller keeps it
                            addr = self.given_row(p, ROW_BYTES, slot)
                    else:
                        addr = self.pulled_row(p, recv_y_rows, stage_rows, d, slot, gwarp * K + k, my_node)
                    if lane == 0:
                        my_addr[at] = addr
                        my_weight[at] = weight
                    n = n + 1
            cute.arch.sync_warp()

            weighted_sum_rows(dtype, my_addr, my_weight, n, v_begin, v_end, lane, out_rows.row(t))
            cute.arch.sync_warp()

        self.finish(p, Int32(DONE_COMBINE), epoch)

    @cute.jit
    def pulled_row(self, p: EpParams, recv_y_rows, stage_rows, d: Int32, slot: Int32, srow: Int32,
                   my_node: Int32) -> Int64:
        """The address of row ``slot`` of rank d's ``recv_y`` for the sum: its peer pointer on this node,
        else staging row ``srow``, fetched whole with ``get_warp`` (every lane calls it)."""
        addr = Int64(0)
        if d // p.local_world_size != my_node:
            nvshmem_cute.get_warp(elem_view(p.stage[srow, None]), elem_view(p.recv_y[slot, None]), d)
            addr = stage_rows.row(srow)
        else:
            addr = recv_y_rows.on_peer(d).row(slot)
        return addr


profiler_name(CombineKernel.kernel, "combine")
