"""Compiling CuTe DSL kernels that call NVSHMEM: a cache keyed by an explicit tuple, NVSHMEM module
registration with a bound on how many are alive, and a CPU mode that compiles for sm_90 with no GPU.

- ``cute.compile`` links NVSHMEM's device bitcode by itself (the nvshmem4py CuTe externs carry it);
  on a GPU host the compiled library is then registered with ``nvshmem.core.library_init``.
- At most ``max_alive`` registered modules are kept (3 by default: on a 4x H200 host a 4th alive
  module faulted); the least recently used one is finalized and dropped from the cache first.
- ``finalize_all`` must run before ``nvshmem.core.finalize()``: register it with
  ``Runtime.add_finalizer`` (``EpBuffer`` does for the registry it makes).
- CPU mode (``use_cpu_target``): NVSHMEM picks its bitcode from the current GPU's architecture and
  CuTe DSL compiles for the detected GPU; with no GPU both are pinned to sm_90.
- Disk cache (``ObjectCache``, opt-in with ``CUTE_EP_COMPILE_CACHE=DIR``): a compiled module is saved
  as an object file (``dump_to_object``) and later processes load it (``cute.runtime.load_module``, a
  few ms) instead of compiling again (tens of seconds per dtype, NVSHMEM's device library is linked
  in). Files are named by the key and a fingerprint of everything that shapes the code: the kernel
  sources, the DSL and nvshmem4py versions and the target architecture, so a stale file is never
  loaded. Verified on 2x H200: object files compiled on a CPU-only host by ``scripts/precompile.py``
  were loaded and registered there (``EpBuffer ready in 2.0-2.8 s``). The cache is off unless asked for.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CPU_TARGET_ARCH = "sm_90"
DEFAULT_MAX_ALIVE = 3
CACHE_ENV = "CUTE_EP_COMPILE_CACHE"
KERNEL_SOURCES = Path(__file__).resolve().parents[1] / "kernels"


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


PTXAS_FAST = "-O0 --Ofast-compile=max"
"""ptxas at its fastest: for compiles whose PTX is read and whose machine code never runs (CPU checks)."""


def ptx_options(dump_dir: str | os.PathLike, fast_ptxas: bool = False) -> str:
    """``compile_kernel`` options that keep the PTX (``compiled.artifacts.PTX``; the DSL also writes it
    into ``dump_dir``, so keep that out of the checkout), with ptxas at ``PTXAS_FAST`` if ``fast_ptxas``."""
    options = f"--keep-ptx --dump-dir {os.fspath(dump_dir)}"
    return f"{options} --ptxas-options='{PTXAS_FAST}'" if fast_ptxas else options


def compile_kernel(fn: Callable, *args: Any, options: str | None = None):
    """``cute.compile(fn, *args)`` with the project's options; returns the compiled function."""
    import cutlass.cute as cute

    if options:
        return cute.compile(fn, *args, options=options)
    return cute.compile(fn, *args)


def target_arch() -> str:
    """The architecture compiled for: CUTE_DSL_ARCH if set (CPU mode sets it), else the current GPU's."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return CPU_TARGET_ARCH


def code_fingerprint(sources: Path = KERNEL_SOURCES, arch: str | None = None) -> str:
    """sha256 over the kernel sources (*.py under ``sources``), the DSL and nvshmem4py versions and the
    target architecture: what a cached object file must match to be loaded."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for path in sorted(sources.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("nvidia-cutlass-dsl", "nvshmem4py-cu13"):
        try:
            h.update(f"{dist}={version(dist)}".encode())
        except PackageNotFoundError:
            h.update(f"{dist}=absent".encode())
    h.update((arch or target_arch()).encode())
    return h.hexdigest()


class ObjectCache:
    """Compiled modules as object files in ``folder`` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, fingerprint: str | None = None) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint or code_fingerprint()

    @classmethod
    def from_env(cls) -> ObjectCache | None:
        """The cache named by $CUTE_EP_COMPILE_CACHE, or None when it is unset or empty."""
        folder = os.environ.get(CACHE_ENV)
        return cls(folder) if folder else None

    @staticmethod
    def prefix(key: tuple) -> str:
        """A C identifier naming the module's functions inside its object file."""
        return "cute_ep_" + re.sub(r"[^0-9A-Za-z]+", "_", "_".join(map(str, key))).strip("_")

    def path(self, key: tuple) -> Path:
        return self.folder / f"{self.prefix(key)}-{self.fingerprint[:16]}.o"

    def load(self, key: tuple) -> Any | None:
        """The cached compiled function of ``key``, or None (absent, or unreadable: then logged)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(path))
            compiled = module[self.prefix(key)]
        except Exception as exc:  # a damaged file is recompiled and overwritten
            log.warning("compile cache: cannot load %s (%s); compiling instead", path, exc)
            return None
        compiled._cute_ep_module = module  # the loaded engine lives as long as the function
        return compiled

    def store(self, key: tuple, compiled: Any) -> Path:
        """Write ``compiled`` for ``key`` (atomically: concurrent ranks may store the same file)."""
        path = self.path(key)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(compiled.dump_to_object(self.prefix(key)))
        os.replace(tmp, path)
        return path


class ModuleRegistry:
    """Compile cache keyed by explicit tuples; registers each module with NVSHMEM on a GPU host.

    ``register=False`` (CPU mode, or kernels without NVSHMEM calls) only caches. ``disk``: an
    ``ObjectCache`` to load compiled modules from and store them in (default: $CUTE_EP_COMPILE_CACHE,
    else none).
    """

    def __init__(
        self, *, register: bool = True, max_alive: int = DEFAULT_MAX_ALIVE, device_id: int | None = None,
        disk: ObjectCache | None = None,
    ) -> None:
        if max_alive < 1:
            raise ValueError(f"max_alive must be >= 1, got {max_alive}")
        self.register = register
        self.max_alive = max_alive
        self.device_id = device_id
        self.disk = disk if disk is not None else ObjectCache.from_env()
        self._entries: OrderedDict[Hashable, tuple[Any, Any]] = OrderedDict()
        self.compiles = 0
        self.loads = 0

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
        compiled = self.disk.load(key) if self.disk is not None else None
        if compiled is not None:
            self.loads += 1
        else:
            fn, args = build()
            compiled = compile_kernel(fn, *args)
            self.compiles += 1
            if self.disk is not None:
                log.info("compile cache: stored %s", self.disk.store(key, compiled))
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
