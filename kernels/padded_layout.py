"""DeepEP's low-latency receive layout in one launch: the expert-major receive rows of a dispatch placed
into the per-expert padded layout ``[El, S, W]`` (S = R * M slots per local expert), with its metadata.

Inputs: ``recv_rows`` [C, W] (expert l's rows back to back, source rank ascending, rows past the
received count stale), ``recv_src`` [C] int32 tags ``(s * M + t) * K + k``, ``tokens_per_expert`` [El]
int32. Outputs: ``rows`` (row j of expert l goes to slot
``l * S + j - start[l]``), ``src_info`` at each filled slot (the token index on its source), ``count``
[El] int32, ``layout_range`` [El, R] int64 (``(begin << 32) | rows`` of each source's block, sources in
rank order), ``slot`` [C] int64 (each expert-major row's slot; rows past the count get ``El * S - 1``,
which combine's gather may read and ignore), and with ``add_stats`` ``stats`` [El] += count.

The same results as ``cute_ep.deep_ep.low_latency.padded_layout`` (its 19 torch operations, each a launch
and host time, and a copy of every row of the capacity) on the slots it fills; slots past an expert's
count are left as they were (DeepEP's are uninitialised there too). Rows move as 128-bit pieces of any
element type (``row_bytes`` a multiple of 16), so one compiled function serves every dtype.

Shape of the work: ``ctas`` CTAs of 256 threads. Each CTA loads ``tokens_per_expert`` into shared memory
and scans it (each expert's first row); a warp per expert-major row (grid-stride) finds its expert by
binary search over those starts and copies the row. CTA 0 also writes ``count``, ``layout_range`` and the
statistics. Nothing here calls NVSHMEM: it is compiled apart from the EP module.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64

from cute_ep.kernels.config import WARP
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.rows import copy_row_warp, row_space
from cute_ep.kernels.scan import exclusive_scan_cta

MAX_LOCAL_EXPERTS = 8192  # shared-memory bound on El (the starts: 32 KB)
SEARCH_STEPS = 14  # binary-search steps: enough for MAX_LOCAL_EXPERTS + 1 entries
ROW_SEARCH_STEPS = 31  # over an expert's rows: any int32 count


class PaddedLayoutKernel:
    """The padded-layout launch (see the module docstring); every size is a run-time argument."""

    threads = 256

    @cute.jit
    def __call__(self, recv_rows: cute.Pointer, recv_src: cute.Pointer, tokens_per_expert: cute.Pointer,
                 rows: cute.Pointer, src_info: cute.Pointer, count: cute.Pointer, layout_range: cute.Pointer,
                 slot: cute.Pointer, stats: cute.Pointer, capacity: Int32, experts: Int32, num_ranks: Int32,
                 max_tokens: Int32, topk: Int32, row_bytes: Int32, add_stats: Int32, ctas: Int32, stream):
        el, slots = experts, num_ranks * max_tokens
        vec = cute.make_layout
        # the two row buffers travel as tensors for rows.py's RowSpace (their base address; one entry per row
        # here, the rows' own size being row_bytes)
        self.kernel(
            cute.make_tensor(recv_rows, vec(capacity)), cute.make_tensor(recv_src, vec(capacity)),
            cute.make_tensor(tokens_per_expert, vec(el)), cute.make_tensor(rows, vec(el * slots)),
            cute.make_tensor(src_info, vec(el * slots)), cute.make_tensor(count, vec(el)),
            cute.make_tensor(layout_range, cute.make_layout((el, num_ranks), stride=(num_ranks, 1))),
            cute.make_tensor(slot, vec(capacity)), cute.make_tensor(stats, vec(el)), capacity, el, num_ranks,
            max_tokens, topk, row_bytes, add_stats,
        ).launch(grid=(ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, recv_rows: cute.Tensor, recv_src: cute.Tensor, tokens_per_expert: cute.Tensor,
               rows: cute.Tensor, src_info: cute.Tensor, count: cute.Tensor, layout_range: cute.Tensor,
               slot: cute.Tensor, stats: cute.Tensor, capacity: Int32, el: Int32, num_ranks: Int32,
               max_tokens: Int32, topk: Int32, row_bytes: Int32, add_stats: Int32):
        NT = self.threads
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        NCTA, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        starts = smem.allocate_tensor(Int32, cute.make_layout(MAX_LOCAL_EXPERTS), 16)
        scratch = smem.allocate_tensor(Int32, cute.make_layout(NT // WARP + 1), 4)
        for i in range(tid, el, NT):
            starts[i] = tokens_per_expert[i]
        cute.arch.sync_threads()
        exclusive_scan_cta(starts, el, scratch, NT)  # starts[l]: expert l's first row; ends with a barrier
        total = scratch[NT // WARP]
        slots = num_ranks * max_tokens
        if bid == 0:
            self.metadata(recv_src, tokens_per_expert, starts, count, layout_range, stats, el, num_ranks,
                          topk * max_tokens, add_stats)
        pieces = row_bytes // 16
        given, placed = row_space(recv_rows, row_bytes), row_space(rows, row_bytes)
        lane = tid % WARP
        NW = NT // WARP
        for j in range(bid * NW + tid // WARP, capacity, NCTA * NW):
            if j < total:
                e = self.expert_of(starts, j, el)
                s = e * slots + j - starts[e]
                copy_row_warp(Int32, given.row(j), placed.row(s), pieces, lane)
                if lane == 0:
                    src_info[s] = recv_src[j] // topk % max_tokens
                    slot[j] = Int64(s)
            else:
                if lane == 0:
                    slot[j] = Int64(el * slots - 1)

    @cute.jit
    def expert_of(self, starts: cute.Tensor, j: Int32, el: Int32) -> Int32:
        """The last expert whose first row is at or before row j (experts without rows share their
        start with the next one, so the last such is the one holding j)."""
        lo = Int32(0)
        hi = el
        for _ in cutlass.range_constexpr(SEARCH_STEPS):
            if lo < hi:
                mid = (lo + hi) // 2
                if starts[mid] <= j:
                    lo = mid + 1
                else:
                    hi = mid
        return lo - 1

    @cute.jit
    def metadata(self, recv_src: cute.Tensor, tokens_per_expert: cute.Tensor, starts: cute.Tensor,
                 count: cute.Tensor, layout_range: cute.Tensor, stats: cute.Tensor, el: Int32,
                 num_ranks: Int32, tags_per_rank: Int32, add_stats: Int32):
        """CTA 0: each expert's count (and the statistics), and each (expert, source) block: within an
        expert the rows come in source order, so a block's ends are two binary searches over the tags.
        Why from the tags and not the count table: a peer's next layout may rewrite this rank's count
        table before this launch runs; the receive rows it cannot touch before this rank's next layout."""
        tid, _, _ = cute.arch.thread_idx()
        for e in range(tid, el, self.threads):
            c = tokens_per_expert[e]
            count[e] = c
            if add_stats != 0:
                stats[e] = stats[e] + c
        for pair in range(tid, el * num_ranks, self.threads):
            e = pair // num_ranks
            s = pair % num_ranks
            begin = starts[e]
            end = begin + tokens_per_expert[e]
            first = self.first_of_source(recv_src, begin, end, s, tags_per_rank)
            after = self.first_of_source(recv_src, first, end, s + 1, tags_per_rank)
            layout_range[e, s] = (Int64(first - begin) << 32) | Int64(after - first)

    @cute.jit
    def first_of_source(self, recv_src: cute.Tensor, lo: Int32, hi: Int32, source: Int32,
                        tags_per_rank: Int32) -> Int32:
        """The first row in [lo, hi) whose tag comes from ``source`` or a later rank (hi if none)."""
        for _ in cutlass.range_constexpr(ROW_SEARCH_STEPS):
            if lo < hi:
                mid = (lo + hi) // 2
                if recv_src[mid] // tags_per_rank < source:
                    lo = mid + 1
                else:
                    hi = mid
        return lo


profiler_name(PaddedLayoutKernel.kernel, "low_latency_layout")


# --------------------------------------------------------------------------------------------------
# host side: what a compile needs (no GPU: the pointers are stand-ins)
# --------------------------------------------------------------------------------------------------

COMPILE_KEY = ("padded_layout",)
# kinds of the launch's arguments, in order (cute_ep.launcher.PreparedCall)
ARG_KINDS = ("ptr",) * 9 + ("i32",) * 8 + ("stream",)


def example_args() -> tuple:
    """Arguments for compiling the launch without touching memory (no GPU)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    gmem = cute.AddressSpace.gmem
    types = (Int32, Int32, Int32, Int32, Int32, Int32, Int64, Int64, Int32)
    aligns = (16, 4, 4, 16, 4, 4, 8, 8, 4)
    ptrs = tuple(make_ptr(t, (i + 1) << 20, gmem, assumed_align=a)
                 for i, (t, a) in enumerate(zip(types, aligns, strict=True)))
    sizes = (Int32(2048), Int32(8), Int32(2), Int32(128), Int32(8), Int32(1024), Int32(0), Int32(16))
    return (*ptrs, *sizes, cuda.CUstream(0))


def build():
    """(jit function, example args) for ``ModuleRegistry.get`` under ``COMPILE_KEY``."""
    return PaddedLayoutKernel(), example_args()
