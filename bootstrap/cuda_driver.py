"""The few CUDA driver calls the host path makes itself, through ctypes on ``libcuda``.

Why not torch or cuda-python for these: on the H200 test host the status read through torch (a
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
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133  # contexts made on this device are shared through CUDA MPS
CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


class _ExecAffinity(ctypes.Structure):
    """CUexecAffinityParam with its one member in use: the SM count of a context."""

    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]


class CudaDriverError(RuntimeError):
    """A driver call returned an error (the message names the call and the CUresult)."""


class Driver:
    """Typed entry points of ``libcuda``: a device-to-host copy on a stream, a stream sync and query, the
    device address of pinned host memory, device attributes (MPS) and the current context's SM count."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        u64, size, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        self._lib = lib
        self._dtoh = self._entry("cuMemcpyDtoHAsync_v2", ptr, u64, size, ptr)
        self._sync = self._entry("cuStreamSynchronize", ptr)
        self._query = self._entry("cuStreamQuery", ptr)
        self._host_dptr = self._entry("cuMemHostGetDevicePointer_v2", ctypes.POINTER(u64), ptr, ctypes.c_uint)
        self._name = self._entry("cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._attribute = self._entry("cuDeviceGetAttribute", ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                      ctypes.c_int)
        self._affinity = self._entry("cuCtxGetExecAffinity", ctypes.POINTER(_ExecAffinity), ctypes.c_int)

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

    def device_attribute(self, attribute: int, ordinal: int) -> int:
        """``cuDeviceGetAttribute`` of device ``ordinal`` (the driver must be initialised: torch has
        made a context)."""
        out = ctypes.c_int()
        self._check("cuDeviceGetAttribute", self._attribute(ctypes.byref(out), attribute, ordinal))
        return out.value

    def mps_enabled(self, ordinal: int) -> bool:
        """Whether this process's contexts on device ``ordinal`` run through CUDA MPS."""
        return bool(self.device_attribute(CU_DEVICE_ATTRIBUTE_MPS_ENABLED, ordinal))

    def context_sm_count(self) -> int | None:
        """SMs the current context may use (under MPS: its active-thread limit), None if unknown."""
        out = _ExecAffinity()
        if self._affinity(ctypes.byref(out), CU_EXEC_AFFINITY_TYPE_SM_COUNT):
            return None
        return int(out.sm_count) or None

    def device_pointer(self, host: int) -> int | None:
        """The device address of pinned host memory at ``host`` (None: not mapped for the device)."""
        out = ctypes.c_uint64()
        if self._host_dptr(ctypes.byref(out), host, 0):
            return None
        return out.value


# Run in a child process without CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: under an MPS limit this process's own
# device attributes report its limit, not the GPU.
_SM_COUNT_CHILD = f"""
import ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
dev, count = ctypes.c_int(), ctypes.c_int()
ok = lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), int(sys.argv[1])) == 0
ok = ok and lib.cuDeviceGetAttribute(ctypes.byref(count), {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT},
                                     dev) == 0
print(count.value if ok else -1)
"""


def unlimited_sm_count(ordinal: int) -> int | None:
    """The SM count of device ``ordinal`` as a process without an MPS active-thread limit sees it (a child
    process asks the driver), or None if that fails."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    try:
        done = subprocess.run([sys.executable, "-c", _SM_COUNT_CHILD, str(ordinal)], env=env,
                              capture_output=True, text=True, timeout=60)
        count = int(done.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return count if count > 0 else None


@functools.cache
def driver() -> Driver | None:
    """The process's ``Driver``, or None where ``libcuda`` cannot be loaded."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
