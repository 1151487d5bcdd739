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



class Launcher:
    """Calls a compiled ``EpModule`` through argument storage that persists between calls.

    Why: the DSL's generic call converts every argument to C storage anew on each call (the bundle's 18
    scalars and 26 pointers: about 50 us of host time per launch, measured on the development machine),
    while a launch changes only the call's scalars, the caller's four tensors and the stream. The storage
    is made once, from the module's own argument conversion (``generate_execution_args``); a launch writes
    the values that change into it and runs the module on the same address list
    (``run_compiled_program``).

    compiled: the module (as ``ModuleRegistry.get`` returns it); sizes: ``size_scalars(cfg)``; pointers:
    a ``Pointers`` with every field set (the per-call ones to any valid stand-in).
    """

    def __init__(self, compiled, sizes: tuple, pointers: Pointers, rank: int) -> None:
        import ctypes

        import cuda.bindings.driver as cuda

        self._compiled = compiled
        self._keep = (sizes, pointers, cuda.CUstream(0))  # the storage the address list points into
        scalars = launch_scalars(sizes, **dict.fromkeys(CALL_SCALARS, 0))
        exe, adapted = compiled.generate_execution_args(scalars, pointers, self._keep[2])
        self._exe, self._adapted = exe, adapted
        addrs = [a if isinstance(a, int) else a.value for a in exe]
        if len(addrs) != len(CALL_SCALARS) + len(SIZE_SCALARS) + len(BUFFERS) + 1:
            raise RuntimeError(f"unexpected argument layout of the compiled module: {len(addrs)} arguments")
        self.scalars = {n: ctypes.c_int32.from_address(addrs[i]) for i, n in enumerate(CALL_SCALARS)}
        first = len(CALL_SCALARS) + len(SIZE_SCALARS)
        self.pointers = {b.name: ctypes.c_uint64.from_address(addrs[first + j])
                         for j, b in enumerate(BUFFERS)}
        self.stream = ctypes.c_uint64.from_address(addrs[-1])
        self.scalars["rank"].value = rank

    def __call__(self, stream: int, pointers: Mapping[str, int], **scalars: int) -> None:
        """One launch: ``scalars`` (names of ``CALL_SCALARS``, others keep their values), the device
        addresses of the per-call buffers, and the CUDA stream handle."""
        for name, value in scalars.items():
            self.scalars[name].value = value
        for name, addr in pointers.items():
            self.pointers[name].value = addr
        self.stream.value = stream
        self._compiled.run_compiled_program(self._exe)
