"""What the kernels share: ``EpKernel`` (every kernel: compile-time element type, block size, launch
from the parameter bundle), ``RowCopyKernel`` (the local row copies around a dispatch) and
``CombineFamily`` (the pull combine, kernels/combine.py, both phases of the reduced combine,
kernels/reduce_push.py and kernels/partial_sum.py, and the rank layout's push, kernels/rank_push.py).

Each of them gives a warp one item at a time (a token, or a received group) in a persistent grid-stride
loop, lists the rows to sum in a per-warp routing list in shared memory (row address and weight, in the
order of the sum), and hands the list to ``kernels.rowsum.weighted_sum_rows``. With fewer items than
warps an item's row is split into parts over the idle warps (``EpKernel.row_split``, which the dispatch
kernel's decode sends use too). The last CTA to finish completes the operation. ``CombineFamily`` holds
those pieces; a kernel subclasses it and writes only its ``kernel``.

Every kernel is compiled under a name profilers show as ``cute_ep::<step>()::kernel``
(``kernels.naming.profiler_name``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.buffers import SIGNAL_COMBINE, EpParams
from cute_ep.kernels.config import (
    COMBINE_WARPS_PER_CTA,
    MAX_TOPK,
    OP_COMBINE,
    PHASE_RECEIVE,
    VECTOR_BYTES,
    WARP,
)
from cute_ep.kernels.signals import fault_free, last_cta_arrives, signal_and_wait_peers


class WarpStart(NamedTuple):
    """Returned by ``CombineFamily.begin``."""

    lane: Any  # lane in the warp
    gwarp: Any  # this warp's index in the grid
    num_warps: Any  # warps in the grid
    row_addr: Any  # [MAX_TOPK] int64 (shared memory): this warp's list of rows to sum, in order
    weight: Any  # [MAX_TOPK] fp32 (shared memory): their weights
    pieces: Any  # 128-bit pieces per row
    row_bytes: Any  # bytes per row (Int64)
    epoch: Any  # this call's combine epoch (Int64)


class EpKernel:
    """A kernel of the module: the element type is fixed at compile time, every size comes in the
    ``EpParams`` bundle, and a launch is ``grid_ctas(p)`` CTAs of ``threads`` threads on ``stream``.
    A subclass writes its ``@cute.kernel def kernel(self, p)`` (the low-latency kernels also their
    ``receive_kernel``, launched by ``launch_halves``)."""

    threads = 256
    # CTAs that share an SM by design (0: no hint). ptxas otherwise budgets registers for more CTAs than
    # the launch ever places on an SM, and spills: phase 1 of the reduced combine got 80 registers and
    # 48/72 bytes of spill stores/loads per thread, and took 422 us instead of 322 us (T=4096, one H200).
    # The hint (``.minnctapersm``) lets it use up to 65536 / (ctas_per_sm * threads) registers.
    ctas_per_sm = 0

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    def grid_ctas(self, p: EpParams):
        """CTAs per launch: the op's SM budget (a persistent grid-stride loop inside)."""
        return p.num_sms

    def launch_hints(self) -> dict:
        if self.ctas_per_sm < 1:
            return {}
        # The carveout is the driver's default (-1); naming it keeps the compile from asking a GPU for
        # the SM's shared memory (which a host without a GPU cannot answer).
        return {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": -1}

    @cute.jit
    def __call__(self, p: EpParams, stream):
        self.start(self.kernel(p), p, stream)

    @cute.jit
    def start(self, traced, p: EpParams, stream):
        """Launch ``traced`` (one of this class's kernels applied to ``p``) as every module kernel is."""
        traced.launch(grid=(self.grid_ctas(p), 1, 1), block=(self.threads, 1, 1), stream=stream,
                      **self.launch_hints())

    @cute.jit
    def launch_halves(self, p: EpParams, stream):
        """The low-latency kernels' launch: ``receive_kernel`` (the receiving half alone) when ``p.phase`` is
        PHASE_RECEIVE, else ``kernel``. Why a kernel of its own: its SMs fetch only the receive's code (in the
        whole dispatch kernel its launch started ~3,100 instructions in; 14% of its stall samples waited for
        an instruction fetch, against 2% in DeepEP's receive, Nsight Compute, one H200)."""
        if p.phase == PHASE_RECEIVE:
            self.start(self.receive_kernel(p), p, stream)
        else:
            self.start(self.kernel(p), p, stream)

    @cute.jit
    def row_split(self, work: Int32, num_pieces: Int32, num_warps: Int32, may_split: Int32):
        """(parts, pieces per part): a row of ``num_pieces`` 128-bit pieces is split into parts over the
        warps left idle by ``work`` items (at most one part per 32 pieces), only if ``may_split`` != 0."""
        parts = Int32(1)
        if may_split != 0:
            if work > 0:
                parts = num_warps // work
            max_parts = (num_pieces + WARP - 1) // WARP
            if parts > max_parts:
                parts = max_parts
            if parts < 1:
                parts = Int32(1)
        return parts, (num_pieces + parts - 1) // parts

    @cute.jit
    def part_of(self, u: Int32, parts: Int32, span: Int32, num_pieces: Int32):
        """(item, first piece, end piece) of work unit ``u`` of the grid-stride loop over items x parts."""
        v_begin = (u % parts) * span
        v_end = v_begin + span
        if v_end > num_pieces:
            v_end = num_pieces
        return u // parts, v_begin, v_end


class RowCopyKernel(EpKernel):
    """Base of the local row copies around a dispatch (kernels/assemble.py before it, kernels/deliver.py
    after it): 512 threads, ``ctas_per_budget_sm`` CTAs per SM of the op's budget; ``warps`` gives a thread
    its warp's place in the grid."""

    threads = 512
    # They replace torch copies, which took the whole GPU: with 4 CTAs per SM (96 at a 24-SM budget) the
    # delivery of 4096 rows of 7168 bf16 took 30.5 us against torch's 27.9 for the same bytes, with 8 29.8
    # against 27.6 (one H200).
    ctas_per_budget_sm = 8

    def grid_ctas(self, p: EpParams):
        return p.num_sms * self.ctas_per_budget_sm

    @cute.jit
    def warps(self):
        """(this warp's index in the grid, warps in the grid, lane)."""
        WPC = self.threads // WARP
        NCTA, _, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        return bid * WPC + tid // WARP, NCTA * WPC, tid % WARP


class CombineFamily(EpKernel):
    """Base of the combine kernels: warp coordinates, routing list, completion."""

    warps_per_cta = COMBINE_WARPS_PER_CTA
    threads = COMBINE_WARPS_PER_CTA * WARP
    grid_factor = 1  # CTAs launched per num_sms

    def grid_ctas(self, p: EpParams):
        return p.num_sms * self.grid_factor

    @cute.jit
    def begin(self, p: EpParams) -> WarpStart:
        """What every combine kernel starts from (``WarpStart``): this warp's coordinates, its routing
        list in shared memory (lane 0 writes entries; a ``sync_warp`` before the sum makes them
        visible), the row's size and this call's combine epoch."""
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        NCTA, _, _ = cute.arch.grid_dim()
        warp = tid // WARP
        smem = cutlass.memory.SmemAllocator()
        WPC = self.warps_per_cta
        row_addr = smem.allocate_tensor(Int64, cute.make_layout(WPC * MAX_TOPK), 16)
        weight = smem.allocate_tensor(Float32, cute.make_layout(WPC * MAX_TOPK), 16)
        elem_bytes = self.dtype.width // 8
        return WarpStart(
            lane=tid % WARP,
            gwarp=bid * WPC + warp,
            num_warps=NCTA * WPC,
            row_addr=cute.make_tensor(row_addr.iterator + warp * MAX_TOPK, cute.make_layout(MAX_TOPK)),
            weight=cute.make_tensor(weight.iterator + warp * MAX_TOPK, cute.make_layout(MAX_TOPK)),
            pieces=p.hidden // (VECTOR_BYTES // elem_bytes),
            row_bytes=Int64(p.hidden) * elem_bytes,
            epoch=p.epochs[OP_COMBINE] + Int64(1),
        )

    @cute.jit
    def start_push(self, p: EpParams, epoch: Int64) -> cute.Tensor:
        """A pushing phase's start (phase 1 of the reduced combine and of the rank layout's push): the start
        barrier on ``SIGNAL_COMBINE`` (a peer may still be summing its previous call's rows: CTA 0 raises
        2 * epoch - 1, every CTA waits), and the shared-memory flag ``cta_arrives_last`` answers in."""
        bid, _, _ = cute.arch.block_idx()
        last = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(1), 4)
        signal_and_wait_peers(p, Int32(SIGNAL_COMBINE), epoch * 2 - 1, Int32(OP_COMBINE), epoch,
                              Int32(bid == 0))
        return last

    @cute.jit
    def given_row(self, p: EpParams, row_bytes: Int64, q) -> Int64:
        """The address of row q of the caller's y where the caller keeps it: ``y`` when ``y_rows`` is not
        0, else ``recv_y`` (y is recv_y itself); with ``y_gather`` the row ``y_slot[q]``."""
        base = p.recv_y.iterator.toint()
        if p.y_rows != 0:
            base = p.y.iterator.toint()
        i = Int64(q)
        if p.y_gather != 0:
            i = p.y_slot[q]
        return base + i * row_bytes

    @cute.jit
    def finish(self, p: EpParams, done_slot: Int32, epoch: Int64):
        """After the CTA's work: the last CTA to arrive advances ``epochs[OP_COMBINE]`` to ``epoch``
        unless a wait timed out (a timed-out call does not count as run). The host reads the epoch after
        the launch ends, so the arrivals are fenced within this GPU only."""
        tid, _, _ = cute.arch.thread_idx()
        cute.arch.sync_threads()
        if tid == 0:
            if last_cta_arrives(p.done, done_slot, system=False) != 0:
                if fault_free(p.fault):
                    p.epochs[OP_COMBINE] = epoch
