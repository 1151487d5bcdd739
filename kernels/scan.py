"""Sums and searches over counts: a warp's inclusive scan; for the layout's step 3 (kernels/layout.py) an
exclusive prefix scan of a shared-memory vector, reading its entries, and each column's sum over the CTAs'
count rows of ``layout_parts``; the block holding a row among blocks laid end to end (the low-latency
kernels' rows of each expert and source)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_ep.kernels.config import WARP
from cute_ep.kernels.ptx import ld_volatile_i32
from cute_ep.kernels.rows import element_addr


@cute.jit
def warp_inclusive_scan(v: Int32, lane: Int32) -> Int32:
    """The sum of ``v`` over lanes 0..lane of the warp (every lane calls it)."""
    incl = v
    for k in cutlass.range_constexpr(5):
        got = cute.arch.shuffle_sync_up(incl, 1 << k)
        if lane >= (1 << k):
            incl = incl + got
    return incl


@cute.jit
def exclusive_scan_cta(vals: cute.Tensor, n: Int32, scratch: cute.Tensor, NT: cutlass.Constexpr):
    """``vals[0:n]`` (shared memory) becomes its exclusive prefix sums and ``scratch[NT // WARP]`` their
    total; ``scratch`` holds NT // WARP + 1 ints of shared memory. Every thread of the CTA (NT threads,
    at most 32 warps) calls it; it ends with a CTA barrier.

    Each thread sums a contiguous chunk, each warp scans its threads' chunk sums with shuffles, warp 0
    scans the warp totals, and each thread writes its chunk's prefixes."""
    tid, _, _ = cute.arch.thread_idx()
    warp = tid // WARP
    lane = tid % WARP
    NWT = NT // WARP
    per = (n + NT - 1) // NT
    lo = tid * per
    hi = lo + per
    if hi > n:
        hi = n
    own = Int32(0)
    for i in range(lo, hi):
        own = own + vals[i]
    incl = warp_inclusive_scan(own, lane)  # the chunk sums across the warp
    if lane == WARP - 1:
        scratch[warp] = incl
    cute.arch.sync_threads()
    if warp == 0:
        wt = Int32(0)
        if lane < NWT:
            wt = scratch[lane]
        winc = warp_inclusive_scan(wt, lane)
        if lane < NWT:
            scratch[lane] = winc - wt  # the warps before this one
        if lane == WARP - 1:
            scratch[NWT] = winc
    cute.arch.sync_threads()
    run = scratch[warp] + incl - own
    for i in range(lo, hi):
        c = vals[i]
        vals[i] = run
        run = run + c
    cute.arch.sync_threads()


@cute.jit
def prefix_at(prefix: cute.Tensor, total: Int32, i: Int32, n: Int32) -> Int32:
    """Entry ``i`` (0 <= i <= n) of exclusive prefix sums held as ``prefix[0:n]`` and their ``total``."""
    v = total
    if i < n:
        v = prefix[i]
    return v


@cute.jit
def last_at_or_before(starts: cute.Tensor, r: Int32, hi: Int32, steps: cutlass.Constexpr) -> Int32:
    """The last index in [0, hi] whose start (``starts``, ascending) is at or before r: the block holding
    row r, since an empty block shares the next one's start. A binary search of ``steps`` steps
    (2 ** steps > hi)."""
    lo = Int32(0)
    top = hi
    for _ in cutlass.range_constexpr(steps):
        if lo < top:
            mid = (lo + top + 1) // 2
            if starts[mid] <= r:
                lo = mid
            else:
                top = mid - 1
    return lo


@cute.jit
def warp_batch(units: Int32, first: Int32, stride: Int32) -> Int32:
    """How many units of a grid-stride loop a warp takes in its batch from ``first``: first, first + stride,
    ... below ``units``, at most WARP (a lane each, looked up at once before the warp works through them)."""
    count = (units - first + stride - 1) // stride
    if count > WARP:
        count = Int32(WARP)
    return count


PARTS_IN_FLIGHT = 16  # loads of earlier CTAs' counts a thread issues before it adds the first


@cute.jit
def sum_earlier_ctas(parts: cute.Tensor, col0: Int32, ncols: Int32, n: Int32, acc: cute.Tensor,
                     NT: cutlass.Constexpr):
    """``acc[i]`` (shared memory) = the sum of ``parts[c, col0 + i]`` over CTAs c < n, for i < ncols. Every
    thread of the CTA (NT threads) calls it; it ends with a CTA barrier.

    The CTAs of this launch wrote those rows (volatile loads). Why this shape: a CTA far down a grid of 132
    sums 131 rows per column; each column is split over NT // ncols threads (all of them for the rank
    layout's R columns), each with PARTS_IN_FLIGHT loads issued before the first is added, so the CTA waits
    for a few memory latencies rather than one per row."""
    tid, _, _ = cute.arch.thread_idx()
    per_col = NT // ncols
    if per_col < 1:
        per_col = Int32(1)
    for i in range(tid, ncols, NT):
        acc[i] = Int32(0)
    cute.arch.sync_threads()
    for item in range(tid, ncols * per_col, NT):
        col = item % ncols
        total = Int32(0)
        for c0 in range(item // ncols, n, per_col * PARTS_IN_FLIGHT):
            vals = []
            for j in cutlass.range_constexpr(PARTS_IN_FLIGHT):
                c = c0 + j * per_col
                if c >= n:
                    c = n - 1  # a valid address; its value is not counted
                vals.append(ld_volatile_i32(element_addr(parts, (c, col0 + col))))
            for j in cutlass.range_constexpr(PARTS_IN_FLIGHT):
                if c0 + j * per_col < n:
                    total = total + vals[j]
        if total != 0:
            cute.arch.atomic_add(acc.iterator + col, total)
    cute.arch.sync_threads()
