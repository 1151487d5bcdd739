"""The views of the received rows that ``EpBuffer``'s dispatch returns: ``ReceivedViews``, its mixin.

Host code only.
"""

from __future__ import annotations

import torch

KEPT_VIEWS = 64  # row counts whose views (up to five tensors each) a buffer keeps


class ReceivedViews:
    """``EpBuffer``'s views of its receive buffers (``recv_x``, ``recv_w``, ``recv_src``, ``recv_topk_idx``,
    ``recv_topk_w``; ``cfg``, ``_check_num_recv``)."""

    _fp8_rows: torch.Tensor | None = None  # fp8_packed_rows() of the whole capacity, made once
    _views: dict[tuple, tuple] | None = None  # _received's views by (rows, layout, format), made once

    def _received(self, n: int, by_rank: bool, fp8: bool) -> tuple:
        """The views of a dispatch's result, first n rows: (recv_x, recv_w, recv_src, fp8 scales, the rank
        layout's per-k ids and weights), None where the call has none. Made once per row count, layout and
        format and handed to every such call, for the latest ``KEPT_VIEWS`` of them: a sync-free call's n
        is always its capacity, and a decode step's counts repeat (the slices cost 7-9 us of host time
        per synced dispatch on an H200 host, 2026-11-30)."""
        if self._views is None:
            self._views = {}
        # Views made in inference mode are marked so (in-place ops on them fail outside it): kept apart.
        key = (n, by_rank, fp8, torch.is_inference_mode_enabled())
        got = self._views.get(key)
        if got is None:
            recv_x, scales = self.fp8_views(n) if fp8 else (self.recv_x[:n], None)  # either layout's n fits
            # The rank layout's weights are per (row, k); the expert layout's per row.
            per_k = (self.recv_topk_idx[:n], self.recv_topk_w[:n]) if by_rank else (None, None)
            got = (recv_x, None if by_rank else self.recv_w[:n], self.recv_src[:n], scales, *per_k)
            if len(self._views) >= KEPT_VIEWS:  # the oldest goes first
                del self._views[next(iter(self._views))]
            self._views[key] = got
        return got

    def fp8_packed_rows(self, num_recv: int | None = None) -> torch.Tensor:
        """The received packed FP8 rows [n, cfg.fp8_row_bytes] uint8 (a view of ``recv_x``'s memory, where
        an FP8 dispatch puts them); n = num_recv, or the capacity."""
        if num_recv is None and self._fp8_rows is not None:
            return self._fp8_rows
        c = self.cfg
        c.check_fp8()
        n = c.capacity if num_recv is None else num_recv
        self._check_num_recv(n)
        p = c.fp8_row_bytes
        rows = self.recv_x.view(torch.uint8).view(-1)[: c.capacity * p].view(c.capacity, p)
        if num_recv is None:
            self._fp8_rows = rows
        return rows[:n]

    def fp8_views(self, num_recv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The received FP8 rows and scales after an FP8 dispatch: (q [n, H] float8_e4m3fn, scales
        [n, H / 128] fp32), strided views of ``fp8_packed_rows`` (rows ``cfg.fp8_row_bytes`` apart)."""
        from cute_ep.fp8 import unpack_fp8_rows

        return unpack_fp8_rows(self.fp8_packed_rows(num_recv), self.cfg.hidden)
