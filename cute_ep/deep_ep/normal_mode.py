"""DeepEP's normal mode on a ``cute_ep.deep_ep.Buffer`` (``NormalMode``): ``get_dispatch_layout``,
``dispatch`` and ``combine`` on the rank layout, their argument checks, and the internode calls it
refuses. How a token's row is routed and packed, and the handle's matrices: ``cute_ep.deep_ep.normal``;
a dispatch without a cached handle (its count table, the agreement in it): ``cute_ep.deep_ep.fresh_dispatch``.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.deep_ep import normal
from cute_ep.deep_ep.checks import _ID_DTYPES, _check_row_dtype, check_expert_ids, check_tensors
from cute_ep.deep_ep.fresh_dispatch import FreshDispatch
from cute_ep.deep_ep.handles import NormalHandle, _NormalRoute
from cute_ep.deep_ep.lifecycle import _Scope
from cute_ep.deep_ep.pool import _CARRIER
from cute_ep.deep_ep.token_layout import TokenLayout, shared_token_layout
from cute_ep.deep_ep.utils import Config, EventOverlap, without_function_modes

__all__ = ["NormalMode"]


@dataclass(frozen=True)
class _DispatchArgs:
    """A normal dispatch's checked arguments: x and its scales, is_token_in_rank, the row format, the
    channels of the handle's matrices, the cached handle's route (or None), num_experts (0 with a cached
    handle) and num_worst_tokens."""

    x: Tensor
    scales: Tensor | None
    in_rank: Tensor
    fmt: normal.RowFormat
    channels: int
    route: _NormalRoute | None
    num_experts: int
    num_worst: int

    def same(self) -> dict[str, Any]:
        """What must be the same on every rank (it chooses the buffers and the collectives)."""
        return {"x's dtype and hidden size": (str(self.x.dtype), self.fmt.hidden),
                "x_scales' columns": self.fmt.num_scales, "topk_idx's K (0: no top-k)": self.fmt.topk,
                "num_experts (num_tokens_per_expert's length)": self.num_experts,
                "num_worst_tokens": self.num_worst,
                "handle (a cached dispatch's buffers)": None if self.route is None else self.route.max_tokens}


class NormalMode(FreshDispatch):
    """DeepEP's normal-mode calls of ``Buffer``. They use what ``BufferLifecycle`` sets (``group``,
    ``rank``, ``group_size``, ``device``, ``backend``, ``_nccl``, ``_combined``), ``BufferPool``'s buffers,
    ``CallChecks``' checks and ``Buffer.get_dispatch_config``."""

    @without_function_modes
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> tuple[Tensor, Tensor | None, Tensor, Tensor, EventOverlap]:
        """DeepEP's layout: (num_tokens_per_rank [R] int32, None (no RDMA ranks), num_tokens_per_expert [E]
        int32, is_token_in_rank [T, R] bool, event). topk_idx [T, K] int64 (int32 accepted), -1: none. Exact;
        ids outside [-1, E) raise ValueError (DeepEP defines -1, no expert, and the experts; on a GPU they are
        not checked here: that is a host sync, which this call makes none of; they count nowhere). Local: no
        collective. On the CuTe backend one kernel launch (up to 8192 experts and 64 ranks; beyond, torch
        operations with the same results)."""
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            fast = self._layout_kernel_for(topk_idx, num_experts)
            if fast is not None:
                per_rank, per_expert, in_rank = fast(topk_idx, num_experts, self.group_size)
                return per_rank, None, per_expert, in_rank, EventOverlap(None)
        self._check_alive()
        self._check_comm_flags(previous_event, async_finish, allocate_on_comm_stream)
        check_tensors(self.device, topk_idx=(topk_idx, "[T, K] int64", torch.int64))
        if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"topk_idx must be [T, K] int64, got {list(topk_idx.shape)} {topk_idx.dtype}")
        self._check_num_experts(num_experts)
        self._check_device(topk_idx=topk_idx)
        if not topk_idx.is_cuda:
            check_expert_ids(topk_idx, num_experts)
        with _Scope(self, previous_event, async_finish) as scope:
            if self.backend == "cute" and TokenLayout.fits(topk_idx, num_experts, self.group_size):
                # one launch (kernels/token_layout.py) instead of a dozen torch operations
                layout = shared_token_layout()(topk_idx, num_experts, self.group_size)
                if scope.comm is None and type(topk_idx) is Tensor:
                    self._layout_kernel_takes.add((num_experts, topk_idx.dtype, topk_idx.device,
                                                   topk_idx.dim()))
            else:
                layout = normal.dispatch_layout(topk_idx, num_experts, self.group_size)
            per_rank, per_expert, in_rank = layout
        event = scope.finish((per_rank, per_expert, in_rank), (topk_idx,))
        return per_rank, None, per_expert, in_rank, EventOverlap(event)

    def _layout_kernel_for(self, topk_idx: Any, num_experts: Any) -> TokenLayout | None:
        """The layout launch for a call on the caller's stream of a kind (num_experts; the ids' dtype, device
        and rank; a plain tensor) that a checked call already took to the kernel, when the ids' shape fits
        it too: the call goes straight to the launch, its checks' answers being those of that call. None
        otherwise (the checked path). Why: the checks and the stream scope answer the same for every such
        call, and cost 4.8-6.9 us of host time in a 22-34 us call (two H200 hosts, 2026-11-29)."""
        if type(topk_idx) is not Tensor or self.runtime is None:
            return None
        if (num_experts, topk_idx.dtype, topk_idx.device, topk_idx.dim()) not in self._layout_kernel_takes:
            return None
        t, k = topk_idx.shape
        return shared_token_layout() if t * max(k, self.group_size) < 2**31 else None

    @without_function_modes
    def dispatch(self, x: Tensor | tuple[Tensor, Tensor], handle: tuple | None = None,
                 num_tokens_per_rank: Tensor | None = None, num_tokens_per_rdma_rank: Tensor | None = None,
                 is_token_in_rank: Tensor | None = None, num_tokens_per_expert: Tensor | None = None,
                 topk_idx: Tensor | None = None, topk_weights: Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        """DeepEP's normal dispatch: every token goes to each rank of its ``is_token_in_rank`` row.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``
        as DeepEP: recv_x [N, H] of x's dtype, or ``(recv_x, recv_x_scales)`` for an ``(x, x_scales)`` input
        (FP8 values and scales move unchanged; scales come back row-major [N, S]); rows grouped by source
        rank, tokens ascending; recv_topk_idx [N, K] (topk_idx's dtype): the local expert id where the
        expert is on this rank, else -1; recv_topk_weights [N, K] fp32: the weight there, else 0.0;
        num_recv_tokens_per_expert_list: per local expert, the sum over ranks of ``num_tokens_per_expert``,
        rounded up to ``expert_alignment`` (empty with ``num_worst_tokens``); handle: ``NormalHandle``.
        With a cached ``handle`` (no top-k) only recv_x is returned (the rest None) and nothing is synced.

        ``num_worst_tokens`` > 0: no host sync; N = num_worst_tokens rows (rows past the real count are
        uninitialised, their recv_topk_idx -1 and weights 0.0). The buffers then hold
        ceil(num_worst_tokens / R) tokens per rank (rounded to the bucket): it must be the same on every
        rank and at least R x the largest token count (DeepEP's own tests pass tokens x R), else
        ``ValueError`` on the rank with too many tokens. Received rows past num_worst_tokens are dropped,
        as DeepEP leaves them undefined.

        Differences from DeepEP: x may be any dtype whose rows are a multiple of 16 bytes; any number of
        ranks and top-k the kernels take; ``config`` sizes the handle's channel matrices (its num_sms
        must be even), and its num_sms are the SMs of the kernels where this call builds the buffers of its
        shape (later calls of the shape keep them); topk_idx values outside [-1, E) raise ValueError
        (checked where the call syncs the host: on the reference backend always, on GPUs without
        num_worst_tokens). Without
        ``num_worst_tokens`` the call makes one host sync, and raises ``ValueError`` on every rank if some
        rank's ``num_tokens_per_rank`` disagrees with its ``is_token_in_rank`` (DeepEP would move wrong
        rows). Top-k ids and weights (and FP8 scales) ride in each token's row.
        """
        self._check_alive()
        del num_tokens_per_rdma_rank  # one NVLink domain: DeepEP's intranode dispatch ignores it too
        # A cached dispatch given only x (and config), on the caller's stream: a kind already checked goes
        # straight to the kernels (``_KnownDispatch``).
        plain = (handle is not None and previous_event is None and not async_finish
                 and not allocate_on_comm_stream and num_tokens_per_rank is None and is_token_in_rank is None
                 and num_tokens_per_expert is None and topk_idx is None and topk_weights is None
                 and expert_alignment == 1 and num_worst_tokens == 0)
        known_key = self._known_dispatch_key(x, handle, config) if plain else None
        if known_key is not None:
            known = self._known_dispatches.get(known_key)
            if known is not None and known.route() is handle.cute_ep and known.usable(self):
                return known.run(self, handle.cute_ep, x)

        def check() -> _DispatchArgs:
            return self._dispatch_args(x, handle, num_tokens_per_rank, is_token_in_rank,
                                       num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                       num_worst_tokens, config, previous_event, async_finish,
                                       allocate_on_comm_stream)

        if handle is None:
            given = {"per_rank": num_tokens_per_rank, "in_rank": is_token_in_rank,
                     "per_expert": num_tokens_per_expert, "topk_idx": topk_idx, "topk_weights": topk_weights,
                     "alignment": expert_alignment, "num_worst": num_worst_tokens}
            recv_x, recv_scales, recv_idx, recv_w, per_expert, new_handle, event = self._dispatch_fresh(
                check, given, num_worst_tokens == 0, previous_event, async_finish)
            out_x = (recv_x, recv_scales) if recv_scales is not None else recv_x
            return out_x, recv_idx, recv_w, per_expert, new_handle, EventOverlap(event)
        a = self._agreed("dispatch", check, _DispatchArgs.same, synced=False)
        world = self.group_size
        with _Scope(self, previous_event, async_finish) as scope:
            buf_key, buf = self._buffer(a.fmt.elems, _CARRIER, world, world, a.route.max_tokens,
                                        num_sms=2 * a.channels)
            recv_x, recv_scales = _cached_rows(self, buf, a.fmt, a.route, a.x, a.scales)
            event = scope.finish((recv_x, recv_scales), (a.x, a.scales, a.in_rank))
        if known_key is not None and self.backend == "cute":
            if len(self._known_dispatches) >= _MAX_KNOWN_DISPATCHES:
                self._known_dispatches.clear()
            self._known_dispatches[known_key] = _KnownDispatch(weakref.ref(a.route), a.fmt, buf_key, buf)
        out_x = (recv_x, recv_scales) if a.scales is not None else recv_x
        return out_x, None, None, None, None, EventOverlap(event)

    @staticmethod
    def _known_dispatch_key(x: Any, handle: Any, config: Any) -> tuple | None:
        """What a cached dispatch's checks read of its arguments (the handle, x's and its scales' dtype,
        shape, strides and device, the config's SMs), or None for arguments the fast path leaves to the
        checked one (a tensor subclass, anything but a tensor or a pair of them)."""
        xs, scales = x if type(x) is tuple and len(x) == 2 else (x, None)
        if type(handle) is not NormalHandle or type(xs) is not Tensor:
            return None
        if scales is not None and type(scales) is not Tensor:
            return None
        if config is not None and type(config) is not Config:
            return None
        of_scales = None if scales is None else (scales.dtype, scales.shape, scales.stride(), scales.device)
        return (id(handle.cute_ep), None if config is None else config.num_sms, xs.dtype, xs.shape,
                xs.stride(), xs.device, of_scales)

    def _dispatch_args(self, x: Any, handle: Any, per_rank: Any, in_rank: Any, per_expert: Any, topk_idx: Any,
                       topk_weights: Any, alignment: Any, num_worst: Any, config: Config | None,
                       previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool
                       ) -> _DispatchArgs:
        """``dispatch``'s arguments checked on this rank (no collective): ValueError names the first bad
        one."""
        self._check_comm_flags(previous_event, async_finish, allocate_on_comm_stream)
        config = config if config is not None else self.get_dispatch_config(self.group_size)
        channels = self._channels(config)
        x, x_scales = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
        route = None
        if handle is not None:
            route = self._route(handle, NormalHandle).cute_ep
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch with a cached handle takes no topk_idx / topk_weights (as DeepEP)")
            in_rank = handle[4]
        else:
            self._check_fresh_args(per_rank, in_rank, per_expert, topk_idx, topk_weights)
        for name, value in (("expert_alignment", alignment), ("num_worst_tokens", num_worst)):
            if not isinstance(value, numbers.Integral) or value < (1 if name == "expert_alignment" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'expert_alignment' else 0}, got "
                                 f"{value!r}")
        fmt = self._row_format(x, x_scales, in_rank, topk_idx, topk_weights)
        num_experts = 0
        if handle is None:
            self._check_counts(per_rank, per_expert)
            num_experts = per_expert.shape[0]
            # topk_idx's values: checked with the count table (``_dispatch_fresh``), where the call reads it
        return _DispatchArgs(x, x_scales, in_rank, fmt, channels, route, num_experts, num_worst)

    def _check_fresh_args(self, per_rank: Any, in_rank: Any, per_expert: Any, topk_idx: Any,
                          topk_weights: Any) -> None:
        """A dispatch without a handle: the layout's three tensors given, top-k ids and weights together."""
        missing = [n for n, v in (("num_tokens_per_rank", per_rank), ("is_token_in_rank", in_rank),
                                  ("num_tokens_per_expert", per_expert)) if v is None]
        if missing:
            raise ValueError(f"dispatch without a handle needs {', '.join(missing)} (get_dispatch_layout's)")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx and topk_weights go together: pass both or neither, got "
                             f"{'topk_idx' if topk_weights is None else 'topk_weights'} alone")
        r = self.group_size
        check_tensors(self.device, num_tokens_per_rank=(per_rank, f"[{r}] int32", torch.int32),
                      is_token_in_rank=(in_rank, f"[T, {r}] bool", torch.bool),
                      num_tokens_per_expert=(per_expert, "[E] int32", torch.int32),
                      topk_idx=(topk_idx, "[T, K] int64", torch.int64),
                      topk_weights=(topk_weights, "[T, K] float32", torch.float32))

    @without_function_modes
    def combine(self, x: Tensor, handle: tuple, topk_weights: Tensor | None = None, bias: Any = None,
                config: Config | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[Tensor, Tensor | None, EventOverlap]:
        """DeepEP's normal combine: each token's rows summed over the ranks it went to, without weights.

        x [N, H] bf16 (fp16 / fp32 work too): one row per row the dispatch delivered (the handle's); returns
        ``(combined_x [T, H], combined_topk_weights [T, K] or None, event)``. combined_x[t] = the sum over t's
        destination ranks, ascending, of their rows, in fp32 from 0.0, rounded once: bit-identical to
        DeepEP's without ``bias``. combined_topk_weights: ``topk_weights`` [N, K] fp32 summed the same way
        (bit-identical). ``bias``: a [T, H] tensor or a tuple of two, added in fp32 after the rows' sum is
        rounded (DeepEP adds them before rounding: results can differ by one rounding of x's dtype).
        ``config``: its num_sms are the SMs of the kernels where this call builds the buffers of its shape
        (a combine after a BF16 dispatch of the same rows uses the dispatch's). The top-k weights travel
        with ``all_to_all_single`` on the group; after a ``num_worst_tokens`` dispatch that costs one host
        sync (the row counts).
        """
        self._check_alive()
        sms = config.num_sms if isinstance(config, Config) and config.num_sms > 0 else 0
        route, bias_0, bias_1 = self._agreed("combine", lambda: self._combine_args(
            x, handle, topk_weights, bias, previous_event, async_finish, allocate_on_comm_stream),
            lambda _: {"x's dtype and hidden size": (str(x.dtype), x.shape[1]),
                       "topk_weights (given or None)": topk_weights is not None}, synced=False)
        world = self.group_size
        with _Scope(self, previous_event, async_finish) as scope:
            rows = min(x.shape[0], world * route.max_tokens)
            key, buf = self._buffer(x.shape[1], x.dtype, world, world, route.max_tokens, num_sms=sms)
            pushes = getattr(buf, "pushes", None)  # the kernels' buffers
            if pushes is not None and pushes(route.dispatch_handle):
                # x read where it is, each row pushed to its token's rank (EpBuffer.pushes): no copy, no
                # fence (the kernels' start barrier orders the pushes after every peer's last sums), and
                # no check of x's rows (made above) that would read the count back
                sent = route.dispatch_handle
                out = torch.empty((sent.num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
                buf.launch_combine(sent, out, "reduced", y=x[:rows])
            else:
                self._fence(key)
                # y covers the buffer's rank capacity (the rows a sync-free dispatch's views cover); combine
                # reads only the first ``rows``.
                y = buf.expert_output(world * route.max_tokens)
                y[:rows].copy_(x[:rows])
                out = buf.combine(y, route.dispatch_handle)
            self._combined.add(key)
            if bias_0 is not None or bias_1 is not None:
                extra = sum(b.float() for b in (bias_0, bias_1) if b is not None)
                out = (out.float() + extra).to(x.dtype)
            weights = None
            if topk_weights is not None:
                weights = self._combine_weights(topk_weights, route, handle[4])
            event = scope.finish((out, weights), (x, topk_weights, bias_0, bias_1, *handle.made()))
        return out, weights, EventOverlap(event)

    def _combine_args(self, x: Any, handle: Any, topk_weights: Any, bias: Any, previous_event: Any,
                      async_finish: bool, allocate_on_comm_stream: bool) -> tuple:
        """``combine``'s arguments checked on this rank: (the handle's route, bias_0, bias_1)."""
        self._check_comm_flags(previous_event, async_finish, allocate_on_comm_stream)
        route = self._route(handle, NormalHandle).cute_ep
        tokens, n = handle[4].shape[0], route.num_recv
        check_tensors(self.device, x=(x, f"[{n}, H] bfloat16", torch.bfloat16),
                      topk_weights=(topk_weights, f"[{n}, K] float32", torch.float32))
        self._check_rows("x", x, n, "the rows the dispatch of this handle returned")
        bias_0, bias_1 = self._unpack_bias(bias)
        for name, b in (("bias", bias_0), ("bias[1]", bias_1)):
            check_tensors(self.device, **{name: (b, f"[{tokens}, {x.shape[1]}] {x.dtype}", x.dtype)})
            if b is not None and (tuple(b.shape) != (tokens, x.shape[1]) or b.dtype != x.dtype):
                raise ValueError(
                    f"{name} must be [{tokens}, {x.shape[1]}] {x.dtype}, got {list(b.shape)} {b.dtype}"
                )
        if topk_weights is not None and (topk_weights.dim() != 2 or topk_weights.shape[0] != n
                                         or topk_weights.dtype != torch.float32):
            raise ValueError(f"topk_weights must be [{n}, K] float32 (one row per received row), got "
                             f"{list(topk_weights.shape)} {topk_weights.dtype}")
        self._check_device(x=x, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1)
        return route, bias_0, bias_1

    @staticmethod
    def _check_rows(name: str, x: Tensor, rows: int, what: str) -> None:
        """A combine's x: [rows, H] (``what`` they are) with rows of a multiple of 16 bytes, bf16 / fp16 /
        fp32 (the sum is fp32): the shape and the dtype named apart."""
        if x.dim() != 2 or x.shape[0] != rows or (x.shape[1] * x.element_size()) % 16:
            raise ValueError(f"{name} must be [{rows}, H] ({what}; H x element size a multiple of 16 bytes), "
                             f"got {list(x.shape)}")
        _check_row_dtype(name, x, " (combine sums in float32)")

    def internode_dispatch(self, *args: Any, **kwargs: Any) -> tuple:
        """DeepEP's internode normal dispatch: not supported (``NotImplementedError``)."""
        raise NotImplementedError(
            "cute_ep.deep_ep: internode_dispatch (DeepEP's RDMA normal mode) is not supported; dispatch runs "
            "the group in one NVLink domain"
        )

    def internode_combine(self, *args: Any, **kwargs: Any) -> tuple:
        """DeepEP's internode normal combine: not supported (``NotImplementedError``)."""
        raise NotImplementedError(
            "cute_ep.deep_ep: internode_combine (DeepEP's RDMA normal mode) is not supported; combine runs "
            "the group in one NVLink domain"
        )

    def _combine_weights(self, weights: Tensor, route: _NormalRoute, in_rank: Tensor) -> Tensor:
        """[T, K] fp32: each token's rows of ``weights`` [N, K] summed over its destination ranks, ascending,
        from 0.0 (DeepEP's order): the rows go home with ``all_to_all_single``."""
        world, rank, dev = self.group_size, self.rank, self.device
        counts = route.counts_host if route.counts_host is not None else route.counts.tolist()
        back = [counts[s][rank] for s in range(world)]  # rows received from s go back to s
        home = [counts[rank][r] for r in range(world)]  # this rank's tokens that went to r
        send = weights[: sum(back)].contiguous()
        if world == 1:
            recv = send.clone()
        else:
            host = not self._nccl and send.is_cuda  # gloo moves host tensors
            send = send.cpu() if host else send
            recv = torch.empty((sum(home), weights.shape[1]), dtype=torch.float32, device=send.device)
            dist.all_to_all_single(recv, send, output_split_sizes=home, input_split_sizes=back,
                                   group=self.group)
            recv = recv.to(dev)
        t = in_rank.shape[0]
        acc = torch.zeros((t, weights.shape[1]), dtype=torch.float32, device=dev)
        if recv.shape[0] == 0:
            return acc
        hits = in_rank.t().to(torch.int64)  # [R, T]: scans along the last dimension (normal.send_head)
        starts = torch.tensor([[sum(home[:r])] for r in range(world)], dtype=torch.int64, device=dev)
        pos = (starts + hits.cumsum(dim=1) - hits).clamp(max=recv.shape[0] - 1)  # [R, T]
        for r in range(world):  # ascending rank, as DeepEP sums
            acc = acc + torch.where(in_rank[:, r : r + 1], recv[pos[r]], torch.zeros_like(acc))
        return acc

    @staticmethod
    def _unpack_bias(bias: Any) -> tuple[Tensor | None, Tensor | None]:
        if bias is None:
            return None, None
        if isinstance(bias, Tensor):
            return bias, None
        if isinstance(bias, tuple) and len(bias) == 2:
            return bias
        raise ValueError(f"bias must be a tensor, a tuple of two tensors or None, got {type(bias).__name__}")

    # -- argument checks -------------------------------------------------------------------------

    def _check_comm_flags(self, previous_event: Any, async_finish: bool,
                          allocate_on_comm_stream: bool) -> None:
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError(
                "allocate_on_comm_stream=True needs previous_event and async_finish=True (as DeepEP)"
            )

    def _channels(self, config: Config) -> int:
        if config.num_sms < 2 or config.num_sms % 2:
            raise ValueError(
                f"config.num_sms must be even and >= 2 (two SMs per channel), got {config.num_sms}"
            )
        return config.num_sms // 2

    def _row_format(self, x: Tensor, scales: Tensor | None, in_rank: Tensor, topk_idx: Tensor | None,
                    topk_weights: Tensor | None) -> normal.RowFormat:
        check_tensors(self.device, x=(x, "[T, H] (or a tuple (x, x_scales))", torch.bfloat16),
                      x_scales=(scales, "[T, S] float32", torch.float32))
        if x.dim() != 2 or (x.shape[1] * x.element_size()) % 16:
            raise ValueError(f"x must be [T, H] with H x element size a multiple of 16 bytes, got "
                             f"{list(x.shape)} {x.dtype}")
        t = x.shape[0]
        if tuple(in_rank.shape) != (t, self.group_size) or in_rank.dtype != torch.bool:
            raise ValueError(f"is_token_in_rank must be [{t}, {self.group_size}] bool, got "
                             f"{list(in_rank.shape)} {in_rank.dtype}")
        if self.group_size > 64:
            raise ValueError(f"the normal mode takes at most 64 ranks (one expert per rank, top-R), got "
                             f"{self.group_size}")
        if scales is not None and (x.element_size() != 1 or scales.dim() != 2 or scales.shape[0] != t
                                   or scales.dtype not in (torch.float32, torch.int32)):
            raise ValueError(f"x_scales must be [{t}, S] float32 or int32 beside 1-byte x, got "
                             f"{list(scales.shape)} {scales.dtype} with x {x.dtype}")
        k = 0
        if topk_idx is not None:
            k = topk_idx.shape[1] if topk_idx.dim() == 2 else -1
            if topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_idx.dtype not in _ID_DTYPES:
                raise ValueError(
                    f"topk_idx must be [{t}, K] int64, got {list(topk_idx.shape)} {topk_idx.dtype}"
                )
            if tuple(topk_weights.shape) != (t, k) or topk_weights.dtype != torch.float32:
                raise ValueError(f"topk_weights must be [{t}, {k}] float32, got {list(topk_weights.shape)} "
                                 f"{topk_weights.dtype}")
        self._check_device(x=x, x_scales=scales, is_token_in_rank=in_rank, topk_idx=topk_idx,
                           topk_weights=topk_weights)
        return normal.RowFormat(x.dtype, x.shape[1], None if scales is None else scales.dtype,
                                0 if scales is None else scales.shape[1], k)

    def _check_counts(self, per_rank: Tensor, per_expert: Tensor) -> None:
        r = self.group_size
        if tuple(per_rank.shape) != (r,) or per_rank.dtype not in _ID_DTYPES:
            raise ValueError(f"num_tokens_per_rank must be [{r}] int32 (get_dispatch_layout's), got "
                             f"{list(per_rank.shape)} {per_rank.dtype}")
        if (per_expert.dim() != 1 or per_expert.shape[0] % r or not per_expert.shape[0]
                or per_expert.dtype not in _ID_DTYPES):
            raise ValueError(f"num_tokens_per_expert must be [E] int32 with E a multiple of {r} ranks "
                             f"(get_dispatch_layout's), got {list(per_expert.shape)} {per_expert.dtype}")
        self._check_device(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert)


_MAX_KNOWN_DISPATCHES = 16  # kinds of cached dispatch remembered (more: forgotten, then learnt again)


@dataclass(frozen=True)
class _KnownDispatch:
    """A kind of cached dispatch a checked call made (``NormalMode._known_dispatch_key``): the handle's
    route (a weak reference: the key holds its id, and nothing here keeps its tensors alive), its row
    format and the buffer it ran on. A call of that kind runs as the checked call's body does, without
    the checks (their answers depend only on the key), the stream scope (the caller's stream, no event) or
    the buffer lookup. Why: DeepEP's tests time cached dispatches back to back, where the host's time per
    call is the line's time once it exceeds the kernels'."""

    route: Callable[[], _NormalRoute | None]
    fmt: normal.RowFormat
    buf_key: tuple
    buf: Any

    def usable(self, mode: NormalMode) -> bool:
        """The buffer is still the pool's for its key (not evicted), noted as the latest used."""
        return mode._kept_buffer(self.buf_key) is self.buf

    def run(self, mode: NormalMode, route: _NormalRoute, x: Any) -> tuple:
        xs, scales = x if type(x) is tuple else (x, None)
        recv_x, recv_scales = _cached_rows(mode, self.buf, self.fmt, route, xs, scales)
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        return out_x, None, None, None, None, EventOverlap(None)


def _cached_rows(mode: NormalMode, buf: Any, fmt: normal.RowFormat, route: _NormalRoute, x: Tensor,
                 scales: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A cached dispatch's work on ``buf``: x (and its scales) put into rows of ``fmt`` and sent by the
    handle's routing (its dispatch kept the per-rank ids and zero weights it was given, its own copy), and
    the received rows split into new tensors (both by the same launch on the kernels' buffers, else by
    torch): (recv_x, recv_scales or None)."""
    sent = route.dispatch_handle
    rows = min(route.num_recv, mode.group_size * route.max_tokens)
    outputs = recv_x, recv_scales, _ = fmt.outputs(route.num_recv, x.device)
    received = mode._rows_sent_on(buf, fmt, x, scales, sent,
                                  fmt.delivery(rows, outputs))
    if received is not None:  # the host backends: copied here
        fmt.unpack(received[:rows], route.num_recv, outputs)
    return recv_x, recv_scales
