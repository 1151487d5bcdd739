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

A call replayed so is remembered under its call key (``ll_graphs.dispatch_call_key`` /
``combine_call_key``: the tensors' addresses, shapes, strides and dtypes and the plain arguments, read
once), and a later call with the same key is recalled: its graph replayed with no signature, no checks'
memo and no graph key built (the call key holds all they hold). On a 2-core CPU with the launches stubbed
(the CPU tests' stand-ins, 2026-11-29) a dispatch + combine pair's host work went from 25.5-28.8 us to
13.8-18.3.
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
    ``_ll_replay_handles`` (per parity, the latest replayed dispatch's handle), ``BufferPool._built`` /
    ``_kept_buffer`` and ``LowLatencyMode._staging``."""

    def _ll_dispatch_recalled(self, call_key: tuple | None, topk_idx: Tensor, m: int,
                              num_experts: int) -> tuple | None:
        """``low_latency_dispatch``'s result where a call of key ``call_key`` was replayed before and its
        graph is kept (``LowLatencyGraphs.recall``): replayed again and noted; else None."""
        got = None if call_key is None else self._ll_graphs.recall(call_key)
        if got is None:
            return None
        key, plan, (pool_key, hidden) = got
        buf = self._kept_buffer(pool_key)
        if buf is not plan.buf:
            return None
        return self._ll_dispatch_noted(buf, self._ll_graphs.replay_plan(key, plan), m, hidden, num_experts,
                                       topk_idx)

    def _ll_dispatch_replayed(self, sig: tuple | None, call_key: tuple | None, x: Tensor, topk_idx: Tensor,
                              stats: Tensor | None, m: int, num_experts: int) -> tuple | None:
        """``low_latency_dispatch``'s result where its direct graph (signature ``sig``, this parity, x,
        topk_idx and ``stats`` where they are) is captured: replayed, noted as the full path notes it (the
        buffer's latest dispatch, parity flipped, earlier combines ordered) and remembered under
        ``call_key``; else None."""
        if sig is None or not x.is_contiguous() or not x.shape[0]:
            return None
        hidden = x.shape[1]
        pool_key, buf = self._built(hidden, x.dtype, num_experts, topk_idx.shape[1], m, low_latency=True)
        if buf is None:  # building one is collective: the full path
            return None
        key = direct_key(sig, self._ll_index, x, topk_idx, stats)
        ran, result = self._ll_graphs.replay(key, buf)
        if not ran:
            return None
        if call_key is not None:
            self._ll_graphs.remember(call_key, key, (pool_key, hidden))
        return self._ll_dispatch_noted(buf, result, m, hidden, num_experts, topk_idx)

    def _ll_dispatch_noted(self, buf: object, result: tuple, m: int, hidden: int, num_experts: int,
                           topk_idx: Tensor) -> tuple:
        """A replayed dispatch noted as its full path notes it; its return value."""
        recv, padded, sent = result
        parity = self._ll_index
        self._ll_index ^= 1
        buf.replayed_dispatch(sent)
        self._combined.clear()  # a dispatch orders every rank's earlier combines before later writes
        # the handle of this parity's previous replay where it is the same one (same dispatch, same ids
        # tensor unchanged since): a handle holds only these, and making one is most of a replay's notes
        handle = self._ll_replay_handles[parity]
        route = None if handle is None else handle.cute_ep
        if route is None or route.dispatch_handle is not sent or not route.gives(topk_idx):
            handle = low_latency_handle(padded, sent, m, hidden, num_experts, topk_idx)
            self._ll_replay_handles[parity] = handle
        return recv, padded.count, handle, EventOverlap(None, None), None

    def _ll_combine_recalled(self, call_key: tuple | None, topk_idx: Tensor,
                             route: _LowLatencyRoute) -> tuple | None:
        """``low_latency_combine``'s result (without ``out`` or ``zero_copy``) where a call of key
        ``call_key`` was replayed before, its graph is kept, the ids are the dispatch's unchanged, no fence
        is due and the new output lands where that call's did: replayed again and noted; else None."""
        if not route.gives(topk_idx):
            return None
        got = None if call_key is None else self._ll_graphs.recall(call_key)
        if got is None:
            return None
        key, plan, (pool_key, sent, shape, dtype, out_at) = got
        if sent is not route.dispatch_handle or pool_key in self._combined:
            return None
        buf = self._kept_buffer(pool_key)
        if buf is not plan.buf:
            return None
        combined = torch.empty(shape, dtype=dtype, device=self.device)
        if combined.data_ptr() != out_at:
            return None
        self._ll_graphs.replay_plan(key, plan)
        return self._ll_combine_noted(buf, pool_key, combined)

    def _ll_combine_replayed(self, sig: tuple | None, call_key: tuple | None, x: Tensor, topk_idx: Tensor,
                             topk_weights: Tensor, route: _LowLatencyRoute, zero_copy: bool) -> tuple | None:
        """``low_latency_combine``'s result (without ``out``) where its graph (signature ``sig`` and the
        addresses it reads and writes, a new output's among them) is captured: replayed, noted as the full
        path notes it and remembered under ``call_key`` (None with ``zero_copy``); else None. Only on the
        dispatch's ids unchanged, and where no fence is due."""
        if sig is None or not route.gives(topk_idx):
            return None
        sent = route.dispatch_handle
        src = self._staging(route)[self._ll_index] if zero_copy else x
        if not src.is_contiguous() or not topk_weights.is_contiguous():
            return None
        pool_key, buf = self._built(route.hidden, src.dtype, route.num_experts, sent.topk_idx.shape[1],
                                    route.max_tokens, low_latency=True)
        if buf is None or pool_key in self._combined:  # not built, or a fence first: the full path
            return None
        shape = (route.num_tokens, route.hidden)
        combined = torch.empty(shape, dtype=src.dtype, device=self.device)
        key = combine_key(sig, src, route.slot, sent.topk_idx, topk_weights, sent.scatter, combined)
        if not self._ll_graphs.replay(key, buf)[0]:
            return None
        if call_key is not None:  # none with zero_copy (its input is the staging buffer)
            self._ll_graphs.remember(call_key, key, (pool_key, sent, shape, src.dtype, combined.data_ptr()))
        return self._ll_combine_noted(buf, pool_key, combined)

    def _ll_combine_noted(self, buf: object, pool_key: tuple, combined: Tensor) -> tuple:
        """A replayed combine noted as its full path notes it; its return value."""
        self._ll_index ^= 1
        buf.replayed_combine()
        self._combined.add(pool_key)
        return combined, EventOverlap(None, None), None
