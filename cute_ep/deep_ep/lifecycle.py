"""What a ``cute_ep.deep_ep.Buffer`` holds from its creation to ``destroy()`` (``BufferLifecycle``): the
group and its runtime, the backend, the device, the byte budget of the kernels' symmetric buffers, NVSHMEM
and the compiled-module registry (GPUs), and the communication stream; and where each call's work runs
(``_Scope``: on that stream, with torch's own defaults).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.collectives import world_of
from cute_ep.deep_ep.ll_graphs import LowLatencyGraphs
from cute_ep.deep_ep.runtime import GroupRuntime, NvshmemSession, choose_backend, resolve_group
from cute_ep.deep_ep.utils import EventHandle, plain_torch_defaults

__all__ = ["BUDGET_ENV_VAR", "BufferLifecycle"]

BUDGET_ENV_VAR = "CUTE_EP_DEEP_EP_SYMMETRIC_BYTES"
"""Overrides a Buffer's symmetric byte budget (a size as NVSHMEM_SYMMETRIC_SIZE takes it: "8G", "512M")."""


class _Scope:
    """One call's work on the Buffer's communication stream (``cute_ep.deep_ep.buffer``'s docstring:
    Streams); on a CPU, in place. Inside it torch's defaults are its own (``utils.plain_torch_defaults``)."""

    def __init__(self, buffer: BufferLifecycle, previous_event: Any = None,
                 async_finish: bool = False) -> None:
        self.previous = getattr(getattr(previous_event, "event", None), "event", None)
        # A call with neither previous_event nor async_finish runs on the caller's stream: its order is the
        # same (the caller's stream would wait for the communication stream right away), and the outputs
        # belong to the stream that uses them. On the communication stream they must be marked as used by
        # the caller's (record_stream), and the allocator then keeps each freed block until an event
        # passes: with the host ahead of the GPU, every call allocated anew (a cudaMalloc per call).
        in_place = not async_finish and self.previous is None
        self.comm = None if in_place else buffer._comm_stream
        self.async_finish = async_finish
        self.compute: Any = None
        self._ctx: Any = None
        self._defaults: Any = None

    def __enter__(self) -> _Scope:
        self._defaults = plain_torch_defaults()
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
        async_finish the inputs as used by the communication stream. A call that ran on the caller's
        stream (or on a CPU) has nothing to wait for or mark."""
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


class BufferLifecycle:
    """A ``Buffer`` from its creation (``_init``: every attribute the other parts of ``Buffer`` read) to
    ``destroy()``, and its communication stream."""

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
        self._ll_replay_handles: list = [None, None]  # per parity, the latest replayed dispatch's handle
        self._ll_staging: dict[tuple, list[Tensor | None]] = {}
        self._ll_kept: dict[tuple, Any] = {}  # LowLatencyMode._ll_kept_of: tensors and scratch kept per shape
        self._ll_graphs = LowLatencyGraphs()  # low-latency calls replayed from CUDA graphs (GPUs)
        self._routing_kept: tuple = (None, None)  # FreshDispatch._rank_routing: (shape, its constants)
        self._layout_kernel_takes: set[tuple] = set()  # NormalMode._layout_kernel_for: the calls checked
        self._known_dispatches: dict[tuple, Any] = {}  # NormalMode's _KnownDispatch per kind of cached call
        self._fence_zero: Any = None  # BufferPool._fence's all-reduce operand, made on first use

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

    def destroy(self) -> None:
        """Free the buffers (collective: every rank calls it) and, with the last Buffer of the process,
        NVSHMEM; on a gloo group, wait until gloo's worker threads hold nothing of this Buffer's collectives
        (``checks.drain_gloo``: a program may keep its group until it exits). Safe to call twice, and after
        a call that raised. (DeepEP allows it only with ``explicitly_destroy``; here always.)"""
        if self.runtime is None:
            return
        try:
            with plain_torch_defaults():
                self._release()
        finally:
            if self._owns_runtime:
                self.runtime.close()  # lets gloo's workers finish with this Buffer's collectives first
            self.runtime = self.group = None  # a destroyed Buffer refers to no process group

    def _forget_replays(self) -> None:
        """Drop the low-latency graphs and the handles of their replays: a buffer they launch on, or whose
        tensors a handle holds, is being freed."""
        self._ll_graphs.clear()
        self._ll_replay_handles = [None, None]

    def _release(self) -> None:
        self._forget_replays()  # they launch on the buffers freed below
        self._known_dispatches.clear()  # they name the buffers freed below
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

    def get_comm_stream(self) -> Any:
        """The communication stream (a high-priority ``torch.cuda.Stream``); None on a CPU."""
        return self._comm_stream
