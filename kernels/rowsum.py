"""The fixed-order fp32 weighted sum of rows that every combine kernel uses (pull, and both phases of
the reduced combine), so the three round identically.

``weighted_sum_rows``: a warp computes, for the 128-bit pieces [v_begin, v_end) of a row,
dst = dtype(sum over i ascending of weight[i] * row_i) with fp32 products and sums rounded separately
(``mul_rn``/``add_rn``: the order and roundings of ``cute_ep.reference``), starting from +0.

Why it is shaped this way: a warp that loads one piece of one row, uses it and moves on waits a full
memory latency per load, so the time goes to latency, not bandwidth. Each lane therefore works on
several pieces (32 pieces apart) at once, and walks the rows in groups of up to 8 whose loads, for every
piece, are all issued before the first is used: LOADS_IN_FLIGHT 128-bit loads per lane. How the 16 are
split depends on how many rows there are (``SHAPES``): 8 or more rows, 2 pieces of 8 rows; fewer, more
pieces of fewer rows (4 x 4, 8 x 2) — with 2 pieces per lane a sum of 2 rows (the rank layout's combine
and the reduced combine's second phase on 2 ranks) had 4 loads in flight per lane and was latency-bound
(rank combine 1100 us at 4096 tokens and 24 SMs on 2x H200, DeepEP's 419 us). The order of the sum of
each element is unchanged (ascending i). A span's last round loads each lane's pieces below its end, and
for the others a spare address of this GPU's.
Loads bypass L1 (``.cg``): rows written by other GPUs, or
rewritten staging rows, must not be served from a stale L1 line.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.config import VECTOR_BYTES, WARP
from cute_ep.kernels.ptx import add_rn, f32_from_bits, mul_rn
from cute_ep.kernels.rows import gmem_tensor

LOADS_IN_FLIGHT = 16  # 128-bit loads a lane issues before it uses the first
# (fewest rows, pieces per lane, largest row group): pieces x group = LOADS_IN_FLIGHT
SHAPES = ((8, 2, 8), (4, 4, 4), (0, 8, 2))


def shapes_upto(max_pieces: int) -> tuple[tuple[int, int, int], ...]:
    """SHAPES with at most ``max_pieces`` pieces per lane (the last one taking any number of rows): a
    kernel with two CTAs per SM (128 registers a thread) keeps 4 (8 pieces of fp32 sums would spill)."""
    kept = [shape for shape in SHAPES if shape[1] <= max_pieces]
    return (*kept[:-1], (0, *kept[-1][1:]))


class RowList(NamedTuple):
    """The warp's list of rows to sum: ``n`` row addresses and their weights (shared memory, written
    before a ``sync_warp``), in the order of the sum."""

    row_addr: cute.Tensor  # [>= n] Int64
    weight: cute.Tensor  # [>= n] Float32
    n: Int32


@cute.jit
def accumulate_group(
    dtype: cutlass.Constexpr,
    group: cutlass.Constexpr,
    pieces: cutlass.Constexpr,
    acc: cute.Tensor,
    rows: RowList,
    first: Int32,
    offset: Int64,
    valid: Int32,
    spare: Int64,
):
    """acc[q * V + i] += weight[j] * element i of row j's piece at offset + q * WARP * 16 bytes, for the
    rows j in [first, first + group) ascending and q < ``pieces`` (those from ``valid`` on load ``spare``
    and are not stored); every load is issued before the first multiply."""
    V = VECTOR_BYTES // (dtype.width // 8)
    layout = cute.make_layout(V)
    load = cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=128, load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL
    )
    frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(group * pieces)]
    # A piece past ``valid`` loads another address (no branch: registers written under a branch went to
    # local memory) and its sum is not stored: ``spare``, this GPU's memory, where the rows are a peer's
    # (a second load of the row's own piece crossed NVLink again: 14% more reads for the 128-piece rest of
    # an H 7168 bf16 row).
    keep = [Int64(Int32(valid > q)) for q in range(pieces)]
    for j in cutlass.range_constexpr(group):
        row = rows.row_addr[first + j] + offset
        for q in cutlass.range_constexpr(pieces):
            src = spare + keep[q] * (row + Int64(q * WARP * VECTOR_BYTES) - spare)
            cute.copy(load, gmem_tensor(dtype, src, layout, VECTOR_BYTES), frags[j * pieces + q])
    for j in cutlass.range_constexpr(group):
        wj = rows.weight[first + j]
        for q in cutlass.range_constexpr(pieces):
            vals = widened(dtype, frags[j * pieces + q])
            for i in cutlass.range_constexpr(V):
                acc[q * V + i] = add_rn(acc[q * V + i], mul_rn(wj, vals[i]))


@cute.jit
def widened(dtype: cutlass.Constexpr, frag: cute.Tensor):
    """The V elements of a 128-bit register fragment as fp32 values (exactly: every element type here
    widens without rounding). BF16 is widened from the fragment's 32-bit words, one instruction an element
    (the low half shifted up, the high half masked): the conversion's own lowering took 1.5, a sixth of
    the low-latency combine's sum (Nsight Compute, one H200)."""
    if cutlass.const_expr(dtype == cutlass.BFloat16):
        words = cute.recast_tensor(frag, Int32).load()
        vals = []
        for i in cutlass.range_constexpr(VECTOR_BYTES // 4):
            vals.append(f32_from_bits(words[i] << 16))  # element 2i: the word's low 16 bits
            vals.append(f32_from_bits(words[i] & Int32(-65536)))  # element 2i + 1: the high 16 bits
        return vals
    else:
        return frag.load().to(Float32)


@cute.jit
def sum_pieces(
    dtype: cutlass.Constexpr,
    pieces: cutlass.Constexpr,
    max_group: cutlass.Constexpr,
    rows: RowList,
    offset: Int64,
    valid: Int32,
    dst_addr: Int64,
    spare: Int64,
):
    """The first min(``pieces``, ``valid``) of ``pieces`` pieces (WARP pieces apart, from ``offset``) of the
    weighted sum of the n listed rows, stored to ``dst_addr`` at the same offsets; rows in groups of
    ``max_group`` (then halves); ``spare``: see ``accumulate_group``."""
    V = VECTOR_BYTES // (dtype.width // 8)
    acc = cute.make_rmem_tensor(cute.make_layout(V * pieces), Float32)
    acc.fill(0.0)
    done = Int32(0)
    for group in cutlass.range_constexpr(4):  # groups of 8, 4, 2, 1 rows, those <= max_group
        size = 8 >> group
        if cutlass.const_expr(size <= max_group):
            end = done + (rows.n - done) // size * size
            for c in range(done, end, size):
                accumulate_group(dtype, size, pieces, acc, rows, c, offset, valid, spare)
            done = end
    for q in cutlass.range_constexpr(pieces):
        res = cute.make_rmem_tensor(cute.make_layout(V), dtype)
        part = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        for i in cutlass.range_constexpr(V):
            part[i] = acc[q * V + i]
        res.store(part.load().to(dtype))
        if valid > q:
            dst = dst_addr + offset + Int64(q * WARP * VECTOR_BYTES)
            cute.autovec_copy(res, gmem_tensor(dtype, dst, cute.make_layout(V), VECTOR_BYTES))


@cute.jit
def sum_span(
    dtype: cutlass.Constexpr,
    pieces: cutlass.Constexpr,
    max_group: cutlass.Constexpr,
    rows: RowList,
    span: tuple[Int32, Int32],
    lane: Int32,
    dst_addr: Int64,
    dst_is_local: cutlass.Constexpr,
):
    """Pieces span = [v_begin, v_end) of the sum, ``pieces`` per lane a round; in the last round a lane
    takes only its pieces below v_end, its others loading the spare address (this lane's piece of the
    destination row when it is this GPU's, else of the first row). Why not smaller rounds for the rest:
    each round waits a memory latency, and a rest of rounds of one piece a lane took two for a part of 56
    pieces, where one round of two pieces a lane holds it; the rest in smaller rounds, code of their own,
    held the rank combine longer (one rank of one H200, 4096 tokens: 183.3 against 174.7 us)."""
    v_begin, v_end = span
    for u in range(v_begin + lane, v_end, pieces * WARP):
        valid = (v_end - u + WARP - 1) // WARP  # this lane's pieces u, u + WARP, ... below v_end
        offset = Int64(u * VECTOR_BYTES)
        spare = dst_addr + offset
        if cutlass.const_expr(not dst_is_local):
            spare = rows.row_addr[0] + offset
        sum_pieces(dtype, pieces, max_group, rows, offset, valid, dst_addr, spare)


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
    max_pieces: cutlass.Constexpr = 8,
    dst_is_local: cutlass.Constexpr = True,
):
    """Pieces [v_begin, v_end) of dst = sum over i in [0, n) ascending of weight[i] * row_addr[i]'s row
    (fp32, then ``dtype``); ``row_addr``/``weight``: the warp's list (shared memory, written before a
    ``sync_warp``). n == 0 writes zeros. ``dst_addr`` may be a peer's memory (peer pointer): then
    ``dst_is_local`` False (``sum_span``'s spare loads). ``max_pieces``: see ``shapes_upto``."""
    shapes = shapes_upto(max_pieces)
    taken = Int32(0)
    for shape in cutlass.range_constexpr(len(shapes)):
        min_rows, pieces, max_group = shapes[shape]
        if taken == 0:
            if n >= min_rows:
                taken = Int32(1)
                sum_span(dtype, pieces, max_group, RowList(row_addr, weight, n), (v_begin, v_end), lane,
                         dst_addr, dst_is_local)
