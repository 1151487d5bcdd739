"""The low-latency layout's launches (``LowLatencyLaunches``, part of ``cute_ep.buffer.EpBuffer``), on buffers
built with ``EpConfig.low_latency``: DeepEP's per-expert padded layout dispatched and combined in one launch
of the module each, or each in two halves (``phase``, DeepEP's ``return_recv_hook``: the sending half now,
the receiving half when the caller asks for the data). ``cute_ep.deep_ep``'s low-latency mode makes these
calls; the protocol is in kernels/low_latency_dispatch.py and kernels/low_latency_combine.py.
"""

from __future__ import annotations

from typing import Any

import torch

from cute_ep.api import DispatchHandle
from cute_ep.input_checks import check_combine_out
from cute_ep.kernels.config import OP_COMBINE, OP_DISPATCH, PHASE_ALL, PHASE_RECEIVE
from cute_ep.kernels.variants import variant
from cute_ep.launcher import storage_addresses

__all__ = ["LowLatencyLaunches"]


class LowLatencyLaunches:
    """Launches of an ``EpBuffer`` (its ``_launch``, ``cfg``, ``device``) in the low-latency layout. Neither
    checks its tensors beyond what is said, nor syncs the host: both can be captured in CUDA graphs."""

    _launch: Any
    _note_launched_dispatch: Any
    cfg: Any
    device: torch.device

    def launch_low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                    own: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                    padded: dict[str, torch.Tensor], fp8: int = 0,
                                    phase: int = PHASE_ALL) -> DispatchHandle:
        """Enqueue the low-latency dispatch (or one half of it, ``phase``: kernels/config.py PHASE_*) on the
        current stream.

        x [T, H] cfg.dtype, contiguous (T <= cfg.max_tokens); topk_idx [T, K] int32 (ids outside [-1, E) are
        skipped and recorded in ``input_fault``); topk_weights [T, K] fp32 (copied into own[2] only);
        own (slots, ids, weights): [T, K] int32 / int32 / fp32, contiguous, the caller's to keep: the
        kernel writes each pair's place on its expert's rank into the first and copies the routing into the
        others. padded: the tensors the padded layout is written into, by their ``kernels.buffers`` names:
        ll_x [El * R * M, W] (W: H of cfg.dtype, or with ``fp8`` a packed FP8 row of
        ``packed_fp8_row_bytes(H)`` bytes), ll_src_info [El * R * M] int32, ll_count [El] int32, ll_range
        [El, R] int64, ll_stats [El] int32 (the counts are added to it; ll_count itself: none) and y_slot
        [El * R * M] int64 (each filled slot's pair, which the combine reads). fp8: 0, or the scale rule
        (``FP8_SCALE_*``) the kernel quantizes by. Returns the handle its combine takes (the receiving half
        returns the same handle and notes nothing)."""
        t = x.shape[0]
        self._launch(OP_DISPATCH, t, x=x, idx=topk_idx, w=topk_weights,
                     own=storage_addresses(own) if t else None, named=padded, fp8=fp8, phase=phase,
                     **variant("low-latency").scalars)
        handle = DispatchHandle(own[1], own[2], own[0], t, "scatter", "low-latency")
        if phase != PHASE_RECEIVE:
            self._note_launched_dispatch(handle)
        return handle

    def launch_low_latency_combine(self, handle: DispatchHandle, out: torch.Tensor, y: torch.Tensor,
                                   pairs: torch.Tensor, count: torch.Tensor, phase: int = PHASE_ALL) -> None:
        """Enqueue the low-latency combine (or one half of it, ``phase``) on the current stream: out[t] = the
        sum over k ascending of handle.topk_weights[t, k] times the row of y holding pair (t, k), for the
        pairs whose id in handle.topk_idx is not -1. out [T, H] cfg.dtype, contiguous (checked); y the
        padded rows [El * R * M, H] cfg.dtype, contiguous; pairs and count: the dispatch's ``y_slot`` and
        ``ll_count`` (``launch_low_latency_dispatch``)."""
        check_combine_out(self.cfg, self.device, out, handle.num_tokens)
        self._launch(OP_COMBINE, handle.num_tokens, idx=handle.topk_idx, w=handle.topk_weights, out=out,
                     scatter=handle.scatter, y=y, y_slot=pairs, named={"ll_count": count}, phase=phase,
                     **variant("low-latency").scalars)
