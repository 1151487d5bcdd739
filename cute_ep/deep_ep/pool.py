"""The backends' buffers of a ``cute_ep.deep_ep.Buffer`` (``BufferPool``): one per shape (row width, dtype,
experts, top-k, max_tokens; the low-latency mode's apart), built on first use and kept, the least recently
used freed when a new one would exceed the byte budget; the fence before a buffer's expert outputs are
written again; and the bytes a call shape needs (``get_symmetric_bytes_hint``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.deep_ep import normal
from cute_ep.deep_ep.checks import agree
from cute_ep.deep_ep.lifecycle import BUDGET_ENV_VAR
from cute_ep.kernels.config import EpConfig

__all__ = ["COMBINE_ENV_VAR", "LOW_LATENCY_SMS_ENV_VAR", "MIN_BUCKET", "BufferPool", "low_latency_grid",
           "normal_combine_algorithm"]

LOW_LATENCY_SMS_ENV_VAR = "CUTE_EP_LOW_LATENCY_SMS"
"""Where set, the SMs of the low-latency mode's kernels as its buffers are built (else DeepEP's low-latency
grid for the shape: ``low_latency_grid``)."""
COMBINE_ENV_VAR = "CUTE_EP_DEEP_EP_COMBINE"
"""The normal mode's combine on the kernels, as its buffers are built: "pull" (default: each token's rows
read from the ranks that hold them, the caller's x copied into the buffer first) or "push" (each rank's
rows of x stored into their token's rank and summed there, ``EpBuffer.pushes``; the buffers hold the
partial rows too). The same result bit for bit."""
COMBINES = {"pull": "pull", "push": "reduced"}  # the name -> EpConfig.combine_algorithm


def normal_combine_algorithm() -> str:
    """``EpConfig.combine_algorithm`` of the normal mode's buffers: ``COMBINE_ENV_VAR``'s (ValueError for
    another value)."""
    name = os.environ.get(COMBINE_ENV_VAR, "").strip() or "pull"
    if name not in COMBINES:
        raise ValueError(f"{COMBINE_ENV_VAR} must be one of {sorted(COMBINES)}, got {name!r}; unset it for "
                         "the pull")
    return COMBINES[name]


def low_latency_grid(num_experts: int, sms: int) -> int:
    """The CTAs DeepEP v1.2.1's low-latency dispatch launches for ``num_experts`` experts on a GPU of
    ``sms`` SMs: each CTA serves ceil(num_experts / sms) experts, so ceil(num_experts / that) CTAs (96 for
    288 experts on a 132-SM H200). The low-latency mode's kernels (dispatch and combine) take as many by
    default. DeepEP's combine launches at least as many: one CTA per ceil(tokens / sms) of the call's
    tokens where that is more (128 at 128 tokens on an H200), so at DeepEP's test shapes its combine runs
    on a third more SMs than ours; ours on 128 measured no faster (one H200, 2026-11-29, docs/results.md)."""
    per_cta = -(-num_experts // max(1, sms))
    return -(-num_experts // per_cta)

MIN_BUCKET = 64
"""The least max_tokens of a normal-mode buffer (larger ones are powers of two)."""
_CARRIER = torch.bfloat16


def _bucket(tokens: int) -> int:
    return max(MIN_BUCKET, 1 << max(0, tokens - 1).bit_length())


class BufferPool:
    """The backends' buffers of ``Buffer``, keyed by shape. They use what ``BufferLifecycle`` sets
    (``group``, ``group_size``, ``runtime``, ``backend``, ``device``, ``symmetric_bytes``, ``_registry``,
    ``_sm_cap``, ``_nccl``, ``_buffers``: key -> buffer, least recently used first, ``_combined``) and
    ``_buffer_sms()``: ``Buffer.num_sms``, the SMs of a buffer built now."""

    @staticmethod
    def get_symmetric_bytes_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, *,
                                 num_topk: int = 0, num_experts: int = 0, fp8: bool = False,
                                 low_latency: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of symmetric buffers one call shape needs on GPUs (cute-ep's own, beside DeepEP's hints).

        Normal mode: a dispatch of ``dtype`` rows (``fp8``: e4m3 with fp32 scales per 128 columns), with
        ``num_topk`` ids and weights riding along (0: none), and the combine of its rows. Low-latency
        mode (``low_latency``): a dispatch to ``num_experts`` experts with top-``num_topk`` and its combine,
        of ``dtype`` rows (the same bytes with ``fp8``: use_fp8 quantizes into that buffer's packed rows).
        ``num_max_tokens_per_rank`` is rounded to the normal mode's bucket in the normal mode."""
        def cfg(width: int, dt: torch.dtype, experts: int, topk: int, tokens: int,
                ll: bool = False) -> EpConfig:
            return EpConfig(world_size=num_ranks, local_world_size=num_ranks, num_experts=experts, topk=topk,
                            hidden=width, dtype=dt, max_tokens=tokens, low_latency=ll,
                            combine_algorithm="pull" if ll else normal_combine_algorithm())

        if low_latency:  # one buffer: an FP8 dispatch quantizes into its packed rows (H % 128 == 0)
            return cfg(hidden, dtype, num_experts, num_topk, num_max_tokens_per_rank, True).symmetric_bytes()
        m = _bucket(num_max_tokens_per_rank)
        fmt = normal.RowFormat(torch.float8_e4m3fn if fp8 else dtype, hidden,
                               torch.float32 if fp8 else None, hidden // 128 if fp8 else 0, num_topk)
        combine = cfg(hidden, dtype, num_ranks, num_ranks, m)
        total = combine.symmetric_bytes()
        if fp8 or not fmt.passthrough or dtype != _CARRIER:
            total += cfg(fmt.elems, _CARRIER, num_ranks, num_ranks, m).symmetric_bytes()
        return total

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """Not supported: there is no single raw buffer (``NotImplementedError``)."""
        raise NotImplementedError(
            "cute_ep.deep_ep: get_local_buffer_tensor is not supported: the buffers are per shape "
            "(EpBuffer's recv_x / recv_y), not one raw byte range"
        )

    def _used_bytes(self) -> int:
        return sum(b.cfg.symmetric_bytes() for b in self._buffers.values())

    def _built(self, hidden: int, dtype: torch.dtype, num_experts: int, topk: int, max_tokens: int,
               low_latency: bool = False) -> tuple[tuple, Any]:
        """(key, the buffer of those sizes built before, or None): ``_buffer`` without building one."""
        key = (hidden, dtype, num_experts, topk, max_tokens) + (("low-latency",) if low_latency else ())
        return key, self._kept_buffer(key)

    def _kept_buffer(self, key: tuple) -> Any:
        """The buffer built before under ``key`` (``_built``'s), noted as the latest used; else None."""
        buf = self._buffers.get(key)
        if buf is not None:
            self._buffers.move_to_end(key)
        return buf

    def _buffer(self, hidden: int, dtype: torch.dtype, num_experts: int, topk: int, max_tokens: int,
                low_latency: bool = False, num_sms: int = 0) -> tuple[tuple, Any]:
        """(key, the backend's buffer) for rows of ``hidden`` ``dtype`` elements, ``num_experts`` experts,
        top-``topk``, ``max_tokens`` tokens per rank: the one built before, or a new one (collective).
        ``low_latency``: the low-latency mode's own (its SMs: ``_low_latency_sms``). ``num_sms``: the SMs
        of a new buffer's kernels (the building call's config; 0: ``Buffer.num_sms``), at most the share."""
        key, buf = self._built(hidden, dtype, num_experts, topk, max_tokens, low_latency)
        if buf is not None:
            return key, buf
        if self.group_size > 1:  # a collective build: every rank must build the same (else a ConfigError)
            name = ("the buffers' (row width, dtype, experts, top-k, tokens per rank): x's dtype and hidden "
                    "size, num_experts, top-k and num_max_dispatch_tokens_per_rank")
            agree(self.runtime.cpu_group, "cute_ep.deep_ep: building the buffers of a new shape", None,
                  {name: (hidden, str(dtype), num_experts, topk, max_tokens)})
        env = self.runtime.env
        cfg = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                       num_experts=num_experts, topk=topk, hidden=hidden, dtype=dtype, max_tokens=max_tokens,
                       num_sms=(self._new_buffer_sms(low_latency, num_sms, num_experts)
                                if self.backend == "cute" else 0),
                       low_latency=low_latency and self.backend == "cute",
                       # normal mode: with "push", the partial rows a combine pushes into (EpBuffer.pushes)
                       combine_algorithm="pull" if low_latency else normal_combine_algorithm())
        if self.backend == "cute":
            from cute_ep.buffer import EpBuffer

            need = cfg.symmetric_bytes()
            if need > self.symmetric_bytes:
                raise ValueError(
                    f"cute_ep.deep_ep: rows of {hidden} x {dtype} with {num_experts} experts, top-{topk} and "
                    f"up to {max_tokens} tokens per rank need {need} bytes of symmetric buffers, more than "
                    f"this Buffer's budget of {self.symmetric_bytes} (num_nvl_bytes + num_rdma_bytes); "
                    f"create the Buffer with symmetric_bytes >= {need}, or set {BUDGET_ENV_VAR}"
                )
            while self._buffers and self._used_bytes() + need > self.symmetric_bytes:
                old = next(iter(self._buffers))  # the least recently used; every rank evicts the same
                self._buffers.pop(old).close()
                self._combined.discard(old)
                self._forget_replays()  # a graph may launch on the buffer just freed
            buf = EpBuffer(self.runtime, cfg, registry=self._registry)
        else:
            from cute_ep.reference_backend import ReferenceEpBuffer

            buf = ReferenceEpBuffer(self.runtime, cfg)
        self._buffers[key] = buf
        return key, buf

    def _new_buffer_sms(self, low_latency: bool, num_sms: int, num_experts: int) -> int:
        """The SMs of a kernels' buffer built now: ``num_sms`` (the building call's config), else the
        mode's default (``Buffer.num_sms``, or ``_low_latency_sms(num_experts)``), at most each rank's
        share."""
        if not num_sms:  # the mode's default only when the call gives none (its variable is read there)
            num_sms = self._low_latency_sms(num_experts) if low_latency else self._buffer_sms()
        return min(num_sms, self._sm_cap)

    def _low_latency_sms(self, num_experts: int) -> int:
        """The SMs of low-latency buffers of ``num_experts`` experts built now: ``CUTE_EP_LOW_LATENCY_SMS``
        where set, else ``low_latency_grid`` on each rank's share of its GPU (either capped by the share).
        Why not ``Buffer.num_sms``: DeepEP's low-latency kernels take no SM budget (a decode step's
        communication runs alone), and ours on 24 SMs took 102.4 us per BF16 pair on one H200 (a world of
        one, DeepEP's test shapes) against 66.7 on 96."""
        env = os.environ.get(LOW_LATENCY_SMS_ENV_VAR, "").strip()
        if not env:
            return low_latency_grid(num_experts, self._sm_cap)
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{LOW_LATENCY_SMS_ENV_VAR} must be an integer >= 1 (the SMs of the low-latency "
                             f"kernels), got {env!r}; unset it for DeepEP's low-latency grid")
        return int(env)

    def _bucketed(self, hidden: int, dtype: torch.dtype, num_experts: int, topk: int, tokens: int) -> int:
        """max_tokens for a normal-mode dispatch of up to ``tokens`` tokens per rank: the least built buffer
        of this shape that holds them, else the bucket (every rank decides alike)."""
        want = _bucket(tokens)
        built = [k[4] for k in self._buffers
                 if len(k) == 5 and k[:4] == (hidden, dtype, num_experts, topk) and k[4] >= want]
        return min(built, default=want)

    def _dispatch_on(self, buf: Any, x: Tensor, ids: Tensor, weights: Tensor, layout: str,
                     into: tuple[int, tuple[Tensor, ...]] | None = None) -> Any:
        """A sync-free dispatch on ``buf``; ``into`` (rows, parts), the kernels' buffers only: the same launch
        copies the received rows into the parts (``EpBuffer.launch_dispatch``'s ``deliver``)."""
        self._combined.clear()  # a dispatch orders every rank's earlier combines before later writes
        if into is not None:
            return buf.dispatch(x, ids, weights, layout=layout, sync=False, deliver=into)
        return buf.dispatch(x, ids, weights, layout=layout, sync=False)

    def _rows_sent_on(self, buf: Any, fmt: Any, x: Tensor, scales: Tensor | None, sent: Any,
                      into: tuple[int, tuple[Tensor, ...]]) -> Tensor | None:
        """A rank-layout dispatch of x (and its scales) in rows of ``fmt`` (``normal.RowFormat``) along the
        routing of ``sent`` (a cached dispatch: the cached handle's ``DispatchHandle``, checked before), with
        no handle kept. On the kernels one launch that puts the rows together from x and the scales where
        it can (``fmt.assembly``) and copies the first ``into[0]`` received rows into the parts ``into[1]``:
        ``EpBuffer.launch_cached_dispatch`` (no layout) while ``sent`` is the buffer's latest dispatch, else
        ``launch_dispatch`` on its ids and weights (none of ``dispatch()``'s argument checks, handle storage
        or result views, which only a kept handle needs); returns None. On the host backends: the received
        rows, [capacity, W] of the buffer, for the caller to copy."""
        self._combined.clear()  # a dispatch orders every rank's earlier combines before later writes
        ids, weights = sent.topk_idx, sent.topk_weights
        launch = getattr(buf, "launch_dispatch", None)  # the kernels' buffers (the host backends: dispatch)
        if launch is None:
            rows = fmt.pack(x, scales, None, None)
            return buf.dispatch(rows, ids, weights, layout="rank", sync=False).recv_x
        parts = fmt.assembly(x, scales)
        if parts is None:
            rows, extra = fmt.pack(x, scales, None, None), {"deliver": into}
        else:  # the launch writes the rows
            rows = torch.empty((x.shape[0], fmt.elems), dtype=torch.bfloat16, device=x.device)
            extra = {"deliver": into, "assemble": parts}
        if buf.is_latest(sent):  # the routing's slots and counts are still the buffer's: no layout
            buf.launch_cached_dispatch(rows, sent, **extra)
        else:
            launch(rows, ids, weights, layout="rank", **extra)
        return None

    def _fence(self, key: tuple) -> None:
        """Before writing a buffer's expert outputs again without a dispatch in between (GPU kernels
        only): wait until every peer's previous combine, which reads them, is done (one small all-reduce
        on the communication stream)."""
        if self.backend != "cute" or key not in self._combined or self.group_size == 1:
            return
        if self._nccl:  # on a kept zero (its sum stays 0): no tensor made per call
            if self._fence_zero is None:
                self._fence_zero = torch.zeros(1, device=self.device)
            dist.all_reduce(self._fence_zero, group=self.group)
        else:  # a host barrier orders device work only after a device sync
            self.runtime.barrier()
