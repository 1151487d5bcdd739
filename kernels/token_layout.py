"""DeepEP's ``get_dispatch_layout`` in one launch: from topk_idx [T, K], each rank's and each expert's token
count and which ranks each token goes to.

Outputs (written whole by the launch, no zeroing before): ``per_rank`` [R] int32 (tokens with at least one
expert on rank r), ``per_expert`` [E] int32 ((t, k) pairs naming expert e), ``in_rank`` [T, R] uint8 (torch
bool: 1 where token t has an expert on rank r). Ranks own E / R experts each, in order. An id outside
[0, E) (-1 means no expert) counts nowhere, compared as the 64- or 32-bit integer it is.

Shape of the work: one CTA of ``threads`` threads, a thread per token in a stride loop; the counts gather
in shared-memory histograms (``MAX_EXPERTS`` + ``MAX_RANKS`` ints, so E and R are bounded: the host
checks) and are written out after one CTA barrier. Why one CTA: a layout reads T x K ids (256 KB at 4096
tokens, top-8, int64) and writes T x R bytes, a few microseconds for one SM, and with one CTA the counts
need no zeroing launch before and no grid-wide arrival after. Every size is a run-time argument; one
compiled function per id type (int64, DeepEP's, and int32). Nothing here calls NVSHMEM: it is compiled
apart from the EP module (kernels/module.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64, Uint8

from cute_ep.kernels.naming import profiler_name

MAX_EXPERTS = 8192  # shared-memory histogram bound (32 KB of counts)
MAX_RANKS = 64  # the normal mode's bound on ranks
ID_TYPES = {"int64": Int64, "int32": Int32}


class TokenLayoutKernel:
    """The layout launch (see the module docstring). id_type: the element type of topk_idx (Int64 or
    Int32)."""

    threads = 1024

    def __init__(self, id_type: type[cutlass.Numeric]) -> None:
        self.id_type = id_type

    @cute.jit
    def __call__(self, topk_idx: cute.Pointer, in_rank: cute.Pointer, per_rank: cute.Pointer,
                 per_expert: cute.Pointer, num_tokens: Int32, topk: Int32, num_experts: Int32,
                 num_ranks: Int32, stream):
        ids = cute.make_tensor(topk_idx, cute.make_layout((num_tokens, topk), stride=(topk, 1)))
        hits = cute.make_tensor(in_rank, cute.make_layout((num_tokens, num_ranks), stride=(num_ranks, 1)))
        self.kernel(ids, hits, cute.make_tensor(per_rank, cute.make_layout(num_ranks)),
                    cute.make_tensor(per_expert, cute.make_layout(num_experts)), num_tokens, topk,
                    num_experts, num_ranks).launch(grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, ids: cute.Tensor, hits: cute.Tensor, per_rank: cute.Tensor, per_expert: cute.Tensor,
               num_tokens: Int32, topk: Int32, num_experts: Int32, num_ranks: Int32):
        NT = self.threads
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        # counts[e]: pairs naming expert e; counts[MAX_EXPERTS + r]: tokens bound for rank r
        counts = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS + MAX_RANKS), 16)
        for i in range(tid, MAX_EXPERTS + MAX_RANKS, NT):
            counts[i] = Int32(0)
        cute.arch.sync_threads()
        per_owner = num_experts // num_ranks
        for t in range(tid, num_tokens, NT):
            for r in range(num_ranks):
                hit = Int32(0)
                for k in range(topk):
                    e = self.expert(ids, t, k, num_experts)
                    if e >= 0:
                        if r == 0:  # each pair counted once, on the first pass over the ranks
                            cute.arch.atomic_add(counts.iterator + e, Int32(1))
                        if e // per_owner == r:
                            hit = Int32(1)
                hits[t, r] = Uint8(hit)
                if hit != 0:
                    cute.arch.atomic_add(counts.iterator + (MAX_EXPERTS + r), Int32(1))
        cute.arch.sync_threads()
        for e in range(tid, num_experts, NT):
            per_expert[e] = counts[e]
        for r in range(tid, num_ranks, NT):
            per_rank[r] = counts[MAX_EXPERTS + r]

    @cute.jit
    def expert(self, ids: cute.Tensor, t: Int32, k: Int32, num_experts: Int32) -> Int32:
        """Token t's k-th id as an expert in [0, E), or -1 (no expert, or an id outside: compared at the
        id's own width, so a 64-bit id never wraps into the range)."""
        raw = ids[t, k]
        e = Int32(-1)
        if raw >= self.id_type(0):
            if raw < self.id_type(num_experts):
                e = Int32(raw)
        return e


profiler_name(TokenLayoutKernel.kernel, "get_dispatch_layout")


# --------------------------------------------------------------------------------------------------
# host side: what a compile needs (no GPU: the pointers are stand-ins)
# --------------------------------------------------------------------------------------------------


def compile_key(id_type: str) -> tuple:
    """The compile-cache key of the layout for topk_idx of ``id_type`` ("int64" or "int32")."""
    if id_type not in ID_TYPES:
        raise ValueError(f"id_type must be one of {sorted(ID_TYPES)}, got {id_type!r}")
    return ("token_layout", id_type)


def example_args(id_type: str) -> tuple:
    """Arguments for compiling the layout for ``id_type`` without touching memory (no GPU)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    elem = ID_TYPES[id_type]
    gmem = cute.AddressSpace.gmem
    return (make_ptr(elem, 1 << 20, gmem, assumed_align=elem.width // 8),
            make_ptr(Uint8, 1 << 21, gmem, assumed_align=1), make_ptr(Int32, 1 << 22, gmem, assumed_align=4),
            make_ptr(Int32, 1 << 23, gmem, assumed_align=4), Int32(64), Int32(8), Int32(256), Int32(4),
            cuda.CUstream(0))


def build(id_type: str):
    """(jit function, example args) of the layout, for ``ModuleRegistry.get`` under ``compile_key``."""
    compile_key(id_type)  # validates it
    return TokenLayoutKernel(ID_TYPES[id_type]), example_args(id_type)
