"""The fixed-order fp32 weighted sum of rows that every combine kernel uses (pull, and both phases of
the reduced combine), so the three round identically.

``weighted_sum_rows``: a warp computes, for the 128-bit pieces [v_begin, v_end) of a row,
dst = dtype(sum over i ascending of weight[i] * row_i) with fp32 products and sums rounded separately
(``mul_rn``/``add_rn``: the order and roundings of ``validators.reference``), starting from +0. The rows
are walked in groups of 8 (then 4, then 1) whose loads are all issued before the first is used (one
load in flight per warp left combine latency-bound). Loads bypass L1 (``.cg``): rows written by other
GPUs, or rewritten staging rows, must not be served from a stale L1 line.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.config import VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import add_rn, gmem_tensor, mul_rn


@cute.jit
def accumulate_group(
    dtype: cutlass.Constexpr,
    group: cutlass.Constexpr,
    acc: cute.Tensor,
    row_addr: cute.Tensor,
    weight: cute.Tensor,
    first: Int32,
    offset: Int64,
):
    """acc += weight[i] * row i's piece at ``offset``, for i in [first, first + group), ascending i;
    all ``group`` loads are issued before the first multiply."""
    V = VECTOR_BYTES // (dtype.width // 8)
    layout = cute.make_layout(V)
    load = cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=128, load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL
    )
    frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(group)]
    for j in cutlass.range_constexpr(group):
        cute.copy(load, gmem_tensor(dtype, row_addr[first + j] + offset, layout, VECTOR_BYTES), frags[j])
    for j in cutlass.range_constexpr(group):
        vals = frags[j].load().to(Float32)
        wj = weight[first + j]
        for i in cutlass.range_constexpr(V):
            acc[i] = add_rn(acc[i], mul_rn(wj, vals[i]))


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
    V = VECTOR_BYTES // (dtype.width // 8)
    n8 = n // 8 * 8
    n4 = n8 + (n - n8) // 4 * 4
    for v in range(v_begin + lane, v_end, WARP):
        offset = Int64(v * VECTOR_BYTES)
        acc = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        acc.fill(0.0)
        for c in range(0, n8, 8):
            accumulate_group(dtype, 8, acc, row_addr, weight, c, offset)
        for c in range(n8, n4, 4):
            accumulate_group(dtype, 4, acc, row_addr, weight, c, offset)
        for c in range(n4, n):
            accumulate_group(dtype, 1, acc, row_addr, weight, c, offset)
        res = cute.make_rmem_tensor(cute.make_layout(V), dtype)
        res.store(acc.load().to(dtype))
        cute.autovec_copy(res, gmem_tensor(dtype, dst_addr + offset, cute.make_layout(V), VECTOR_BYTES))
