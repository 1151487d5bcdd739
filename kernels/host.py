"""Host-side helpers to call an ``EpModule``: pointers for real tensors or for CPU-only compiles."""

from __future__ import annotations

from collections.abc import Mapping

from cute_ep.kernels.config import EpConfig
from cute_ep.kernels.module import POINTER_ARGS, EpModule, pointer_dtypes


def make_pointer(cfg: EpConfig, name: str, addr: int):
    """The CuTe pointer of argument ``name`` (see ``POINTER_ARGS``) at device address ``addr``."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dtype, align = pointer_dtypes(cfg)[name]
    addr = int(addr)
    if addr % align:
        raise ValueError(f"{name} must be {align}-byte aligned, got address {addr:#x}")
    return make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def make_pointers(cfg: EpConfig, addresses: Mapping[str, int]) -> list:
    """CuTe pointers in ``POINTER_ARGS`` order for the given device addresses (bytes)."""
    return [make_pointer(cfg, name, addresses[name]) for name in POINTER_ARGS]


def example_args(cfg: EpConfig) -> tuple:
    """Arguments for compiling ``EpModule(cfg)`` without touching memory (no GPU needed)."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32

    fake = {name: 1 << 20 for name in POINTER_ARGS}  # any aligned address: compile only
    ints = (0, 0, 0, 0, 0, 0, 1, *cfg.shape_args())  # op, mode, fp8, algo, calgo, rank, num_tokens, sizes
    return (*(Int32(v) for v in ints), *make_pointers(cfg, fake), cuda.CUstream(0))


def build(cfg: EpConfig):
    """(jit function, example args) for ``ModuleRegistry.get`` under ``cfg.compile_key()``."""
    from cute_ep.kernels.config import cute_dtype

    return EpModule(cute_dtype(cfg.dtype)), example_args(cfg)
