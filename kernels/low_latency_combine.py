"""Low-latency combine kernel: the experts' outputs in DeepEP's padded layout pushed back to their tokens'
ranks, then summed there: out[t] = the sum over k ascending of topk_w[t, k] * (the output of pair (t, k)),
in fp32 (product and sum rounded separately), rounded once (``weighted_sum_rows``), pairs with id -1 or
no slot skipped: bit for bit the pull combine's sum (kernels/combine.py).

Inputs on the expert's rank: ``y`` (the caller's padded tensor, [El * R * M, H], expert l's rows from
l * R * M), ``ll_count`` [El] (its rows per expert) and ``y_slot`` [El * R * M], which the low-latency
dispatch (kernels/low_latency_dispatch.py) wrote for each filled slot: (s * M + t) * K + k, the pair it
holds. Why push and not pull: the rows sit in the caller's tensor, which peers cannot read; pushing them
needs no staging copy into symmetric memory, and a store is not waited for as a remote load is.

1. Push (every warp): each CTA scans ``ll_count`` into the first row of each expert among all filled
   slots, and the grid's warps take those rows in parts of columns (``push_split``), each warp the same
   share, whatever the experts' counts (a grid-stride loop over every slot, empty ones too: at 128 tokens,
   top-8 of 288 experts on one H200 it spent 14% of the kernel's warp samples skipping empty slots and
   gave 40-59 of the 1536 warps two rows while a third had none); row r of expert l goes into row
   t * K + k of ``ll_comb`` on source rank s (peer-pointer stores on this node, ``put_warp`` to other
   nodes).
2. The last CTA to finish its pushes (``done[DONE_PUSH]``) raises ``signals[SIGNAL_COMBINE, rank]`` on every
   peer to this call's epoch, having advanced epochs[OP_COMBINE] (every CTA read it before it arrived, and
   nothing was recorded in ``fault`` when the launch started); every CTA waits until all peers have raised
   theirs here (bounded waits). Why the epoch here: an arrival of every summing CTA after its sum put a
   fence and an atomic's round trip at the end of the launch; a wait that times out records a fault,
   which the host reads before the epochs.
3. Sum (a warp per token, split into parts over idle warps at decode sizes): the token's rows of
   ``ll_comb`` weighted by ``topk_w`` into ``out``.
Why one set of ``ll_comb`` suffices: a peer pushes its next combine only after its next dispatch, which
waits for this rank's counts of that dispatch, enqueued after this combine; two combines in a row are
ordered by the host (``cute_ep.deep_ep``'s fence between them).
With ``phase`` PHASE_SEND a launch runs steps 1-2 (the signal raised, nothing waited for) and a later one
with PHASE_RECEIVE step 3 after the wait, from a kernel of its own, ``receive_kernel`` (DeepEP's
``return_recv_hook``).
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.base import CombineFamily, WarpStart
from cute_ep.kernels.buffers import DONE_PUSH, SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import MAX_EXPERTS, OP_COMBINE, PHASE_SEND, VECTOR_BYTES, WARP
from cute_ep.kernels.dispatch_senders import send_row_into
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import RowSpace, row_space
from cute_ep.kernels.rowsum import weighted_sum_rows
from cute_ep.kernels.scan import exclusive_scan_cta, last_at_or_before, warp_batch
from cute_ep.kernels.signals import (
    cta_arrives_last,
    fault_free,
    signal_and_wait_peers,
    signal_peers,
    wait_peers,
)

# 128-bit pieces per lane in flight in a pushed row: a decode batch gives each warp a row or two, each a
# chain of load latencies (7168 bf16: 4 steps of 8 against 7 of the dispatch's 4; with 16, ptxas spilled)
PUSH_UNROLL = 8
MAX_PUSH_PARTS = 8  # parts of a row pushed by different warps, at most
EXPERT_SEARCH_STEPS = 13  # binary-search steps over a rank's experts (2 ** 13 > MAX_EXPERTS)


class LowLatencyCombineKernel(CombineFamily):
    """The low-latency combine (see the module docstring); every size is a run-time argument."""

    grid_factor = 2  # more warps, fewer rows each to push one after another at decode sizes
    # Every CTA waits for the peers' signal, which needs every CTA's pushes: all CTAs must be resident at
    # once, so two per SM of the budget, as launched (ptxas otherwise took 146 registers, one CTA per SM:
    # the grid fits only where twice the budget's SMs are free).
    ctas_per_sm = 2

    @cute.jit
    def __call__(self, p: EpParams, stream):
        self.launch_halves(p, stream)  # a receiving half: step 3 alone, ``receive_kernel``

    @cute.kernel
    def receive_kernel(self, p: EpParams):
        """Step 3 alone (``PHASE_RECEIVE``), after the wait for every peer's signal: the call's epoch is the
        one its sending half advanced to."""
        start = self.begin(p)
        epoch = start.epoch - Int64(1)  # the sending half already advanced the word to this call's
        wait_peers(p, Int32(SIGNAL_COMBINE), epoch, Int32(OP_COMBINE), epoch)
        self.sum_tokens(p, start)

    @cute.kernel
    def kernel(self, p: EpParams):
        start = self.begin(p)
        lane, gwarp, NWARPS, _, _, NV, ROW_BYTES, epoch = start  # (a receiving half runs ``receive_kernel``)
        tid, _, _ = cute.arch.thread_idx()
        comb = row_space(p.ll_comb, ROW_BYTES)
        smem = cutlass.memory.SmemAllocator()
        last = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
        firsts = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), 16)
        sums = smem.allocate_tensor(Int32, cute.make_layout(self.threads // WARP + 1), 4)
        live = Int32(0)  # read once, at the start: no latency of its own where the epoch advances
        if fault_free(p.fault):
            live = Int32(1)
        self.push_rows(p, firsts, sums, comb, lane, gwarp, NWARPS, NV, ROW_BYTES)  # 1. push
        announce = cta_arrives_last(p, DONE_PUSH, last, tid)  # this CTA finished the pushes last
        # 2. the last CTA advances the epoch (every CTA read it before it arrived) and announces every CTA's
        # rows; every CTA waits for every peer's (not when sending only)
        if announce != 0:
            if tid == 0:
                if live != 0:
                    p.epochs[OP_COMBINE] = epoch
        if p.phase == PHASE_SEND:
            if announce != 0:
                signal_peers(p, Int32(SIGNAL_COMBINE), epoch)
        else:
            signal_and_wait_peers(p, Int32(SIGNAL_COMBINE), epoch, Int32(OP_COMBINE), epoch, announce)
            self.sum_tokens(p, start)

    @cute.jit
    def sum_tokens(self, p: EpParams, start: WarpStart):
        """Step 3: each token's pushed rows of ``ll_comb`` weighted by ``topk_w`` into ``out`` (a warp per
        token, split into parts over idle warps at decode sizes); nothing once a fault is recorded."""
        lane, gwarp, NWARPS, my_addr, my_weight, NV, ROW_BYTES, _ = start
        K = p.topk
        comb = row_space(p.ll_comb, ROW_BYTES)
        work = Int32(0)
        if fault_free(p.fault):
            work = p.num_tokens
        out_rows = row_space(p.out, ROW_BYTES)
        parts, span = self.row_split(work, NV, NWARPS, Int32(1))
        for u in range(gwarp, work * parts, NWARPS):
            t, v_begin, v_end = self.part_of(u, parts, span, NV)
            # a lane per pair (K <= 32, EpConfig's low-latency bound): the token's ids, slots and weights
            # loaded at once, not one pair's after another's (16 dependent loads at top-8)
            pushed = Int32(0)
            w = Float32(0.0)
            if lane < K:
                e = p.topk_idx[t, lane]
                slot = p.scatter[t, lane]
                w = p.topk_w[t, lane]
                if e >= 0:
                    if slot >= 0:
                        pushed = Int32(1)
            members = Int32(cute.arch.vote_ballot_sync(pushed != 0))
            if pushed != 0:  # its place among the pairs summed, k ascending
                at = cute.arch.popc(members & Int32(cute.arch.lanemask_lt()))
                my_addr[at] = comb.row(t * K + lane)
                my_weight[at] = w
            n = cute.arch.popc(members)
            cute.arch.sync_warp()
            weighted_sum_rows(self.dtype, my_addr, my_weight, n, v_begin, v_end, lane, out_rows.row(t))
            cute.arch.sync_warp()

    @cute.jit
    def push_rows(self, p: EpParams, firsts: cute.Tensor, sums: cute.Tensor, comb: RowSpace, lane: Int32,
                  gwarp: Int32, NWARPS: Int32, NV: Int32, row_bytes: Int64):
        """Step 1, by every thread of the CTA: ``firsts`` (shared, El ints) becomes each expert's first row
        among the filled slots (``sums``: the scan's scratch); filled row j is then expert l's row r (l the
        last expert whose first row is at or before j), and its part's columns go to the pair's row of
        ``comb`` on its source rank. Nothing moves once a fault is recorded."""
        tid, _, _ = cute.arch.thread_idx()
        El, S, MK = p.experts_per_rank, p.rank_capacity, p.max_tokens * p.topk
        for el in range(tid, El, self.threads):
            firsts[el] = p.ll_count[el]
        cute.arch.sync_threads()
        exclusive_scan_cta(firsts, El, sums, self.threads)
        total = Int32(0)
        if fault_free(p.fault):
            total = sums[self.threads // WARP]
        parts, span = self.push_split(total, NV, NWARPS)
        rows = row_space(p.y, row_bytes)
        units = total * parts
        for base in range(gwarp, units, NWARPS * WARP):
            # the warp's next 32 units looked up at once, a lane each (search, y_slot read): one latency
            # for them all, not one before each unit's copy
            slot, src, dst_row = Int32(0), Int32(0), Int32(0)
            if base + lane * NWARPS < units:
                j = (base + lane * NWARPS) // parts
                el = last_at_or_before(firsts, j, El - 1, EXPERT_SEARCH_STEPS)
                slot = el * S + j - firsts[el]
                pair = p.y_slot[slot]
                src, dst_row = Int32(pair // MK), Int32(pair % MK)
            for i in range(warp_batch(units, base, NWARPS)):
                _, v_begin, v_end = self.part_of(base + i * NWARPS, parts, span, NV)
                at = Int64(v_begin) * VECTOR_BYTES
                src_addr = rows.row(cute.arch.shuffle_sync(slot, i)) + at
                send_row_into(self.dtype, p, comb.from_byte(at), src_addr, cute.arch.shuffle_sync(src, i),
                              cute.arch.shuffle_sync(dst_row, i), Int32(1), (v_end - v_begin) * VECTOR_BYTES,
                              lane, PUSH_UNROLL)

    @cute.jit
    def push_split(self, rows: Int32, num_pieces: Int32, num_warps: Int32):
        """(parts, pieces per part) for pushing ``rows`` rows of ``num_pieces`` 128-bit pieces over
        ``num_warps`` warps: the parts (at most MAX_PUSH_PARTS, a lane's piece at least each) that leave the
        busiest warp the fewest rounds of PUSH_UNROLL loads per lane (fewer parts on a tie). Why rounds: a
        part's copy waits a memory latency per round, so at decode sizes (rows near the warps' count) a
        row in 4 parts of one round each beats one row of 4 rounds per warp."""
        best, best_rounds = Int32(1), Int32(-1)
        for parts in cutlass.range_constexpr(1, MAX_PUSH_PARTS + 1):
            if parts * WARP <= num_pieces:
                span = (num_pieces + parts - 1) // parts
                rounds = ((rows * parts + num_warps - 1) // num_warps) * \
                    ((span + PUSH_UNROLL * WARP - 1) // (PUSH_UNROLL * WARP))
                if best_rounds < 0 or rounds < best_rounds:
                    best, best_rounds = Int32(parts), rounds
        return best, (num_pieces + best - 1) // best


# "combine_low_latency": DeepEP's bench_kineto finds a call's combine kernels by "::combine"; the receiving
# half under the same name (bench_kineto splits one profiler line's kernels into the halves)
profiler_name(LowLatencyCombineKernel.kernel, "combine_low_latency")
profiler_name(LowLatencyCombineKernel.receive_kernel, "combine_low_latency")
