"""``EpBuffer``: the buffers of ``kernels.buffers.BUFFERS`` + the compiled kernels of one configuration.

    buf = EpBuffer(runtime, cfg)                    # collective: every rank, same cfg
    res = buf.dispatch(x, topk_idx, topk_weights)   # rows land in res.recv_x, expert-major
    y = buf.expert_output(res.num_recv)             # the experts' outputs go here (or in any [N, H] tensor)
    out = buf.combine(y, res.handle)                # [T, H], top-k weighted sum
    buf.close()

The public calls are those of ``cute_ep.api.EpBackend`` (argument shapes and dtypes there); the GPU buffer
adds ``launch_dispatch`` / ``launch_combine`` (no checks, no host sync: capturable in CUDA graphs),
``launch_cached_dispatch`` (along the latest dispatch's routing), ``fp8_views`` and ``check_faults``.

Ordering: every call is collective and every rank makes the same sequence of calls. No rank moves a
dispatch's rows before every peer has entered that dispatch (its layout's count exchange, or a cached
dispatch's wait), i.e. before everything a peer enqueued earlier on its stream (its experts reading
``recv_x``, its combine reading peers' ``recv_y``) has finished: calls on one stream per rank never
overwrite rows still in use. Work on another stream must be ordered before the next dispatch by the
caller, and the views a dispatch returns are valid until the next dispatch.

Faults: every wait for a peer is bounded by ``cfg.timeout_s``. A rank whose peer never arrives (it skipped a
call, died, or runs a different sequence of calls) gets ``PeerTimeout`` naming the peer and the operation
instead of a hang; from then on the buffer's kernels move no data, and it must be closed and rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from cute_ep.api import BackendBase, DispatchHandle, DispatchResult
from cute_ep.cached_dispatch import CachedDispatch
from cute_ep.gpu_checks import (
    check_gpu_runtime,
    check_kernel_handle,
    check_kernel_layout,
    check_reduced_handle,
)
from cute_ep.input_checks import (
    check_buffer_config,
    check_combine_input,
    check_combine_out,
    check_dispatch_algorithm,
    check_dispatch_inputs,
    check_dispatch_options,
    check_topk_values,
    note_dispatch_rows,
)
from cute_ep.kernels.buffers import BUFFERS, CALL, HOST, STATUS, SYMMETRIC, Buffer, Pointers, buffers_of
from cute_ep.kernels.config import (
    DISPATCH_ALGORITHMS,
    MODES,
    OP_COMBINE,
    OP_DISPATCH,
    OP_LAYOUT,
    ConfigError,
    EpConfig,
)
from cute_ep.kernels.variants import variant
from cute_ep.launcher import current_stream_handle, storage_addresses
from cute_ep.low_latency_launches import LowLatencyLaunches
from cute_ep.module_launch import ModuleLaunch
from cute_ep.received_views import ReceivedViews
from cute_ep.spare import SpareOutputs, handle_storage
from cute_ep.status import StatusBlock
from cute_ep.status_checks import StatusChecks
from cute_ep.streams import on_stream

__all__ = ["EpBuffer", "check_gpu_runtime"]


class EpBuffer(StatusChecks, ModuleLaunch, LowLatencyLaunches, CachedDispatch, ReceivedViews, BackendBase):
    """Owns one configuration's NVSHMEM symmetric buffers and compiled module (see module docstring).

    runtime:  a started ``cute_ep.bootstrap.Runtime`` with backend "nvshmem".
    cfg:      the ``EpConfig``; world_size must match the runtime's.
    registry: a ``ModuleRegistry`` to share compiled modules between buffers (one is made otherwise).
    algorithm: the dispatch primitive (kernels.config.DISPATCH_ALGORITHMS): "dedup" (default: a row
             crosses the link once per destination rank), "per_pair" (every (token, k) row), "put_warp"
             (every row with put_warp), or "auto": time the three at ``cfg.max_tokens`` tokens now
             (collective; the slowest rank's median decides; ``self.algorithm_table`` holds the table)
             and use the fastest. ``profile_cache``: a ``cute_ep.profiler.ProfileCache`` to keep and
             reuse that choice per shape.

    Every buffer of ``kernels.buffers.BUFFERS`` that is not a per-call argument is an attribute of the
    same name (``recv_x``, ``signals``, ``epochs``, ...), allocated from its table shape.
    """

    _dispatches = 0  # dispatches so far (a count read for an older one would be a later one's)
    _latest_scatter: torch.Tensor | None = None  # the latest dispatch's handle's slots (combine's staging)

    def __init__(self, runtime: Any, cfg: EpConfig, registry: Any = None, algorithm: str = "dedup",
                 profile_cache: Any = None) -> None:
        check_dispatch_algorithm(algorithm, allow_auto=True)
        check_gpu_runtime(runtime)  # before anything touches CUDA or imports the GPU stack

        from cute_ep.bootstrap.compile import ModuleRegistry
        from cute_ep.kernels.host import build, make_pointer, size_scalars
        from cute_ep.launcher import Launcher

        # num_sms 0 (the default) becomes the least SM share of any rank (its GPU, over the ranks on it).
        cfg = check_buffer_config(runtime, cfg, kernels=True)
        if cfg.num_sms < 1:
            raise ConfigError(f"num_sms 0 (this rank's share of its GPU) needs a runtime on a GPU, got "
                              f"device {getattr(runtime, 'device', None)}")
        self.runtime, self.cfg, self.rank, self.device = runtime, cfg, runtime.env.rank, runtime.device
        index = self.device.index
        self._device_index = torch.cuda.current_device() if index is None else index
        self._closed = False
        self._own_registry = registry is None
        self.registry = registry if registry is not None else ModuleRegistry(device_id=self._device_index)
        if self._own_registry:
            runtime.add_finalizer(self.registry.finalize_all)
        # Compile (or fetch) first: it is local work that can fail, and nothing is allocated yet.
        self.module = self.registry.get(cfg.compile_key(), lambda: build(cfg))

        self.status = StatusBlock(cfg, self.device)  # epochs, fault, num_recv, dropped: one host copy
        self._symmetric: list[torch.Tensor] = []
        for b in BUFFERS:
            if b.place != CALL:
                setattr(self, b.name, self._allocate(b))
        self._calls = [0, 0, 0]  # launches per operation: the epochs a completed call reaches
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # routing of the latest dispatch
        self._latest_recv: int | None = None  # its num_recv (None: not read back, sync=False or launch_*)
        self._drops = torch.zeros(cfg.num_experts, dtype=torch.int64)  # read from the device, not reported
        self._handle_sets = SpareOutputs(handle_storage)  # dispatch()'s handle storage made ahead (spare.py)
        self.poison()
        runtime.barrier()  # synchronizes the device first: every rank's signals are zero before any signal

        # Stand-ins for empty per-call tensors (a kernel needs a valid pointer even for zero tokens).
        one = SimpleNamespace(num_tokens=1, capacity=1, hidden=cfg.hidden, topk=cfg.topk, experts_per_rank=1,
                              rank_capacity=1, world_size=1, fp8_scales=1)
        self._empty = {b.name: torch.empty(b.shape(one), dtype=b.torch_dtype(cfg), device=self.device)
                       for b in buffers_of(CALL)}
        self._align = {b.name: b.align(cfg) for b in buffers_of(CALL)}
        self._empty_addr = {name: t.data_ptr() for name, t in self._empty.items()}
        # The module's argument storage, made once: a launch writes only what changes (kernels/host.py).
        tensors = {b.name: self._empty[b.name] if b.place == CALL else getattr(self, b.name) for b in BUFFERS}
        pointers = Pointers(*(make_pointer(cfg, n, t.data_ptr()) for n, t in tensors.items()))
        self._launcher = Launcher(self.module, size_scalars(cfg), pointers, self.rank)
        self.algorithm_table: str | None = None
        self.algorithm = algorithm
        if algorithm == "auto":
            from cute_ep.profiler import choose_dispatch_algorithm

            self.algorithm, self.algorithm_table = choose_dispatch_algorithm(self, profile_cache)
            self.poison()  # the timed dispatches left rows behind

    def _allocate(self, b: Buffer) -> torch.Tensor:
        """One table buffer: symmetric (zeroed) when peers use it and this config needs it, else local."""
        c = self.cfg
        if b.place == STATUS:
            return self.status.views[b.name]
        if b.place == HOST:
            return self.status.mirror
        shape, dtype = b.alloc_shape(c), b.torch_dtype(c)
        if b.place == SYMMETRIC and b.is_needed(c):
            import nvshmem.core.interop.torch as nvshmem_torch

            tensor = nvshmem_torch.tensor(shape, dtype=dtype)
            tensor.zero_()  # counts and signals must start at zero; the rest is poisoned or written first
            self._symmetric.append(tensor)
            return tensor
        return torch.full(shape, b.fill, dtype=dtype, device=self.device)

    # -- public API ------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 mode: str = "scatter", fp8: bool = False, algorithm: str | None = None, sync: bool = True,
                 layout: str = "expert", *, stream: torch.cuda.Stream | None = None,
                 previous_event: torch.cuda.Event | None = None,
                 deliver: tuple[int, tuple[torch.Tensor, ...]] | None = None) -> DispatchResult:
        """Send every (token, k) row to the rank owning expert ``topk_idx[t, k]`` (arguments, returns and
        errors: ``cute_ep.api.EpBackend.dispatch``). Collective.

        stream / previous_event (GPU only): run the kernels on ``stream`` (e.g. a communication stream,
        with ``cfg.num_sms`` bounding the SMs they take), after ``previous_event`` (default: after the
        caller's current stream); the result's ``event`` marks their end on ``stream``. With only
        ``previous_event``, the current stream waits for it first. deliver: the received rows also copied
        into the caller's tensors by the same launch (``launch_dispatch``'s).

        Host syncs: one wait for the status (sizes, faults, refused inputs, drops), which the layout kernel
        writes into pinned host memory once the count is known (no copy, no stream sync); the rows may still
        be moving when the call returns, and the stream orders every later use of them. A peer that times out
        after that raises at the next check, as after sync=False, which waits for nothing. Its views (recv_x,
        ...) are the same tensors in every call of a layout, format and count (views of the buffer's memory,
        made once: resize or restride them in place and the next such results see it). The ids' values are
        checked on the device; a refused call raises ``ValueError`` on every rank (this rank's own inputs
        named as before, else the rank that passed invalid ones). The handle's slots, ids and weights are its
        own, made ahead for the next calls of one shape (``cute_ep.spare``).
        """
        self._check_open()
        check_kernel_layout(self.cfg, layout, mode, fp8)
        check_dispatch_options(self.cfg, mode, fp8)
        check_dispatch_algorithm(algorithm)
        x, idx, w = check_dispatch_inputs(self.cfg, self.device, x, topk_idx, topk_weights, values=False)
        t, c = x.shape[0], self.cfg
        by_rank = layout == "rank"
        # Host work is ordered around the launch and the one wait for the status: before the launch only what
        # the kernels write into, the handle while they run, after the wait the count's views. A tensor op
        # costs 1.4-5 us of host time on an H200 host, so the calls below are counted.
        with on_stream(self.device, stream, previous_event, x, idx, w) as on:
            # The handle owns its routing (a caller editing its tensors later cannot change combine): the
            # layout writes the slots into the first of its three [T, K] tensors and copies the ids and
            # weights into the others (the launch takes their addresses). Made ahead of the call, many at
            # once, on this stream (``cute_ep.spare``).
            on_this = current_stream_handle(self._device_index)
            key = (t, c.topk, self.device, on_this)
            scatter, idx_own, w_own, own = self._handle_sets.take(key)
            # A synced call's status: the layout kernel writes it into pinned host memory once the count
            # is known, which the host polls (no copy, no stream sync); ``read()`` when that is off or did
            # not happen.
            seq = self.status.next_seq() if sync and self.status.use_mirror() else 0
            self._enqueue_dispatch(x, idx, w, mode, fp8, algorithm, layout, own=own if t else None,
                                   mirror_seq=seq, deliver=deliver)
            self._handle_sets.refill(key, 3 * 4 * t * c.topk)  # three [T, K] of 4 bytes, as the kernels run
            event = on.record_event() if stream is not None else None
            handle = DispatchHandle(idx_own, w_own, scatter, t, mode, layout)
            self._sent = (idx_own, w_own)
            self._latest_scatter = scatter  # device's num_recv is this dispatch's (combine's staging)
            status = num_recv = running = None
            if seq and self.status.wait_mirror(seq, on_this):
                # mirrored by the layout kernel: this dispatch's rows may still be moving
                running = OP_DISPATCH
                num_recv = self.status.quiet_count(self._calls, OP_LAYOUT, OP_DISPATCH, OP_COMBINE,
                                                   running=running)
                status = None if num_recv is not None else self.status.mirrored()  # checked below
            elif sync:
                status = self.status.read()
        if stream is not None:  # made on ``stream``, used on the caller's
            caller = torch.cuda.current_stream(self.device)
            scatter.record_stream(caller)  # the slots' and ids' storage
            w_own.record_stream(caller)
        if status is not None:
            self._check_ran(status, OP_LAYOUT, OP_DISPATCH, OP_COMBINE, running=running)
            refused = self.status.refused_inputs(status)
            if refused is not None:
                check_topk_values(c, topk_idx)  # this rank's own inputs: the message names them
                raise ValueError(f"dispatch: {refused}")
            num_recv = status["num_recv"]
        # What combine's y must hold for this handle (check_combine_input): the count; without sync the
        # whole capacity, or as many rows as the count on the device says (read only for such a y).
        self._dispatches += 1
        self._latest_recv = num_recv
        note_dispatch_rows(handle, self._count_reader() if num_recv is None else num_recv)
        rows = num_recv if num_recv is not None else c.rank_capacity if by_rank else c.capacity
        recv_x, recv_w, recv_src, scales, *per_k = self._received(rows, by_rank, bool(fp8))
        # tokens_per_expert and the count are the buffer's own (views valid until the next dispatch).
        result = DispatchResult(recv_x, recv_w, recv_src, self.tokens_per_expert, rows, handle,
                                scales, self.num_recv, event, *per_k)
        if status is not None:
            self._take_drops(status["dropped"], result)
        return result

    def launch_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        mode: str = "scatter", fp8: bool | int = False, algorithm: str | None = None,
                        layout: str = "expert", *,
                        own: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        deliver: tuple[int, tuple[torch.Tensor, ...]] | None = None,
                        assemble: tuple[torch.Tensor, torch.Tensor] | None = None) -> DispatchHandle:
        """Enqueue the layout, dispatch and fan-out kernels on the current stream (one launch of the
        module): no checks, no host sync, so the call can be captured in a CUDA graph.

        Arguments must already satisfy ``check_dispatch_inputs`` (topk_idx int32, and for fp8
        ``cfg.check_fp8``). The results stay in the buffer on the device: ``recv_x`` (or ``fp8_views``)
        / ``recv_w`` / ``recv_src`` (first ``num_recv[0]`` rows), ``tokens_per_expert``, ``scatter``,
        ``dropped`` (see ``check_capacity``). Returns a handle that refers to (does not copy) the given
        routing tensors and the buffer's ``scatter``: valid for ``launch_combine`` until the next dispatch.
        fp8: True, or a scale rule of ``kernels.config`` (``FP8_SCALE_*``; True is ``FP8_SCALE_DIVIDE``).
        own: (slots [T, K] int32, ids [T, K] int32, weights [T, K] fp32), contiguous, the caller's to keep:
        the layout writes the slots into the first and copies topk_idx / topk_weights into the others, and
        the handle refers to these three instead (valid for as long as the caller keeps them unwritten).
        deliver: (rows, parts), parts up to 3 contiguous 2-D tensors of at least ``rows`` rows, on the
        buffer's device, 16-byte aligned: the same launch then copies the first ``rows`` received rows out
        of ``recv_x`` into them (kernels/deliver.py), part i taking the next ``parts[i].shape[1] *
        element_size`` bytes of each row (a multiple of 4; together at most a row), so they outlive the
        buffer's next dispatch. ``ValueError`` for parts that do not fit a row.
        assemble: (values [T, V] contiguous, words [T, S] of 4-byte elements, any strides >= 0), on the
        buffer's device: the same launch first writes each row of x (contiguous, the launch's to write) as
        the row of values' bytes, then its S words, then zeros (kernels/assemble.py); e.g. FP8 rows and
        their scales. ``ValueError`` for parts that do not fit a row.
        """
        t = x.shape[0]
        self._enqueue_dispatch(x, topk_idx, topk_weights, mode, fp8, algorithm, layout,
                               own=storage_addresses(own) if t and own is not None else None, deliver=deliver,
                               assemble=assemble if t else None)
        slots, ids, weights = own if own is not None else (self.scatter[:t], topk_idx, topk_weights)
        handle = DispatchHandle(ids, weights, slots, t, mode, layout)
        self._note_launched_dispatch(handle)
        return handle

    def replayed_dispatch(self, handle: DispatchHandle) -> None:
        """Note a ``launch_dispatch`` replayed from a CUDA graph the caller captured it into, as its launch
        would have: ``handle`` (the one the captured call returned) is the latest dispatch's, and the
        layout and dispatch ran once more (what ``check_ran`` expects)."""
        self._note_launched_dispatch(handle)
        self._calls[OP_LAYOUT] += 1
        self._calls[OP_DISPATCH] += 1

    def replayed_combine(self) -> None:
        """Note a ``launch_combine`` replayed from a CUDA graph: the combine ran once more (``check_ran``)."""
        self._calls[OP_COMBINE] += 1

    def _note_launched_dispatch(self, handle: DispatchHandle) -> None:
        self._sent = (handle.topk_idx, handle.topk_weights)
        self._latest_scatter = handle.scatter
        self._dispatches += 1
        self._latest_recv = None  # the count stays on the device: combine takes y of the whole capacity
        note_dispatch_rows(handle, None)

    def _enqueue_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                          mode: str, fp8: bool | int, algorithm: str | None, layout: str,
                          own: tuple[int, int, int] | None = None,
                          mirror_seq: int = 0, deliver: tuple[int, tuple[torch.Tensor, ...]] | None = None,
                          assemble: tuple[torch.Tensor, torch.Tensor] | None = None,
                          routed: torch.Tensor | None = None) -> None:
        """One launch of the module: the layout (its own kernel, or folded into the dispatch's CTAs up to
        cfg.layout_in_dispatch tokens), the dispatch and the fan-out. The slots go to the buffer's
        ``scatter``, or with ``own`` = addresses of contiguous [T, K] (slots int32, ids int32, weights fp32)
        to the first, and the layout copies ``topk_idx`` / ``topk_weights`` into the others.
        ``mirror_seq`` (not 0): the layout kernel mirrors the status block into pinned host memory once the
        count is known (``StatusBlock.wait_mirror``). ``deliver``, ``assemble``: see ``launch_dispatch``.
        ``routed``: the latest layout's [T, K] slots, sent on with no layout (``launch_cached_dispatch``; mode
        "scatter")."""
        by_rank = layout == "rank"
        # The rank layout's rows have one order: its slots always come from the layout kernel.
        kernel_mode = MODES["scatter" if by_rank else mode]
        self._launch(OP_DISPATCH, x.shape[0], x=x, idx=topk_idx, w=topk_weights, own=own, scatter=routed,
                     routed=int(routed is not None), mirror_seq=mirror_seq, mode=kernel_mode, deliver=deliver,
                     fp8=fp8, assemble=assemble, algo=DISPATCH_ALGORITHMS[algorithm or self.algorithm],
                     # a reduced-combine buffer makes every expert-layout dispatch record the (token, rank)
                     # groups; the rank layout's dispatch is one for both of its combines
                     **variant(layout, None if by_rank else self.cfg.combine_algorithm).scalars)

    def launch_combine(self, handle: DispatchHandle, out: torch.Tensor, algorithm: str | None = None, *,
                       y: torch.Tensor | None = None, y_slot: torch.Tensor | None = None) -> None:
        """Enqueue the combine kernel(s) on the current stream: no host sync (capturable), and of the
        arguments only ``out`` is checked (host-side: its shape, dtype, device and contiguity).

        Reads the symmetric ``recv_y`` (see ``expert_output``); out [handle.num_tokens, H] cfg.dtype,
        contiguous, on the buffer's device (``ValueError`` otherwise: the kernels write every row).
        algorithm: "pull" or "reduced" (default: ``cfg.combine_algorithm``); see ``combine``. A rank-layout
        handle's combine has one result: pulled, or pushed with "reduced" where ``pushes(handle)``.
        y: the caller's expert outputs, staged into ``recv_y`` by the same launch first, as ``combine``
        stages them (for this buffer's latest dispatch only the rows it received). y_slot [C'] int64,
        contiguous, with y: row j of ``recv_y`` is staged from ``y[y_slot[j]]`` (a gather; y any [N, H]
        rows of cfg.dtype, every value in [0, N): not checked on the device).
        """
        check_combine_out(self.cfg, self.device, out, handle.num_tokens)
        staged, y_rows, slots = (None, 0, None) if y is None else self._staging(y, handle, y_slot)
        self._enqueue_combine(handle, out, algorithm, staged, y_rows, slots)

    def _enqueue_combine(self, handle: DispatchHandle, out: torch.Tensor, algorithm: str | None,
                         y: torch.Tensor | None = None, y_rows: int = 0,
                         y_slot: torch.Tensor | None = None) -> None:
        """``launch_combine`` without the check of ``out`` (``combine`` makes its own); ``y`` / ``y_rows`` /
        ``y_slot``: the caller's expert outputs the module stages into ``recv_y`` first (``_staging``)."""
        t = handle.num_tokens
        # The kernels read the handle's slots where they are (a handle from dispatch() owns a copy): no
        # copy into the buffer's ``scatter`` unless they are not laid out as it is.
        scatter = handle.scatter
        if scatter.dtype != torch.int32 or not scatter.is_contiguous() or scatter.device != self.device:
            self.scatter[:t].copy_(scatter.reshape(t, self.cfg.topk))
            scatter = self.scatter
        if handle.layout == "rank":  # one result: pulled, pushed only where asked for and possible
            algorithm = "reduced" if algorithm == "reduced" and self.pushes(handle) else "pull"
        self._launch(OP_COMBINE, t, idx=handle.topk_idx, w=handle.topk_weights, out=out, scatter=scatter,
                     y=y, y_rows=y_rows, y_slot=y_slot,
                     **variant(handle.layout, algorithm or self.cfg.combine_algorithm).scalars)

    def pushes(self, handle: DispatchHandle) -> bool:
        """Whether ``launch_combine(handle, out, "reduced")`` pushes ``handle``'s rows (kernels/rank_push.py,
        y read where it is), the pull's sums: a rank-layout handle of the latest dispatch, a "reduced" buffer.
        Not the default: slower than the pull (2x H200, 4096 tokens, 24 SMs: 328.2 against 227.6 us)."""
        return handle.layout == "rank" and self.cfg.combine_algorithm == "reduced" and self.is_latest(handle)

    def expert_output(self, num_recv: int) -> torch.Tensor:
        """The symmetric [num_recv, H] buffer combine reads; experts writing here save a copy."""
        self._check_num_recv(num_recv)
        return self.recv_y[:num_recv]

    def _count_reader(self) -> Callable[[], int | None]:
        """Reads this dispatch's received-row count on the device (a host sync); None once overwritten."""
        serial = self._dispatches

        def read() -> int | None:
            return int(self.num_recv[0].item()) if self._dispatches == serial and not self._closed else None

        return read

    def combine(self, y: torch.Tensor, handle: DispatchHandle, algorithm: str | None = None, *,
                stream: torch.cuda.Stream | None = None, previous_event: torch.cuda.Event | None = None
                ) -> torch.Tensor:
        """The top-k weighted sum of each token's expert outputs: a new [T, H] cfg.dtype tensor
        (arguments: ``cute_ep.api.EpBackend.combine``). Collective.

        The reduced combine weights rows with the weights the dispatch sent, so it needs the handle of
        this buffer's latest dispatch, unchanged; the pull combine uses the handle's ids and weights
        (they may differ from the dispatch's, as in autograd). stream / previous_event as in ``dispatch``
        (wait for ``stream``, e.g. ``torch.cuda.current_stream().wait_stream(stream)``, before reading
        the output elsewhere).

        No host sync: a peer that never arrives, or a kernel that did not run, raises at the next
        host-visible check (the next ``dispatch``, ``check_ran`` or ``check_faults``).
        """
        self._check_open()
        c = self.cfg
        # y's rows: the handle's dispatch's num_recv (noted at the dispatch), or the whole capacity.
        check_combine_input(c, self.device, y, handle, self._latest_recv)
        check_kernel_handle(handle)
        self._check_combine_algorithm(handle, algorithm)
        out = torch.empty((handle.num_tokens, c.hidden), dtype=c.dtype, device=self.device)
        with on_stream(self.device, stream, previous_event, y, out, handle.topk_idx, handle.topk_weights,
                       handle.scatter):
            staged, y_rows = None, 0
            if y.data_ptr() != self.recv_y.data_ptr():
                staged, y_rows, _ = self._staging(y, handle)
            self._enqueue_combine(handle, out, algorithm, staged, y_rows)
        return out

    def _staging(self, y: torch.Tensor, handle: DispatchHandle, y_slot: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, int, torch.Tensor | None]:
        """How combine reads y: (the tensor the module's staging kernel, or the push, reads, its ``y_rows``,
        the ``y_slot`` it gathers by or None), or (None, 0, None) after a copy into ``recv_y`` here. For
        the latest dispatch's handle the kernels take the rows it received (the device's count, at most
        y's or y_slot's rows; a sync-free dispatch's y covers the worst case). A y the kernels cannot read
        in 16-byte pieces (strided, misaligned, or y_slot not contiguous int64) is copied here."""
        rows = y.shape[0] if y_slot is None else y_slot.shape[0]
        if not rows:
            return None, 0, None
        gather_ok = y_slot is None or (y_slot.dtype == torch.int64 and y_slot.is_contiguous())
        if not gather_ok or not y.is_contiguous() or y.data_ptr() % self._align["y"]:
            if y_slot is None:
                self.recv_y[:rows].copy_(y)
            else:
                torch.index_select(y, 0, y_slot.long(), out=self.recv_y[:rows])
            return None, 0, None
        return y, -rows if handle.scatter is self._latest_scatter else rows, y_slot

    def close(self) -> None:
        """Free the symmetric buffers (collective: every rank calls it). Safe to call twice."""
        if self._closed:
            return
        import nvshmem.core.interop.torch as nvshmem_torch

        self.runtime.barrier()  # synchronizes the device first: no kernel still uses the buffers
        for tensor in self._symmetric:
            nvshmem_torch.free_tensor(tensor)
        self._symmetric = []
        self._closed = True
        if self._own_registry:
            self.registry.finalize_all()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: the peers may never reach a collective close, so none is attempted
        # (the buffers stay allocated until NVSHMEM is torn down); the error itself propagates.
        self._closed = True

    # -- internals -------------------------------------------------------------------------------

    def _check_combine_algorithm(self, handle: DispatchHandle, algorithm: str | None) -> None:
        check_reduced_handle(self.cfg, handle, algorithm, self._sent)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EpBuffer is closed")
