"""New output tensors made ahead of the calls that return them: ``SpareOutputs``; and the sets of the calls
that use it: ``handle_storage`` (``EpBuffer.dispatch``'s handle), the layout call's in
``cute_ep.deep_ep.token_layout``.

A call that hands the caller new tensors allocates them before its launch, on the path from the call to its
kernel (DeepEP's ``get_dispatch_layout``: three tensors, 10.2-10.5 us of host time per call on an H200 host,
2026-12-01). Here the sets of the next calls of the same shape on the same stream are made right after a
launch, while its kernel runs, and many at once: one allocation per output for up to ``SPARE_AHEAD`` calls,
split into each call's views by one ``unbind`` (2.3 us a set on that host). Each set is handed out once,
so the caller owns what it gets as it owned a fresh allocation; its tensors are views of blocks that other
calls' sets share (a tensor kept keeps its block: at most ``SPARE_MAX_BYTES`` of sets in all).

Views of one block share its version counter: an in-place torch op on one set's tensor counts as one on
every other's (autograd then refuses a backward through a saved one), and a view made inside a custom
``autograd.Function`` may not be changed in place. So only tensors that kernels write and torch ops only
read come from here: a combine's output is an activation, and is allocated by its call (each output made
ahead as an allocation of its own took more host time per call back to back, one H200 host, 2026-12-01).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["SPARE_AHEAD", "SPARE_MAX_BYTES", "SpareOutputs", "handle_storage"]

# Sets made ahead in one go, and the most bytes they may hold together: for larger outputs the allocation is
# a small part of the call, and a batch would hold that much memory between calls.
SPARE_AHEAD = 64
SPARE_MAX_BYTES = 16 << 20


class SpareOutputs:
    """New output sets made ahead for the next calls of a kind.

    make(key, n): ``n`` new sets for ``key`` (a list; each set a tuple of tensors). ``take(key)``: a set made
    ahead for ``key`` if one is left, else one made now; either way the caller's from then on.
    ``refill(key, nbytes)``, after the launch: once every set made ahead is handed out, makes the next
    calls' sets when the call before this one had the same ``key`` too (a run of calls of one shape, as
    decode steps are; a call of a new shape makes nothing ahead): ``SPARE_MAX_BYTES // nbytes`` of them, at
    most ``SPARE_AHEAD`` (none when one set is larger).

    ``key`` must hold everything the tensors depend on (shapes, dtypes, device) and the CUDA stream they
    are made on: the caching allocator orders the reuse of a block on the stream that allocated it, so a
    set is handed out only on that stream. During CUDA graph capture nothing is taken or made ahead (a
    graph's tensors come from its own memory pool, and replays write into them). capturing: the test for
    capture on the current stream (default torch's; a CPU-only build of torch has none, so pass one there).
    """

    __slots__ = ("_make", "_key", "_sets", "_last", "_capturing")

    def __init__(self, make: Callable[[Any, int], list], capturing: Callable[[], bool] | None = None) -> None:
        self._make = make
        self._key: Hashable = None
        self._sets: list = []
        self._last: Hashable = None
        self._capturing = torch.cuda.is_current_stream_capturing if capturing is None else capturing

    def take(self, key: Hashable) -> Any:
        if self._left_for(key) and not self._capturing():
            return self._sets.pop()
        return self._make(key, 1)[0]

    def refill(self, key: Hashable, nbytes: int) -> None:
        # Sized only when a batch is due: most calls of a run find sets left and do nothing more.
        if self._last == key and not self._left_for(key) and not self._capturing():
            ahead = min(SPARE_AHEAD, SPARE_MAX_BYTES // max(1, nbytes))
            if ahead > 0:
                self._key, self._sets = key, self._make(key, ahead)
        self._last = key

    def _left_for(self, key: Hashable) -> bool:
        """Sets made ahead for ``key`` are left to hand out."""
        return bool(self._sets) and self._key == key


def handle_storage(key: tuple, n: int) -> list[tuple]:
    """``n`` sets of a dispatch handle's own routing for key (T, K, device, stream): (slots [T, K] int32, ids
    [T, K] int32, weights [T, K] fp32, their three addresses), from one int32 and one fp32 allocation (the
    slots and ids planes interleaved per set), each set's tensors contiguous and apart from every other's.
    Views, so they share the blocks' version counters: the kernels write them, no torch op does."""
    t, k, dev, _ = key
    ints = torch.empty((n, 2, t, k), dtype=torch.int32, device=dev)
    floats = torch.empty((n, t, k), dtype=torch.float32, device=dev)
    planes, rows = ints.view(2 * n, t, k).unbind(0), floats.unbind(0)
    first, first_w, plane = ints.data_ptr(), floats.data_ptr(), 4 * t * k
    return [(planes[2 * i], planes[2 * i + 1], rows[i],
             (first + 2 * i * plane, first + (2 * i + 1) * plane, first_w + i * plane)) for i in range(n)]
