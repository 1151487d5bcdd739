"""DeepEP's low-latency mode on a ``cute_ep.deep_ep.Buffer`` (``LowLatencyMode``): ``low_latency_dispatch``
and ``low_latency_combine`` (on GPUs the module's low-latency layout, kernels/low_latency_dispatch.py and
kernels/low_latency_combine.py; on the host backends the expert layout), the staging tensors of
``zero_copy`` combines, and their argument checks. The per-expert padded layout in torch and DeepEP's FP8
cast: ``cute_ep.deep_ep.low_latency``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cute_ep.api import DispatchHandle
from cute_ep.deep_ep import low_latency as ll
from cute_ep.deep_ep.handles import LowLatencyHandle, _LowLatencyRoute, low_latency_handle
from cute_ep.deep_ep.lifecycle import _Scope
from cute_ep.deep_ep.ll_checks import _MAX_SIGNATURES, LowLatencyChecks
from cute_ep.deep_ep.ll_graphs import combine_call_key, combine_key, dispatch_call_key
from cute_ep.deep_ep.ll_replay import LowLatencyReplays
from cute_ep.deep_ep.pool import _CARRIER
from cute_ep.deep_ep.utils import EventOverlap, without_function_modes
from cute_ep.kernels.buffers import packed_fp8_row_bytes
from cute_ep.kernels.config import (
    FP8_SCALE_LOW_LATENCY,
    FP8_SCALE_POWER_OF_TWO,
    PHASE_ALL,
    PHASE_RECEIVE,
    PHASE_SEND,
)

__all__ = ["LowLatencyMode"]


class LowLatencyMode(LowLatencyChecks, LowLatencyReplays):
    """DeepEP's low-latency calls of ``Buffer``. They use what ``BufferLifecycle`` sets (``runtime``,
    ``group_size``, ``device``, ``backend``, ``_combined``, ``_ll_index``: DeepEP's buffer parity,
    ``_ll_staging``), ``BufferPool``'s buffers and ``CallChecks``' checks."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """A barrier (collective): the kernels' signals never need cleaning (they count calls), so this
        only keeps DeepEP's call sequence."""
        self._check_alive()
        del num_max_dispatch_tokens_per_rank, hidden, num_experts
        self.runtime.barrier()

    @without_function_modes
    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Tensor | None = None,
                             dispatch_wait_recv_cost_stats: Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:
        """DeepEP's low-latency dispatch, sync-free: ``(recv_x, recv_count, handle, event, hook)``.

        recv_x [El, R * M, H] bf16 (x's dtype), or with ``use_fp8`` ``(q, scales)``: q [El, R * M, H]
        float8_e4m3fn (a view of the received rows, which hold the scales behind the values: rows
        ``H + 4 H / 128`` bytes apart rounded up to 16, not H; ``.contiguous()`` gives DeepEP's), scales
        [El, R * M, H / 128] fp32, or with ``use_ue8m0`` [El, R * M, ceil(H / 512)]
        int32 (four exponent bytes each), both column-major in their last two dimensions as DeepEP's;
        expert l's rows in slots [0, recv_count[l]) (M = num_max_dispatch_tokens_per_rank); recv_count [El]
        int32; handle: ``LowLatencyHandle`` (src_info: each slot's token index on its source;
        layout_range: ``(begin << 32) | rows`` per source rank). ``cumulative_local_expert_recv_stats`` [El]
        int32 gets recv_count added.

        The FP8 cast is DeepEP's (per 128 columns, amax at least 1e-4; ``round_scale``: power-of-two scales),
        done on the sender by the dispatch kernel on GPUs (in torch on the host backends); the values and
        scales arrive bit for bit. Within an expert the blocks
        of source ranks come in rank order, each source's tokens ascending (DeepEP's order depends on
        arrival). A ``low_latency_combine`` given this call's ``topk_idx`` tensor, unchanged since, reuses
        the ids the dispatch kept.
        ``return_recv_hook``: on GPUs, as DeepEP's, the call only sends (the kernel's sending half) and the
        hook, called before the data is read and before the next low-latency call, enqueues the receiving half
        on the current stream (and ue8m0's scales copy); on the host backends the data is complete when the
        call returns and the hook does nothing. As DeepEP's, the results live in two alternating sets of
        receive tensors: valid until the next low-latency dispatch that lands on the same set (the second
        low-latency call after this one, a combine counting as a call; copy what must live longer). A token
        naming an expert twice is refused on the host backends; on GPUs, where checking would cost a host
        sync, the kernel skips ids outside [-1, E), sends a repeated expert's pairs as two, and records the
        call in its buffer's status block (``input_fault``). On GPUs the dispatch is one launch that writes
        the padded layout (two with ``return_recv_hook``), and the combine's launch pushes the rows back by
        the pairs the dispatch wrote. x may be bf16, fp16 or fp32 and H any size the kernels take (a multiple
        of 128 with FP8).

        Raises:
            NotImplementedError: ``dispatch_wait_recv_cost_stats`` (no per-peer wait timing).
            ValueError: bad shapes or dtypes, more tokens than M, ``use_ue8m0`` without ``round_scale``, or
                both ``async_finish`` and ``return_recv_hook`` (as DeepEP).
        """
        self._check_alive()
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "cute_ep.deep_ep: dispatch_wait_recv_cost_stats is not supported (the kernels do not time "
                "their waits per peer); pass None"
            )
        m, world = num_max_dispatch_tokens_per_rank, self.group_size
        stats = cumulative_local_expert_recv_stats
        repeatable = not (async_finish or return_recv_hook)  # may replay a captured graph (ll_replay)
        call_key = None  # the kernels' calls only (the only ones with graphs)
        if repeatable and self.backend == "cute":  # a call repeated: recalled by its call key
            call_key = dispatch_call_key(self._ll_index, x, topk_idx, stats, m, num_experts, use_fp8,
                                         round_scale, use_ue8m0)
            replayed = self._ll_dispatch_recalled(call_key, topk_idx, m, num_experts)
            if replayed is not None:
                return replayed
        flags = (use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        sig = self._ll_signature((x, topk_idx, stats, m, num_experts, *flags))
        self._ll_agreed("low_latency_dispatch", sig,
                        lambda: self._ll_dispatch_args(x, topk_idx, m, num_experts, stats, *flags),
                        lambda _: {"x's dtype and hidden size": (str(x.dtype), x.shape[1]),
                                   "num_max_dispatch_tokens_per_rank": m, "num_experts": num_experts,
                                   "topk_idx's K": topk_idx.shape[1], "use_fp8": bool(use_fp8)})
        if repeatable:  # a repeated call: its graph replayed (ll_replay)
            replayed = self._ll_dispatch_replayed(sig, call_key, x, topk_idx, stats, m, num_experts)
            if replayed is not None:
                return replayed
        el, hidden, k = num_experts // world, x.shape[1], topk_idx.shape[1]
        with _Scope(self, None, async_finish) as scope:
            parity = self._ll_index  # DeepEP's buffer parity: this call's receive tensors
            self._ll_index ^= 1
            hook = _no_wait if return_recv_hook else None
            if self.backend == "cute":  # the kernels, which also quantize FP8 rows
                rule = 0 if not use_fp8 else FP8_SCALE_POWER_OF_TWO if round_scale else FP8_SCALE_LOW_LATENCY
                recv, padded, sent, receive = self._ll_kernels_dispatch(
                    sig if scope.comm is None else None, parity, x, topk_idx, m, num_experts, rule, use_ue8m0,
                    stats, return_recv_hook)
                hook = receive or hook
            else:
                if use_fp8:  # cast into the rows the buffer moves: [H bytes of e4m3 | H / 128 fp32 | zeros]
                    packed = self._ll_cached("fp8 rows", (m, packed_fp8_row_bytes(hidden)), torch.uint8)
                    ll.cast_fp8_blocks(x, round_scale, out=packed[: x.shape[0]])
                    payload = packed[: x.shape[0]].view(torch.bfloat16)
                else:
                    payload = x.contiguous()
                key, buf = self._buffer(payload.shape[1], payload.dtype, num_experts, k, m, low_latency=True)
                # the expert layout carries a weight per row; DeepEP's low-latency dispatch has none
                weights = self._ll_cached("weights", (m, k), torch.float32)[: x.shape[0]]
                res = self._dispatch_on(buf, payload, topk_idx.contiguous(), weights, "expert")
                scratch, into = self._ll_receive(key, parity, res.recv_x, el, m)
                got = (res.recv_x, res.recv_src, res.tokens_per_expert)
                recv, padded = self._ll_place(parity, got, m, k, scratch, into, stats,
                                              hidden if use_fp8 else 0, use_ue8m0)
                sent = res.handle
            handle = low_latency_handle(padded, sent, m, hidden, num_experts, topk_idx)
            outputs = (*(recv if isinstance(recv, tuple) else (recv,)), padded.count, padded.src_info,
                       padded.layout_range, padded.slot)
            event = scope.finish(outputs, (x, topk_idx, stats))
        extra = (x, topk_idx, *outputs[:-1], stats) if async_finish else None
        return recv, padded.count, handle, EventOverlap(event, extra), hook

    @without_function_modes
    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Tensor | None = None,
                            combine_wait_recv_cost_stats: Tensor | None = None) -> tuple:
        """DeepEP's low-latency combine: ``(combined_x [T, H], event, hook)``, combined_x[t] = the sum over k
        ascending of topk_weights[t, k] * x[expert, slot of (t, k)], in fp32 (product and sum rounded
        separately), rounded once; pairs whose ``topk_idx`` is -1 are skipped (the rest must be the
        dispatch's ids). x [El, R * M, H] bf16 (fp16 / fp32 work too) in the dispatch's padded layout;
        ``zero_copy``: read the rows from ``get_next_low_latency_combine_buffer(handle)`` instead of x;
        ``out``: write the result there and return it. ``return_recv_hook`` as in ``low_latency_dispatch``.

        Raises:
            NotImplementedError: ``use_logfmt`` (no LogFMT format), ``combine_wait_recv_cost_stats``.
            ValueError: bad shapes or dtypes, or both ``async_finish`` and ``return_recv_hook``.
        """
        self._check_alive()
        if use_logfmt:
            raise NotImplementedError("cute_ep.deep_ep: use_logfmt=True (LogFMT combine) is not supported; "
                                      "the rows travel in x's dtype")
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("cute_ep.deep_ep: combine_wait_recv_cost_stats is not supported (the "
                                      "kernels do not time their waits per peer); pass None")
        both = async_finish and return_recv_hook
        route = handle.cute_ep if isinstance(handle, LowLatencyHandle) else None
        repeatable = not (async_finish or return_recv_hook) and out is None  # may replay (ll_replay)
        call_key = None  # the kernels' calls only (the only ones with graphs)
        # recalled by its call key (not with zero_copy: its input is the staging buffer, never remembered)
        if repeatable and route is not None and self.backend == "cute" and not zero_copy:
            call_key = combine_call_key(self._ll_index, x, topk_weights, route.dispatch_handle)
            replayed = self._ll_combine_recalled(call_key, topk_idx, route)
            if replayed is not None:
                return replayed
        sig = None if route is None else self._ll_signature((
            x, topk_idx, topk_weights, out, zero_copy, both, route.max_tokens, route.hidden,
            route.num_experts, route.num_tokens, route.dispatch_handle.topk_idx.shape[1]))
        self._ll_agreed("low_latency_combine", sig, lambda: self._ll_combine_args(
            x, topk_idx, topk_weights, handle, zero_copy, out, both), lambda r: {
                "x's dtype": str(r[1].dtype),
                "the handle's (num_max_dispatch_tokens_per_rank, hidden, num_experts)": (
                    r[0].max_tokens, r[0].hidden, r[0].num_experts)})
        if repeatable:  # a repeated call: replayed (ll_replay)
            replayed = self._ll_combine_replayed(sig, call_key, x, topk_idx, topk_weights, route, zero_copy)
            if replayed is not None:
                return replayed
        src = self._staging(route)[self._ll_index] if zero_copy else x
        hidden, k = route.hidden, route.dispatch_handle.topk_idx.shape[1]
        with _Scope(self, None, async_finish) as scope:
            key, buf = self._buffer(hidden, src.dtype, route.num_experts, k, route.max_tokens,
                                    low_latency=True)
            self._fence(key)
            self._ll_index ^= 1
            # The kernels' launch reads the padded rows received itself and pushes them back to their
            # tokens' ranks (a strided x is made contiguous first); the host backends' expert layout
            # reads them from the torch gather of every row.
            launch = self.backend == "cute"
            if not launch:
                rows = buf.expert_output(buf.cfg.capacity)
                ll.expert_major_rows(src, route.slot, rows)
            sent = route.dispatch_handle
            ids = sent.topk_idx
            if not route.gives(topk_idx):
                # pairs the caller set to -1 are skipped; the rest are the dispatch's (checked above on CPUs)
                ids = torch.where(topk_idx < 0, torch.full_like(ids, -1), ids)
            now = DispatchHandle(ids, topk_weights.contiguous(), sent.scatter, sent.num_tokens, sent.mode,
                                 sent.layout)
            receive = None  # with return_recv_hook on the kernels: the receiving half, for the hook
            if launch:
                combined = out if out is not None and out.is_contiguous() else torch.empty(
                    (route.num_tokens, hidden), dtype=src.dtype, device=self.device)
                receive = self._ll_launch_combine(sig if scope.comm is None else None, buf, now, combined,
                                                  src.contiguous(), route, return_recv_hook)
            else:
                combined = buf.combine(rows, now)
            self._combined.add(key)
            if out is not None and combined is not out:
                if receive is None:
                    out.copy_(combined)
                else:
                    receive = _then_copy(receive, combined, out)
                combined = out
            event = scope.finish((combined,), (x, topk_idx, topk_weights, *handle[:2]))
        extra = (x, topk_idx, topk_weights, *handle[:2], combined) if async_finish else None
        return combined, EventOverlap(event, extra), receive or (_no_wait if return_recv_hook else None)

    def _ll_fp8_out(self, parity: int, rows: Tensor, hidden: int, ue8m0: bool,
                    copy: bool = True) -> tuple[Tensor, Tensor]:
        """A low-latency FP8 dispatch's (q, scales) from its padded packed rows [El, S, P]: q [El, S, H]
        float8_e4m3fn, a view of the rows; scales DeepEP's [El, S, H / 128] fp32 (``ue8m0``: [El, S,
        ceil(H / 512)] int32 of exponent bytes), column-major in the last two dimensions, kept per parity
        and rewritten here (one copy; not with ``copy`` False: the rows are still to come). The views are
        made once per rows tensor (each costs host time)."""
        el, slots = rows.shape[0], rows.shape[1]

        def views() -> tuple[Tensor, Tensor, Tensor]:
            q, s_rows = ll.split_fp8_payload(rows, hidden)  # q: rows P bytes apart, no copy
            return q, s_rows, self._ll_scales(parity, el, s_rows.shape[-1], slots, ue8m0).transpose(1, 2)

        q, s_rows, scales = self._ll_kept_of(("fp8 views", rows.data_ptr(), hidden, ue8m0), views)
        if not copy:
            return q, scales
        if ue8m0:
            scales.copy_(ll.ue8m0_pack(s_rows.reshape(-1, s_rows.shape[-1])).view(el, slots, -1))
        else:
            scales.copy_(s_rows)
        return q, scales

    def _ll_scales(self, parity: int, el: int, nsc: int, slots: int, ue8m0: bool) -> Tensor:
        """The storage of a parity's DeepEP scales, [El, nsc, S] fp32 (``ue8m0``: [El, ceil(nsc / 4), S]
        int32), kept: ``_ll_fp8_out`` returns its transpose, and the kernels write fp32 scales into it."""
        if ue8m0:
            return self._ll_cached(f"scales {parity}", (el, -(-nsc // 4), slots), torch.int32)
        return self._ll_cached(f"scales {parity}", (el, nsc, slots), torch.float32)

    def _ll_kernels_dispatch(self, sig: tuple | None, parity: int, x: Tensor, topk_idx: Tensor, m: int,
                             num_experts: int, fp8_rule: int, ue8m0: bool, stats: Tensor | None,
                             split: bool) -> tuple[Any, ll.PaddedRecv, DispatchHandle, Any]:
        """A low-latency dispatch on the kernels: (what it returns as recv_x, the padded layout, the
        dispatch's handle, with ``split`` the hook that receives, else None). One launch of the module
        writes the padded layout into this parity's receive tensors (kernels/low_latency_dispatch.py), with
        FP8's fp32 scales in DeepEP's layout (ue8m0's are packed by one copy after); replayed from a CUDA
        graph where ``sig`` (the arguments' signature, None: never) repeats at this parity (``ll_graphs``).
        ``split`` (DeepEP's return_recv_hook): the sending half now, the receiving half (and ue8m0's copy)
        in the hook."""
        hidden, k, world = x.shape[1], topk_idx.shape[1], self.group_size
        el = num_experts // world
        key, buf = self._buffer(hidden, x.dtype, num_experts, k, m, low_latency=True)
        width, dtype = (packed_fp8_row_bytes(hidden), torch.uint8) if fp8_rule else (hidden, x.dtype)
        into = self._ll_kept_of(("padded", key, parity, dtype, width), lambda: ll.PaddedOut.make_exact(
            el, world, m, width, dtype, self.device))
        padded = into.received(el, world * m)
        # FP8 with fp32 scales: the kernel writes them in DeepEP's column-major layout (_ll_fp8_out's tensor)
        scales = None
        if fp8_rule and not ue8m0:
            scales = self._ll_scales(parity, el, hidden // 128, world * m, False)

        def enqueue(xs: Tensor, ids: Tensor, add_to: Tensor | None, phase: int = PHASE_ALL) -> tuple:
            sent = self._ll_launch_dispatch(buf, key, parity, xs, ids, num_experts, fp8_rule, into, add_to,
                                            phase, scales)
            if not fp8_rule:
                return padded.rows, padded, sent
            fp8 = self._ll_fp8_out(parity, padded.rows, hidden, ue8m0, ue8m0 and phase != PHASE_SEND)
            return fp8, padded, sent

        if split:
            xs = x.contiguous()
            recv, _, sent = enqueue(xs, topk_idx, stats, PHASE_SEND)

            def receive() -> None:
                self._ll_launch_dispatch(buf, key, parity, xs, topk_idx, num_experts, fp8_rule, into, stats,
                                         PHASE_RECEIVE, scales)
                if fp8_rule and ue8m0:
                    self._ll_fp8_out(parity, padded.rows, hidden, ue8m0, True)

            return recv, padded, sent, receive
        if sig is not None and x.shape[0]:
            how, result = self._ll_graphs.dispatch(sig, parity, buf, x, topk_idx, stats, enqueue)
            if how is not None:
                recv, padded, sent = result
                buf.replayed_dispatch(sent)
                self._combined.clear()  # as _ll_launch_dispatch
                if stats is not None and how == "copied":  # a direct graph adds them itself
                    stats.add_(padded.count)
                return recv, padded, sent, None
        return (*enqueue(x.contiguous(), topk_idx, stats), None)

    def _ll_launch_combine(self, sig: tuple | None, buf: Any, now: DispatchHandle, combined: Tensor,
                           src: Tensor, route: _LowLatencyRoute, split: bool) -> Callable[[], None] | None:
        """A low-latency combine's launch on the kernels (kernels/low_latency_combine.py): the padded rows
        ``src`` that the dispatch counted (``route.count``) pushed back by the pairs it wrote
        (``route.slot``), summed into ``combined``; replayed from a CUDA graph where ``sig`` (None: never)
        and the addresses of every tensor it reads or writes repeat (``ll_graphs``), else launched.
        ``split`` (DeepEP's return_recv_hook): the sending half now; returns the receiving half's launch."""
        slot = route.slot

        def launch(phase: int = PHASE_ALL) -> None:
            rows = src.view(-1, src.shape[-1])
            buf.launch_low_latency_combine(now, combined, rows, slot, route.count, phase)

        if split:
            launch(PHASE_SEND)
            return lambda: launch(PHASE_RECEIVE)
        if sig is not None:
            key = combine_key(sig, src, slot, now.topk_idx, now.topk_weights, now.scatter, combined)
            if self._ll_graphs.combine(key, buf, launch)[0]:
                buf.replayed_combine()
                return None
        launch()
        return None

    def _ll_place(self, parity: int, received: tuple[Tensor, Tensor, Tensor], m: int, k: int,
                  scratch: ll.PaddedScratch, into: ll.PaddedOut, stats: Tensor | None, fp8_hidden: int,
                  ue8m0: bool) -> tuple[Any, ll.PaddedRecv]:
        """(what a low-latency dispatch returns as recv_x, its padded layout) on the host backends, from
        what their expert-layout dispatch received, ``received`` = (rows, source tags, rows per local
        expert): the padded layout in torch, ``stats`` added, and with ``fp8_hidden`` (H of FP8 rows; 0:
        not FP8) the (q, scales) views."""
        rows, src, per_expert = received
        padded = ll.padded_layout(rows, src, per_expert, self.group_size, m, k, scratch, into)
        if stats is not None:
            stats.add_(padded.count)
        if not fp8_hidden:
            return padded.rows, padded
        return self._ll_fp8_out(parity, padded.rows, fp8_hidden, ue8m0), padded

    def _ll_launch_dispatch(self, buf: Any, key: tuple, parity: int, x: Tensor, topk_idx: Tensor,
                            num_experts: int, fp8_rule: int, into: ll.PaddedOut, stats: Tensor | None,
                            phase: int = PHASE_ALL, scales: Tensor | None = None) -> DispatchHandle:
        """A low-latency call's dispatch on the kernels: one launch of the module
        (``EpBuffer.launch_low_latency_dispatch``; ``phase``: one half of it) writing the padded layout
        into ``into`` (and its counts into ``stats``), on routing tensors kept per parity (the handle owns
        them until the second low-latency call after this one, DeepEP's lifetime), so no tensor is made per
        call. The ids become int32 as ``check_dispatch_inputs`` makes them: clamped to [-2, E] first (the
        kernel skips and records an id outside [-1, E); no int64 id wraps into that range). ``fp8_rule``: 0
        (rows as they are), or the kernel quantizes each row by that scale rule (``FP8_SCALE_LOW_LATENCY``
        or ``FP8_SCALE_POWER_OF_TWO``: DeepEP's low-latency cast, bit for bit)."""
        if phase != PHASE_RECEIVE:
            self._combined.clear()  # a dispatch orders every rank's earlier combines before later writes
        t, k = topk_idx.shape
        views = self._ll_kept_of(("routing views", key, parity, topk_idx.dtype), dict)
        routing = views.get(t)
        if routing is None:
            base = self._ll_kept_of(("routing", key, parity, topk_idx.dtype), lambda: _LowLatencyRouting.make(
                buf.cfg.max_tokens, k, topk_idx.dtype, self.device))
            if len(views) >= _MAX_SIGNATURES:
                views.clear()
            routing = views[t] = base.first(t)
        if phase != PHASE_RECEIVE:  # the receiving half reads the ids the sending half kept
            torch.clamp(topk_idx, -2, num_experts, out=routing.clamped)
            if routing.ids is not routing.clamped:
                routing.ids.copy_(routing.clamped)
        padded = {"ll_x": into.rows, "ll_src_info": into.src_info, "ll_count": into.count,
                  "ll_range": into.layout_range, "ll_stats": into.count if stats is None else stats,
                  "y_slot": into.slot, "ll_scales": into.count if scales is None else scales}
        return buf.launch_low_latency_dispatch(x, routing.ids, routing.weights, routing.own, padded,
                                               fp8=fp8_rule, phase=phase)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> Tensor:
        """The [El, R * M, H] bf16 tensor the next ``low_latency_combine(..., zero_copy=True)`` reads; fill it
        with the experts' outputs. Two alternate, as DeepEP's (each low-latency call flips them). Plain
        device memory: zero_copy saves no copy here."""
        self._check_alive()
        return self._staging(self._route(handle, LowLatencyHandle).cute_ep)[self._ll_index]

    def _staging(self, route: _LowLatencyRoute) -> list[Tensor]:
        key = (route.max_tokens, route.hidden, route.num_experts)
        pair = self._ll_staging.setdefault(key, [None, None])
        i = self._ll_index
        if pair[i] is None:
            el, slots = route.num_experts // self.group_size, self.group_size * route.max_tokens
            pair[i] = torch.zeros((el, slots, route.hidden), dtype=_CARRIER, device=self.device)
        return pair

    def _ll_receive(self, key: tuple, parity: int, recv_rows: Tensor, el: int, m: int
                    ) -> tuple[ll.PaddedScratch, ll.PaddedOut]:
        """The padded layout's scratch for a buffer, and its receive tensors for one parity: DeepEP's two
        alternating low-latency buffers (a dispatch's results stay valid until the next low-latency
        dispatch of the same parity, i.e. the second low-latency call after it), made once each."""
        world = self.group_size
        scratch = self._ll_kept_of(("scratch", key), lambda: ll.PaddedScratch.make(
            recv_rows.shape[0], el, world, m, self.device))
        width = recv_rows.shape[1]  # BF16 and FP8 calls share a buffer: their rows differ
        return scratch, self._ll_kept_of(("receive", key, parity, recv_rows.dtype, width),
                                         lambda: ll.PaddedOut.make(scratch, world, width, recv_rows.dtype,
                                                                   self.device))

    def _ll_cached(self, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A zero-filled tensor kept for the low-latency calls of this shape: what the kernels read and the
        calls rewrite in full before each read (the FP8 rows' values and scales, padding left zero), or
        never write (the zero weights)."""
        return self._ll_kept_of((what, shape, dtype),
                                lambda: torch.zeros(shape, dtype=dtype, device=self.device))

    def _ll_kept_of(self, key: tuple, make: Callable[[], Any]) -> Any:
        """What the low-latency calls keep under ``key`` (made by ``make`` on first use): each tensor made
        per call would cost host time."""
        kept = self._ll_kept.get(key)
        if kept is None:
            kept = self._ll_kept[key] = make()
        return kept

@dataclasses.dataclass(frozen=True)
class _LowLatencyRouting:
    """The routing tensors of the low-latency dispatches of one parity, M rows each: the caller's ids
    clamped (their dtype), as int32 (the same tensor for int32 ids), the zero weights the expert layout
    carries, and the (slots, ids, weights) the dispatch handle owns."""

    clamped: Tensor
    ids: Tensor
    weights: Tensor
    own: tuple[Tensor, Tensor, Tensor]

    @staticmethod
    def make(m: int, k: int, id_dtype: torch.dtype, device: torch.device) -> _LowLatencyRouting:
        clamped = torch.zeros((m, k), dtype=id_dtype, device=device)
        ids = clamped if id_dtype == torch.int32 else torch.zeros((m, k), dtype=torch.int32, device=device)
        slots, own_ids, own_w = torch.zeros((3, m, k), dtype=torch.int32, device=device).unbind(0)
        return _LowLatencyRouting(clamped, ids, torch.zeros((m, k), dtype=torch.float32, device=device),
                                  (slots, own_ids, own_w.view(torch.float32)))

    def first(self, t: int) -> _LowLatencyRouting:
        """The same tensors' first ``t`` rows (views)."""
        clamped = self.clamped[:t]
        return _LowLatencyRouting(clamped, clamped if self.ids is self.clamped else self.ids[:t],
                                  self.weights[:t], tuple(o[:t] for o in self.own))


def _then_copy(receive: Callable[[], None], result: Tensor, out: Tensor) -> Callable[[], None]:
    """A hook that runs ``receive`` and then copies ``result`` into the caller's (strided) ``out``."""
    def hook() -> None:
        receive()
        out.copy_(result)

    return hook


def _no_wait() -> None:
    """The receive hook: the data is already complete (``low_latency_dispatch``)."""
