"""Small device helpers shared by the kernels: exact fp32 arithmetic, system-scope loads, views, row
copies and bounded waits.

Why these exist:
- ``mul_rn``/``add_rn``: a plain ``a * b + c`` may be contracted into an FMA by the compiler (one
  rounding instead of two). Combine promises bit-identity with the fixed-order torch reference,
  which rounds the product and the sum separately, so the kernels spell both roundings out.
- ``ld_volatile_i32``: values written by other GPUs (counts) or by other CTAs (the fault record) must
  not come from a stale L1 line; a volatile global load always goes to the memory system.
- ``elem_view``: NVSHMEM's CuTe FFIs accept a pointer whose alignment is exactly the element size,
  while 128-bit vector copies want a 16-byte aligned view of the same bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import nvshmem.core as _nvshmem_core
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# NVSHMEM enum values used on the device (taken from nvshmem4py so they can never drift).
SIGNAL_SET = int(_nvshmem_core.SignalOp.SIGNAL_SET)


def _asm(ret, args, text: str, constraints: str, side_effects: bool = False):
    return llvm.inline_asm(
        ret,
        args,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * b rounded to nearest even, never fused with a following add."""
    return Float32(
        _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
             "mul.rn.f32 $0, $1, $2;", "=f,f,f")
    )


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b rounded to nearest even, never fused with a preceding multiply."""
    return Float32(
        _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
             "add.rn.f32 $0, $1, $2;", "=f,f,f")
    )


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a / b, IEEE division rounded to nearest even (what torch computes; no approximate reciprocal)."""
    return Float32(
        _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
             "div.rn.f32 $0, $1, $2;", "=f,f,f")
    )


@dsl_user_op
def abs_max(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max(a, |b|) for finite values."""
    return Float32(
        _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
             "{ .reg .f32 t; abs.f32 t, $2; max.f32 $0, $1, t; }", "=f,f,f")
    )


@dsl_user_op
def max_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max(a, b) for finite values."""
    return Float32(
        _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
             "max.f32 $0, $1, $2;", "=f,f,f")
    )


@dsl_user_op
def cvt_e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two fp32 values as float8_e4m3fn (round to nearest even, saturated to +-448): ``lo`` in bits
    0-7, ``hi`` in bits 8-15 of the result (the upper 16 bits are zero)."""
    return Int32(
        _asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
             "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; cvt.u32.u16 $0, t; }", "=r,f,f")
    )


@dsl_user_op
def st_global_u32(addr: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """32-bit global store to a raw address."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "st.global.b32 [$0], $1;", "l,r", side_effects=True)


@dsl_user_op
def st_global_f32(addr: Int64, value: Float32, *, loc=None, ip=None) -> None:
    """32-bit float global store to a raw address."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
         "st.global.f32 [$0], $1;", "l,f", side_effects=True)


@dsl_user_op
def st_global_v2_u32(addr: Int64, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    """64-bit global store of two words (``a`` at the lower address) to a raw 8-byte aligned address."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(a).ir_value(loc=loc, ip=ip),
                Int32(b).ir_value(loc=loc, ip=ip)],
         "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", side_effects=True)


@dsl_user_op
def ld_volatile_i32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """32-bit volatile global load from a raw address (sees other GPUs' completed writes)."""
    return Int32(
        _asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
             "ld.volatile.global.b32 $0, [$1];", "=r,l", side_effects=True)
    )


@dsl_user_op
def fence_sys(*, loc=None, ip=None) -> None:
    """Order this thread's earlier writes before its later ones for every observer in the system."""
    _asm(None, [], "fence.sc.sys;", "", side_effects=True)


@cute.jit
def elem_view(t: cute.Tensor) -> cute.Tensor:
    """The same tensor with the pointer alignment set to exactly one element (NVSHMEM FFIs)."""
    width = t.element_type.width // 8
    p = cute.make_ptr(t.element_type, t.iterator.toint(), cute.AddressSpace.gmem, assumed_align=width)
    return cute.make_tensor(p, t.layout)


@cute.jit
def row_view(dtype: cutlass.Constexpr, addr: Int64, num_elems: Int32) -> cute.Tensor:
    """A 1-D global tensor of ``num_elems`` over a raw address, aligned to one element (NVSHMEM FFIs)."""
    p = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=dtype.width // 8)
    return cute.make_tensor(p, cute.make_layout(num_elems))


@cute.jit
def gmem_tensor(dtype: cutlass.Constexpr, addr: Int64, layout: cute.Layout, align: cutlass.Constexpr):
    """A global-memory tensor over a raw address (peer pointers, staging rows)."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align), layout)


ROW_COPY_UNROLL = 8  # 128-bit pieces per lane in flight while a warp copies a row


@cute.jit
def copy_row_warp(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, num_pieces: Int32, lane: Int32):
    """A warp copies ``num_pieces`` 128-bit pieces from ``src_addr`` to ``dst_addr`` (both 16-byte
    aligned; the destination may be a peer's memory through its NVSHMEM peer pointer).

    Why unrolled: a warp that loads one piece, stores it and moves on has one load in flight and waits
    a full memory latency per 512 bytes; ROW_COPY_UNROLL independent loads before the stores hide it.
    """
    V = 16 // (dtype.width // 8)
    U = ROW_COPY_UNROLL
    step = U * 32
    full = num_pieces // step * step
    layout = cute.make_layout(V)
    for base in range(0, full, step):
        frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(U)]
        for j in cutlass.range_constexpr(U):
            off = Int64((base + j * 32 + lane) * 16)
            cute.autovec_copy(gmem_tensor(dtype, src_addr + off, layout, 16), frags[j])
        for j in cutlass.range_constexpr(U):
            off = Int64((base + j * 32 + lane) * 16)
            cute.autovec_copy(frags[j], gmem_tensor(dtype, dst_addr + off, layout, 16))
    for v in range(full + lane, num_pieces, 32):
        frag = cute.make_rmem_tensor(layout, dtype)
        off = Int64(v * 16)
        cute.autovec_copy(gmem_tensor(dtype, src_addr + off, layout, 16), frag)
        cute.autovec_copy(frag, gmem_tensor(dtype, dst_addr + off, layout, 16))


# -- bounded waits -----------------------------------------------------------------------------------



@dsl_user_op
def global_timer_ns(*, loc=None, ip=None) -> Int64:
    """%globaltimer (nanoseconds), read afresh on every call (a side-effecting asm is never hoisted)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", side_effects=True))


@dsl_user_op
def ld_acquire_u64(addr: Int64, *, loc=None, ip=None) -> Int64:
    """64-bit acquire load at system scope: what a peer wrote before its release is visible after."""
    return Int64(
        _asm(T.i64(), [Int64(addr).ir_value(loc=loc, ip=ip)],
             "ld.acquire.sys.global.u64 $0, [$1];", "=l,l", side_effects=True)
    )


@cute.jit
def wait_signal_ge(addr: Int64, target: Int64, timeout_ns: Int64) -> Int32:
    """Spin until the 64-bit signal at ``addr`` (this rank's symmetric memory) is >= ``target``.

    Returns 1 when it arrived, 0 when ``timeout_ns`` passed first. Why not ``nvshmem signal_wait``:
    that waits forever, so one rank that skips a call hangs every other rank with no error.
    """
    state = Int32(0)  # 0: waiting, 1: arrived, 2: timed out
    start = global_timer_ns()
    while state == Int32(0):
        if ld_acquire_u64(addr) >= target:
            state = Int32(1)
        else:
            if global_timer_ns() - start > timeout_ns:
                state = Int32(2)
    result = Int32(0)
    if state == Int32(1):
        result = Int32(1)
    return result


@cute.jit
def record_fault(fault: cute.Tensor, op: Int32, peer: Int32, epoch: Int64):
    """Record (op, peer, epoch) in ``fault`` ([FAULT_WORDS] int32: faults recorded, operation, peer,
    epoch's low 32 bits) unless an earlier fault is recorded (the first one wins).

    Every kernel checks ``fault[0]`` when it starts and does nothing if it is set, so after a timeout
    no kernel of this buffer moves data until the host has read the record and raised."""
    old = cute.arch.atomic_add(fault.iterator, Int32(1))
    if old == Int32(0):
        fault[1] = op
        fault[2] = peer
        fault[3] = Int32(epoch)


@cute.jit
def signal_and_wait_peers(
    signals: cute.Tensor,
    row: Int32,
    rank: Int32,
    world_size: Int32,
    value: Int64,
    timeout_ms: Int32,
    op: Int32,
    epoch: Int64,
    fault: cute.Tensor,
    signal: Int32,
):
    """A barrier across ranks on signal row ``row`` (``signals`` is [rows, R] uint64, symmetric).

    If ``signal`` != 0, CTA 0's first R threads first SET ``row[rank]`` on every peer to ``value``
    (after a system fence: this rank's earlier writes are visible first). Then the first R threads of
    every CTA wait until ``row[p] >= value`` for every peer p, each at most ``timeout_ms``; a peer that
    never arrives is recorded in ``fault`` as (op, p, epoch). Nothing happens once a fault is recorded.
    Ends with a CTA barrier.
    """
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    if ld_volatile_i32(fault.iterator.toint()) == Int32(0):
        if signal != 0:
            if bid == 0:
                if tid < world_size:
                    fence_sys()
                    nvshmem_cute.signal_op(
                        cute.make_tensor(signals.iterator + (row * world_size + rank), cute.make_layout(1)),
                        value, SIGNAL_SET, tid,
                    )
        if tid < world_size:
            addr = signals.iterator.toint() + Int64((row * world_size + tid) * 8)
            if wait_signal_ge(addr, value, Int64(timeout_ms) * 1000000) == 0:
                record_fault(fault, op, tid, epoch)
    cute.arch.sync_threads()
