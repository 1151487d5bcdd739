"""``cute_ep.deep_ep.Buffer``: DeepEP v1.2.1's ``deep_ep.Buffer`` on cute-ep's backends.

The same names, arguments, defaults, shapes, dtypes and return tuples as DeepEP; what differs is listed
in each method's docstring and in docs/deep_ep.md. The receive sides are built on two dispatches of
``cute_ep``:

* normal mode (``dispatch`` / ``combine``): the rank layout (``layout="rank"``, rows grouped by source
  rank, tokens ascending: DeepEP's order), routed by ``is_token_in_rank`` with one expert per rank
  (``normal.rank_routing``); FP8 scales and top-k ids / weights travel in the token's row
  (``normal.RowFormat``);
* low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``): the expert layout
  (``layout="expert"``), rearranged into DeepEP's per-expert padded tensors with torch ops
  (``low_latency.padded_layout``), no host sync.

Buffers: DeepEP's ``Buffer`` is sized by bytes and learns the shapes per call; cute-ep's buffers are sized
by shape (``EpConfig``: hidden, experts, top-k, dtype, most tokens per rank). So a ``Buffer`` builds them
on first use, one per (row width, dtype, experts, top-k, max_tokens), and keeps them: the normal mode's
max_tokens is the least power of two (at least 64) holding every rank's tokens, or one already built that
holds them; the low-latency mode's is ``num_max_dispatch_tokens_per_rank``. On GPUs the kernels' symmetric
buffers (NVSHMEM) must fit the Buffer's byte budget: ``symmetric_bytes=`` if given, else
``$CUTE_EP_DEEP_EP_SYMMETRIC_BYTES`` (e.g. "8G"), else ``num_nvl_bytes + num_rdma_bytes``; the least
recently used buffers are freed to make room (collectively: every rank makes the same calls), and a shape
whose buffers alone exceed the budget raises ``ValueError`` naming the bytes it needs
(``Buffer.get_symmetric_bytes_hint`` computes them ahead).

Wrong arguments (``checks``): every call checks its arguments before anything moves and raises ValueError
naming the argument, the value and what is accepted; where the call waits on the host anyway (the reference
backend; on the kernels a dispatch without num_worst_tokens or a handle, and a build of new buffers) the
ranks agree first, so that an argument wrong on one rank raises on every rank and none waits alone. The
Buffer stays usable after such an error.

Streams (GPUs): as in DeepEP, every call runs on the Buffer's communication stream (``get_comm_stream``,
high priority), after ``previous_event`` or else after the caller's current stream; with ``async_finish``
the caller's stream does not wait and the returned event marks the end, otherwise it waits. On a CPU
(the reference backend) every call is complete when it returns: ``async_finish`` returns an event with
nothing to wait for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.api import DispatchHandle
from cute_ep.collectives import world_of
from cute_ep.deep_ep import low_latency as ll
from cute_ep.deep_ep import normal
from cute_ep.deep_ep.checks import agree, check_expert_ids, check_tensors, error_of
from cute_ep.deep_ep.runtime import GroupRuntime, NvshmemSession, choose_backend, resolve_group
from cute_ep.deep_ep.utils import Config, EventHandle, EventOverlap, get_low_latency_rdma_size_hint
from cute_ep.kernels.config import SUPPORTED_DTYPES, EpConfig

__all__ = ["BUDGET_ENV_VAR", "Buffer", "LowLatencyHandle", "NormalHandle"]

BUDGET_ENV_VAR = "CUTE_EP_DEEP_EP_SYMMETRIC_BYTES"
"""Overrides a Buffer's symmetric byte budget (a size as NVSHMEM_SYMMETRIC_SIZE takes it: "8G", "512M")."""
MIN_BUCKET = 64
"""The least max_tokens of a normal-mode buffer (larger ones are powers of two)."""
_CARRIER = torch.bfloat16
_ID_DTYPES = (torch.int64, torch.int32)


def _bucket(tokens: int) -> int:
    return max(MIN_BUCKET, 1 << max(0, tokens - 1).bit_length())


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


@dataclass(frozen=True)
class _LowLatencyRoute:
    """cute_ep's side of a low-latency handle: the expert-layout dispatch handle and each expert-major
    row's padded slot (``low_latency.PaddedRecv.slot``)."""

    dispatch_handle: DispatchHandle
    slot: Tensor
    max_tokens: int
    hidden: int
    num_experts: int
    num_tokens: int


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
    """

    cute_ep: _NormalRoute

    def __new__(cls, entries: tuple, route: _NormalRoute) -> NormalHandle:
        obj = super().__new__(cls, entries)
        obj.cute_ep = route
        return obj


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle, the 5-tuple ``(packed_recv_src_info [El, R * M] int32,
    packed_recv_layout_range [El, R] int64, num_max_dispatch_tokens_per_rank, hidden, num_experts)``, plus
    ``.cute_ep``: the routing cute_ep's combine needs (pass the tuple itself)."""

    cute_ep: _LowLatencyRoute

    def __new__(cls, entries: tuple, route: _LowLatencyRoute) -> LowLatencyHandle:
        obj = super().__new__(cls, entries)
        obj.cute_ep = route
        return obj


@contextlib.contextmanager
def _plain_torch_defaults() -> Iterator[None]:
    """torch's own defaults (fp32, CPU) inside a call: callers may set others (DeepEP's tests set bf16 and
    CUDA with ``torch.set_default_dtype`` / ``set_default_device``), and the backends' host-side tensors
    must not follow them."""
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    if dtype == torch.float32 and device.type == "cpu":
        yield
        return
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)


class _Scope:
    """One call's work on the Buffer's communication stream (see the module docstring); on a CPU, in
    place. Inside it torch's defaults are its own (``_plain_torch_defaults``)."""

    def __init__(self, buffer: Buffer, previous_event: Any = None, async_finish: bool = False) -> None:
        self.comm = buffer._comm_stream
        self.previous = getattr(getattr(previous_event, "event", None), "event", None)
        self.async_finish = async_finish
        self.compute: Any = None
        self._ctx: Any = None
        self._defaults: Any = None

    def __enter__(self) -> _Scope:
        self._defaults = _plain_torch_defaults()
        self._defaults.__enter__()
        if self.comm is not None:
            self.compute = torch.cuda.current_stream(self.comm.device)
            if self.previous is not None:
                self.comm.wait_event(self.previous)
            else:
                self.comm.wait_stream(self.compute)
            self._ctx = torch.cuda.stream(self.comm)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._ctx is not None:
                self._ctx.__exit__(*exc)
        finally:
            self._defaults.__exit__(*exc)

    def finish(self, outputs: tuple, inputs: tuple) -> EventHandle | None:
        """After the body: the event (async_finish) or the caller's stream waiting for the work; the
        outputs made on the communication stream are marked as used by the caller's stream, and with
        async_finish the inputs as used by the communication stream."""
        if self.comm is None:
            return EventHandle.completed() if self.async_finish else None
        # Inside a CUDA graph capture the graph owns its memory, and record_stream cannot be captured.
        record = not torch.cuda.is_current_stream_capturing()
        for t in outputs:
            if record and isinstance(t, Tensor) and t.is_cuda:
                t.record_stream(self.compute)
        if self.async_finish:
            for t in inputs:
                if record and isinstance(t, Tensor) and t.is_cuda:
                    t.record_stream(self.comm)
            return EventHandle(self.comm)
        self.compute.wait_stream(self.comm)
        return None


class Buffer:
    """DeepEP's communication buffer (``deep_ep.Buffer``) on cute-ep's backends (module docstring).

    Arguments as DeepEP's; how they are used here:
        group: the torch.distributed group of the expert-parallel ranks. NCCL with CUDA: the CuTe kernels
            (``EpBuffer``; this Buffer starts NVSHMEM over the group's ranks: ``cute_ep.deep_ep.runtime``);
            gloo: the torch reference (``ReferenceEpBuffer``) on CPU tensors. None: the default group, or a
            world of one when torch.distributed is not initialised (DeepEP requires a group).
        num_nvl_bytes, num_rdma_bytes: their sum is the byte budget of the kernels' symmetric buffers (module
            docstring); unused by the CPU backends.
        low_latency_mode: accepted; both modes work on any Buffer here (DeepEP allows the low-latency calls
            only with it set).
        num_qps_per_rank, allow_mnnvl: accepted and unused (no RDMA queue pairs; MNNVL is not detected).
        allow_nvlink_for_low_latency_mode: accepted; the kernels reach peers of a node over NVLink either
            way (same results).
        explicitly_destroy: with True call ``destroy()``; without it nothing is released by a destructor (a
            destructor must not run collectives): buffers and NVSHMEM live until the process ends.
        comm: an mpi4py communicator instead of a group: not supported (``NotImplementedError``).
        backend (keyword, cute-ep's): "cute" or "reference" instead of the automatic choice (on an NCCL
            group "reference" moves CUDA tensors through the host).
        symmetric_bytes (keyword, cute-ep's): the byte budget instead of num_nvl_bytes + num_rdma_bytes.
        runtime (keyword, cute-ep's): a started ``cute_ep.bootstrap.Runtime`` whose NVSHMEM (backend
            "nvshmem") or gloo group this Buffer uses instead of starting its own (``group`` defaults to
            ``runtime.group``); its heap must hold the budget, and ``destroy()`` leaves it running.

    Raises:
        NotImplementedError: ``num_rdma_bytes > 0`` without ``low_latency_mode`` (DeepEP's internode normal
            mode), or ``comm`` without ``group``.
        ValueError: a negative byte count, an unknown backend, "cute" without CUDA or NCCL.
    """

    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm: Any = None, *, backend: str | None = None,
                 symmetric_bytes: int | None = None, runtime: Any = None) -> None:
        del num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl  # see the docstring
        with _plain_torch_defaults():
            self._init(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, comm,
                       backend, symmetric_bytes, runtime)

    def _init(self, group: Any, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
              explicitly_destroy: bool, comm: Any, backend: str | None, symmetric_bytes: int | None,
              runtime: Any) -> None:
        if group is None and comm is not None:
            raise NotImplementedError(
                "cute_ep.deep_ep: comm (an mpi4py communicator) is not supported; pass a torch.distributed "
                "group"
            )
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise ValueError(
                f"num_nvl_bytes and num_rdma_bytes must be >= 0, got {num_nvl_bytes}, {num_rdma_bytes}"
            )
        if num_rdma_bytes > 0 and not low_latency_mode:
            raise NotImplementedError(
                f"cute_ep.deep_ep: num_rdma_bytes > 0 with low_latency_mode=False (DeepEP's internode "
                f"normal mode) is not supported, got num_rdma_bytes={num_rdma_bytes}; the normal mode runs "
                f"within the group's NVLink domain with num_rdma_bytes=0"
            )
        self.group = resolve_group(group if group is not None or runtime is None else runtime.group)
        self.rank, self.group_size = world_of(self.group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.backend = choose_backend(self.group, backend, runtime)
        # Collectives of CUDA tensors need NCCL; on another group (ranks sharing a GPU) they go through
        # the host.
        self._nccl = self.group is not None and "nccl" in str(dist.get_backend(self.group)).lower()
        if runtime is not None:
            device = runtime.device if runtime.device is not None else torch.device("cpu")
        else:  # the reference backend on an NCCL group keeps the caller's CUDA tensors
            on_gpu = self.backend == "cute" or (self._nccl and torch.cuda.is_available())
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.device = device
        self._owns_runtime = runtime is None
        self.runtime: Any = runtime if runtime is not None else GroupRuntime(self.group, device)
        self.symmetric_bytes = self._budget(symmetric_bytes)
        self._session = None
        self._registry: Any = None
        self._sm_cap = 0
        if self.backend == "cute":
            self._start_kernels()
        self._buffers: OrderedDict[tuple, Any] = OrderedDict()
        self._comm_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._combined: set[tuple] = set()  # buffers combined on since the latest dispatch (see _fence)
        self._ll_index = 0  # DeepEP's low-latency buffer parity: flips on every low-latency call
        self._ll_staging: dict[tuple, list[Tensor | None]] = {}

    def _start_kernels(self) -> None:
        """NVSHMEM (this Buffer's session, or the given runtime's), the compiled-module registry, and the
        kernels' SM budget cap: the least SM share of any rank (every rank must build the same configs)."""
        from cute_ep.collectives import all_gather_objects
        from cute_ep.input_checks import sm_share_of

        if self._owns_runtime:
            self._session = NvshmemSession.attach(self.runtime, self.symmetric_bytes)
            self._registry = self._session.registry
        else:
            self._registry = getattr(self.runtime, "registry", None)
            if self._registry is None:
                from cute_ep.bootstrap.compile import ModuleRegistry

                self._registry = ModuleRegistry(device_id=self.device.index)
                self.runtime.add_finalizer(self._registry.finalize_all)
                self.runtime.registry = self._registry
        share = sm_share_of(self.runtime)
        self._sm_cap = min(s for s in all_gather_objects(share[0] if share else 1, self.runtime.cpu_group))

    def _budget(self, symmetric_bytes: int | None) -> int:
        if symmetric_bytes is not None:
            if symmetric_bytes < 0:
                raise ValueError(f"symmetric_bytes must be >= 0, got {symmetric_bytes}")
            return symmetric_bytes
        env = os.environ.get(BUDGET_ENV_VAR, "").strip()
        if env:
            from cute_ep.bootstrap.runtime import parse_size

            return parse_size(env)
        return self.num_nvl_bytes + self.num_rdma_bytes

    # -- lifecycle -------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Free the buffers (collective: every rank calls it) and, with the last Buffer of the process,
        NVSHMEM; on a gloo group, wait until gloo's worker threads hold nothing of this Buffer's collectives
        (``checks.drain_gloo``: a program may keep its group until it exits). Safe to call twice, and after
        a call that raised. (DeepEP allows it only with ``explicitly_destroy``; here always.)"""
        if self.runtime is None:
            return
        try:
            with _plain_torch_defaults():
                self._release()
        finally:
            if self._owns_runtime:
                self.runtime.close()  # lets gloo's workers finish with this Buffer's collectives first
            self.runtime = self.group = None  # a destroyed Buffer refers to no process group

    def _release(self) -> None:
        try:
            for key in list(self._buffers):
                self._buffers.pop(key).close()
        finally:
            if self._session is not None:
                self._session.release()
                self._session = None

    def _check_alive(self) -> None:
        if self.runtime is None:
            raise RuntimeError("cute_ep.deep_ep: this Buffer was destroyed")

    # -- DeepEP's static helpers -----------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the kernels are built for sm_90 and the FP8 paths work (on every backend)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set ``Buffer.num_sms`` (even, as DeepEP requires): the SMs of the default configs and of the
        kernels' buffers built from now on (a buffer keeps the budget it was built with)."""
        if new_num_sms % 2:
            raise ValueError(f"the SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (for ``previous_event=``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's RDMA bytes for the low-latency mode (its formula:
        ``utils.get_low_latency_rdma_size_hint``). The budget it gives usually holds this module's
        low-latency buffers too (``get_symmetric_bytes_hint(..., low_latency=True)`` says exactly)."""
        m = num_max_dispatch_tokens_per_rank
        return get_low_latency_rdma_size_hint(m, hidden, num_ranks, num_experts)

    @staticmethod
    def get_symmetric_bytes_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, *,
                                 num_topk: int = 0, num_experts: int = 0, fp8: bool = False,
                                 low_latency: bool = False, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of symmetric buffers one call shape needs on GPUs (cute-ep's own, beside DeepEP's hints).

        Normal mode: a dispatch of ``dtype`` rows (``fp8``: e4m3 with fp32 scales per 128 columns), with
        ``num_topk`` ids and weights riding along (0: none), and the combine of its rows. Low-latency
        mode (``low_latency``): a dispatch to ``num_experts`` experts with top-``num_topk`` (``fp8``:
        use_fp8) and its combine. ``num_max_tokens_per_rank`` is rounded to the normal mode's bucket."""
        def cfg(width: int, dt: torch.dtype, experts: int, topk: int, tokens: int) -> EpConfig:
            return EpConfig(world_size=num_ranks, local_world_size=num_ranks, num_experts=experts, topk=topk,
                            hidden=width, dtype=dt, max_tokens=tokens)

        if low_latency:
            m = num_max_tokens_per_rank
            combine = cfg(hidden, _CARRIER, num_experts, num_topk, m)
            if not fp8:
                return combine.symmetric_bytes()
            width = -(-(hidden + 4 * (hidden // 128)) // 16) * 8
            dispatch = cfg(width, _CARRIER, num_experts, num_topk, m)
            return combine.symmetric_bytes() + dispatch.symmetric_bytes()
        m = _bucket(num_max_tokens_per_rank)
        fmt = normal.RowFormat(torch.float8_e4m3fn if fp8 else dtype, hidden,
                               torch.float32 if fp8 else None, hidden // 128 if fp8 else 0, num_topk)
        combine = cfg(hidden, dtype, num_ranks, num_ranks, m)
        total = combine.symmetric_bytes()
        if fp8 or not fmt.passthrough or dtype != _CARRIER:
            total += cfg(fmt.elems, _CARRIER, num_ranks, num_ranks, m).symmetric_bytes()
        return total

    def get_comm_stream(self) -> Any:
        """The communication stream (a high-priority ``torch.cuda.Stream``); None on a CPU."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """Not supported: there is no single raw buffer (``NotImplementedError``)."""
        raise NotImplementedError(
            "cute_ep.deep_ep: get_local_buffer_tensor is not supported: the buffers are per shape "
            "(EpBuffer's recv_x / recv_y), not one raw byte range"
        )

    @staticmethod
    def _unpack_bias(bias: Any) -> tuple[Tensor | None, Tensor | None]:
        if bias is None:
            return None, None
        if isinstance(bias, Tensor):
            return bias, None
        if isinstance(bias, tuple) and len(bias) == 2:
            return bias
        raise ValueError(f"bias must be a tensor, a tuple of two tensors or None, got {type(bias).__name__}")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config for ``num_ranks`` (its table, with ``Buffer.num_sms``); a
        count outside the table gets ``Config(Buffer.num_sms)`` (DeepEP refuses it)."""
        table = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                 24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128),
                 128: (20, 560, 32, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
        return Config(Buffer.num_sms, *table.get(num_ranks, (6, 256, 6, 128)))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config for ``num_ranks`` (as ``get_dispatch_config``)."""
        table = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                 24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
                 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
        return Config(Buffer.num_sms, *table.get(num_ranks, (6, 256, 6, 128)))

    # -- the backends' buffers -------------------------------------------------------------------

    def _used_bytes(self) -> int:
        return sum(b.cfg.symmetric_bytes() for b in self._buffers.values())

    def _buffer(self, hidden: int, dtype: torch.dtype, num_experts: int, topk: int, max_tokens: int
                ) -> tuple[tuple, Any]:
        """(key, the backend's buffer) for rows of ``hidden`` ``dtype`` elements, ``num_experts`` experts,
        top-``topk``, ``max_tokens`` tokens per rank: the one built before, or a new one (collective)."""
        key = (hidden, dtype, num_experts, topk, max_tokens)
        buf = self._buffers.get(key)
        if buf is not None:
            self._buffers.move_to_end(key)
            return key, buf
        if self.group_size > 1:  # a collective build: every rank must build the same (else a ConfigError)
            name = ("the buffers' (row width, dtype, experts, top-k, tokens per rank): x's dtype and hidden "
                    "size, num_experts, top-k and num_max_dispatch_tokens_per_rank")
            agree(self.runtime.cpu_group, "cute_ep.deep_ep: building the buffers of a new shape", None,
                  {name: (hidden, str(dtype), num_experts, topk, max_tokens)})
        env = self.runtime.env
        cfg = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                       num_experts=num_experts, topk=topk, hidden=hidden, dtype=dtype, max_tokens=max_tokens,
                       num_sms=min(Buffer.num_sms, self._sm_cap) if self.backend == "cute" else 0)
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
            buf = EpBuffer(self.runtime, cfg, registry=self._registry)
        else:
            from cute_ep.reference_backend import ReferenceEpBuffer

            buf = ReferenceEpBuffer(self.runtime, cfg)
        self._buffers[key] = buf
        return key, buf

    def _bucketed(self, hidden: int, dtype: torch.dtype, num_experts: int, topk: int, tokens: int) -> int:
        """max_tokens for a normal-mode dispatch of up to ``tokens`` tokens per rank: the least built buffer
        of this shape that holds them, else the bucket (every rank decides alike)."""
        want = _bucket(tokens)
        built = [k[4] for k in self._buffers if k[:4] == (hidden, dtype, num_experts, topk) and k[4] >= want]
        return min(built, default=want)

    def _dispatch_on(self, buf: Any, x: Tensor, ids: Tensor, weights: Tensor, layout: str) -> Any:
        self._combined.clear()  # a dispatch orders every rank's earlier combines before later writes
        return buf.dispatch(x, ids, weights, layout=layout, sync=False)

    def _fence(self, key: tuple) -> None:
        """Before writing a buffer's expert outputs again without a dispatch in between (GPU kernels
        only): wait until every peer's previous combine, which reads them, is done (one small all-reduce
        on the communication stream)."""
        if self.backend != "cute" or key not in self._combined or self.group_size == 1:
            return
        if self._nccl:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        else:  # a host barrier orders device work only after a device sync
            self.runtime.barrier()

    def _all_gather_rows(self, row: Tensor) -> Tensor:
        """[R, n]: every rank's 1-D ``row`` (same length), in rank order (collective, no host sync)."""
        if self.group_size == 1:
            return row[None]
        part = row if self._nccl or not row.is_cuda else row.cpu()
        out = [torch.empty_like(part) for _ in range(self.group_size)]
        dist.all_gather(out, part, group=self.group)
        return torch.stack(out).to(row.device)

    def _check_device(self, **tensors: Any) -> None:
        for name, t in tensors.items():
            if t is not None and t.device != self.device:
                raise ValueError(f"{name} must be on {self.device} (this Buffer's backend: {self.backend}), "
                                 f"got {t.device}")

    # -- normal mode -----------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> tuple[Tensor, Tensor | None, Tensor, Tensor, EventOverlap]:
        """DeepEP's layout: (num_tokens_per_rank [R] int32, None (no RDMA ranks), num_tokens_per_expert [E]
        int32, is_token_in_rank [T, R] bool, event). topk_idx [T, K] int64 (int32 accepted), -1: none. Exact;
        ids outside [-1, E) raise ValueError (DeepEP defines -1, no expert, and the experts; on a GPU they are
        not checked here: that is a host sync, which this call makes none of). Local: no collective."""
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
            per_rank, per_expert, in_rank = normal.dispatch_layout(topk_idx, num_experts, self.group_size)
        event = scope.finish((per_rank, per_expert, in_rank), (topk_idx,))
        return per_rank, None, per_expert, in_rank, EventOverlap(event)

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
        ranks and top-k the kernels take; ``config`` only sizes the handle's channel matrices (its num_sms
        must be even); topk_idx values outside [-1, E) raise ValueError (checked where the call syncs the
        host: on the reference backend always, on GPUs without num_worst_tokens). Without
        ``num_worst_tokens`` the call makes one host sync, and raises ``ValueError`` on every rank if some
        rank's ``num_tokens_per_rank`` disagrees with its ``is_token_in_rank`` (DeepEP would move wrong
        rows). Top-k ids and weights (and FP8 scales) ride in each token's row.
        """
        self._check_alive()
        del num_tokens_per_rdma_rank  # one NVLink domain: DeepEP's intranode dispatch ignores it too
        synced = handle is None and num_worst_tokens == 0
        a: _DispatchArgs = self._agreed("dispatch", lambda: self._dispatch_args(
            x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
            expert_alignment, num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream,
            synced), _DispatchArgs.same, synced=synced)
        world = self.group_size
        with _Scope(self, previous_event, async_finish) as scope:
            payload = a.fmt.pack(a.x, a.scales, topk_idx, topk_weights)
            ids, zero_w = normal.rank_routing(a.in_rank)
            if a.route is not None:
                _, buf = self._buffer(a.fmt.elems, _CARRIER, world, world, a.route.max_tokens)
                res = self._dispatch_on(buf, payload, ids, zero_w, "rank")
                rows = min(a.route.num_recv, world * a.route.max_tokens)
                recv_x, recv_scales, _, _ = a.fmt.unpack(res.recv_x[:rows], a.route.num_recv)
                event = scope.finish((recv_x, recv_scales), (a.x, a.scales, a.in_rank))
                out_x = (recv_x, recv_scales) if a.scales is not None else recv_x
                return out_x, None, None, None, None, EventOverlap(event)
            result = self._dispatch_fresh(a.x.shape[0], a.fmt, payload, ids, zero_w, a.in_rank,
                                          num_tokens_per_rank, num_tokens_per_expert, topk_idx,
                                          expert_alignment, num_worst_tokens, a.channels)
            recv_x, recv_scales, recv_idx, recv_w, per_expert, new_handle = result
            event = scope.finish((recv_x, recv_scales, recv_idx, recv_w, *new_handle),
                                 (a.x, a.scales, a.in_rank, topk_idx, topk_weights, num_tokens_per_rank,
                                  num_tokens_per_expert))
        out_x = (recv_x, recv_scales) if a.scales is not None else recv_x
        return out_x, recv_idx, recv_w, per_expert, new_handle, EventOverlap(event)

    def _dispatch_args(self, x: Any, handle: Any, per_rank: Any, in_rank: Any, per_expert: Any, topk_idx: Any,
                       topk_weights: Any, alignment: Any, num_worst: Any, config: Config | None,
                       previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool,
                       synced: bool) -> _DispatchArgs:
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
            if topk_idx is not None and (self.backend == "reference" or synced or not topk_idx.is_cuda):
                check_expert_ids(topk_idx, num_experts)  # on a GPU only where the call syncs anyway
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

    def _dispatch_fresh(self, tokens: int, fmt: normal.RowFormat, payload: Tensor, ids: Tensor,
                        zero_w: Tensor, in_rank: Tensor, per_rank_given: Tensor, per_expert_given: Tensor,
                        topk_idx: Tensor | None, alignment: int, num_worst: int, channels: int) -> tuple:
        """A dispatch without a cached handle (inside the call's stream scope)."""
        world, rank, dev = self.group_size, self.rank, self.device
        el = per_expert_given.shape[0] // world
        mine = torch.cat([torch.full((1,), tokens, dtype=torch.int64, device=dev),
                          in_rank.sum(dim=0, dtype=torch.int64), per_rank_given.to(torch.int64),
                          per_expert_given.to(torch.int64)])
        table = self._all_gather_rows(mine)  # [R, 1 + 2R + E]: every rank's counts
        counts = table[:, 1 : 1 + world]  # [source, destination] tokens, from is_token_in_rank
        counts_host = None
        # The call's host sync; none with num_worst_tokens on a GPU (on a CPU the table is on the host).
        host = table.cpu() if num_worst == 0 or table.device.type == "cpu" else None
        if num_worst == 0:
            given = host[:, 1 + world : 1 + 2 * world]
            bad = [r for r in range(world) if not torch.equal(given[r], host[r, 1 : 1 + world])]
            if bad:
                raise ValueError(
                    f"dispatch: num_tokens_per_rank disagrees with is_token_in_rank.sum(0) on rank(s) {bad}: "
                    f"{given[bad[0]].tolist()} vs {host[bad[0], 1 : 1 + world].tolist()}"
                )
            max_tokens = self._bucketed(fmt.elems, _CARRIER, world, world, int(host[:, 0].max()))
            counts_host = host[:, 1 : 1 + world].tolist()
            num_out = sum(row[rank] for row in counts_host)
            sums = host[:, 1 + 2 * world + rank * el : 1 + 2 * world + (rank + 1) * el].sum(dim=0).tolist()
            per_expert = [(n + alignment - 1) // alignment * alignment for n in sums]
        else:
            max_tokens = self._bucketed(fmt.elems, _CARRIER, world, world, -(-num_worst // world))
            # Every rank knows every rank's count on a CPU (all raise alike); on a GPU only its own.
            most = int(host[:, 0].max()) if host is not None else tokens
            if most > max_tokens:
                raise ValueError(
                    f"dispatch: num_worst_tokens={num_worst} sizes the buffers for {max_tokens} tokens per "
                    f"rank (ceil(num_worst_tokens / {world} ranks), rounded up), but a rank has {most}; pass "
                    f"num_worst_tokens >= num_tokens x num_ranks on every rank"
                )
            num_out, per_expert = num_worst, []
        _, buf = self._buffer(fmt.elems, _CARRIER, world, world, max_tokens)
        res = self._dispatch_on(buf, payload, ids, zero_w, "rank")
        rows = min(num_out, world * max_tokens)
        recv_x, recv_scales, gidx, gw = fmt.unpack(res.recv_x[:rows], num_out)
        count = res.recv_count.to(device=dev, dtype=torch.int64)
        valid = torch.arange(num_out, device=dev) < count  # [num_out]
        src = res.recv_src[:rows].to(torch.int64)
        src_rank = torch.zeros(num_out, dtype=torch.int64, device=dev)
        src_token = torch.zeros(num_out, dtype=torch.int64, device=dev)
        src_rank[:rows] = torch.div(src, max_tokens, rounding_mode="floor")
        src_token[:rows] = src % max_tokens
        recv_idx = recv_w = None
        if gidx is not None:
            local = gidx.to(torch.int64) - rank * el
            here = (local >= 0) & (local < el) & valid[:, None]
            recv_idx = torch.where(here, local, -1).to(topk_idx.dtype)
            recv_w = torch.where(here, gw, torch.zeros_like(gw))
        recv_src_idx = torch.where(valid, src_token, -1).to(torch.int32)
        # DeepEP's handle holds this rank's column only (the rest 0); ``route.counts`` holds them all.
        prefix = torch.zeros((world, world), dtype=torch.int32, device=dev)
        prefix[:, rank] = counts[:, rank].cumsum(dim=0).to(torch.int32)
        entries = (
            prefix,  # rank_prefix_matrix
            normal.channel_prefix_matrix(in_rank, channels),
            normal.recv_channel_prefix_matrix(src_rank, src_token, valid, table[:, 0], channels),
            recv_src_idx,
            in_rank,
            normal.send_head(in_rank, channels),
        )
        route = _NormalRoute(res.handle, max_tokens, num_out, counts, counts_host)
        return recv_x, recv_scales, recv_idx, recv_w, per_expert, NormalHandle(entries, route)

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
        ``config`` is unused. The top-k weights travel with ``all_to_all_single`` on the group; after a
        ``num_worst_tokens`` dispatch that costs one host sync (the row counts).
        """
        self._check_alive()
        del config
        route, bias_0, bias_1 = self._agreed("combine", lambda: self._combine_args(
            x, handle, topk_weights, bias, previous_event, async_finish, allocate_on_comm_stream),
            lambda _: {"x's dtype and hidden size": (str(x.dtype), x.shape[1]),
                       "topk_weights (given or None)": topk_weights is not None}, synced=False)
        world = self.group_size
        with _Scope(self, previous_event, async_finish) as scope:
            rows = min(x.shape[0], world * route.max_tokens)
            key, buf = self._buffer(x.shape[1], x.dtype, world, world, route.max_tokens)
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
            event = scope.finish((out, weights), (x, topk_weights, bias_0, bias_1, *handle))
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
        hits = in_rank.to(torch.int64)
        starts = torch.tensor([sum(home[:r]) for r in range(world)], dtype=torch.int64, device=dev)
        pos = (starts[None, :] + hits.cumsum(dim=0) - hits).clamp(max=recv.shape[0] - 1)  # [T, R]
        for r in range(world):  # ascending rank, as DeepEP sums
            acc = acc + torch.where(in_rank[:, r : r + 1], recv[pos[:, r]], torch.zeros_like(acc))
        return acc

    # -- low-latency mode ------------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """A barrier (collective): the kernels' signals never need cleaning (they count calls), so this
        only keeps DeepEP's call sequence."""
        self._check_alive()
        del num_max_dispatch_tokens_per_rank, hidden, num_experts
        self.runtime.barrier()

    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Tensor | None = None,
                             dispatch_wait_recv_cost_stats: Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:
        """DeepEP's low-latency dispatch, sync-free: ``(recv_x, recv_count, handle, event, hook)``.

        recv_x [El, R * M, H] bf16 (x's dtype), or with ``use_fp8`` ``(q, scales)``: q [El, R * M, H]
        float8_e4m3fn, scales [El, R * M, H / 128] fp32, or with ``use_ue8m0`` [El, R * M, ceil(H / 512)]
        int32 (four exponent bytes each), both column-major in their last two dimensions as DeepEP's;
        expert l's rows in slots [0, recv_count[l]) (M = num_max_dispatch_tokens_per_rank); recv_count [El]
        int32; handle: ``LowLatencyHandle`` (src_info: each slot's token index on its source;
        layout_range: ``(begin << 32) | rows`` per source rank). ``cumulative_local_expert_recv_stats`` [El]
        int32 gets recv_count added.

        The FP8 cast is DeepEP's (per 128 columns, amax at least 1e-4; ``round_scale``: power-of-two scales),
        done on the sender in torch; the values and scales arrive bit for bit. Within an expert the blocks of
        source ranks come in rank order, each source's tokens ascending (DeepEP's order depends on arrival).
        ``return_recv_hook``: the data is complete when the call returns; the hook (call it, as with DeepEP)
        does nothing. Results are fresh tensors (DeepEP's reuse two buffers). A token naming an expert twice
        is refused. Work and memory traffic scale with the receive capacity (every row a rank could get), as
        the host does not know the received count. x may be bf16, fp16 or fp32 and H any size the kernels
        take (a multiple of 128 with FP8).

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
        self._agreed("low_latency_dispatch", lambda: self._ll_dispatch_args(
            x, topk_idx, m, num_experts, stats, use_fp8, round_scale, use_ue8m0, async_finish,
            return_recv_hook), lambda _: {"x's dtype and hidden size": (str(x.dtype), x.shape[1]),
                                          "num_max_dispatch_tokens_per_rank": m, "num_experts": num_experts,
                                          "topk_idx's K": topk_idx.shape[1], "use_fp8": bool(use_fp8)},
            synced=False)
        el, hidden = num_experts // world, x.shape[1]
        with _Scope(self, None, async_finish) as scope:
            if use_fp8:
                q, scale_inv = ll.cast_fp8_blocks(x, round_scale)
                payload = ll.fp8_payload(q, scale_inv)
            else:
                payload = x.contiguous()
            _, buf = self._buffer(payload.shape[1], payload.dtype, num_experts, topk_idx.shape[1], m)
            self._ll_index ^= 1
            weights = torch.zeros(topk_idx.shape, dtype=torch.float32, device=self.device)
            res = self._dispatch_on(buf, payload, topk_idx.contiguous(), weights, "expert")
            padded = ll.padded_layout(res.recv_x, res.recv_src, res.tokens_per_expert, world, m,
                                      topk_idx.shape[1])
            if use_fp8:
                q_rows, s_rows = ll.split_fp8_payload(padded.rows, hidden)
                recv_q = q_rows.contiguous()
                slots, nsc = world * m, s_rows.shape[-1]
                if use_ue8m0:
                    packed = ll.ue8m0_pack(s_rows.reshape(-1, nsc)).view(el, slots, -1)
                    scales = torch.empty((el, packed.shape[-1], slots), dtype=torch.int32, device=self.device)
                else:
                    packed = s_rows
                    scales = torch.empty((el, nsc, slots), dtype=torch.float32, device=self.device)
                scales = scales.transpose(1, 2)
                scales.copy_(packed)
                recv: Any = (recv_q, scales)
            else:
                recv = padded.rows
            if stats is not None:
                stats.add_(padded.count)
            route = _LowLatencyRoute(res.handle, padded.slot, m, hidden, num_experts, x.shape[0])
            handle = LowLatencyHandle((padded.src_info, padded.layout_range, m, hidden, num_experts), route)
            outputs = (*(recv if isinstance(recv, tuple) else (recv,)), padded.count, padded.src_info,
                       padded.layout_range, padded.slot)
            event = scope.finish(outputs, (x, topk_idx, stats))
        extra = (x, topk_idx, *outputs[:-1], stats) if async_finish else None
        hook = _no_wait if return_recv_hook else None
        return recv, padded.count, handle, EventOverlap(event, extra), hook

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
        route, src = self._agreed("low_latency_combine", lambda: self._ll_combine_args(
            x, topk_idx, topk_weights, handle, zero_copy, out, async_finish and return_recv_hook), lambda r: {
                "x's dtype": str(r[1].dtype),
                "the handle's (num_max_dispatch_tokens_per_rank, hidden, num_experts)": (
                    r[0].max_tokens, r[0].hidden, r[0].num_experts)}, synced=False)
        hidden, k = route.hidden, route.dispatch_handle.topk_idx.shape[1]
        with _Scope(self, None, async_finish) as scope:
            key, buf = self._buffer(hidden, src.dtype, route.num_experts, k, route.max_tokens)
            self._fence(key)
            self._ll_index ^= 1
            y = buf.expert_output(buf.cfg.capacity)
            ll.expert_major_rows(src, route.slot, y)
            sent = route.dispatch_handle
            ids = torch.where(topk_idx < 0, torch.full_like(sent.topk_idx, -1), sent.topk_idx).contiguous()
            combined = buf.combine(y, dataclasses.replace(sent, topk_idx=ids,
                                                          topk_weights=topk_weights.contiguous()))
            self._combined.add(key)
            if out is not None:
                out.copy_(combined)
                combined = out
            event = scope.finish((combined,), (x, topk_idx, topk_weights, *handle[:2]))
        extra = (x, topk_idx, topk_weights, *handle[:2], combined) if async_finish else None
        return combined, EventOverlap(event, extra), _no_wait if return_recv_hook else None

    def _ll_combine_args(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, zero_copy: bool,
                         out: Any, both_flags: bool) -> tuple[_LowLatencyRoute, Tensor]:
        """``low_latency_combine``'s arguments checked on this rank: (the handle's route, the rows to read:
        x, or with ``zero_copy`` the next staging tensor)."""
        if both_flags:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        route = self._route(handle, LowLatencyHandle).cute_ep
        world, el = self.group_size, route.num_experts // self.group_size
        slots, hidden, t = world * route.max_tokens, route.hidden, route.num_tokens
        k = route.dispatch_handle.topk_idx.shape[1]
        check_tensors(self.device, x=(x, f"[{el}, {slots}, {hidden}] bfloat16", torch.bfloat16),
                      topk_idx=(topk_idx, f"[{t}, {k}] int64", torch.int64),
                      topk_weights=(topk_weights, f"[{t}, {k}] float32", torch.float32),
                      out=(out, f"[{t}, {hidden}] bfloat16", torch.bfloat16))
        src = self._staging(route)[self._ll_index] if zero_copy else x
        if tuple(src.shape) != (el, slots, hidden):
            raise ValueError(f"x must be [{el}, {slots}, {hidden}] (local experts, ranks x "
                             f"num_max_dispatch_tokens_per_rank, hidden: the dispatch's padded layout), got "
                             f"{list(src.shape)}")
        _check_row_dtype("x", src, " (combine sums in float32)")
        if tuple(topk_idx.shape) != (t, k) or topk_idx.dtype not in _ID_DTYPES:
            raise ValueError(f"topk_idx must be [{t}, {k}] int64 (the dispatch's), got "
                             f"{list(topk_idx.shape)} {topk_idx.dtype}")
        if tuple(topk_weights.shape) != (t, k) or topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_weights must be [{t}, {k}] float32, got {list(topk_weights.shape)} "
                             f"{topk_weights.dtype}")
        if out is not None and (tuple(out.shape) != (t, hidden) or out.dtype != src.dtype):
            raise ValueError(f"out must be [{t}, {hidden}] {src.dtype}, got {list(out.shape)} {out.dtype}")
        self._check_device(x=src, topk_idx=topk_idx, topk_weights=topk_weights, out=out)
        if self.backend == "reference" or not topk_idx.is_cuda:  # on a GPU: a host sync, so not checked
            self._check_same_ids(topk_idx, route.dispatch_handle.topk_idx)
        return route, src

    @staticmethod
    def _check_same_ids(topk_idx: Tensor, sent: Tensor) -> None:
        """low_latency_combine's ids: the dispatch's, or -1 (the pair is skipped)."""
        differ = (topk_idx >= 0) & (topk_idx.long() != sent.long())
        if bool(differ.any()):
            t, j = (int(i) for i in differ.nonzero()[0])
            raise ValueError(f"topk_idx must be the ids low_latency_dispatch was given, or -1 to skip a "
                             f"pair, got {int(topk_idx[t, j])} at [{t}, {j}] where the dispatch had "
                             f"{int(sent[t, j])}")

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

    # -- argument checks -------------------------------------------------------------------------

    def _agreed(self, what: str, check: Callable[[], Any], same: Callable[[Any], dict[str, Any]], *,
                synced: bool) -> Any:
        """``check()`` (a call's argument checks on this rank; returns what the call needs), agreed over the
        group before anything moves (``checks.agree``: if any rank's arguments are wrong, or ``same(result)``
        differs between ranks, every rank raises ValueError) wherever the call waits on the host anyway: on
        the reference backend, and on the kernels' only with ``synced``. A sync-free call on the kernels
        raises on the rank at fault alone (an agreement would be a collective and a host sync; its peers'
        kernels end with PeerTimeout)."""
        result, error = error_of(check)
        if self.group_size > 1 and (self.backend == "reference" or synced):
            agree(self.runtime.cpu_group, what, error, {} if error is not None else same(result))
        elif error is not None:
            raise error
        return result

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

    @staticmethod
    def _route(handle: Any, kind: type) -> Any:
        if not isinstance(handle, kind):
            raise ValueError(
                f"handle must be the {kind.__name__} this Buffer's "
                f"{'dispatch' if kind is NormalHandle else 'low_latency_dispatch'} returned (it carries the "
                f"routing of cute_ep's kernels), got {type(handle).__name__}"
            )
        return handle

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

    def _check_num_experts(self, num_experts: Any) -> None:
        if not isinstance(num_experts, numbers.Integral) or num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(
                f"num_experts must be a positive multiple of {self.group_size} ranks, got {num_experts}"
            )

    def _ll_dispatch_args(self, x: Any, topk_idx: Any, m: Any, num_experts: Any, stats: Any, use_fp8: bool,
                          round_scale: bool, use_ue8m0: bool, async_finish: bool,
                          return_recv_hook: bool) -> None:
        """``low_latency_dispatch``'s arguments checked on this rank."""
        check_tensors(self.device, x=(x, "[T, H] bfloat16", torch.bfloat16),
                      topk_idx=(topk_idx, "[T, K] int64", torch.int64),
                      cumulative_local_expert_recv_stats=(stats, "[El] int32", torch.int32))
        self._check_ll_inputs(x, topk_idx, m, num_experts, use_fp8)
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (as DeepEP)")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        el = num_experts // self.group_size
        if stats is not None and (tuple(stats.shape) != (el,) or stats.dtype != torch.int32):
            raise ValueError(f"cumulative_local_expert_recv_stats must be [{el}] int32, got "
                             f"{list(stats.shape)} {stats.dtype}")
        self._check_device(x=x, topk_idx=topk_idx, cumulative_local_expert_recv_stats=stats)
        if self.backend == "reference" or not topk_idx.is_cuda:  # on a GPU the kernels check them
            check_expert_ids(topk_idx, num_experts)

    def _check_ll_inputs(self, x: Tensor, topk_idx: Tensor, m: Any, num_experts: Any, use_fp8: bool) -> None:
        if x.dim() != 2 or (x.shape[1] * x.element_size()) % 16:
            raise ValueError(f"x must be [T, H] with rows a multiple of 16 bytes, got {list(x.shape)} "
                             f"{x.dtype}")
        _check_row_dtype("x", x)
        if use_fp8 and x.shape[1] % 128:
            raise ValueError(f"use_fp8 needs hidden to be a multiple of 128, got {x.shape[1]}")
        if not isinstance(m, numbers.Integral) or m < 1:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be an int >= 1, got {m!r}")
        if x.shape[0] > m:
            raise ValueError(f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={m}")
        t = x.shape[0]
        if topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_idx.dtype not in _ID_DTYPES:
            raise ValueError(f"topk_idx must be [{t}, K] int64, got {list(topk_idx.shape)} {topk_idx.dtype}")
        self._check_num_experts(num_experts)


def _check_row_dtype(name: str, rows: Tensor, why: str = "") -> None:
    """ValueError unless ``rows`` (the argument ``name``) is bfloat16, float16 or float32, saying how to
    convert it."""
    if rows.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be bfloat16, float16 or float32{why}, got {rows.dtype}; convert it "
                         f"with {name}.to(torch.bfloat16)")


def _no_wait() -> None:
    """The receive hook: the data is already complete (``low_latency_dispatch``)."""
