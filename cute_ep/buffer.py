"""``EpBuffer``: symmetric buffers + the compiled kernels of one expert-parallel configuration.

    buf = EpBuffer(runtime, cfg)                    # collective: every rank, same cfg
    res = buf.dispatch(x, topk_idx, topk_weights)   # rows land in res.recv_x, expert-major
    y = buf.expert_output(res.num_recv)             # write the experts' outputs here (or pass any
    ...                                             # [num_recv, H] tensor to combine: it is copied)
    out = buf.combine(y, res.handle)                # [T, H], top-k weighted sum
    buf.close()

Shapes: T tokens on this rank (T <= cfg.max_tokens, may be 0), H = cfg.hidden, K = cfg.topk.

Ordering: every call is collective and every rank makes the same sequence of calls. Each dispatch
starts with the layout kernel's count exchange, and no rank moves rows before every peer's layout
kernel has started, i.e. before everything a peer enqueued earlier on its stream (its experts
reading ``recv_x``, its combine reading peers' ``recv_y``) has finished. So calls on one stream per
rank never overwrite rows still in use. Work on another stream must be ordered before the next
dispatch by the caller, and the views a dispatch returns are valid until the next dispatch.

Faults: every wait for a peer is bounded by ``cfg.timeout_s``. A rank whose peer never arrives (it
skipped a call, died, or runs a different sequence of calls) gets ``PeerTimeout`` naming the peer and
the operation instead of a hang; from then on the buffer's kernels move no data, and it must be
closed and rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cute_ep.kernels.config import (
    COMBINE_ALGORITHMS,
    DISPATCH_ALGORITHMS,
    FAULT_WORDS,
    FP8_BLOCK,
    MODES,
    OP_COMBINE,
    OP_DISPATCH,
    OP_LAYOUT,
    ConfigError,
    EpConfig,
)


class KernelDidNotRun(RuntimeError):
    """A launch returned without its kernel running (its epoch did not advance)."""


class PeerTimeout(RuntimeError):
    """A kernel waited longer than ``cfg.timeout_s`` for a peer's signal (see the module docstring)."""

    def __init__(self, message: str, *, op: str, peer: int, call: int) -> None:
        super().__init__(message)
        self.op = op
        self.peer = peer
        self.call = call


class CapacityExceeded(RuntimeError):
    """Rows were dropped because experts received more than ``cfg.expert_capacity`` (capacity_factor).

    dropped: {global expert: rows dropped} since the last check; total: their sum; result: the
    ``DispatchResult`` of the call that raised (complete and consistent: combine skips the dropped
    pairs), or None when raised by ``check_capacity`` after ``launch_dispatch``. Every rank raises alike.
    """

    def __init__(self, message: str, *, dropped: dict[int, int], result: Any = None) -> None:
        super().__init__(message)
        self.dropped = dropped
        self.total = sum(dropped.values())
        self.result = result


def capacity_error(cfg: EpConfig, dropped: torch.Tensor, result: Any = None) -> CapacityExceeded | None:
    """The ``CapacityExceeded`` to raise for per-expert drop counts ``dropped`` [E] (None: none dropped).
    One message for every backend."""
    counts = {int(e): int(n) for e, n in enumerate(dropped.tolist()) if n}
    if not counts:
        return None
    el = cfg.experts_per_rank
    shown = ", ".join(f"expert {e} (rank {e // el}): {n}" for e, n in list(counts.items())[:8])
    more = f", and {len(counts) - 8} more experts" if len(counts) > 8 else ""
    return CapacityExceeded(
        f"dispatch dropped {sum(counts.values())} rows beyond expert_capacity={cfg.expert_capacity} "
        f"(capacity_factor={cfg.capacity_factor:g}): {shown}{more}. The dropped (token, k) pairs are left "
        f"out of combine; raise capacity_factor, or build the buffer with on_overflow='drop' to drop rows "
        f"silently (counted by dropped_rows()).",
        dropped=counts, result=result,
    )


OP_NAMES = {OP_LAYOUT: "layout", OP_DISPATCH: "dispatch", OP_COMBINE: "combine"}

# Offsets (int32 words) inside EpBuffer's status block.
STATUS_FAULT = 6
STATUS_NUM_RECV = STATUS_FAULT + FAULT_WORDS
STATUS_DROPPED = STATUS_NUM_RECV + 2


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs from a dispatch: the routing and the slot of every (token, k).

    topk_idx [T, K] int32, topk_weights [T, K] fp32, scatter [T, K] int32 (slot in the owner's
    receive buffer, -1 for dropped pairs), num_tokens T, mode "scatter" | "atomic".
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    scatter: torch.Tensor
    num_tokens: int
    mode: str


@dataclass(frozen=True)
class DispatchResult:
    """recv_x [num_recv, H] (view of the symmetric buffer, valid until the next dispatch): cfg.dtype,
    or torch.float8_e4m3fn after an FP8 dispatch (a strided view: rows are ``cfg.fp8_row_bytes`` apart);
    recv_weights [num_recv] fp32, recv_src [num_recv] int32 ((src_rank * max_tokens + t) * K + k),
    tokens_per_expert [E/R] int32 (rows of each local expert, back to back), num_recv, handle;
    recv_scales [num_recv, H / 128] fp32 after an FP8 dispatch (row i, block b of 128 columns is
    ``recv_x[i, 128 b : 128 (b + 1)].float() * recv_scales[i, b]``), else None."""

    recv_x: torch.Tensor
    recv_weights: torch.Tensor
    recv_src: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_recv: int
    handle: DispatchHandle
    recv_scales: torch.Tensor | None = None


class EpBuffer:
    """Owns one configuration's NVSHMEM symmetric buffers and compiled module (see module docstring).

    runtime: a started ``cute_ep.bootstrap.runtime.Runtime`` with backend "nvshmem".
    cfg:     the ``EpConfig``; world_size must match the runtime's.
    registry: a ``ModuleRegistry`` to share compiled modules between buffers (one is made otherwise).
    algorithm: the dispatch primitive (kernels.config.DISPATCH_ALGORITHMS): "dedup" (default: a row
             crosses the link once per destination rank), "per_pair" (every (token, k) row), "put_warp"
             (every row with put_warp), or "auto": time the three at ``cfg.max_tokens`` tokens now
             (collective; the slowest rank's median decides; ``self.algorithm_table`` holds the table)
             and use the fastest. ``profile_cache``: a ``cute_ep.profiler.ProfileCache`` to keep and
             reuse that choice per shape.
    """

    def __init__(self, runtime: Any, cfg: EpConfig, registry: Any = None, algorithm: str = "dedup",
                 profile_cache: Any = None) -> None:
        import nvshmem.core.interop.torch as nvshmem_torch

        from cute_ep.bootstrap.compile import ModuleRegistry
        from cute_ep.kernels.host import build

        if algorithm != "auto" and algorithm not in DISPATCH_ALGORITHMS:
            raise ValueError(
                f"algorithm must be 'auto' or one of {sorted(DISPATCH_ALGORITHMS)}, got {algorithm!r}"
            )
        env = runtime.env
        check_buffer_config(runtime, cfg)
        self.runtime = runtime
        self.cfg = cfg
        self.rank = env.rank
        self.device = runtime.device
        self._closed = False
        self._own_registry = registry is None
        self.registry = registry if registry is not None else ModuleRegistry(device_id=env.local_rank)
        if self._own_registry:
            runtime.add_finalizer(self.registry.finalize_all)
        c = cfg
        # Compile (or fetch) first: it is local work that can fail, and nothing is allocated yet.
        self.module = self.registry.get(c.compile_key(), lambda: build(c))

        sym = lambda shape, dtype: nvshmem_torch.tensor(shape, dtype=dtype)  # noqa: E731
        self.recv_x = sym((c.capacity, c.hidden), c.dtype)
        self.recv_y = sym((c.capacity, c.hidden), c.dtype)
        self.recv_w = sym((c.capacity,), torch.float32)
        self.recv_src = sym((c.capacity,), torch.int32)
        self.recv_from = sym((c.capacity,), torch.int32)  # dispatch's de-duplication (kernels/fanout.py)
        self.counts = sym((c.world_size, c.num_experts), torch.int32)
        self.signals = sym((3, c.world_size), torch.int64)  # uint64 on the device
        self.stage = sym((c.stage_rows, c.hidden), c.dtype)
        self._symmetric = [self.recv_x, self.recv_y, self.recv_w, self.recv_src, self.recv_from, self.counts,
                           self.signals, self.stage]
        if c.combine_algorithm == "reduced":
            # The reduced combine (kernels/reduce_push.py, kernels/partial_sum.py): each primary slot's group
            # members, written by dispatch, and one partial row per (token, source rank).
            self.recv_group = sym((c.capacity * c.topk,), torch.int32)
            self.partials = sym((c.partial_rows, c.hidden), c.dtype)
            self._symmetric += [self.recv_group, self.partials]
        else:  # never read or written: the kernels only need valid pointers
            self.recv_group = torch.zeros(1, dtype=torch.int32, device=self.device)
            self.partials = torch.zeros((1, c.hidden), dtype=c.dtype, device=self.device)
        # Packed FP8 rows of this rank's tokens (kernels/quantize.py): the source of its puts, symmetric.
        fp8_ok = c.hidden % FP8_BLOCK == 0
        self.packed = sym((c.max_tokens * c.fp8_row_bytes if fp8_ok else 16,), torch.uint8)
        self._symmetric.append(self.packed)
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.scatter = torch.full((c.max_tokens * c.topk,), -1, **i32)
        self.send_offsets = torch.zeros(c.num_experts, **i32)
        self.cursor = torch.zeros(c.num_experts, **i32)
        self.send_limit = torch.zeros(c.num_experts, **i32)
        self.tokens_per_expert = torch.zeros(c.experts_per_rank, **i32)
        self.done = torch.zeros(3, **i32)
        # Everything the host reads after a call, in one block so that one copy (one sync) reads it:
        # epochs [3] int64 | fault [FAULT_WORDS] | num_recv [1] | padding | dropped [E].
        self._status = torch.zeros(STATUS_DROPPED + c.num_experts, **i32)
        self.epochs = self._status[0:6].view(torch.int64)
        self.fault = self._status[STATUS_FAULT:STATUS_FAULT + FAULT_WORDS]  # first timed-out wait
        self.num_recv = self._status[STATUS_NUM_RECV:STATUS_NUM_RECV + 1]
        self.dropped = self._status[STATUS_DROPPED:]  # rows each expert dropped (capacity), accumulated
        self._calls = [0, 0, 0]  # expected epochs: layout, dispatch, combine
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # routing of the latest dispatch
        self._drops = torch.zeros(c.num_experts, dtype=torch.int64)  # read from the device, not yet reported
        # Signals and counts start at zero on every rank before anyone may signal.
        self.counts.zero_()
        self.signals.zero_()
        self.poison()
        runtime.barrier()  # synchronizes the device first

        self._static_ptrs: dict[str, Any] | None = None  # made at the first launch
        self._call_ptrs: dict[tuple[str, int], Any] = {}
        self._shape_args = c.shape_args()
        self._empty_x = torch.empty((1, c.hidden), dtype=c.dtype, device=dev)
        self._empty_i = torch.empty((1, c.topk), dtype=torch.int32, device=dev)
        self._empty_w = torch.empty((1, c.topk), dtype=torch.float32, device=dev)
        self.algorithm_table: str | None = None
        self.algorithm = algorithm
        if algorithm == "auto":
            self.algorithm = self._choose_algorithm(profile_cache)
            self.poison()  # the timed dispatches left rows behind

    # -- public API ------------------------------------------------------------------------------

    def poison(self) -> None:
        """Fill the receive buffers with NaN / -1 so that a row nobody wrote cannot pass a check."""
        self.recv_x.fill_(float("nan"))
        self.recv_y.fill_(float("nan"))
        self.recv_w.fill_(float("nan"))
        self.recv_src.fill_(-1)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 mode: str = "scatter", fp8: bool = False, algorithm: str | None = None) -> DispatchResult:
        """Send every (token, k) row to the rank owning expert ``topk_idx[t, k]``.

        x [T, H] cfg.dtype, topk_idx [T, K] int32/int64 in [-1, E) (-1: dropped), topk_weights
        [T, K] fp32, all contiguous on this rank's GPU. mode "scatter" (deterministic order) or
        "atomic" (slots taken with an atomic add on the sender). fp8: quantize rows to e4m3 with one
        fp32 scale per 128 columns on the sender (needs H % 128 == 0; see DispatchResult). algorithm:
        the dispatch primitive for this call (default: the buffer's, see the class docstring). Collective:
        every rank calls it with the same mode and fp8.

        Rows beyond ``cfg.expert_capacity`` are dropped (capacity_factor > 0); with on_overflow="raise"
        this raises ``CapacityExceeded`` (holding the complete result) on every rank.
        Host syncs: one to check the inputs, one to read the results' sizes and status.
        """
        self._check_open()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        if fp8:
            self.cfg.check_fp8()
        if algorithm is not None and algorithm not in DISPATCH_ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(DISPATCH_ALGORITHMS)}, got {algorithm!r}")
        x, idx, w = check_dispatch_inputs(self.cfg, self.device, x, topk_idx, topk_weights)
        t = x.shape[0]
        self.launch_dispatch(x, idx, w, mode, fp8=fp8, algorithm=algorithm)
        status = self._read_status()
        self._check_ran(status, OP_LAYOUT, OP_DISPATCH)
        num_recv = status["num_recv"]
        tpe = self.tokens_per_expert.clone()
        scatter = self.scatter[: t * self.cfg.topk].view(t, self.cfg.topk).clone()
        # The handle owns its routing: a caller editing its tensors later cannot change combine.
        handle = DispatchHandle(idx.clone(), w.clone(), scatter, t, mode)
        self._sent = (handle.topk_idx, handle.topk_weights)
        recv_x, recv_scales = self.recv_x[:num_recv], None
        if fp8:
            recv_x, recv_scales = self.fp8_views(num_recv)
        result = DispatchResult(recv_x, self.recv_w[:num_recv], self.recv_src[:num_recv], tpe, num_recv,
                                handle, recv_scales)
        self._take_drops(status["dropped"], result)
        return result

    def fp8_packed_rows(self, num_recv: int | None = None) -> torch.Tensor:
        """The received packed FP8 rows [n, cfg.fp8_row_bytes] uint8 (a view of ``recv_x``'s memory, where
        an FP8 dispatch puts them); n = num_recv, or the capacity."""
        c = self.cfg
        c.check_fp8()
        n = c.capacity if num_recv is None else num_recv
        p = c.fp8_row_bytes
        return self.recv_x.view(torch.uint8).view(-1)[: c.capacity * p].view(c.capacity, p)[:n]

    def fp8_views(self, num_recv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The received FP8 rows and scales after an FP8 dispatch: (q [n, H] float8_e4m3fn, scales
        [n, H / 128] fp32), strided views of ``fp8_packed_rows`` (rows ``cfg.fp8_row_bytes`` apart)."""
        from cute_ep.fp8 import unpack_fp8_rows

        return unpack_fp8_rows(self.fp8_packed_rows(num_recv), self.cfg.hidden)

    def launch_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        mode: str = "scatter", fp8: bool = False, algorithm: str | None = None
                        ) -> DispatchHandle:
        """Enqueue the layout, dispatch and fan-out kernels on the current stream: no checks, no host
        sync, so the call can be captured in a CUDA graph.

        Arguments must already satisfy ``check_dispatch_inputs`` (topk_idx int32, and for fp8
        ``cfg.check_fp8``). The results stay in the buffer on the device: ``recv_x`` (or ``fp8_views``)
        / ``recv_w`` / ``recv_src`` (first ``num_recv[0]`` rows), ``tokens_per_expert``, ``scatter``,
        ``dropped`` (see ``check_capacity``). Returns a handle that refers to (does not copy) the given
        routing tensors and the buffer's ``scatter``: valid for ``launch_combine`` until the next dispatch.
        """
        t = x.shape[0]
        self._launch(OP_LAYOUT, 0, t, x=x, idx=topk_idx, w=topk_weights)
        algo = DISPATCH_ALGORITHMS[algorithm or self.algorithm]
        groups = COMBINE_ALGORITHMS[self.cfg.combine_algorithm]  # record groups for the reduced combine
        self._launch(OP_DISPATCH, MODES[mode], t, x=x, idx=topk_idx, w=topk_weights, fp8=fp8, algo=algo,
                     calgo=groups)
        scatter = self.scatter[: t * self.cfg.topk].view(t, self.cfg.topk)
        handle = DispatchHandle(topk_idx, topk_weights, scatter, t, mode)
        self._sent = (topk_idx, topk_weights)
        return handle

    def launch_combine(self, handle: DispatchHandle, out: torch.Tensor, algorithm: str | None = None) -> None:
        """Enqueue the combine kernel(s) on the current stream: no checks, no host sync (capturable).

        Reads the symmetric ``recv_y`` (see ``expert_output``); out [handle.num_tokens, H] cfg.dtype.
        algorithm: "pull" or "reduced" (default: ``cfg.combine_algorithm``); see ``combine``.
        """
        t = handle.num_tokens
        if handle.scatter.data_ptr() != self.scatter.data_ptr():  # a handle from dispatch() owns a copy
            self.scatter[: t * self.cfg.topk].copy_(handle.scatter.view(-1))
        calgo = COMBINE_ALGORITHMS[algorithm or self.cfg.combine_algorithm]
        self._launch(OP_COMBINE, 0, t, idx=handle.topk_idx, w=handle.topk_weights, out=out, calgo=calgo)

    def expert_output(self, num_recv: int) -> torch.Tensor:
        """The symmetric [num_recv, H] buffer combine reads; experts writing here save a copy."""
        if not 0 <= num_recv <= self.cfg.capacity:
            raise ValueError(f"num_recv must be in [0, capacity={self.cfg.capacity}], got {num_recv}")
        return self.recv_y[:num_recv]

    def combine(self, y: torch.Tensor, handle: DispatchHandle, algorithm: str | None = None) -> torch.Tensor:
        """The top-k weighted sum of each token's expert outputs. Returns a new [T, H] cfg.dtype tensor.

        y [num_recv, H] cfg.dtype: this rank's expert outputs, in recv_x's row order. handle: the
        ``DispatchResult.handle`` of the dispatch whose rows y holds. algorithm (default
        ``cfg.combine_algorithm``; every rank passes the same):
          "pull":    out[t] = sum over k ascending of topk_weights[t, k] * y_owner[scatter[t, k]] (fp32,
                     then cfg.dtype), bit-identical to ``cute_ep.reference.reference_combine``; uses
                     the handle's ids and weights (they may differ from the dispatch's, as in autograd).
          "reduced": each rank first sums a token's rows it holds (ascending k, weights as sent by the
                     dispatch) into one partial row rounded to cfg.dtype; the token's rank sums the
                     partials in the order of each rank's first kept k (fp32, then cfg.dtype): one row
                     per (token, rank) crosses the link. ``reference_combine_reduced`` is its bit-exact
                     reference. Needs ``EpConfig(combine_algorithm="reduced")`` and the handle of this
                     buffer's latest dispatch, unchanged.
        Collective.
        """
        self._check_open()
        c = self.cfg
        check_combine_input(c, self.device, y)
        self._check_combine_algorithm(handle, algorithm)
        if y.data_ptr() != self.recv_y.data_ptr():
            self.recv_y[: y.shape[0]].copy_(y)
        out = torch.empty((handle.num_tokens, c.hidden), dtype=c.dtype, device=self.device)
        self.launch_combine(handle, out, algorithm)
        self._check_ran(self._read_status(), OP_COMBINE)  # the read waits for the kernel (same stream)
        return out

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

    def __enter__(self) -> EpBuffer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: the peers may never reach a collective close, so none is attempted
        # (the buffers stay allocated until NVSHMEM is torn down); the error itself propagates.
        self._closed = True

    # -- internals -------------------------------------------------------------------------------

    def _check_combine_algorithm(self, handle: DispatchHandle, algorithm: str | None) -> None:
        if resolve_combine_algorithm(self.cfg, algorithm) != "reduced":
            return
        sent = self._sent
        if sent is None or handle.topk_idx is not sent[0] or handle.topk_weights is not sent[1]:
            raise ValueError(
                "combine algorithm 'reduced' weights rows with the weights the latest dispatch sent: pass "
                "that dispatch's handle unchanged (this one has other ids or weights, or comes from an "
                "earlier dispatch), or use algorithm='pull'"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EpBuffer is closed")

    def _launch(self, op: int, mode: int, num_tokens: int, *, x=None, idx=None, w=None, out=None,
                fp8: bool = False, algo: int = 0, calgo: int = 0) -> None:
        import cuda.bindings.driver as cuda

        from cute_ep.kernels.host import make_pointer
        from cute_ep.kernels.module import POINTER_ARGS

        if self._static_ptrs is None:
            # The buffer's own tensors never move: their pointers are made once (host time per call).
            own = {
                "scatter": self.scatter, "recv_x": self.recv_x, "recv_y": self.recv_y, "recv_w": self.recv_w,
                "recv_src": self.recv_src, "recv_from": self.recv_from, "counts": self.counts,
                "signals": self.signals, "stage": self.stage, "send_offsets": self.send_offsets,
                "cursor": self.cursor, "send_limit": self.send_limit, "dropped": self.dropped,
                "packed": self.packed, "tokens_per_expert": self.tokens_per_expert, "num_recv": self.num_recv,
                "epochs": self.epochs, "done": self.done, "fault": self.fault, "recv_group": self.recv_group,
                "partials": self.partials,
            }
            self._static_ptrs = {name: make_pointer(self.cfg, name, t.data_ptr()) for name, t in own.items()}
        call = {
            "x": (x if x is not None and x.numel() else self._empty_x).data_ptr(),
            "topk_idx": (idx if idx is not None and idx.numel() else self._empty_i).data_ptr(),
            "topk_w": (w if w is not None and w.numel() else self._empty_w).data_ptr(),
            "out": (out if out is not None and out.numel() else self._empty_x).data_ptr(),
        }
        ptrs = [self._static_ptrs[n] if n in self._static_ptrs else self._call_pointer(n, call[n])
                for n in POINTER_ARGS]
        stream = cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        self.module(op, mode, int(fp8), algo, calgo, self.rank, num_tokens, *self._shape_args, *ptrs, stream)
        self._calls[op] += 1

    def _choose_algorithm(self, cache: Any = None, iters: int = 10, warmup: int = 3) -> str:
        """Time every dispatch primitive at cfg.max_tokens tokens (uniform routing, CUDA events around
        ``launch_dispatch``), gather every rank's medians and return the fastest (collective)."""
        from cute_ep.collectives import all_gather_objects
        from cute_ep.inputs import make_inputs
        from cute_ep.profiler import cached_choice, shape_key

        c, group = self.cfg, self.runtime.cpu_group
        key = shape_key(self.runtime, c, c.max_tokens) + "|dispatch-primitive"
        cached = cached_choice(self.runtime, cache, key)
        if cached in DISPATCH_ALGORITHMS:
            self.algorithm_table = f"dispatch primitive {key}: {cached} (cached in {cache.path})"
            return cached
        x, idx, w = make_inputs(self.rank, c.max_tokens, c.hidden, c.num_experts, c.topk, c.dtype, 0,
                                device=self.device, idx_dtype=torch.int32)
        medians = {}
        for name in DISPATCH_ALGORITHMS:
            times = []
            for i in range(warmup + iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.launch_dispatch(x, idx, w, algorithm=name)
                end.record()
                end.synchronize()
                if i >= warmup:
                    times.append(start.elapsed_time(end) * 1e3)
            self._check_ran(self._read_status(), OP_LAYOUT, OP_DISPATCH)
            medians[name] = sorted(times)[len(times) // 2]
        name, self.algorithm_table = pick_fastest_algorithm(all_gather_objects(medians, group), key)
        if cache is not None and self.rank == 0:
            cache.put_choice(key, name, self.algorithm_table)
        return name

    def _call_pointer(self, name: str, addr: int) -> Any:
        """The pointer of a per-call tensor, remembered by (name, address): callers often pass the same
        tensors again, and making one costs ~3 us of host time (measured on the development machine;
        making all 23 of a launch took 75 us there)."""
        from cute_ep.kernels.host import make_pointer

        key = (name, addr)
        ptr = self._call_ptrs.get(key)
        if ptr is None:
            if len(self._call_ptrs) >= 64:  # bounded: addresses of freed tensors are not kept forever
                self._call_ptrs.clear()
            ptr = self._call_ptrs[key] = make_pointer(self.cfg, name, addr)
        return ptr

    def _read_status(self) -> dict[str, Any]:
        """Epochs, fault record, num_recv and drop counts in one device-to-host copy (one sync)."""
        words = self._status.cpu()
        return {
            "epochs": words[0:6].view(torch.int64).tolist(),
            "fault": words[STATUS_FAULT:STATUS_FAULT + FAULT_WORDS].tolist(),
            "num_recv": int(words[STATUS_NUM_RECV]),
            "dropped": words[STATUS_DROPPED:],
        }

    def check_faults(self, status: dict[str, Any] | None = None) -> None:
        """Raise ``PeerTimeout`` if a kernel of this buffer timed out waiting for a peer (host sync).

        ``dispatch`` and ``combine`` call it; after ``launch_*`` calls (e.g. CUDA graph replays) call it
        before trusting the results."""
        f = (status or self._read_status())["fault"]
        if f[0]:
            op, peer, call = OP_NAMES.get(f[1], f"op {f[1]}"), f[2], f[3]
            raise PeerTimeout(
                f"{op} on rank {self.rank}: rank {peer} did not signal within {self.cfg.timeout_s:g} s "
                f"({op} call {call}; {f[0]} wait(s) timed out). Every rank must make the same sequence of "
                f"dispatch and combine calls. This buffer moves no more data: close it and build a new one.",
                op=op, peer=peer, call=call,
            )

    def dropped_rows(self) -> torch.Tensor:
        """Rows dropped beyond ``cfg.expert_capacity`` per global expert ([E] int64 on the CPU) since the
        last ``dropped_rows``/``check_capacity``/``dispatch`` report; resets the count (host sync)."""
        counts = self._status[STATUS_DROPPED:].cpu().to(torch.int64)
        self.dropped.zero_()
        return counts + self._pending_drops()

    def check_capacity(self, result: Any = None) -> None:
        """With on_overflow="raise": raise ``CapacityExceeded`` (carrying ``result``, if given) if rows
        were dropped since the last report (host sync; call it after ``launch_dispatch`` / graph
        replays). Every rank raises alike. With "drop" the drops stay counted for ``dropped_rows``."""
        self._take_drops(self._status[STATUS_DROPPED:].cpu(), result)

    def _pending_drops(self) -> torch.Tensor:
        pending, self._drops = self._drops, torch.zeros(self.cfg.num_experts, dtype=torch.int64)
        return pending

    def _take_drops(self, dropped: torch.Tensor, result: Any = None) -> None:
        """Account for device drop counts just read: raise (policy "raise") or keep them for dropped_rows."""
        counts = dropped.to(torch.int64)  # a copy: ``dropped`` may alias the status block zeroed next
        if not bool(counts.any()):
            return
        self.dropped.zero_()  # enqueued after the kernels that counted them: the next call counts afresh
        if self.cfg.on_overflow == "raise":
            error = capacity_error(self.cfg, counts + self._pending_drops(), result)
            if error is not None:
                raise error
            return
        self._drops += counts

    def _check_ran(self, status: dict[str, Any], *ops: int) -> None:
        """Raise if a kernel timed out (``PeerTimeout``) or did not run: its epoch must equal the number
        of launches so far."""
        self.check_faults(status)
        got = status["epochs"]
        for op in ops:
            if got[op] != self._calls[op]:
                torch.cuda.synchronize(self.device)  # a sticky CUDA error, if any, raises here first
                raise KernelDidNotRun(
                    f"{OP_NAMES[op]} kernel did not complete: epoch {got[op]}, "
                    f"expected {self._calls[op]} launches"
                )


def pick_fastest_algorithm(medians_per_rank: list[dict[str, float]], key: str) -> tuple[str, str]:
    """The dispatch primitive whose slowest rank's median (microseconds) is least, and a short table.

    medians_per_rank: one {primitive: median us} per rank (all with the same primitives)."""
    names = list(medians_per_rank[0])
    slowest = {n: max(m[n] for m in medians_per_rank) for n in names}
    best = min(names, key=lambda n: slowest[n])
    lines = [f"dispatch primitive {key} (slowest rank's median of the dispatch launch)"]
    for n in names:
        lines.append(f"  {n:>9} {slowest[n]:10.1f} us" + ("  <- chosen" if n == best else ""))
    return best, "\n".join(lines)


def resolve_combine_algorithm(cfg: EpConfig, algorithm: str | None = None) -> str:
    """The combine algorithm of one call: ``algorithm``, or ``cfg.combine_algorithm`` when None.

    "pull" always works; "reduced" needs a buffer built for it (``EpConfig(combine_algorithm=
    "reduced")``: only then does the GPU buffer allocate its partial rows and its dispatches record
    group lists). Shared by ``EpBuffer`` and the host backends (``ReferenceEpBuffer``, ``A2aEpBuffer``).

    Raises:
        ValueError: an unknown name, or "reduced" on a "pull" configuration.
    """
    if algorithm is None:
        return cfg.combine_algorithm
    if not isinstance(algorithm, str) or algorithm not in COMBINE_ALGORITHMS:
        raise ValueError(f"combine algorithm must be one of {sorted(COMBINE_ALGORITHMS)}, got {algorithm!r}")
    if algorithm == "reduced" and cfg.combine_algorithm != "reduced":
        raise ValueError(
            "combine algorithm 'reduced' needs EpConfig(combine_algorithm='reduced') "
            f"(got {cfg.combine_algorithm!r}): only then do its partial rows and the dispatch's group "
            "lists exist"
        )
    return algorithm


def check_dispatch_options(cfg: EpConfig, mode: str, fp8: Any) -> None:
    """Validate dispatch's mode ("scatter" | "atomic") and fp8 flag (a bool; True needs H % 128 == 0)
    for ``cfg`` (the host backends share it). Errors name the constraint and the value."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if not isinstance(fp8, bool):
        raise ValueError(f"fp8 must be True or False, got {fp8!r}")
    if fp8:
        cfg.check_fp8()


def check_dispatch_inputs(cfg: EpConfig, device: torch.device, x: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate dispatch inputs against ``cfg`` (every backend uses this); returns (x, topk_idx as
    contiguous int32, topk_weights). Errors name the constraint and the value."""
    c = cfg
    for name, ten in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if ten.device != device:
            raise ValueError(f"{name} must be on {device}, got {ten.device}")
        if not ten.is_contiguous():
            raise ValueError(f"{name} must be contiguous (stride {ten.stride()})")
    if x.dim() != 2 or x.shape[1] != c.hidden or x.dtype != c.dtype:
        raise ValueError(f"x must be [T, {c.hidden}] {c.dtype}, got {list(x.shape)} {x.dtype}")
    t = x.shape[0]
    if t > c.max_tokens:
        raise ValueError(f"x has {t} tokens, more than max_tokens={c.max_tokens}")
    if tuple(topk_idx.shape) != (t, c.topk) or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_idx must be [{t}, {c.topk}] int32/int64, got {list(topk_idx.shape)} {topk_idx.dtype}"
        )
    if tuple(topk_weights.shape) != (t, c.topk) or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be [{t}, {c.topk}] float32, got {list(topk_weights.shape)} "
            f"{topk_weights.dtype}"
        )
    if t:
        # One host sync for all value checks: min, max and the first token naming an expert twice.
        ids = topk_idx.sort(dim=1).values
        repeated = ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any(dim=1)
        tokens = torch.arange(t, device=ids.device)
        first_rep = torch.where(repeated, tokens, t).min()
        stats = torch.stack([ids[:, 0].min().long(), ids[:, -1].max().long(), first_rep.long()])
        lo, hi, tok = stats.tolist()
        if lo < -1 or hi >= c.num_experts:
            raise ValueError(f"topk_idx values must be in [-1, {c.num_experts}), got min {lo}, max {hi}")
        # Distinct experts per token bound the rows a rank can receive (the buffers' capacity).
        if tok < t:
            raise ValueError(
                f"topk_idx must name distinct experts per token (-1 may repeat): token {tok} has "
                f"{topk_idx[tok].tolist()}"
            )
    return x, topk_idx.to(torch.int32).contiguous(), topk_weights


def check_combine_input(cfg: EpConfig, device: torch.device, y: torch.Tensor) -> None:
    """Validate combine's expert outputs y [num_recv, H] cfg.dtype on ``device`` (every backend)."""
    if y.dtype != cfg.dtype or y.dim() != 2 or y.shape[1] != cfg.hidden or y.device != device:
        raise ValueError(
            f"y must be [num_recv, {cfg.hidden}] {cfg.dtype} on {device}, got "
            f"{list(y.shape)} {y.dtype} on {y.device}"
        )
    if y.shape[0] > cfg.capacity:
        raise ValueError(f"y has {y.shape[0]} rows, more than the capacity {cfg.capacity}")


def check_buffer_config(runtime: Any, cfg: EpConfig) -> None:
    """A buffer's configuration must fit the launch and be the same on every rank (collective).

    A mismatch between ranks would otherwise hang in the first kernel; the error names the ranks.
    """
    import torch.distributed as dist

    env = runtime.env
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Gather before raising anything, so that every rank raises (none waits alone).
        group = getattr(runtime, "cpu_group", None)
        keys: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, cfg.key(), group=group)
    else:
        keys = [cfg.key()]
    if cfg.world_size != env.world_size:
        raise ConfigError(f"cfg.world_size={cfg.world_size} but the launch has world_size={env.world_size}")
    if any(k != keys[0] for k in keys):
        diff = {r: k for r, k in enumerate(keys) if k != keys[0]}
        raise ConfigError(f"ranks built different EpConfigs: rank 0 has {keys[0]}, others {diff}")
