"""The low-latency calls' replay path (``LowLatencyReplays``, a part of ``LowLatencyMode``): a call whose CUDA
graph is captured already (``ll_graphs``) replays it with none of the rest of its full path's host work.

A call repeated as DeepEP's tests and decode loops repeat it (the same argument signature, parity and
tensor addresses) is a graph replay plus the Buffer's notes of it, but its full path also checks the
signature against those seen, enters the call's stream and torch-defaults scope, looks its kept tensors up
and builds the graphs' keys: on a 2x H200 host (2026-11-29, ``torch.set_default_device("cuda")`` as
DeepEP's tests) a replayed dispatch took 43 us of host time and a combine 42, where the replay itself took
about 4. Here a call first looks for its captured graph under the key its full path would build (the same
functions: ``direct_key``, ``combine_key``) and, where it is there, replays it and returns what the full
path would return; else (a first or second sighting, moved tensors, ``async_finish``, ``return_recv_hook``,
``out``, ids the caller changed, graphs off or a capture under way) the full path runs. Nothing collective
happens here: a buffer not built yet, and a combine that must first fence, take the full path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cute_ep.deep_ep.handles import _LowLatencyRoute, low_latency_handle
from cute_ep.deep_ep.ll_graphs import combine_key, direct_key
from cute_ep.deep_ep.utils import EventOverlap

__all__ = ["LowLatencyReplays"]


class LowLatencyReplays:
    """The replay path of ``LowLatencyMode``'s calls (module docstring), run inside those calls (their
    ``without_function_modes``: a caller's default device sees none of the tensor reads here). Reads what
    the Buffer's other parts set: ``_ll_graphs``, ``_ll_index``, ``_combined``, ``device``,
    ``BufferPool._built`` and ``LowLatencyMode._staging``."""

    def _ll_dispatch_replayed(self, sig: tuple | None, x: Tensor, topk_idx: Tensor, stats: Tensor | None,
                              m: int, num_experts: int) -> tuple | None:
        """``low_latency_dispatch``'s result where its direct graph (signature ``sig``, this parity, x,
        topk_idx and ``stats`` where they are) is captured: replayed, noted as the full path notes it (the
        buffer's latest dispatch, parity flipped, earlier combines ordered); else None."""
        if sig is None or not x.is_contiguous() or not x.shape[0]:
            return None
        hidden = x.shape[1]
        _, buf = self._built(hidden, x.dtype, num_experts, topk_idx.shape[1], m, low_latency=True)
        if buf is None:  # building one is collective: the full path
            return None
        parity = self._ll_index
        ran, result = self._ll_graphs.replay(direct_key(sig, parity, x, topk_idx, stats), buf)
        if not ran:
            return None
        recv, padded, sent = result
        self._ll_index ^= 1
        buf.replayed_dispatch(sent)
        self._combined.clear()  # a dispatch orders every rank's earlier combines before later writes
        handle = low_latency_handle(padded, sent, m, hidden, num_experts, topk_idx)
        return recv, padded.count, handle, EventOverlap(None, None), None

    def _ll_combine_replayed(self, sig: tuple | None, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                             route: _LowLatencyRoute, zero_copy: bool) -> tuple | None:
        """``low_latency_combine``'s result (without ``out``) where its graph (signature ``sig`` and the
        addresses it reads and writes, a new output's among them) is captured: replayed, noted as the full
        path notes it; else None. Only on the dispatch's ids unchanged, and where no fence is due."""
        if sig is None or topk_idx is not route.given_ids or topk_idx._version != route.given_version:
            return None
        sent = route.dispatch_handle
        src = self._staging(route)[self._ll_index] if zero_copy else x
        if not src.is_contiguous() or not topk_weights.is_contiguous():
            return None
        key, buf = self._built(route.hidden, src.dtype, route.num_experts, sent.topk_idx.shape[1],
                               route.max_tokens, low_latency=True)
        if buf is None or key in self._combined:  # not built, or a fence first: the full path
            return None
        combined = torch.empty((route.num_tokens, route.hidden), dtype=src.dtype, device=self.device)
        gkey = combine_key(sig, src, route.slot, sent.topk_idx, topk_weights, sent.scatter, combined)
        if not self._ll_graphs.replay(gkey, buf)[0]:
            return None
        self._ll_index ^= 1
        buf.replayed_combine()
        self._combined.add(key)
        return combined, EventOverlap(None, None), None
