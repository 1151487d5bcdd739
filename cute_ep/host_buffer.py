"""``HostEpBuffer``: what the torch-computed backends (reference, all-to-all) share.

Receive buffers that live in ordinary torch memory and grow on demand up to ``cfg.capacity`` rows
(poisoned when they grow; the packed FP8 rows of ``dispatch(..., fp8=True)``, in either layout, get
their own uint8 buffer, and the rank layout's per-row routing ``recv_topk_idx`` / ``recv_topk_w``
[rows, K] theirs, up to ``cfg.rank_capacity`` rows, while its rows use ``recv_x`` (or the packed FP8
rows) / ``recv_src`` / ``recv_y``),
``poison``, ``expert_output``, the expert-capacity bookkeeping shared with ``EpBuffer``
(``dropped_rows``, ``check_capacity``), and a close that is collective unless an error is propagating
(the peers may never arrive then). Subclasses implement dispatch and combine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.api import BackendBase, DispatchHandle, DispatchResult
from cute_ep.fp8 import pack_fp8_rows, quantize_fp8, unpack_fp8_rows
from cute_ep.input_checks import check_buffer_config, note_dispatch_rows
from cute_ep.kernels.config import EpConfig
from cute_ep.status import capacity_error

__all__ = ["HostEpBuffer"]


class HostEpBuffer(BackendBase):
    """Base of ``ReferenceEpBuffer`` and ``A2aEpBuffer`` (see the module docstring).

    runtime: anything with ``env``, ``device`` and ``cpu_group`` attributes (a started Runtime, or a
             stand-in in a world of one). cfg: the ``EpConfig``; world_size must match the runtime's.
    rows:    receive rows allocated now (0: grow on demand).
    """

    def __init__(self, runtime: Any, cfg: EpConfig, rows: int = 0) -> None:
        check_buffer_config(runtime, cfg)
        self.runtime = runtime
        self.cfg = cfg
        self.rank = runtime.env.rank
        device = getattr(runtime, "device", None)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._closed = False
        # Rows dropped per global expert beyond cfg.expert_capacity, since the last report (same on
        # every rank: every rank knows every rank's counts).
        self._dropped = torch.zeros(cfg.num_experts, dtype=torch.int64)
        self._allocate(rows)

    # -- public API (shared) ---------------------------------------------------------------------

    def poison(self) -> None:
        """``BackendBase.poison``, and the packed FP8 rows with e4m3 / fp32 NaN."""
        super().poison()
        self.recv_fp8.fill_(0xFF)

    def dropped_rows(self) -> Tensor:
        """[E] int64 on the CPU: rows dropped per global expert (beyond ``cfg.expert_capacity``) since
        the last ``dropped_rows()`` call or ``check_capacity()`` that raised; the count restarts at 0.
        The same on every rank."""
        out = self._dropped.clone()
        self._dropped.zero_()
        return out

    def check_capacity(self, result: Any = None) -> None:
        """With ``cfg.on_overflow == "raise"``: if rows were dropped since the last report, reset the
        count and raise ``cute_ep.status.CapacityExceeded`` (carrying ``result``, the DispatchResult of
        the call that dropped them, or None). Every rank raises alike. With "drop": nothing happens (the
        drops stay counted for ``dropped_rows``)."""
        if self.cfg.on_overflow != "raise" or not bool(self._dropped.any()):
            return
        dropped = self.dropped_rows()
        error = capacity_error(self.cfg, dropped, result)
        if error is not None:
            raise error

    def expert_output(self, num_recv: int) -> Tensor:
        """The [num_recv, H] buffer combine reads; experts writing here save a copy."""
        self._check_open()
        self._check_num_recv(num_recv)
        self._ensure_rows(num_recv)
        return self.recv_y[:num_recv]

    @property
    def cpu_group(self) -> Any:
        """The runtime's group for host-side collectives; None once this buffer or its runtime is closed.

        Read from the runtime at every use, never kept: a buffer that outlives its ``Runtime`` (a variable
        still set after the ``with`` block) must not keep the process group alive, or gloo's worker
        threads live on into the interpreter's exit, where they can abort it (``Runtime.close`` says how).
        """
        return None if self._closed else getattr(self.runtime, "cpu_group", None)

    def close(self) -> None:
        """Release the buffers (collective, like EpBuffer.close). Safe to call twice."""
        self._close(collective=True)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # After an error the peers may never arrive: no barrier then.
        self._close(collective=exc_type is None)

    # -- internals -------------------------------------------------------------------------------

    def _dispatch_result(self, n: int, tpe: Tensor, handle: DispatchHandle, fp8: bool, sync: bool,
                         dropped: Tensor | None = None, layout: str = "expert") -> DispatchResult:
        """The result of a dispatch whose n received rows are in place: views of n rows, or with
        ``sync=False`` of ``cfg.capacity`` rows (the rank layout: ``cfg.rank_capacity``; the count in
        ``recv_count``), as the GPU buffer returns. ``dropped`` [E]: rows the dispatch dropped beyond
        expert capacity, counted here and raised now (``sync``) or by the next ``check_capacity``."""
        count = torch.tensor([n], dtype=torch.int32, device=self.device)
        note_dispatch_rows(handle, n)  # combine's y: these n rows (or the views' whole capacity)
        by_rank = layout == "rank"
        rows = n if sync else self.cfg.rank_capacity if by_rank else self.cfg.capacity
        self._ensure_rows(rows)
        if fp8:  # either layout: views of the packed rows
            self._fp8_rows(rows)
            recv_x, scales = self._fp8_views(rows)
        else:
            recv_x, scales = self.recv_x[:rows], None
        if by_rank:
            self._rank_rows(rows)
            # No per-row weight in this layout: the weights are per (row, k) in recv_topk_w.
            return DispatchResult(recv_x, None, self.recv_src[:rows], tpe, rows, handle, scales, count,
                                  recv_topk_idx=self.recv_topk_idx[:rows],
                                  recv_topk_weights=self.recv_topk_w[:rows])
        result = DispatchResult(recv_x, self.recv_w[:rows], self.recv_src[:rows], tpe, rows, handle, scales,
                                count)
        if dropped is not None:
            self._add_dropped(dropped)
        if sync:
            self.check_capacity(result)
        return result

    def _allocate(self, rows: int) -> None:
        c, dev = self.cfg, self.device
        self.recv_x = torch.full((rows, c.hidden), float("nan"), dtype=c.dtype, device=dev)
        self.recv_y = torch.full((rows, c.hidden), float("nan"), dtype=c.dtype, device=dev)
        self.recv_w = torch.full((rows,), float("nan"), dtype=torch.float32, device=dev)
        self.recv_src = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        # Packed FP8 rows (the cute_ep/fp8.py format), allocated by the first FP8 dispatch.
        self.recv_fp8 = torch.full((0, c.fp8_row_bytes), 0xFF, dtype=torch.uint8, device=dev)
        # The rank layout's per-row routing: allocated with the other rows only where that layout is
        # possible (no capacity factor), and never past the rows it can receive.
        topk_rows = min(rows, c.rank_capacity) if c.capacity_factor == 0 else 0
        self.recv_topk_idx = torch.full((topk_rows, c.topk), -1, dtype=torch.int32, device=dev)
        self.recv_topk_w = torch.full((topk_rows, c.topk), float("nan"), dtype=torch.float32, device=dev)

    def _add_dropped(self, dropped: Tensor) -> None:
        """Count the rows a dispatch dropped: dropped [E] integer, per global expert."""
        self._dropped += dropped.to(device="cpu", dtype=torch.int64)

    def _fp8_rows(self, n: int) -> Tensor:
        """The first n rows of the packed FP8 receive buffer [n, cfg.fp8_row_bytes] uint8 (grown and
        poisoned with 0xFF as needed, old rows kept)."""
        have = self.recv_fp8.shape[0]
        if n > have:
            new = torch.full((n, self.cfg.fp8_row_bytes), 0xFF, dtype=torch.uint8, device=self.device)
            new[:have].copy_(self.recv_fp8)
            self.recv_fp8 = new
        return self.recv_fp8[:n]

    def _recv_rows(self, n: int, fp8: bool) -> Tensor:
        """The first n receive rows a dispatch writes: with ``fp8`` the packed FP8 rows (``_fp8_rows``),
        else ``recv_x[:n]`` (grown by the caller's ``_ensure_rows``)."""
        return self._fp8_rows(n) if fp8 else self.recv_x[:n]

    def _sent_rows(self, x: Tensor, fp8: bool) -> Tensor:
        """The rows that travel from this rank: x, or with ``fp8`` its packed FP8 rows [T,
        cfg.fp8_row_bytes] uint8 (each token quantized once, before any per-destination copy)."""
        return pack_fp8_rows(*quantize_fp8(x), self.cfg.fp8_row_bytes) if fp8 else x

    def _rank_rows(self, n: int) -> None:
        """Grow the rank layout's ``recv_topk_idx`` / ``recv_topk_w`` to at least n rows (new rows
        poisoned with -1 / NaN, old rows kept)."""
        have = self.recv_topk_idx.shape[0]
        if n <= have:
            return
        new_idx = torch.full((n, self.cfg.topk), -1, dtype=torch.int32, device=self.device)
        new_w = torch.full((n, self.cfg.topk), float("nan"), dtype=torch.float32, device=self.device)
        new_idx[:have].copy_(self.recv_topk_idx)
        new_w[:have].copy_(self.recv_topk_w)
        self.recv_topk_idx, self.recv_topk_w = new_idx, new_w

    def _fp8_views(self, n: int) -> tuple[Tensor, Tensor]:
        """recv_x [n, H] float8_e4m3fn and recv_scales [n, H / 128] fp32: views of the packed rows."""
        return unpack_fp8_rows(self.recv_fp8[:n], self.cfg.hidden)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def _close(self, *, collective: bool) -> None:
        if self._closed:
            return
        group = self.cpu_group
        self._closed = True  # from here on the buffer refers to no process group (``cpu_group`` is None)
        if collective and dist.is_available() and dist.is_initialized() and self.cfg.world_size > 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.barrier(group=group)
        self._allocate(0)

    def _ensure_rows(self, n: int) -> None:
        """Grow the receive buffers to at least n rows (new rows poisoned, old rows kept)."""
        have = self.recv_x.shape[0]
        if n <= have:
            return

        def grow(buf: Tensor, fill: float) -> Tensor:
            new = torch.full((n, *buf.shape[1:]), fill, dtype=buf.dtype, device=self.device)
            new[:have].copy_(buf)
            return new

        self.recv_x = grow(self.recv_x, float("nan"))
        self.recv_y = grow(self.recv_y, float("nan"))
        self.recv_w = grow(self.recv_w, float("nan"))
        self.recv_src = grow(self.recv_src, -1)
