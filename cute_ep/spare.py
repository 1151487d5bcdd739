"""New output tensors made ahead of the call that returns them: ``SpareOutputs``.

A call that hands the caller new tensors allocates them before its launch, on the path from the call to its
kernel (DeepEP's ``get_dispatch_layout``: three tensors, 2-4 us of host time each on an H200 host,
2026-11-29). Made right after the launch instead, while the kernel runs, the next call of the same shape on
the same stream takes them ready. Each set is handed out once, so the caller owns what it gets as it owned
a fresh allocation. It moves host time, it does not remove it: it pays where the kernel outlasts the host
work after the launch (the layout of 4096 tokens runs about 10 us), not where that work is already longer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["SpareOutputs", "SPARE_MAX_BYTES"]

# Outputs larger than this are not made ahead: for them the allocation is a small part of the call, and a
# spare set would hold that much memory between calls.
SPARE_MAX_BYTES = 16 << 20


class SpareOutputs:
    """At most one set of new tensors, made ahead for the next call of a kind.

    make(key): a new set for ``key``. ``take(key)``: the set made ahead for ``key`` if there is one, else
    ``make(key)`` now; either way the caller's from then on. ``refill(key, nbytes)``, after the launch:
    makes the next call's set when the call before this one had the same ``key`` too (a run of calls of
    one shape, as decode steps are; a call of a new shape makes nothing ahead) and the set's ``nbytes``
    are at most ``SPARE_MAX_BYTES``.

    ``key`` must hold everything the tensors depend on (shapes, dtypes, device) and the CUDA stream they
    are made on: the caching allocator orders the reuse of a block on the stream that allocated it, so a
    set is handed out only on that stream. During CUDA graph capture nothing is taken or made ahead (a
    graph's tensors come from its own memory pool, and replays write into them). capturing: the test for
    capture on the current stream (default torch's; a CPU-only build of torch has none, so pass one there).
    """

    __slots__ = ("_make", "_key", "_set", "_last", "_capturing")

    def __init__(self, make: Callable[[Any], Any], capturing: Callable[[], bool] | None = None) -> None:
        self._make = make
        self._key: Hashable = None
        self._set: Any = None
        self._last: Hashable = None
        self._capturing = torch.cuda.is_current_stream_capturing if capturing is None else capturing

    def take(self, key: Hashable) -> Any:
        if self._set is not None and self._key == key and not self._capturing():
            got, self._set = self._set, None
            return got
        return self._make(key)

    def refill(self, key: Hashable, nbytes: int) -> None:
        if self._last == key and nbytes <= SPARE_MAX_BYTES and not self._capturing():
            self._key, self._set = key, self._make(key)
        self._last = key
