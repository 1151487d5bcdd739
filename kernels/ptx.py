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

from cute_ep.kernels.buffers import FAULT_COUNT, FAULT_EPOCH, FAULT_OP, FAULT_PEER

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


def _f32_binary(name: str, ptx: str, doc: str):
    """A device op ``name(a, b) -> Float32`` that is exactly the PTX ``ptx`` ($0 = result, $1 = a,
    $2 = b), so the compiler can neither fuse nor approximate it."""

    @dsl_user_op
    def op(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
        args = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
        return Float32(_asm(T.f32(), args, ptx, "=f,f,f"))

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


mul_rn = _f32_binary("mul_rn", "mul.rn.f32 $0, $1, $2;",
                     "a * b rounded to nearest even, never fused with a following add.")
add_rn = _f32_binary("add_rn", "add.rn.f32 $0, $1, $2;",
                     "a + b rounded to nearest even, never fused with a preceding multiply.")
div_rn = _f32_binary("div_rn", "div.rn.f32 $0, $1, $2;",
                     "a / b, IEEE division rounded to nearest even (what torch computes; no approximate "
                     "reciprocal).")
abs_max = _f32_binary("abs_max", "{ .reg .f32 t; abs.f32 t, $2; max.f32 $0, $1, t; }",
                      "max(a, |b|) for finite values.")
max_f32 = _f32_binary("max_f32", "max.f32 $0, $1, $2;", "max(a, b) for finite values.")


@dsl_user_op
def cvt_e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two fp32 values as float8_e4m3fn (round to nearest even, saturated to +-448): ``lo`` in bits
    0-7, ``hi`` in bits 8-15 of the result (the upper 16 bits are zero)."""
    return Int32(
        _asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
             "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; cvt.u32.u16 $0, t; }", "=r,f,f")
    )


def _global_store(name: str, kind, ptx: str, constraint: str, doc: str):
    """A device op ``name(addr, value)`` storing one ``kind`` value to a raw global address."""

    @dsl_user_op
    def op(addr: Int64, value, *, loc=None, ip=None) -> None:
        args = [Int64(addr).ir_value(loc=loc, ip=ip), kind(value).ir_value(loc=loc, ip=ip)]
        _asm(None, args, ptx, constraint, side_effects=True)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


st_global_u32 = _global_store("st_global_u32", Int32, "st.global.b32 [$0], $1;", "l,r",
                              "32-bit global store to a raw address.")
st_global_f32 = _global_store("st_global_f32", Float32, "st.global.f32 [$0], $1;", "l,f",
                              "32-bit float global store to a raw address.")


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
def copy_row_to_lanes(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, dests: Int32,
                      num_pieces: Int32, lane: Int32, unroll: cutlass.Constexpr = ROW_COPY_UNROLL):
    """A warp copies ``num_pieces`` 128-bit pieces from ``src_addr`` to the address ``dst_addr`` held by
    each lane whose bit is set in ``dests`` (all 16-byte aligned; a destination may be a peer's memory
    through its NVSHMEM peer pointer). Every lane calls it with the same ``dests``.

    Why one call for every destination: each piece is loaded once and stored to all of them (a token's
    row bound for several slots or ranks is read from memory once, not once per copy).
    Why unrolled: a warp that loads one piece, stores it and moves on has one load in flight and waits
    a full memory latency per 512 bytes; ``unroll`` independent loads per lane before the stores hide it
    (ROW_COPY_UNROLL, or fewer where registers are short: kernels/dispatch.py).
    Why the last step is predicated rather than a loop of single pieces: a row of 7168 bf16 (896 pieces)
    is 3 full steps and 128 pieces, and that tail piece by piece was 4 more latencies per row.
    """
    V = 16 // (dtype.width // 8)
    U = unroll
    step = U * 32
    layout = cute.make_layout(V)
    for base in range(0, num_pieces, step):
        frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(U)]
        for j in cutlass.range_constexpr(U):
            v = base + j * 32 + lane
            if v < num_pieces:
                cute.autovec_copy(gmem_tensor(dtype, src_addr + Int64(v * 16), layout, 16), frags[j])
        left = dests
        for _ in range(cute.arch.popc(dests)):
            holder = Int32(cute.arch.clz(cute.arch.brev(left)))  # the lowest destination left
            left = left & (left - 1)
            dst = cute.arch.shuffle_sync(dst_addr, holder)
            for j in cutlass.range_constexpr(U):
                v = base + j * 32 + lane
                if v < num_pieces:
                    cute.autovec_copy(frags[j], gmem_tensor(dtype, dst + Int64(v * 16), layout, 16))


@cute.jit
def copy_row_warp(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, num_pieces: Int32, lane: Int32):
    """A warp copies ``num_pieces`` 128-bit pieces from ``src_addr`` to ``dst_addr`` (the same values in
    every lane): ``copy_row_to_lanes`` with one destination."""
    copy_row_to_lanes(dtype, src_addr, dst_addr, Int32(1), num_pieces, lane)


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
def element(t: cute.Tensor, coord) -> cute.Tensor:
    """A one-element view of ``t`` at ``coord`` (NVSHMEM's single-value FFIs take a tensor)."""
    return cute.make_tensor(t.iterator + cute.crd2idx(coord, t.layout), cute.make_layout(1))


@cute.jit
def element_addr(t: cute.Tensor, coord) -> Int64:
    """The address of ``t``'s element at ``coord`` (for the raw loads above)."""
    return (t.iterator + cute.crd2idx(coord, t.layout)).toint()


@cute.jit
def fault_free(fault: cute.Tensor) -> cutlass.Boolean:
    """No wait of this buffer has timed out yet (a volatile read: other CTAs and kernels record faults)."""
    return ld_volatile_i32(element_addr(fault, FAULT_COUNT)) == Int32(0)


@cute.jit
def record_fault(fault: cute.Tensor, op: Int32, peer: Int32, epoch: Int64):
    """Record (op, peer, epoch) in ``fault`` (the FAULT_* words) unless an earlier fault is recorded
    (the first one wins).

    Every kernel checks ``fault_free`` when it starts and moves no data once a fault is recorded, so
    after a timeout no kernel of this buffer moves data until the host has read the record and raised."""
    old = cute.arch.atomic_add(fault.iterator + FAULT_COUNT, Int32(1))
    if old == Int32(0):
        fault[FAULT_OP] = op
        fault[FAULT_PEER] = peer
        fault[FAULT_EPOCH] = Int32(epoch)


@cute.jit
def signal_and_wait_peers(p, row: Int32, value: Int64, op: Int32, epoch: Int64, signal: Int32):
    """A barrier across ranks on ``p.signals[row, :]`` (one SIGNAL_* row; symmetric, [rows, R] uint64).

    If ``signal`` != 0, this CTA's first R threads first SET ``signals[row, rank]`` on every peer to
    ``value`` (after a system fence: this rank's earlier writes are visible first). Then this CTA's first
    R threads wait until ``signals[row, q] >= value`` for every peer q, each at most ``p.timeout_ms``; a
    peer that never arrives is recorded in ``p.fault`` as (op, q, epoch). Nothing happens once a fault is
    recorded. Ends with a CTA barrier. Every thread of the CTA must call it.
    """
    tid, _, _ = cute.arch.thread_idx()
    R = p.world_size
    if fault_free(p.fault):
        if signal != 0:
            if tid < R:
                fence_sys()
                nvshmem_cute.signal_op(element(p.signals, (row, p.rank)), value, SIGNAL_SET, tid)
        if tid < R:
            if wait_signal_ge(element_addr(p.signals, (row, tid)), value, Int64(p.timeout_ms) * 1000000) == 0:
                record_fault(p.fault, op, tid, epoch)
    cute.arch.sync_threads()


@cute.jit
def last_cta_arrives(done: cute.Tensor, slot: Int32) -> Int32:
    """Called by one thread per CTA after the CTA's work: 1 in the last CTA of the grid to arrive (the
    counter ``done[slot]`` is then reset for the next launch), else 0.

    The fence first makes this CTA's writes visible before its arrival is counted, so the last CTA may
    announce everyone's work."""
    NCTA, _, _ = cute.arch.grid_dim()
    fence_sys()
    last = Int32(0)
    if cute.arch.atomic_add(done.iterator + slot, Int32(1)) == NCTA - 1:
        done[slot] = Int32(0)
        last = Int32(1)
    return last
