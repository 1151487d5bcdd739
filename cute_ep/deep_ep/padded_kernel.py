"""The low-latency dispatch's padded receive layout on a GPU in one launch: the compiled
``PaddedLayoutKernel`` (kernels/padded_layout.py) and its call. On the slots it fills its results equal
``cute_ep.deep_ep.low_latency.padded_layout``'s, the torch form the CPU backends use (and the GPU where the
kernel's bounds do not hold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cute_ep.deep_ep.low_latency import PaddedOut, PaddedRecv, PaddedScratch
from cute_ep.launcher import CompiledApart, current_stream_handle, one_per_process

__all__ = ["PaddedLayoutLaunch", "shared_padded_layout"]


class PaddedLayoutLaunch(CompiledApart):
    """The padded-layout launch, its compiled function made on first use (``registry``: see
    ``cute_ep.launcher.CompiledApart``)."""

    def __init__(self, registry: Any = None) -> None:
        super().__init__(registry)
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
        """The compiled launch behind a ``cute_ep.launcher.PreparedCall`` (made once)."""
        return self._prepared(None, _spec)

    def __call__(self, recv_rows: Tensor, recv_src: Tensor, tokens_per_expert: Tensor, num_ranks: int,
                 max_tokens: int, topk: int, scratch: PaddedScratch, into: PaddedOut,
                 stats: Tensor | None = None) -> PaddedRecv:
        """``padded_layout``'s results for an expert-major dispatch (``fits``), written into ``into`` and
        enqueued on the current stream, no host sync. stats: [El] int32 to add the counts to
        (``cumulative_local_expert_recv_stats``)."""
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


def _spec() -> tuple:
    """The padded layout's (compile key, build, argument stand-ins, their kinds)."""
    from cute_ep.kernels import padded_layout as k

    return k.COMPILE_KEY, k.build, k.example_args(), k.ARG_KINDS


shared_padded_layout = one_per_process(PaddedLayoutLaunch)
"""The process's ``PaddedLayoutLaunch`` (its compiled function serves every Buffer)."""
