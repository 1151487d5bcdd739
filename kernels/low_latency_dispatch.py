"""Low-latency dispatch kernel: DeepEP's per-expert padded receive layout in one launch, with no count
exchange before the rows move.

What rank d gets (the caller's tensors, passed per call): expert l's rows in ``ll_x`` [El * R * M, W] at slots
l * R * M + [0, ll_count[l]), the blocks of source ranks in rank order, each source's tokens ascending;
``ll_src_info`` at each filled slot the token's index on its source; ``ll_count`` [El]; ``ll_range`` [El, R]
int64 ((begin << 32) | rows of each source's block); with FP8 ``ll_scales`` [El, H / 128, R * M] fp32 each
filled slot's scales (DeepEP's column-major scales; ll_count itself: none); ``ll_stats`` [El] += ll_count
(unless it is ``ll_count`` itself: the caller keeps no statistics); ``y_slot`` [El * R * M] int64 at each
filled slot the pair it holds, (s * M + t) * K + k, where the combine (kernels/low_latency_combine.py) pushes
its output. The sender's ``scatter[t, k]`` = (l * R + r) * M + j, the pair's place on the expert's rank (the
combine skips pairs without one). W: a row of the buffer's dtype, or with ``fp8`` a packed FP8 row
(kernels/quantize.py).

Call ``epoch`` (epochs[OP_DISPATCH] + 1) uses set q = epoch % 2 of the symmetric ``ll_rows``,
``ll_index`` and ``ll_signals`` (DeepEP's two alternating buffers). Why two are enough: a rank's call
epoch ends only after every peer's counts of that call arrived, so no peer starts call epoch + 2 (the
next one on set q) before this rank has finished reading set q.
1. Numbering (warp 0 of every CTA, over all pairs): pair i = t * K + k routed to expert e gets j, the
   number of earlier pairs (row-major) routed to e; 32 pairs a step, a histogram of E counts in shared
   memory, lanes of one expert in a step ranked by ``match_sync`` in the steps that hold the CTA's own
   tokens (their slots go to ``scatter``), the other steps only counted. Meanwhile the other warps send
   the CTA's rows, which need no number.
2. Send (warps 1.., a part of SEND_UNIT columns of a token's row each: a decode batch's one or two rows
   per CTA spread over its warps): the row (FP8: quantized once into ``packed``, each part by the warp
   that sends it) goes once to each rank its experts live on, into that rank's
   ``ll_rows[q * R * M + r * M + t]``. Then (every thread, a pair each) t * K + k goes into
   ``ll_index[q, l, r, j]`` on the expert's rank.
3. Counts (the last CTA to finish step 2, its histogram): for every expert e, ``ll_signals[q, l, r]`` on
   e's rank becomes (epoch << 32) | count after a system fence (rows and indices land first); then it
   advances epochs[OP_LAYOUT] and epochs[OP_DISPATCH] (every CTA read the epoch before it arrived). Why
   here and not after the receive: an arrival of every receiving CTA before the last one's update put a
   fence and an atomic's round trip at the end of the launch; a receive whose wait times out records a
   fault, which the host reads before the epochs.
4. Receive (``per`` = the grid's warps // El, at least 1, consecutive warps per local expert): each warp
   waits for its expert's R counts and scans them into the blocks' starts, the expert's first warp writes
   its count, statistics and ranges, and each warp copies every per-th of the expert's rows from
   ``ll_rows`` into their padded slots, each with its slot's ``ll_src_info`` and ``y_slot`` (one read of
   the row's ``ll_index`` entry for both); no CTA barrier.
With ``phase`` PHASE_SEND a launch runs steps 1-3 and returns, and a later one with PHASE_RECEIVE step 4
from a kernel of its own, ``receive_kernel`` (DeepEP's ``return_recv_hook``: the receiving half launched
when the caller asks for the data).
Ids outside [-1, E) and a token naming an expert twice are recorded in ``input_fault`` (this rank); an
invalid id's pair is skipped, a repeated expert's pairs travel as two. After a fault nothing moves.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.base import EpKernel
from cute_ep.kernels.buffers import (
    DONE_DISPATCH,
    FP8_BLOCK,
    INPUT_FAULT_FIRST,
    INPUT_FAULT_RANKS,
    EpParams,
)
from cute_ep.kernels.config import (
    MAX_EXPERTS,
    MAX_WORLD_SIZE,
    OP_DISPATCH,
    OP_LAYOUT,
    PHASE_SEND,
    VECTOR_BYTES,
    WARP,
)
from cute_ep.kernels.dispatch_senders import send_row_into
from cute_ep.kernels.layout import cta_tokens
from cute_ep.kernels.naming import profiler_name
from cute_ep.kernels.ptx import fence_sys
from cute_ep.kernels.quantize import quantize_blocks_warp
from cute_ep.kernels.rows import copy_row_to_lanes, element, element_addr, gmem_tensor, row_space
from cute_ep.kernels.scan import last_at_or_before, warp_batch, warp_inclusive_scan
from cute_ep.kernels.signals import (
    SIGNAL_SET,
    cta_arrives_last,
    fault_free,
    record_fault,
    wait_signal_value,
)

NUMBER_UNROLL = 8  # 32-pair steps whose ids warp 0 loads at once (one latency per 8 steps)
SOURCE_SEARCH_STEPS = 9  # binary-search steps over the R + 1 block starts (R <= MAX_WORLD_SIZE = 256)
STARTS = MAX_WORLD_SIZE + 1  # shared-memory ints per warp: its expert's block starts and total
# 128-bit pieces per lane in flight in the receiving copies: a decode batch gives each warp a few rows of
# local memory to move, each a chain of load latencies (7168 bf16: 2 steps of 16 against 4 of 8)
RECEIVE_ROW_UNROLL = 16
# Columns per part of a row sent (4 FP8 blocks: a part's scales are whole 16-byte pieces): a warp sends (and
# casts) one part of a token's row, so a CTA's one or two decode tokens spread over its 15 sending warps
SEND_UNIT = 512
# 128-bit pieces per lane in flight in a part sent (512 bf16 columns: 2 per lane), and steps of its FP8
# cast loaded at once (4 blocks: 2 steps of 2 blocks); more spilled in ptxas
SEND_ROW_UNROLL = 2
CAST_UNROLL = 2


class LowLatencyDispatchKernel(EpKernel):
    """The low-latency dispatch (see the module docstring); every size is a run-time argument."""

    threads = 512
    ctas_per_sm = 1

    @cute.jit
    def __call__(self, p: EpParams, stream):
        self.launch_halves(p, stream)  # a receiving half: step 4 alone, ``receive_kernel``

    @cute.kernel
    def receive_kernel(self, p: EpParams):
        """Step 4 alone (``PHASE_RECEIVE``): the call's epoch is the one its sending half advanced to."""
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        starts = smem.allocate_tensor(Int32, cute.make_layout(self.threads // WARP * STARTS), 16)
        epoch = p.epochs[OP_DISPATCH]  # the sending half already advanced it to this call's
        live = Int32(0)
        if fault_free(p.fault):
            live = Int32(1)
        self.receive(p, starts, Int32(epoch % 2), epoch, live, tid)

    @cute.kernel
    def kernel(self, p: EpParams):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        NCTA, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), 16)
        starts = smem.allocate_tensor(Int32, cute.make_layout(self.threads // WARP * STARTS), 16)
        last = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
        epoch = p.epochs[OP_DISPATCH] + Int64(1)  # (a receiving half runs ``receive_kernel``)
        q = Int32(epoch % 2)
        live = Int32(0)
        if fault_free(p.fault):
            live = Int32(1)
        # steps 1-3
        t_first, t_end = cta_tokens(p.num_tokens, bid, NCTA)
        if live == 0:
            t_end = t_first
        for e in range(tid, p.num_experts, self.threads):
            hist[e] = Int32(0)
        cute.arch.sync_threads()
        if tid < WARP:
            if live != 0:
                self.number_pairs(p, hist, t_first, t_end, tid)
        else:
            self.send_rows(p, q, t_first, t_end, tid)
        cute.arch.sync_threads()  # the CTA's slots are in scatter
        self.send_indices(p, q, t_first, t_end, tid)
        if cta_arrives_last(p, DONE_DISPATCH, last, tid) != 0:  # its rows and indices are out
            if live != 0:
                self.announce_counts(p, hist, q, epoch, tid)
                if tid == 0:  # every CTA read the epoch before it arrived
                    p.epochs[OP_LAYOUT] = p.epochs[OP_LAYOUT] + Int64(1)
                    p.epochs[OP_DISPATCH] = epoch
        if p.phase != PHASE_SEND:  # step 4
            self.receive(p, starts, q, epoch, live, tid)

    @cute.jit
    def number_pairs(self, p: EpParams, hist: cute.Tensor, t_first: Int32, t_end: Int32, lane: Int32):
        """Step 1, by warp 0: every expert's count of pairs into ``hist``, and the slots of tokens
        [t_first, t_end) (each pair's number within its expert) into ``scatter`` (-1 for an id of -1 or
        out of range). Only the steps of 32 pairs that hold this CTA's tokens are numbered (``match_sync``
        ranks a step's lanes of one expert); the others' pairs are only counted, a shared-memory atomic
        each: numbering every step made the CTA's sending warps wait for warp 0 at the barrier after this
        step (30% of the kernel's warp samples at 128 tokens, one H200)."""
        K, E, El, R, M = p.topk, p.num_experts, p.experts_per_rank, p.world_size, p.max_tokens
        ids = cute.make_tensor(p.topk_idx.iterator, cute.make_layout(p.num_tokens * K))
        scatter = cute.make_tensor(p.scatter.iterator, cute.make_layout(p.max_tokens * K))
        pairs = p.num_tokens * K
        own_begin, own_end = t_first * K, t_end * K
        lt = Int32(cute.arch.lanemask_lt())
        le = lt | (Int32(1) << lane)
        got = cute.make_rmem_tensor(cute.make_layout(NUMBER_UNROLL), Int32)
        for base in range(0, pairs, NUMBER_UNROLL * WARP):
            for u in cutlass.range_constexpr(NUMBER_UNROLL):  # every load in flight before the first use
                got[u] = Int32(-1)
                if base + u * WARP + lane < pairs:
                    got[u] = ids[base + u * WARP + lane]
            for u in cutlass.range_constexpr(NUMBER_UNROLL):
                i = base + u * WARP + lane
                e = got[u]
                key = Int32(-1) - lane  # invalid lanes match nobody
                if e >= 0:
                    if e < E:
                        key = e
                step = base + u * WARP
                if step + WARP <= own_begin or step >= own_end:  # pairs of other CTAs' tokens: counted
                    if key >= 0:
                        cute.arch.atomic_add(hist.iterator + key, Int32(1))
                else:  # this CTA's tokens: numbered, lanes of one expert ranked among themselves
                    cute.arch.sync_warp()  # the earlier steps' counts are in
                    same = Int32(cute.arch.match_sync(cute.arch.FULL_MASK, key))
                    before = Int32(0)
                    if key >= 0:
                        before = hist[key]
                    cute.arch.sync_warp()  # every lane has read the count before its group's last lane adds
                    if key >= 0:
                        if (same & ~le) == 0:  # the group's last lane
                            hist[key] = before + cute.arch.popc(same)
                    cute.arch.sync_warp()
                    t = i // K
                    if t >= t_first:
                        if t < t_end:
                            slot = Int32(-1)
                            if key >= 0:
                                slot = ((key % El) * R + p.rank) * M + before + cute.arch.popc(same & lt)
                            scatter[i] = slot

    @cute.jit
    def send_rows(self, p: EpParams, q: Int32, t_first: Int32, t_end: Int32, tid: Int32):
        """Step 2's rows, by warps 1..: each token of [t_first, t_end) once to every rank it names, in
        parts of SEND_UNIT columns, so that a CTA's few decode tokens keep every sending warp busy (a
        part's FP8 values and scales are cast and sent by the warp that owns it)."""
        dtype = p.x.element_type
        H, K, El, M = p.hidden, p.topk, p.experts_per_rank, p.max_tokens
        esize = dtype.width // 8
        row_bytes = H * esize
        if p.fp8 != 0:
            row_bytes = p.fp8_row_bytes
        x_rows, packed_rows = row_space(p.x, Int64(H) * esize), row_space(p.packed, row_bytes)
        dest = row_space(p.ll_rows, row_bytes)
        lane = tid % WARP
        senders = self.threads // WARP - 1
        units = (H + SEND_UNIT - 1) // SEND_UNIT
        parts = Int32(senders)  # per token, so that each sending warp has a part ...
        if t_end - t_first > 0:
            parts = senders // (t_end - t_first)
        if parts < 1:
            parts = Int32(1)
        per = (units + parts - 1) // parts  # ... of `per` units
        parts = (units + per - 1) // per
        for u in range(tid // WARP - 1, (t_end - t_first) * parts, senders):
            t = t_first + u // parts
            part = u % parts
            c0 = part * per * SEND_UNIT
            c1 = c0 + per * SEND_UNIT
            if c1 > H:
                c1 = H
            d = Int32(-1)
            if lane < K:  # K <= 32 (EpConfig): a lane per pair
                e = p.topk_idx[t, lane]
                if e >= 0:
                    if e < p.num_experts:
                        d = e // El
            same = Int32(cute.arch.match_sync(cute.arch.FULL_MASK, d))  # lanes bound for one rank
            lead = Int32(0)
            if d >= 0:
                if (same & Int32(cute.arch.lanemask_lt())) == 0:
                    lead = Int32(1)
            sends = Int32(cute.arch.vote_ballot_sync(lead != 0))
            slot = q * p.rank_capacity + p.rank * M + t
            if sends != 0:
                if p.fp8 != 0:
                    b0, b1 = c0 // FP8_BLOCK, c1 // FP8_BLOCK
                    last = Int32(0)
                    if part == parts - 1:
                        last = Int32(1)
                    quantize_blocks_warp(dtype, x_rows.row(t), packed_rows.row(t), H, row_bytes, lane, p.fp8,
                                         b0, b1, last, CAST_UNROLL)
                    cute.arch.sync_warp()  # lanes copy bytes other lanes wrote
                    send_row_into(dtype, p, dest.from_byte(c0), packed_rows.row(t) + c0, d, slot, sends,
                                  c1 - c0, lane, SEND_ROW_UNROLL)  # the part's values
                    s0 = H + 4 * b0
                    s1 = H + 4 * b1
                    if last != 0:
                        s1 = row_bytes  # the last part's scales and the padding after them
                    send_row_into(dtype, p, dest.from_byte(s0), packed_rows.row(t) + s0, d, slot, sends,
                                  s1 - s0, lane, SEND_ROW_UNROLL)
                else:
                    send_row_into(dtype, p, dest.from_byte(c0 * esize), x_rows.row(t) + c0 * esize, d, slot,
                                  sends, (c1 - c0) * esize, lane, SEND_ROW_UNROLL)

    @cute.jit
    def send_indices(self, p: EpParams, q: Int32, t_first: Int32, t_end: Int32, tid: Int32):
        """Step 2's indices, a thread per pair (t, k) of the CTA's tokens: t * K + k into
        ``ll_index[q, l, r, j]`` on the expert's rank; the handle's copies of the routing (``own_routing``);
        invalid ids recorded."""
        K, E, El, M = p.topk, p.num_experts, p.experts_per_rank, p.max_tokens
        for i in range(t_first * K + tid, t_end * K, self.threads):
            t = i // K
            k = i % K
            e = p.topk_idx[t, k]
            slot = p.scatter[t, k]
            bad = Int32(0)
            if e < -1:
                bad = Int32(1)
            if e >= E:
                bad = Int32(1)
            for k2 in range(k):
                if p.topk_idx[t, k2] == e:
                    if e >= 0:
                        bad = Int32(1)
            if bad != 0:
                p.input_fault[INPUT_FAULT_RANKS] = Int32(1)
                p.input_fault[INPUT_FAULT_FIRST] = p.rank
            if slot >= 0:
                nvshmem_cute.p(element(p.ll_index, (q, e % El, p.rank, slot % M)), i, e // El)
            if p.own_routing != 0:
                p.own_idx[t, k] = e
                p.own_w[t, k] = p.topk_w[t, k]

    @cute.jit
    def announce_counts(self, p: EpParams, hist: cute.Tensor, q: Int32, epoch: Int64, tid: Int32):
        """Step 3, by the last CTA: each expert's count, tagged with the epoch, into its rank's signal."""
        El = p.experts_per_rank
        fence_sys()  # every CTA's rows and indices (their arrivals seen) before this thread's signals
        for e in range(tid, p.num_experts, self.threads):
            value = (epoch << 32) | Int64(hist[e])
            nvshmem_cute.signal_op(element(p.ll_signals, (q, e % El, p.rank)), value, SIGNAL_SET, e // El)

    @cute.jit
    def receive(self, p: EpParams, starts: cute.Tensor, q: Int32, epoch: Int64, live: Int32, tid: Int32):
        """Step 4, warp by warp with no CTA barrier: ``per`` = the grid's warps // El (at least 1)
        consecutive warps per local expert, each of which reads the expert's counts and scans them into the
        blocks' starts (``place_blocks``, the first of them also writing the expert's metadata) and copies
        every per-th of its rows (``copy_rows``). Why no barrier: a CTA's copying warps waited at two
        barriers for its few placing warps and a warp-0 scan (35% of the receiving launch's warp samples,
        Nsight Compute, 128 tokens, one H200); counts read again by ``per`` warps are a few loads each."""
        NW = self.threads // WARP
        warp, lane = tid // WARP, tid % WARP
        bid, _, _ = cute.arch.block_idx()
        NCTA, _, _ = cute.arch.grid_dim()
        mine = cute.make_tensor(starts.iterator + warp * STARTS, cute.make_layout(STARTS))
        El = p.experts_per_rank
        per = (NCTA * NW) // El
        if per < 1:
            per = Int32(1)
        for job in range(bid * NW + warp, El * per, NCTA * NW):
            el, sub = job // per, job % per
            total = self.place_blocks(p, mine, q, epoch, el, live, sub, lane)
            self.copy_rows(p, mine, q, el, total, sub, per, lane)
            cute.arch.sync_warp()  # every lane has read ``mine`` before the next expert's starts

    @cute.jit
    def place_blocks(self, p: EpParams, starts: cute.Tensor, q: Int32, epoch: Int64, el: Int32, live: Int32,
                     sub: Int32, lane: Int32) -> Int32:
        """Local expert ``el``, by one of its warps: wait for each source's count (a lane per source), the
        blocks' starts into ``starts`` (R + 1 entries, the last the total); the expert's first warp
        (``sub`` 0) also writes its count, statistics and layout ranges. Returns the expert's rows."""
        R = p.world_size
        writes = sub == 0
        keeps_stats = p.ll_stats.iterator.toint() != p.ll_count.iterator.toint()
        prior = Int32(0)  # read before the waits, so the statistics' update adds no latency of its own
        if lane == 0:
            if writes:
                if keeps_stats:
                    prior = p.ll_stats[el]
        carry = Int32(0)
        for s0 in range(0, R, WARP):
            s = s0 + lane
            n = Int32(0)
            if s < R:
                if live != 0:
                    arrived, seen = wait_signal_value(element_addr(p.ll_signals, (q, el, s)), epoch << 32,
                                                      Int64(p.timeout_ms) * 1000000)
                    if arrived != 0:
                        n = Int32(seen & Int64(0xFFFFFFFF))
                    else:
                        record_fault(p.fault, Int32(OP_DISPATCH), s, epoch)
            incl = warp_inclusive_scan(n, lane)  # the counts' running sum across the warp
            if s < R:
                starts[s] = carry + incl - n
            carry = carry + cute.arch.shuffle_sync(incl, WARP - 1)
        if lane == 0:
            starts[R] = carry
            if writes:
                p.ll_count[el] = carry
                if keeps_stats:
                    p.ll_stats[el] = prior + carry
        cute.arch.sync_warp()
        if writes:
            for s in range(lane, R, WARP):
                p.ll_range[el, s] = (Int64(starts[s]) << 32) | Int64(starts[s + 1] - starts[s])
        return carry

    @cute.jit
    def copy_rows(self, p: EpParams, starts: cute.Tensor, q: Int32, el: Int32, total: Int32, sub: Int32,
                  per: Int32, lane: Int32):
        """Step 4's rows of local expert ``el``: rows sub, sub + per, ... below ``total``, row r source s's
        j-th (``starts``), pair ll_index[q, el, s, j]. The warp's rows are looked up 32 at a time, a lane per
        row (the search, the ``ll_index`` read, the slot's ``ll_src_info`` and ``y_slot``), before it copies
        them one after another: one latency for 32 rows' lookups, not one per row before its copy."""
        dtype = p.x.element_type
        row_bytes = p.hidden * (dtype.width // 8)
        if p.fp8 != 0:
            row_bytes = p.fp8_row_bytes
        staged, padded = row_space(p.ll_rows, row_bytes), row_space(p.ll_x, row_bytes)
        scales_out = Int32(0)  # FP8: each row's scales into the caller's column-major ll_scales too
        if p.fp8 != 0:
            if p.ll_scales.iterator.toint() != p.ll_count.iterator.toint():
                scales_out = Int32(1)
        S = p.fp8_scales
        for base in range(sub, total, per * WARP):
            src_row, r = Int32(0), base + lane * per  # this lane's row of the warp's next 32
            if r < total:
                s = last_at_or_before(starts, r, p.world_size - 1, SOURCE_SEARCH_STEPS)
                pair = p.ll_index[q, el, s, r - starts[s]]
                t = pair // p.topk
                src_row = q * p.rank_capacity + s * p.max_tokens + t
                slot = el * p.rank_capacity + r
                p.ll_src_info[slot] = t  # the slot's token, and its pair for the combine
                p.y_slot[slot] = Int64(s * p.max_tokens) * p.topk + pair
            for i in range(warp_batch(total, base, per)):
                src = staged.row(cute.arch.shuffle_sync(src_row, i))
                row = base + i * per
                # FP8: the first 2 * WARP scales loaded before the row, so their latency hides under its own
                early = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                if scales_out != 0:
                    scales = gmem_tensor(Float32, src + p.hidden, cute.make_layout(S), 4)
                    for u in cutlass.range_constexpr(2):
                        if lane + u * WARP < S:
                            early[u] = scales[lane + u * WARP]
                copy_row_to_lanes(dtype, src, padded.row(el * p.rank_capacity + row), Int32(1),
                                  row_bytes // VECTOR_BYTES, lane, RECEIVE_ROW_UNROLL, store_no_l1=True)
                if scales_out != 0:  # [H bytes of e4m3 | H / 128 fp32 scales | ...]
                    # (made in each branch: made once above both, the kernel reads two more parameters)
                    scales = gmem_tensor(Float32, src + p.hidden, cute.make_layout(S), 4)
                    for u in cutlass.range_constexpr(2):
                        if lane + u * WARP < S:
                            p.ll_scales[el, lane + u * WARP, row] = early[u]
                    for c in range(lane + 2 * WARP, S, WARP):  # H above 8192
                        p.ll_scales[el, c, row] = scales[c]


# "dispatch_low_latency": DeepEP's bench_kineto finds a call's dispatch kernels by "::dispatch"
profiler_name(LowLatencyDispatchKernel.kernel, "dispatch_low_latency")
# the receiving half under the same name: bench_kineto splits one profiler line's kernels into the halves
profiler_name(LowLatencyDispatchKernel.receive_kernel, "dispatch_low_latency")
