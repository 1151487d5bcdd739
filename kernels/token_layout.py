"""DeepEP's ``get_dispatch_layout`` in one launch: from topk_idx [T, K], each rank's and each expert's token
count and which ranks each token goes to.

Outputs (written whole by the launch, no zeroing before): ``per_rank`` [R] int32 (tokens with at least one
expert on rank r), ``per_expert`` [E] int32 ((t, k) pairs naming expert e), ``in_rank`` [T, R] uint8 (torch
bool: 1 where token t has an expert on rank r). Ranks own E / R experts each, in order. An id outside
[0, E) (-1 means no expert) counts nowhere, compared as the 64- or 32-bit integer it is.

Shape of the work: a few CTAs, each owning a slice of the outputs, so no CTA waits for another and nothing
is zeroed before the launch. The first ceil(E / ``experts_per_cta``) CTAs each count the pairs naming their
slice of experts; the last ceil(R / ``ranks_per_cta``) CTAs each flag and count the tokens bound for their
slice of ranks. Every CTA reads all T x K ids (256 KB at 4096 tokens, top-8, int64: from L2 after the
first CTA's pass), a thread per token in a stride loop, ``UNROLL`` ids at a time with no branch between
their loads (a token's loads in flight together, not one latency per id); its counts gather in a
shared-memory histogram and go out after one CTA barrier. Why not one CTA (the first form): its 1024
threads read 32 ids one after another per 4 tokens and took 38.4 us at 4096 tokens on an H200, more than
DeepEP's whole call. Every size is a run-time argument; one compiled function per id type (int64, DeepEP's,
and int32). Nothing here calls NVSHMEM: it is compiled apart from the EP module (kernels/module.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64, Uint8

from cute_ep.kernels.naming import profiler_name

MAX_EXPERTS = 8192  # bounds the grid: 256 counting CTAs, each reading every id
MAX_RANKS = 64  # the normal mode's bound on ranks
ID_TYPES = {"int64": Int64, "int32": Int32}
UNROLL = 4  # ids a thread loads back to back before using any


class TokenLayoutKernel:
    """The layout launch (see the module docstring). id_type: the element type of topk_idx (Int64 or
    Int32)."""

    threads = 1024
    experts_per_cta = 32  # an expert-counting CTA's slice of experts
    ranks_per_cta = 8  # a rank-flagging CTA's slice of ranks (its flags: bits of one Int32)

    def __init__(self, id_type: type[cutlass.Numeric]) -> None:
        self.id_type = id_type

    @cute.jit
    def __call__(self, topk_idx: cute.Pointer, in_rank: cute.Pointer, per_rank: cute.Pointer,
                 per_expert: cute.Pointer, num_tokens: Int32, topk: Int32, num_experts: Int32,
                 num_ranks: Int32, stream):
        ids = cute.make_tensor(topk_idx, cute.make_layout((num_tokens, topk), stride=(topk, 1)))
        hits = cute.make_tensor(in_rank, cute.make_layout((num_tokens, num_ranks), stride=(num_ranks, 1)))
        expert_ctas = (num_experts + self.experts_per_cta - 1) // self.experts_per_cta
        rank_ctas = (num_ranks + self.ranks_per_cta - 1) // self.ranks_per_cta
        self.kernel(ids, hits, cute.make_tensor(per_rank, cute.make_layout(num_ranks)),
                    cute.make_tensor(per_expert, cute.make_layout(num_experts)), num_experts, num_ranks,
                    expert_ctas).launch(grid=(expert_ctas + rank_ctas, 1, 1), block=(self.threads, 1, 1),
                                        stream=stream)

    @cute.kernel
    def kernel(self, ids: cute.Tensor, hits: cute.Tensor, per_rank: cute.Tensor, per_expert: cute.Tensor,
               num_experts: Int32, num_ranks: Int32, expert_ctas: Int32):
        EPC, RPC = self.experts_per_cta, self.ranks_per_cta
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        counts = smem.allocate_tensor(Int32, cute.make_layout(EPC), 16)  # this CTA's slice of the counts
        for i in range(tid, EPC, self.threads):
            counts[i] = Int32(0)
        cute.arch.sync_threads()
        if cta < expert_ctas:
            self.count_experts(ids, counts, cta * EPC, num_experts)
        else:
            self.flag_ranks(ids, hits, counts, (cta - expert_ctas) * RPC, num_experts, num_ranks)
        cute.arch.sync_threads()
        if cta < expert_ctas:
            first = cta * EPC
            for i in range(tid, cutlass.min(EPC, num_experts - first), self.threads):
                per_expert[first + i] = counts[i]
        else:
            first = (cta - expert_ctas) * RPC
            for i in range(tid, cutlass.min(RPC, num_ranks - first), self.threads):
                per_rank[first + i] = counts[i]

    @cute.jit
    def count_experts(self, ids: cute.Tensor, counts: cute.Tensor, first: Int32, num_experts: Int32):
        """counts[e - first] += the pairs naming expert e, for e in this CTA's slice [first, first + EPC)."""
        for t in range(cute.arch.thread_idx()[0], ids.shape[0], self.threads):
            for k0 in range(0, ids.shape[1], UNROLL):
                experts = self.experts_of(ids, t, k0, num_experts)
                for j in cutlass.range_constexpr(UNROLL):
                    slot = experts[j] - first
                    if experts[j] >= 0 and slot >= 0 and slot < self.experts_per_cta:
                        cute.arch.atomic_add(counts.iterator + slot, Int32(1))

    @cute.jit
    def flag_ranks(self, ids: cute.Tensor, hits: cute.Tensor, counts: cute.Tensor, first: Int32,
                   num_experts: Int32, num_ranks: Int32):
        """hits[t, r] (1: token t has an expert on rank r) and counts[r - first] += those tokens, for r in
        this CTA's slice [first, first + RPC)."""
        per_owner = num_experts // num_ranks
        for t in range(cute.arch.thread_idx()[0], ids.shape[0], self.threads):
            flags = Int32(0)  # bit j: rank first + j
            for k0 in range(0, ids.shape[1], UNROLL):
                experts = self.experts_of(ids, t, k0, num_experts)
                for j in cutlass.range_constexpr(UNROLL):
                    slot = experts[j] // per_owner - first
                    if experts[j] >= 0 and slot >= 0 and slot < self.ranks_per_cta:
                        flags = flags | (Int32(1) << slot)
            for j in cutlass.range_constexpr(self.ranks_per_cta):
                if first + j < num_ranks:
                    hit = (flags >> j) & 1
                    hits[t, first + j] = Uint8(hit)
                    if hit != 0:
                        cute.arch.atomic_add(counts.iterator + j, Int32(1))

    @cute.jit
    def experts_of(self, ids: cute.Tensor, t: Int32, k0: Int32, num_experts: Int32) -> list:
        """Token t's ids k0 .. k0 + UNROLL - 1 as experts in [0, E), or -1 (past top-k, no expert, or an
        id outside: compared at the id's own width, so a 64-bit id never wraps into the range). The loads
        come first, each guarded by a select rather than a branch, so they are in flight together."""
        topk = ids.shape[1]
        raw = []
        for j in cutlass.range_constexpr(UNROLL):
            raw.append(ids[t, cutlass.min(k0 + j, topk - 1)])
        experts = []
        for j in cutlass.range_constexpr(UNROLL):
            inside = (raw[j] >= self.id_type(0)) & (raw[j] < self.id_type(num_experts)) & (k0 + j < topk)
            experts.append(cutlass.select_(inside, Int32(raw[j]), Int32(-1)))
        return experts


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
