"""Compiling CuTe DSL kernels that call NVSHMEM: a cache keyed by an explicit tuple, NVSHMEM module
registration with a bound on how many are alive, and a CPU mode that compiles for sm_90 with no GPU.

- ``cute.compile`` links NVSHMEM's device bitcode by itself (the nvshmem4py CuTe externs carry it);
  on a GPU host the compiled library is then registered with ``nvshmem.core.library_init``.
- At most ``max_alive`` registered modules are kept (3 by default: on the lent 4x H200 a 4th alive
  module faulted); the least recently used one is finalized and dropped from the cache first.
- ``finalize_all`` must run before ``nvshmem.core.finalize()``: register it with
  ``Runtime.add_finalizer`` (``EpBuffer`` does for the registry it makes).
- CPU mode (``use_cpu_target``): NVSHMEM picks its bitcode from the current GPU's architecture and
  CuTe DSL compiles for the detected GPU; with no GPU both are pinned to sm_90.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger(__name__)

CPU_TARGET_ARCH = "sm_90"
DEFAULT_MAX_ALIVE = 3


def use_cpu_target(arch: str = CPU_TARGET_ARCH) -> None:
    """Compile for ``arch`` without a GPU: pin CuTe DSL's target and NVSHMEM's bitcode choice.

    Safe to call more than once; call it before compiling (importing cutlass first is fine).
    """
    os.environ["CUTE_DSL_ARCH"] = arch
    import nvshmem.core.init_fini as init_fini

    digits = arch.removeprefix("sm_").rstrip("a")
    init_fini._current_device_library_arch = lambda: digits  # no device to ask
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        CuTeDSL._get_dsl().envar.arch = arch
    except Exception as exc:  # the env var above still applies to a DSL created later
        log.debug("could not set the CuTe DSL arch directly: %s", exc)


def compile_kernel(fn: Callable, *args: Any, options: str | None = None):
    """``cute.compile(fn, *args)`` with the project's options; returns the compiled function."""
    import cutlass.cute as cute

    if options:
        return cute.compile(fn, *args, options=options)
    return cute.compile(fn, *args)


class ModuleRegistry:
    """Compile cache keyed by explicit tuples; registers each module with NVSHMEM on a GPU host.

    ``register=False`` (CPU mode, or kernels without NVSHMEM calls) only caches.
    """

    def __init__(
        self, *, register: bool = True, max_alive: int = DEFAULT_MAX_ALIVE, device_id: int | None = None
    ) -> None:
        if max_alive < 1:
            raise ValueError(f"max_alive must be >= 1, got {max_alive}")
        self.register = register
        self.max_alive = max_alive
        self.device_id = device_id
        self._entries: OrderedDict[Hashable, tuple[Any, Any]] = OrderedDict()
        self.compiles = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable, build: Callable[[], tuple[Callable, tuple]]) -> Any:
        """The compiled function for ``key``; ``build()`` returns (jit function, example args)."""
        if not isinstance(key, tuple):
            raise TypeError(f"compile-cache keys are explicit tuples, got {type(key).__name__}: {key!r}")
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][0]
        while len(self._entries) >= self.max_alive:
            old_key, (_, old_lib) = self._entries.popitem(last=False)
            log.info("finalizing NVSHMEM module %r to stay within %d alive", old_key, self.max_alive)
            self._finalize(old_lib)
        fn, args = build()
        compiled = compile_kernel(fn, *args)
        self.compiles += 1
        lib = None
        if self.register:
            compiled, lib = self._register(compiled)
        self._entries[key] = (compiled, lib)
        return compiled

    def _register(self, compiled):
        import nvshmem.core

        if self.device_id is None:
            try:
                from cuda.core import Device
            except ImportError:  # older cuda-core releases
                from cuda.core.experimental import Device
            device_id = Device().device_id
        else:
            device_id = self.device_id
        compiled = compiled.to(device_id)
        lib = nvshmem.core.NvshmemKernelObject.from_handle(int(compiled.jit_module.cuda_library[0]))
        lib._keepalive = compiled
        nvshmem.core.library_init(lib)
        return compiled, lib

    @staticmethod
    def _finalize(lib) -> None:
        if lib is None:
            return
        import nvshmem.core

        nvshmem.core.library_finalize(lib)

    def finalize_all(self) -> None:
        """Finalize every registered module (before ``nvshmem.core.finalize()``) and clear the cache."""
        first_error: BaseException | None = None
        while self._entries:
            _, (_, lib) = self._entries.popitem(last=False)
            try:
                self._finalize(lib)
            except BaseException as exc:  # keep finalizing the rest
                log.error("library_finalize failed: %s", exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
