"""PTX instruction wrappers: exact fp32 arithmetic, fp8 conversion, fp32 bitcasts, volatile and
system-scope loads, fences and the global timer. Only single instructions live here (inline PTX where
the DSL has no operation); row views and copies are in ``kernels.rows``, signals, fault records and
arrival counters in ``kernels.signals``.

Why these exist:
- ``mul_rn``/``add_rn``: a plain ``a * b + c`` may be contracted into an FMA by the compiler (one
  rounding instead of two). Combine promises bit-identity with the fixed-order torch reference,
  which rounds the product and the sum separately, so the kernels spell both roundings out.
- ``ld_volatile_i32``: values written by other GPUs (counts) or by other CTAs (the fault record) must
  not come from a stale L1 line; a volatile global load always goes to the memory system.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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


@dsl_user_op
def f32_bits(a: Float32, *, loc=None, ip=None) -> Int32:
    """The 32 bits of ``a`` as an Int32 (a bitcast, no conversion)."""
    return Int32(llvm.bitcast(T.i32(), Float32(a).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32_from_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The Float32 whose 32 bits are ``bits`` (a bitcast, no conversion)."""
    return Float32(llvm.bitcast(T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def ld_volatile_i32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """32-bit volatile global load from a raw address (sees other GPUs' completed writes)."""
    return Int32(
        _asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
             "ld.volatile.global.b32 $0, [$1];", "=r,l", side_effects=True)
    )


@dsl_user_op
def ld_volatile_i64(addr: Int64, *, loc=None, ip=None) -> Int64:
    """64-bit volatile global load from a raw address: as ``ld_volatile_i32``, and unlike an acquire load
    it does not hold back the loads after it (a thread's loads of a row of words stay in flight together)."""
    return Int64(
        _asm(T.i64(), [Int64(addr).ir_value(loc=loc, ip=ip)],
             "ld.volatile.global.b64 $0, [$1];", "=l,l", side_effects=True)
    )


@dsl_user_op
def fence_sys(*, loc=None, ip=None) -> None:
    """Order this thread's earlier writes before its later ones for every observer in the system."""
    _asm(None, [], "fence.sc.sys;", "", side_effects=True)


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
