"""Events and the tuning ``Config`` of ``cute_ep.deep_ep``: DeepEP v1.2.1's ``EventHandle``, ``EventOverlap``
and ``Config`` (and its buffer size hints), with the same names, arguments and results; and
``plain_torch_defaults``, under which the Buffer's calls run.

On a GPU an ``EventHandle`` is a ``torch.cuda.Event`` recorded on a stream; on a CPU (the reference
backend) there are no streams, so an event is complete when it is made and waiting for it returns at
once. Importing this module imports no GPU library.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "NUM_BUFFER_ALIGNMENT_BYTES",
    "NUM_MAX_NVL_PEERS",
    "Config",
    "EventHandle",
    "EventOverlap",
    "get_low_latency_rdma_size_hint",
    "plain_torch_defaults",
]

NUM_MAX_NVL_PEERS = 8
"""Ranks DeepEP v1.2.1 reaches over NVLink in its normal mode (more ranks: its internode kernels)."""
NUM_BUFFER_ALIGNMENT_BYTES = 128
"""DeepEP's buffer alignment: its size hints are multiples of it."""
_MAX_TOPK_HINT = 128  # DeepEP's size hints assume at most 128 top-k entries and 128 scales per token
_MAX_SCALES_HINT = 128
_SOURCE_META_BYTES = 8  # DeepEP's internode source record: two int32
_INT4 = 16


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


class EventHandle:
    """A point on a stream that another stream can wait for (DeepEP's ``deep_ep_cpp.EventHandle``).

    ``EventHandle()`` records a ``torch.cuda.Event`` on the current CUDA stream, or on ``stream`` when
    given. Without CUDA (the reference backend on a CPU) nothing is recorded: the work before it is
    already done when the call returns, and ``current_stream_wait`` returns at once.
    """

    def __init__(self, stream: Any = None) -> None:
        self.event: Any = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    @classmethod
    def completed(cls) -> EventHandle:
        """An event with nothing to wait for (the CPU backends' calls finish before they return)."""
        handle = cls.__new__(cls)
        handle.event = None
        return handle

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for this event (nothing to do without CUDA)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An event to overlap communication with computation (DeepEP's ``deep_ep.EventOverlap``).

    event: the ``EventHandle`` (None when the call finished on the caller's stream: ``async_finish``
    was not set). extra_tensors: tensors kept alive until the event is waited for (DeepEP keeps the
    low-latency calls' tensors here; a CUDA graph cannot use ``record_stream``).

    ``with event_overlap: ...`` runs the body, then makes the current stream wait for the event.
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event (it must exist: the call was made with
        ``async_finish=True``, or the event came from ``Buffer.capture()``)."""
        if self.event is None:
            raise ValueError("this EventOverlap holds no event: the call was not made with async_finish=True")
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Config:
    """DeepEP's performance tuning config (``deep_ep.Config``): SMs and chunk sizes of its normal-mode
    kernels, with the same arguments, defaults and checks.

    In ``cute_ep.deep_ep`` only ``num_sms`` matters, and only for the handle: ``num_sms // 2`` is the
    number of channels of the handle's channel prefix matrices (as in DeepEP). The kernels' own SM budget
    is ``Buffer.num_sms`` when a shape's buffers are first built; the chunk sizes tune DeepEP's ring
    buffers, which these kernels do not have (they receive every row straight into place).

    Raises:
        ValueError: ``num_sms < 0``, a chunk size <= 0, or a send chunk not smaller than its receive
            chunk (DeepEP's assertions).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        if num_sms < 0:
            raise ValueError(f"Config: num_sms must be >= 0, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config: need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, got "
                f"{num_max_nvl_chunked_send_tokens} and {num_max_nvl_chunked_recv_tokens}"
            )
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ValueError(
                "Config: num_max_rdma_chunked_send_tokens and num_max_rdma_chunked_recv_tokens must be > 0, "
                f"got {num_max_rdma_chunked_send_tokens} and {num_max_rdma_chunked_recv_tokens}"
            )
        # The receive chunk is rounded up to a multiple of the send chunk, as DeepEP does.
        recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if not num_max_rdma_chunked_send_tokens <= recv // 2:
            raise ValueError(
                "Config: num_max_rdma_chunked_send_tokens must be at most half of "
                f"num_max_rdma_chunked_recv_tokens (rounded up to a multiple of it), got "
                f"{num_max_rdma_chunked_send_tokens} and {recv}"
            )
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = recv

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """The NVLink buffer bytes DeepEP v1.2.1 would allocate for rows of ``hidden_bytes`` among
        ``num_ranks`` ranks (its ring buffers: channels x ranks x chunk rows). ``cute_ep.deep_ep`` receives
        every row straight into place, so its own need grows with the tokens instead:
        ``Buffer.get_symmetric_bytes_hint``.

        Raises:
            ValueError: ``num_ranks`` above 8 and not a multiple of 8, or above 8 with an odd num_sms.
        """
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise ValueError(
                f"num_ranks must be below {NUM_MAX_NVL_PEERS} or a multiple of it, got {num_ranks}"
            )
        if num_ranks > NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ValueError(f"num_sms must be even above {NUM_MAX_NVL_PEERS} ranks, got {self.num_sms}")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks  # channels x peers
        rows = slots * self.num_max_nvl_chunked_recv_tokens
        total = slots * (2 * rdma_ranks + 3) * 4
        total += rows * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK_HINT * (8 + 4) + _MAX_SCALES_HINT * 4)
        return _align(total, NUM_BUFFER_ALIGNMENT_BYTES)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """The RDMA buffer bytes DeepEP v1.2.1's internode kernels would allocate (0 up to 8 ranks, one
        node). ``cute_ep.deep_ep`` has no internode normal mode (see ``Buffer``).

        Raises:
            ValueError: above 8 ranks, ``num_ranks`` not a multiple of 8 or an odd num_sms.
        """
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS or self.num_sms % 2:
            raise ValueError(f"num_ranks must be a multiple of {NUM_MAX_NVL_PEERS} and num_sms even, got "
                             f"{num_ranks} and {self.num_sms}")
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        slots = (self.num_sms // 2) * rdma_ranks
        rows = slots * self.num_max_rdma_chunked_recv_tokens
        total = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        per_row = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK_HINT * (8 + 4) + _MAX_SCALES_HINT * 4 + _INT4
        total += rows * per_row * 2
        return _align(total, NUM_BUFFER_ALIGNMENT_BYTES)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """The RDMA buffer bytes DeepEP v1.2.1's low-latency mode needs (two sets of send, receive and
    signal buffers sized for bf16 rows), rounded up past the next 128 bytes as DeepEP rounds it.
    ``num_ranks`` does not enter DeepEP's formula."""
    del num_ranks
    m, scales = num_max_dispatch_tokens_per_rank, hidden // 128
    dispatch_msg = _INT4 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2  # per-128-column bf16 min/max pair, then the bf16 row
    send = max(m * dispatch_msg, num_experts * m * combine_msg)
    recv = max(num_experts * m * dispatch_msg, num_experts * m * combine_msg)
    signal = _align(num_experts * 4, 128)
    total = 2 * (send + recv + signal)
    return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES


class plain_torch_defaults:
    """torch's own defaults (fp32, CPU) inside a call (``with plain_torch_defaults():``): callers may set
    others (DeepEP's tests set bf16 and CUDA with ``torch.set_default_dtype`` / ``set_default_device``), and
    the backends' host-side tensors must not follow them.

    A default device is a torch-function mode; inside, torch functions skip every such mode (torch's
    ``DisableTorchFunction``, a C-level switch) instead of the mode being popped and pushed again. Why:
    ``torch.get_default_device`` and ``set_default_device`` cost 10-30 us of host time each, and every
    call of this Buffer entered this twice. A class rather than a generator: entering and leaving a
    ``contextlib`` generator took 8.4 us of host time against 2-3 here (2-core CPU, 2026-11-28)."""

    __slots__ = ("_dtype", "_modes_off", "_device")

    def __enter__(self) -> None:
        self._dtype = torch.get_default_dtype()
        self._modes_off = self._device = None
        modes = _function_modes()
        if modes and _DISABLE_FUNCTION_MODES is None:  # a torch without the switch: the public path
            self._device = (torch.get_default_device(),)
            torch.set_default_device(None)
        if self._dtype != torch.float32:
            torch.set_default_dtype(torch.float32)
        if modes and _DISABLE_FUNCTION_MODES is not None:
            self._modes_off = _DISABLE_FUNCTION_MODES()
            self._modes_off.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._modes_off is not None:
                self._modes_off.__exit__(*exc)
        finally:
            if self._dtype != torch.float32:
                torch.set_default_dtype(self._dtype)
            if self._device is not None:
                torch.set_default_device(self._device[0])


_DISABLE_FUNCTION_MODES = getattr(torch._C, "DisableTorchFunction", None)


def function_modes_off() -> contextlib.AbstractContextManager:
    """A context in which torch functions and tensor attributes skip every torch-function mode (torch's
    C-level switch; a no-op context where torch lacks it): under a default device (a mode) each read of
    a tensor's shape or strides otherwise passes through Python, about 1 us each (cProfile, H200 host,
    2026-11-28). Unlike ``plain_torch_defaults`` it leaves the default dtype as it is."""
    return _DISABLE_FUNCTION_MODES() if _DISABLE_FUNCTION_MODES is not None else contextlib.nullcontext()


def _function_modes() -> int:
    """How many torch-function modes are active (a default device is one); -1 where torch cannot say
    cheaply (then the modes are treated as present)."""
    count = getattr(torch._C, "_len_torch_function_stack", None)
    return count() if count is not None else -1


def without_function_modes(call: Callable) -> Callable:
    """``call`` run inside ``function_modes_off()``: a Buffer call's argument checks read a dozen tensor
    attributes before its stream scope turns the modes off, and under a default device each read passed
    through Python (8 reads: 10.9 us against 1.2 on a 2-core CPU, 2026-11-29). The calls make every tensor
    with an explicit device and dtype, as inside their scope (``plain_torch_defaults``)."""

    @functools.wraps(call)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with function_modes_off():
            return call(*args, **kwargs)

    return wrapped
