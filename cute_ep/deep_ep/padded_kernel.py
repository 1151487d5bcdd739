"""The low-latency dispatch's padded receive layout on a GPU in one launch: the compiled
``PaddedLayoutKernel`` (kernels/padded_layout.py) and its call. On the slots it fills its results equal
``cute_ep.deep_ep.low_latency.padded_layout``'s, the torch form the CPU backends use (and the GPU where the
kernel's bounds do not hold).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from cute_ep.deep_ep.low_latency import PaddedOut, PaddedRecv, PaddedScratch

__all__ = ["PaddedLayoutLaunch", "shared_padded_layout"]


class PaddedLayoutLaunch:
    """The padded-layout launch, its compiled function made on first use (``registry``: a
    ``cute_ep.bootstrap.compile.ModuleRegistry`` that registers nothing with NVSHMEM; default: a new one,
    which honours ``CUTE_EP_COMPILE_CACHE``)."""

    def __init__(self, registry: Any = None) -> None:
        if registry is None:
            from cute_ep.bootstrap.compile import ModuleRegistry

            registry = ModuleRegistry(register=False, max_alive=2)
        self.registry = registry
        self._lock = threading.Lock()
        self._call: Any = None
        self._sms: dict[int, int] = {}

    @staticmethod
    def fits(recv_rows: Tensor, experts: int, capacity: int) -> bool:
        """Whether the kernel takes this layout: CUDA rows a multiple of 16 bytes, contiguous and aligned,
        El within its shared-memory bound, and sizes that index in int32."""
        from cute_ep.kernels.padded_layout import MAX_LOCAL_EXPERTS

        row_bytes = recv_rows.shape[1] * recv_rows.element_size()
        return (recv_rows.is_cuda and recv_rows.is_contiguous() and row_bytes % 16 == 0
                and recv_rows.data_ptr() % 16 == 0 and experts <= MAX_LOCAL_EXPERTS and capacity < 2**31)

    def prepared(self) -> Any:
        """The compiled launch behind a ``cute_ep.launcher.PreparedCall`` (made once): why: the DSL's own
        call converts its 18 arguments anew each time."""
        with self._lock:
            if self._call is None:
                from cute_ep.kernels import padded_layout as k
                from cute_ep.launcher import PreparedCall

                fn = self.registry.get(k.COMPILE_KEY, k.build)
                self._call = PreparedCall(fn, k.example_args(), k.ARG_KINDS)
            return self._call

    def __call__(self, recv_rows: Tensor, recv_src: Tensor, tokens_per_expert: Tensor, num_ranks: int,
                 max_tokens: int, topk: int, scratch: PaddedScratch, into: PaddedOut,
                 stats: Tensor | None = None) -> PaddedRecv:
        """``padded_layout``'s results for an expert-major dispatch (``fits``), written into ``into`` and
        enqueued on the current stream, no host sync. stats: [El] int32 to add the counts to
        (``cumulative_local_expert_recv_stats``)."""
        from cute_ep.launcher import current_stream_handle

        cap, el, slots = recv_rows.shape[0], scratch.experts, scratch.slots
        dev = recv_rows.device
        call = self.prepared()
        stats_ptr = into.count.data_ptr() if stats is None else stats.data_ptr()
        with self._lock:  # the call's argument storage is shared
            call(recv_rows.data_ptr(), recv_src.data_ptr(), tokens_per_expert.data_ptr(),
                 into.rows.data_ptr(), into.src_info.data_ptr(), into.count.data_ptr(),
                 into.layout_range.data_ptr(), into.slot.data_ptr(), stats_ptr, cap, el, num_ranks,
                 max_tokens, topk, recv_rows.shape[1] * recv_rows.element_size(), int(stats is not None),
                 self._ctas(dev), current_stream_handle(dev.index))
        return into.received(el, slots)

    def _ctas(self, device: torch.device) -> int:
        """One CTA per SM: a warp per row, the rows of a low-latency call (at most R * M * K) spread over
        the GPU."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sms:
            self._sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sms[index]


_SHARED: PaddedLayoutLaunch | None = None
_SHARED_LOCK = threading.Lock()


def shared_padded_layout() -> PaddedLayoutLaunch:
    """The process's ``PaddedLayoutLaunch`` (its compiled function serves every Buffer)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = PaddedLayoutLaunch()
        return _SHARED
