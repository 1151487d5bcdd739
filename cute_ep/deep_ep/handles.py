"""DeepEP's two handles as ``cute_ep.deep_ep.Buffer`` returns them: the tuples of DeepEP's shapes and dtypes
that its callers index and pass back, each carrying (``.cute_ep``) the routing cute_ep's kernels need.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from cute_ep.api import DispatchHandle

__all__ = ["LowLatencyHandle", "NormalHandle", "low_latency_handle"]


@dataclass(frozen=True)
class _NormalRoute:
    """What cute_ep's side of a normal-mode handle holds: the rank-layout dispatch handle, the buffers'
    max_tokens, the rows DeepEP's dispatch returned (N, or num_worst_tokens), the [R, R] token counts
    (source, destination) on the device and, when a host sync read them, on the host."""

    dispatch_handle: DispatchHandle
    max_tokens: int
    num_recv: int
    counts: Tensor
    counts_host: list[list[int]] | None


@dataclass(frozen=True)
class _LowLatencyRoute:
    """cute_ep's side of a low-latency handle: the dispatch's handle, ``low_latency.PaddedRecv``'s slot
    (host backends: each expert-major row's padded slot; kernels: each filled padded slot's pair) and
    count, and the caller's topk_idx with its version counter at the dispatch (a combine given that same
    tensor, unchanged, reuses the dispatch's ids as they are)."""

    dispatch_handle: DispatchHandle
    slot: Tensor
    count: Tensor
    max_tokens: int
    hidden: int
    num_experts: int
    num_tokens: int
    given_ids: Tensor
    given_version: int

    def gives(self, topk_idx: Tensor) -> bool:
        """Whether ``topk_idx`` is the ids tensor the dispatch was given, unchanged since (same tensor, same
        version counter): then the dispatch's ids serve as they are."""
        return topk_idx is self.given_ids and topk_idx._version == self.given_version


class NormalHandle(tuple):
    """DeepEP's normal-mode handle, the 6-tuple ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`` with DeepEP's shapes and
    dtypes, plus ``.cute_ep``: the routing cute_ep's kernels need (pass the tuple itself to ``combine`` and
    cached ``dispatch``; a tuple rebuilt from the six entries is refused).

    * rank_prefix_matrix [R, R] int32: column r (this rank) holds at row i the tokens ranks 0..i send to it,
      as DeepEP's handle; the other columns 0 (DeepEP leaves them uninitialized; every rank's counts,
      [source, destination], are in ``.cute_ep.counts``);
    * channel_prefix_matrix [R, C] int32 (C = config.num_sms / 2 channels, DeepEP's split of a rank's tokens
      into C contiguous ranges): for each destination, the tokens of channels 0..c bound for it (exact);
    * recv_channel_prefix_matrix [R, C] int32: for each source, the rows received from its channels before
      c (exact);
    * recv_src_idx [N] int32: each received row's token index on its source rank (exact);
    * is_token_in_rank [T, R] bool: the caller's tensor (exact);
    * send_head [T, R] int32: for a token bound for rank r, the number of earlier tokens of its channel
      bound for r, -1 elsewhere (the values DeepEP's dispatch writes; DeepEP's combine later rewrites its
      -1 entries in place, this combine leaves the tensor unchanged).

    rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix and send_head are made when first
    read (each a few tensor operations on the current stream, kept afterwards): cute_ep's own calls never
    read them, and making them in every dispatch cost ~0.6 ms of host time at 4096 tokens on a 2x H200 host
    (2026-11-28). Read them after the dispatch's work, as its other outputs; channel_prefix_matrix and
    send_head come from ``is_token_in_rank``, so one read after that tensor was changed in place raises
    RuntimeError.
    """

    cute_ep: _NormalRoute

    def __new__(cls, entries: tuple, route: _NormalRoute,
                lazy: dict[int, Callable[[], Any]] | None = None) -> NormalHandle:
        """entries: the six; where ``lazy`` has a function for an index, the entry (None in ``entries``) is
        that function's result, made on first read."""
        obj = super().__new__(cls, entries)
        obj.cute_ep = route
        obj._lazy = dict(lazy or {})
        obj._made = {}
        return obj

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        i = operator.index(index)
        i = i + len(self) if i < 0 else i
        if i in self._made:
            return self._made[i]
        make = self._lazy.get(i)
        if make is None:
            return tuple.__getitem__(self, index)
        value = self._made[i] = make()
        return value

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"NormalHandle{tuple(self)!r}"

    def made(self) -> tuple:
        """The entries that exist now (the lazy ones only once read): what the Buffer's calls mark as used
        on their streams, without making the others."""
        return tuple(v for i in range(len(self)) if (v := self._made.get(i, tuple.__getitem__(self, i)))
                     is not None)


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle, the 5-tuple ``(packed_recv_src_info [El, R * M] int32,
    packed_recv_layout_range [El, R] int64, num_max_dispatch_tokens_per_rank, hidden, num_experts)``, plus
    ``.cute_ep``: the routing cute_ep's combine needs (pass the tuple itself)."""

    cute_ep: _LowLatencyRoute

    def __new__(cls, entries: tuple, route: _LowLatencyRoute) -> LowLatencyHandle:
        obj = super().__new__(cls, entries)
        obj.cute_ep = route
        return obj


def low_latency_handle(padded: Any, sent: DispatchHandle, max_tokens: int, hidden: int, num_experts: int,
                       topk_idx: Tensor) -> LowLatencyHandle:
    """A low-latency dispatch's handle: its padded layout ``padded`` (``low_latency.PaddedRecv``), the
    dispatch's own handle ``sent`` and the caller's ``topk_idx`` (its version counter noted now)."""
    route = _LowLatencyRoute(sent, padded.slot, padded.count, max_tokens, hidden, num_experts,
                             topk_idx.shape[0], topk_idx, topk_idx._version)
    return LowLatencyHandle((padded.src_info, padded.layout_range, max_tokens, hidden, num_experts), route)
