"""The host path's own driver calls (cute_ep.bootstrap.cuda_driver), on the CPU: arguments pass through
unchanged and an error names the call and the CUresult."""

from __future__ import annotations

import ctypes

import pytest

from cute_ep.bootstrap.cuda_driver import CudaDriverError, Driver


class _FakeLib:
    """Stands in for libcuda: records each call; ``fail`` makes every call return that CUresult."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple] = []

        def entry(name: str):
            def fn(*args):
                self.calls.append((name, *args))
                return fail

            return fn

        for name in ("cuMemcpyDtoHAsync_v2", "cuStreamSynchronize", "cuStreamQuery"):
            setattr(self, name, entry(name))

        def host_pointer(out, host, flags):
            self.calls.append(("cuMemHostGetDevicePointer_v2", host, flags))
            out._obj.value = host + 7  # as if mapped elsewhere
            return fail

        self.cuMemHostGetDevicePointer_v2 = host_pointer

        def error_name(code, out):
            out._obj.value = b"CUDA_ERROR_ILLEGAL_ADDRESS" if code == 700 else None
            return 0

        self.cuGetErrorName = error_name

        def attribute(out, attribute, ordinal):
            self.calls.append(("cuDeviceGetAttribute", attribute, ordinal))
            out._obj.value = {133: 1, 16: 132}.get(attribute, 0)  # MPS enabled, 132 SMs
            return fail

        self.cuDeviceGetAttribute = attribute

        def affinity(out, kind):
            self.calls.append(("cuCtxGetExecAffinity", kind))
            out._obj.sm_count = 66  # as under an MPS limit of half the GPU
            return fail

        self.cuCtxGetExecAffinity = affinity


def test_driver_calls_pass_their_arguments_through():
    lib = _FakeLib()
    drv = Driver(lib)
    drv.copy_to_host(0x1000, 0x2000, 64, 7)
    drv.synchronize(9)
    assert lib.calls == [("cuMemcpyDtoHAsync_v2", 0x1000, 0x2000, 64, 7), ("cuStreamSynchronize", 9)]
    assert lib.cuMemcpyDtoHAsync_v2.restype is ctypes.c_int  # typed: 64-bit addresses are not truncated
    assert lib.cuMemcpyDtoHAsync_v2.argtypes[1] is ctypes.c_uint64 and lib.cuStreamSynchronize.argtypes


def test_driver_errors_name_the_call_and_the_result():
    drv = Driver(_FakeLib(fail=700))
    with pytest.raises(CudaDriverError, match=r"cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        drv.synchronize(1)
    drv = Driver(_FakeLib(fail=999))
    with pytest.raises(CudaDriverError, match=r"cuMemcpyDtoHAsync failed: unknown \(999\)"):
        drv.copy_to_host(1, 2, 3, 4)


def test_stream_query_and_host_pointer():
    lib = _FakeLib()
    drv = Driver(lib)
    assert drv.finished(3) is True and drv.device_pointer(0x5000) == 0x5007
    assert Driver(_FakeLib(fail=600)).finished(3) is False  # CUDA_ERROR_NOT_READY: still running
    assert Driver(_FakeLib(fail=1)).device_pointer(0x5000) is None  # not mapped for the device
    with pytest.raises(CudaDriverError, match=r"cuStreamQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        Driver(_FakeLib(fail=700)).finished(3)  # an earlier launch failed


def test_mps_attribute_and_the_context_sm_limit():
    lib = _FakeLib()
    drv = Driver(lib)
    assert drv.mps_enabled(3) is True and drv.device_attribute(16, 3) == 132
    assert drv.context_sm_count() == 66
    assert lib.calls == [("cuDeviceGetAttribute", 133, 3), ("cuDeviceGetAttribute", 16, 3),
                         ("cuCtxGetExecAffinity", 0)]
    failing = Driver(_FakeLib(fail=700))
    assert failing.context_sm_count() is None  # unknown: the caller falls back to the device attribute
    with pytest.raises(CudaDriverError, match="cuDeviceGetAttribute failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        failing.mps_enabled(0)
