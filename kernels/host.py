"""Host-side helpers to call an ``EpModule``: pointers for real tensors or for CPU-only compiles."""

from __future__ import annotations

from collections.abc import Mapping

from cute_ep.kernels.buffers import (
    BUFFERS,
    BY_NAME,
    CALL_SCALARS,
    ELEMENT_TYPES,
    ROW,
    SIZE_SCALARS,
    Pointers,
    Scalars,
)
from cute_ep.kernels.config import EpConfig


def pointer_type(cfg: EpConfig, name: str) -> tuple:
    """CuTe element type and assumed alignment (bytes) of buffer ``name``'s pointer."""
    import cutlass

    from cute_ep.kernels.config import cute_dtype

    b = BY_NAME[name]
    elem = cute_dtype(cfg.dtype) if b.dtype == ROW else getattr(cutlass, ELEMENT_TYPES[b.dtype][1])
    return elem, b.align(cfg)


def make_pointer(cfg: EpConfig, name: str, addr: int):
    """The CuTe pointer of buffer ``name`` at device address ``addr``."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dtype, align = pointer_type(cfg, name)
    addr = int(addr)
    if addr % align:
        raise ValueError(f"{name} must be {align}-byte aligned, got address {addr:#x}")
    return make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def make_pointers(cfg: EpConfig, addresses: Mapping[str, int]) -> Pointers:
    """One CuTe pointer per buffer, in table order, for the given device addresses (bytes)."""
    return Pointers(*(make_pointer(cfg, b.name, addresses[b.name]) for b in BUFFERS))


def size_scalars(cfg: EpConfig) -> tuple:
    """The sizes every launch passes (``SIZE_SCALARS``), as Int32 values."""
    from cutlass import Int32

    return tuple(Int32(getattr(cfg, n)) for n in SIZE_SCALARS)


def launch_scalars(sizes: tuple, **call: int) -> Scalars:
    """The ``Scalars`` of one launch: ``call`` gives every name of ``CALL_SCALARS``; ``sizes`` comes from
    ``size_scalars`` (made once per buffer)."""
    from cutlass import Int32

    return Scalars(*(Int32(call[n]) for n in CALL_SCALARS), *sizes)


def example_args(cfg: EpConfig) -> tuple:
    """Arguments for compiling ``EpModule(cfg)`` without touching memory (no GPU needed)."""
    import cuda.bindings.driver as cuda

    fake = {b.name: 1 << 20 for b in BUFFERS}  # any aligned address: compile only
    call = dict.fromkeys(CALL_SCALARS, 0) | {"num_tokens": 1}
    return launch_scalars(size_scalars(cfg), **call), make_pointers(cfg, fake), cuda.CUstream(0)


def build(cfg: EpConfig):
    """(jit function, example args) for ``ModuleRegistry.get`` under ``cfg.compile_key()``."""
    from cute_ep.kernels.config import cute_dtype
    from cute_ep.kernels.module import EpModule

    return EpModule(cute_dtype(cfg.dtype)), example_args(cfg)
