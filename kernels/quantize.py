"""FP8 quantization of one row by one warp, called by the dispatch kernel for an FP8 dispatch.

The row's H elements (H a multiple of FP8_BLOCK = 128) become a packed row of ``cfg.fp8_row_bytes``:
[H bytes of float8_e4m3fn | H / 128 fp32 scales | zero padding to a multiple of 16 bytes], which the
dispatch kernel then moves like any other row (same-node peer stores, ``put_warp``, the fan-out).

Per block of 128 columns, exactly as ``cute_ep.fp8.quantize_fp8`` computes it in torch (the scale rule
FP8_SCALE_DIVIDE, kernels/config.py):
    amax  = max(max |x|, FP8_AMAX_FLOOR)
    scale = amax / 448          (IEEE division, rounded to nearest)
    inv   = 448 / amax          (a second division, not 1 / scale: two roundings would differ)
    q     = e4m3(x * inv)       (product rounded to fp32, then to e4m3, nearest even, saturated)
so the received bytes are bit-identical to the reference. DeepEP's low-latency cast
(``cute_ep.deep_ep.low_latency.cast_fp8_blocks``), FP8_SCALE_LOW_LATENCY: amax at least 1e-4 and
scale = amax * fp32(1 / 448); with its ``round_scale``, FP8_SCALE_POWER_OF_TWO: scale = 2^e, e =
ceil(log2(amax * fp32(1 / 448))) read from the product's bits, and inv = 2^-e.

Lanes: a lane holds one 128-bit piece (8 elements of a 16-bit type, 4 of fp32), so a block spans 16
or 32 lanes and a warp step covers 2 or 1 blocks; the block's amax is a butterfly max over its lanes. A warp
loads several steps at once (a round); the round's block scales are computed by one lane each and passed to
the block's lanes by a shuffle.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cute_ep.kernels.buffers import FP8_BLOCK
from cute_ep.kernels.config import (
    FP8_AMAX_FLOOR,
    FP8_LOW_LATENCY_AMAX_FLOOR,
    FP8_MAX,
    FP8_SCALE_DIVIDE,
    FP8_SCALE_LOW_LATENCY,
    FP8_SCALE_POWER_OF_TWO,
    VECTOR_BYTES,
    WARP,
)
from cute_ep.kernels.ptx import (
    abs_max,
    cvt_e4m3x2,
    div_rn,
    f32_bits,
    f32_from_bits,
    max_f32,
    mul_rn,
)
from cute_ep.kernels.rows import gmem_tensor


@cute.jit
def quantize_row_warp(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, hidden: Int32,
                      row_bytes: Int32, lane: Int32, rule: Int32, unroll: cutlass.Constexpr = 1):
    """A warp quantizes the row at ``src_addr`` (``hidden`` elements of ``dtype``, 16-byte aligned) into
    the packed FP8 row at ``dst_addr`` (``row_bytes`` bytes, 16-byte aligned) by the scale ``rule`` (an
    FP8_SCALE_* of kernels/config.py). See the module docstring.

    The caller must ``sync_warp`` before lanes read bytes other lanes wrote.
    ``unroll``: the warp steps whose pieces are loaded before the first is cast (a warp alone on a row
    otherwise waits a full load latency per step: 28 per 7168-bf16 row); 1 where registers are short."""
    quantize_blocks_warp(dtype, src_addr, dst_addr, hidden, row_bytes, lane, rule, Int32(0),
                         hidden // FP8_BLOCK, Int32(1), unroll)


@cute.jit
def quantize_blocks_warp(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, hidden: Int32,
                         row_bytes: Int32, lane: Int32, rule: Int32, first: Int32, end: Int32, pad: Int32,
                         unroll: cutlass.Constexpr):
    """``quantize_row_warp`` of the row's 128-column blocks [first, end) only: their FP8 values and
    scales; the zero padding too where ``pad`` is not 0. Warps casting a row's blocks apart write
    disjoint bytes."""
    V = VECTOR_BYTES // (dtype.width // 8)  # elements per lane
    LPB = FP8_BLOCK // V  # lanes per block: 16 or 32
    BPS = WARP // LPB  # blocks per warp step: 2 or 1
    # Butterfly offsets LPB/2 ... 1 (kept inside the block); a Python list, fixed at trace time.
    OFFSETS = [LPB >> (i + 1) for i in range(LPB.bit_length() - 1)]
    layout = cute.make_layout(V)
    nblocks = hidden // FP8_BLOCK
    # The source row as 128-bit pieces, and the packed row's parts as typed views: the FP8 values as
    # 32-bit words (4 values each), the block scales after them, then the zero padding words.
    src = gmem_tensor(dtype, src_addr, cute.make_layout((V, hidden // V)), VECTOR_BYTES)
    q_words = gmem_tensor(Int32, dst_addr, cute.make_layout((V // 4, hidden // V)), V // 4 * 4)
    scales = gmem_tensor(Float32, dst_addr + Int64(hidden), cute.make_layout(nblocks), 4)
    tail = gmem_tensor(Int32, dst_addr + Int64(hidden + 4 * nblocks), cute.make_layout(WARP), 4)
    sub = lane % LPB
    for b0 in range(first, end, BPS * unroll):  # warp-uniform bounds: every lane takes part in the shuffles
        frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(unroll)]
        for u in cutlass.range_constexpr(unroll):  # every load in flight before the first use
            frags[u].fill(0.0)
            block = b0 + u * BPS + lane // LPB
            if block < end:
                cute.autovec_copy(src[None, block * LPB + sub], frags[u])  # this lane's V elements
        # Each step's block amax (a butterfly over the block's lanes); then lane ``sub`` = u of each block's
        # lanes takes step u's and computes its scale, so one pair of divisions serves the round's blocks.
        # Why: an IEEE division is a sequence of instructions, and the warp ran two for every step.
        amax = Float32(0.0)
        for u in cutlass.range_constexpr(unroll):
            vals = frags[u].load().to(Float32)
            a = Float32(0.0)
            for i in cutlass.range_constexpr(V):
                a = abs_max(a, vals[i])
            for i in cutlass.range_constexpr(len(OFFSETS)):
                a = max_f32(a, cute.arch.shuffle_sync_bfly(a, OFFSETS[i]))
            if sub == u:
                amax = a
        scale, inv_held = block_scale(amax, rule)
        if sub < unroll:
            block = b0 + sub * BPS + lane // LPB
            if block < end:
                scales[block] = scale
        for u in cutlass.range_constexpr(unroll):
            block = b0 + u * BPS + lane // LPB
            inv = cute.arch.shuffle_sync(inv_held, lane - sub + u)  # step u's, from lane u of the block
            vals = frags[u].load().to(Float32)
            words = cute.make_rmem_tensor(cute.make_layout(V // 4), Int32)
            for w in cutlass.range_constexpr(V // 4):
                b01 = cvt_e4m3x2(mul_rn(vals[4 * w], inv), mul_rn(vals[4 * w + 1], inv))
                b23 = cvt_e4m3x2(mul_rn(vals[4 * w + 2], inv), mul_rn(vals[4 * w + 3], inv))
                words[w] = b01 | (b23 << 16)
            if block < end:
                cute.autovec_copy(words, q_words[None, block * LPB + sub])  # one 64- or 32-bit store
    # Zero padding after the scales (fewer than 16 bytes, one word per lane).
    pad_words = (row_bytes - hidden - 4 * nblocks) // 4
    if pad != 0:
        if lane < pad_words:
            tail[lane] = Int32(0)


@cute.jit
def block_scale(amax: Float32, rule: Int32):
    """(the stored scale, the multiplier) of a block whose max |x| is ``amax``, by ``rule`` (the module
    docstring). The rule is uniform across the warp, so the branches do not diverge."""
    floor = Float32(FP8_AMAX_FLOOR)
    if rule != FP8_SCALE_DIVIDE:
        floor = Float32(FP8_LOW_LATENCY_AMAX_FLOOR)
    amax = max_f32(amax, floor)
    scale = div_rn(amax, Float32(FP8_MAX))
    inv = div_rn(Float32(FP8_MAX), amax)
    if rule == FP8_SCALE_LOW_LATENCY:
        scale = mul_rn(amax, Float32(1.0 / FP8_MAX))
    if rule == FP8_SCALE_POWER_OF_TWO:
        bits = f32_bits(mul_rn(amax, Float32(1.0 / FP8_MAX)))
        exp = ((bits >> 23) & 0xFF) - 127
        if (bits & 0x7FFFFF) != 0:  # not a power of two: round the exponent up
            exp = exp + 1
        scale = f32_from_bits((exp + 127) << 23)
        inv = f32_from_bits((127 - exp) << 23)
    return scale, inv
