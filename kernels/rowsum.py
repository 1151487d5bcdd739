"""The fixed-order fp32 weighted sum of rows that every combine kernel uses (pull, and both phases of
the reduced combine), so the three round identically.

``weighted_sum_rows``: a warp computes, for the 128-bit pieces [v_begin, v_end) of a row,
dst = dtype(sum over i ascending of weight[i] * row_i) with fp32 products and sums rounded separately
(``mul_rn``/``add_rn``: the order and roundings of ``cute_ep.reference``), starting from +0.

Why it is shaped this way: a warp that loads one piece of one row, uses it and moves on waits a full
memory latency per load, so the time goes to latency, not bandwidth. Each lane therefore works on
PIECES pieces (32 pieces apart) at once, and walks the rows in groups of 8 (then 4, 2, 1) whose loads,
for every piece, are all issued before the first is used: up to 8 x PIECES 128-bit loads in flight per
lane. The order of the sum of each element is unchanged (ascending i). Loads bypass L1 (``.cg``): rows
written by other GPUs, or rewritten staging rows, must not be served from a stale L1 line.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.config import VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import add_rn, gmem_tensor, mul_rn

PIECES = 2  # 128-bit pieces per lane in flight per row (with 8 rows: 16 loads of 16 bytes)


@cute.jit
def accumulate_group(
    dtype: cutlass.Constexpr,
    group: cutlass.Constexpr,
    pieces: cutlass.Constexpr,
    acc: cute.Tensor,
    row_addr: cute.Tensor,
    weight: cute.Tensor,
    first: Int32,
    offset: Int64,
):
    """acc[q * V + i] += weight[j] * element i of row j's piece at offset + q * WARP * 16 bytes, for the
    rows j in [first, first + group) ascending and q < ``pieces``; every load is issued before the first
    multiply."""
    V = VECTOR_BYTES // (dtype.width // 8)
    layout = cute.make_layout(V)
    load = cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=128, load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL
    )
    frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(group * pieces)]
    for j in cutlass.range_constexpr(group):
        for q in cutlass.range_constexpr(pieces):
            src = row_addr[first + j] + offset + Int64(q * WARP * VECTOR_BYTES)
            cute.copy(load, gmem_tensor(dtype, src, layout, VECTOR_BYTES), frags[j * pieces + q])
    for j in cutlass.range_constexpr(group):
        wj = weight[first + j]
        for q in cutlass.range_constexpr(pieces):
            vals = frags[j * pieces + q].load().to(Float32)
            for i in cutlass.range_constexpr(V):
                acc[q * V + i] = add_rn(acc[q * V + i], mul_rn(wj, vals[i]))


@cute.jit
def sum_pieces(
    dtype: cutlass.Constexpr,
    pieces: cutlass.Constexpr,
    row_addr: cute.Tensor,
    weight: cute.Tensor,
    n: Int32,
    offset: Int64,
    dst_addr: Int64,
):
    """``pieces`` pieces (WARP pieces apart, from ``offset``) of the weighted sum of the n listed rows,
    stored to ``dst_addr`` at the same offsets."""
    V = VECTOR_BYTES // (dtype.width // 8)
    n8 = n // 8 * 8
    n4 = n8 + (n - n8) // 4 * 4
    n2 = n4 + (n - n4) // 2 * 2
    acc = cute.make_rmem_tensor(cute.make_layout(V * pieces), Float32)
    acc.fill(0.0)
    for c in range(0, n8, 8):
        accumulate_group(dtype, 8, pieces, acc, row_addr, weight, c, offset)
    for c in range(n8, n4, 4):
        accumulate_group(dtype, 4, pieces, acc, row_addr, weight, c, offset)
    for c in range(n4, n2, 2):
        accumulate_group(dtype, 2, pieces, acc, row_addr, weight, c, offset)
    for c in range(n2, n):
        accumulate_group(dtype, 1, pieces, acc, row_addr, weight, c, offset)
    for q in cutlass.range_constexpr(pieces):
        res = cute.make_rmem_tensor(cute.make_layout(V), dtype)
        part = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        for i in cutlass.range_constexpr(V):
            part[i] = acc[q * V + i]
        res.store(part.load().to(dtype))
        dst = dst_addr + offset + Int64(q * WARP * VECTOR_BYTES)
        cute.autovec_copy(res, gmem_tensor(dtype, dst, cute.make_layout(V), VECTOR_BYTES))


@cute.jit
def weighted_sum_rows(
    dtype: cutlass.Constexpr,
    row_addr: cute.Tensor,
    weight: cute.Tensor,
    n: Int32,
    v_begin: Int32,
    v_end: Int32,
    lane: Int32,
    dst_addr: Int64,
):
    """Pieces [v_begin, v_end) of dst = sum over i in [0, n) ascending of weight[i] * row_addr[i]'s row
    (fp32, then ``dtype``); ``row_addr``/``weight``: the warp's list (shared memory, written before a
    ``sync_warp``). n == 0 writes zeros. ``dst_addr`` may be a peer's memory (peer pointer)."""
    step = PIECES * WARP
    full = v_begin + (v_end - v_begin) // step * step
    for v in range(v_begin + lane, full, step):
        sum_pieces(dtype, PIECES, row_addr, weight, n, Int64(v * VECTOR_BYTES), dst_addr)
    for v in range(full + lane, v_end, WARP):
        sum_pieces(dtype, 1, row_addr, weight, n, Int64(v * VECTOR_BYTES), dst_addr)
