"""A dispatch along the routing of the buffer's latest dispatch (``CachedDispatch``, part of
``cute_ep.buffer.EpBuffer``): DeepEP's cached dispatch. The rows of a new x go where that dispatch's rows
went, with no layout: its slots, received counts and source tags hold, so the launch only waits for every
rank to enter the call before it sends (kernels/dispatch.py, "Routed"). Uses: a second tensor of the same
tokens, the gradient sent back along a combine's routing, DeepEP's ``dispatch(x, handle=handle)``.
"""

from __future__ import annotations

from typing import Any

import torch

from cute_ep.api import DispatchHandle
from cute_ep.gpu_checks import is_latest_dispatch

__all__ = ["CachedDispatch"]


class CachedDispatch:
    """``launch_cached_dispatch`` of an ``EpBuffer`` (its ``_enqueue_dispatch``, ``cfg`` and the routing of
    its latest dispatch, ``_sent``)."""

    _enqueue_dispatch: Any
    _sent: tuple[torch.Tensor, torch.Tensor] | None
    _latest_scatter: torch.Tensor | None
    cfg: Any

    def is_latest(self, handle: DispatchHandle) -> bool:
        """Whether ``handle`` is this buffer's latest dispatch's (no dispatch or layout since): what
        ``launch_cached_dispatch`` and the expert layout's reduced combine need."""
        return is_latest_dispatch(handle, self._sent)

    def launch_cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle, fp8: bool | int = False, *,
                               deliver: tuple[int, tuple[torch.Tensor, ...]] | None = None,
                               assemble: tuple[torch.Tensor, torch.Tensor] | None = None) -> DispatchHandle:
        """Enqueue the dispatch of x [T, H] along ``handle``'s routing (one launch of the module, no layout,
        no host sync: capturable). Collective: every rank passes the handle of its own latest dispatch.

        handle: the latest dispatch's (``is_latest``), of the expert or rank layout, T = handle.num_tokens;
        its routing tensors unchanged since (the kernels read its slots, ids and weights where they are).
        x: as ``launch_dispatch`` takes it (contiguous, cfg.dtype; FP8 with ``fp8``); deliver / assemble:
        as there. The results are where that dispatch left them: ``recv_x`` (or the FP8 views), with the
        same count, ``tokens_per_expert``, ``recv_src``, ``recv_w`` (the rank layout's ``recv_topk_idx`` /
        ``recv_topk_w``), now with x's rows. Returns ``handle``, still the latest dispatch's.

        ``ValueError`` for a handle that is not the latest dispatch's (a dispatch or a layout ran since:
        dispatch anew), of the low-latency layout, with slots other than [T, K] contiguous int32, or for T
        rows of x other than the handle's.
        """
        if handle.layout not in ("expert", "rank"):
            raise ValueError(f"launch_cached_dispatch takes an expert- or rank-layout handle, got layout "
                             f"{handle.layout!r}: dispatch anew")
        if not self.is_latest(handle):
            raise ValueError("launch_cached_dispatch needs the handle of this buffer's latest dispatch (its "
                             "slots and receive counts are that dispatch's on every rank); a dispatch or a "
                             "layout ran since: dispatch anew")
        t = x.shape[0] if x.dim() else -1
        if t != handle.num_tokens:
            raise ValueError(f"x must have the handle's {handle.num_tokens} rows, got shape {tuple(x.shape)}")
        slots = handle.scatter  # the kernels read them where they are: [T, K] int32, contiguous
        if slots.dtype != torch.int32 or not slots.is_contiguous() or slots.numel() != t * self.cfg.topk:
            raise ValueError(f"the handle's scatter must be the dispatch's [{t}, {self.cfg.topk}] int32 "
                             f"slots, contiguous; got {slots.dtype} of shape {tuple(slots.shape)}: dispatch "
                             f"anew")
        sent, latest = self._sent, self._latest_scatter
        # The handle's slots in scatter mode (an atomic-mode dispatch wrote its slots back there).
        self._enqueue_dispatch(x, handle.topk_idx, handle.topk_weights, "scatter", fp8, None, handle.layout,
                               deliver=deliver, assemble=assemble if t else None, routed=slots)
        self._sent, self._latest_scatter = sent, latest  # still that dispatch's slots and counts
        return handle
