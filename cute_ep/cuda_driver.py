"""The few CUDA driver calls the host path makes itself, through ctypes on ``libcuda``.

Why not torch or cuda-python for these: on the lent H200's host the status read through torch (a
``Tensor.copy_`` into pinned memory and a ``synchronize``) cost ~15 us more host time than these two
driver calls, and cuda-python's wrappers convert every argument anew (~9 us for a ``cudaMemcpyAsync``).
Streams are torch's (the driver's ``CUstream``
is the runtime's ``cudaStream_t``); the current context is the one torch made current. Importing this
module loads nothing; ``driver()`` returns None where there is no driver library (CPU-only machines),
and callers then take torch's path.
"""

from __future__ import annotations

import ctypes
import functools

CUDA_ERROR_NOT_READY = 600  # cuStreamQuery: work is still pending


class CudaDriverError(RuntimeError):
    """A driver call returned an error (the message names the call and the CUresult)."""


class Driver:
    """Typed entry points of ``libcuda``: a device-to-host copy on a stream, a stream sync and query, and
    the device address of pinned host memory."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        u64, size, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        self._lib = lib
        self._dtoh = self._entry("cuMemcpyDtoHAsync_v2", ptr, u64, size, ptr)
        self._sync = self._entry("cuStreamSynchronize", ptr)
        self._query = self._entry("cuStreamQuery", ptr)
        self._host_dptr = self._entry("cuMemHostGetDevicePointer_v2", ctypes.POINTER(u64), ptr, ctypes.c_uint)
        self._name = self._entry("cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))

    def _entry(self, name: str, *argtypes):
        fn = getattr(self._lib, name)
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        return fn

    def _check(self, what: str, code: int) -> None:
        if code:
            text = ctypes.c_char_p()
            self._name(code, ctypes.byref(text))
            name = text.value.decode() if text.value else "unknown"
            raise CudaDriverError(f"{what} failed: {name} ({code})")

    def copy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue a copy of ``nbytes`` from device address ``src`` to (pinned) host address ``dst``."""
        self._check("cuMemcpyDtoHAsync", self._dtoh(dst, src, nbytes, stream))

    def synchronize(self, stream: int) -> None:
        """Wait until everything enqueued on ``stream`` has run."""
        self._check("cuStreamSynchronize", self._sync(stream))

    def finished(self, stream: int) -> bool:
        """Whether everything enqueued on ``stream`` has run (an error of an earlier launch raises)."""
        code = self._query(stream)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check("cuStreamQuery", code)
        return True

    def device_pointer(self, host: int) -> int | None:
        """The device address of pinned host memory at ``host`` (None: not mapped for the device)."""
        out = ctypes.c_uint64()
        if self._host_dptr(ctypes.byref(out), host, 0):
            return None
        return out.value


@functools.cache
def driver() -> Driver | None:
    """The process's ``Driver``, or None where ``libcuda`` cannot be loaded."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
