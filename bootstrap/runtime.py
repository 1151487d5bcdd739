"""Process group and NVSHMEM lifecycle for one process of a launch (one or several processes per GPU).

Usage::

    env = DistEnv.from_environ()
    with start(env, symmetric_bytes=plan_bytes) as rt:   # backend="nvshmem" by default
        rt.add_finalizer(compiled_modules.finalize)      # runs before nvshmem.core.finalize()
        ...

Two backends:

* ``"gloo"``: CPU only, a plain gloo process group. Used by the torch reference backends on a machine
  without a GPU.
* ``"nvshmem"``: binds the GPU (local rank r: GPU r % G, ``bootstrap/gpu_share.py``), starts a
  ``cpu:gloo,cuda:nccl`` process group plus a separate gloo group (gloo only when ranks share a GPU:
  NCCL refuses that), sizes the NVSHMEM symmetric heap, broadcasts NVSHMEM's unique id over gloo and
  initialises NVSHMEM with the *global* rank.

This module must import on machines without a GPU, so torch, NVSHMEM and cuda.core are imported
inside the functions that need them.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .dist_env import DistEnv
from .gpu_share import (
    MPS_PERCENTAGE_VAR,
    GpuPlacement,
    GpuShareError,
    gpus_in_use,
    mps_missing_message,
    place,
    shared_gpu_environ,
    sm_share,
    world_group_backend,
)

if TYPE_CHECKING:
    import numpy
    import torch

__all__ = [
    "BACKENDS",
    "HEAP_ENV_VAR",
    "HeapConfigError",
    "Runtime",
    "configure_symmetric_heap",
    "format_size",
    "check_heap_fits",
    "heap_bytes_for",
    "parse_size",
    "share_unique_id",
    "start",
]

log = logging.getLogger(__name__)

BACKENDS = ("nvshmem", "gloo")
HEAP_ENV_VAR = "NVSHMEM_SYMMETRIC_SIZE"

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

# Heap sizing. Observed on a 4x H200 host: 352 MiB of symmetric buffers faulted with an illegal
# memory access under NVSHMEM's default heap (1 GiB), and ran with 8G. So the heap needs room
# beyond the caller's own buffers (NVSHMEM's internal allocations, alignment): scale the request,
# add a fixed reserve, round to whole GiB, and never go below twice the default.
HEAP_HEADROOM = 1.25
HEAP_RESERVE_BYTES = 256 * MIB
HEAP_MIN_BYTES = 2 * GIB
# Ranks that share a GPU share its memory too: there the heap is the buffers plus 1/16, the same reserve,
# rounded to 256 MiB (8 ranks at DeepSeek-V3 shapes, max_tokens 4096: 7.03 GiB of buffers, 7.75 GiB heaps,
# 62 GiB in all, where the padded rule's 10 GiB heaps would not fit one 80 GB GPU).
SHARED_HEAP_HEADROOM = 1 / 16
SHARED_HEAP_GRANULE = 256 * MIB
SHARED_HEAP_MIN_BYTES = GIB
# GPU memory a rank needs beside its heap (CUDA context, NVSHMEM's own state, the compiled module, torch's
# allocations for a call's inputs and outputs): what the fit check counts per rank on a shared GPU.
RANK_OVERHEAD_BYTES = GIB


class HeapConfigError(ValueError):
    """NVSHMEM_SYMMETRIC_SIZE is malformed or too small for what the caller will allocate."""


# --------------------------------------------------------------------------------------------------
# symmetric heap sizing
# --------------------------------------------------------------------------------------------------


def heap_bytes_for(buffers_bytes: int, *, shared_gpu: bool = False) -> int:
    """Symmetric heap size (bytes) to request for `buffers_bytes` of symmetric buffers.

    ``ceil_GiB(buffers * 1.25 + 256 MiB)``, at least 2 GiB; with `shared_gpu` (the host's ranks share
    GPUs) ``ceil_256MiB(buffers * 17/16 + 256 MiB)``, at least 1 GiB.
    """
    if buffers_bytes < 0:
        raise ValueError(f"buffers_bytes={buffers_bytes} is negative")
    if shared_gpu:
        wanted = buffers_bytes + math.ceil(buffers_bytes * SHARED_HEAP_HEADROOM) + HEAP_RESERVE_BYTES
        rounded = -(-wanted // SHARED_HEAP_GRANULE) * SHARED_HEAP_GRANULE
        return max(rounded, SHARED_HEAP_MIN_BYTES)
    wanted = math.ceil(buffers_bytes * HEAP_HEADROOM) + HEAP_RESERVE_BYTES
    rounded = -(-wanted // GIB) * GIB
    return max(rounded, HEAP_MIN_BYTES)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)(.*)$")
_SIZE_SCALE = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB}


def parse_size(text: str) -> int:
    """Parse a size the way NVSHMEM reads NVSHMEM_SYMMETRIC_SIZE: "8G", "512m", "3.1M", "1073741824".

    Suffixes k/m/g/t (either case) are powers of 1024 and anything after the suffix is ignored, as
    NVSHMEM does ("8GB" == "8G"). Returns the integer ceiling in bytes.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise HeapConfigError(f"{HEAP_ENV_VAR}={text!r} is not a size (e.g. '8G', '512M', '1073741824')")
    number, suffix, rest = match.groups()
    if not suffix and rest.strip():
        raise HeapConfigError(
            f"{HEAP_ENV_VAR}={text!r} has an unknown unit {rest.strip()!r} (use k, M, G, T)"
        )
    return math.ceil(float(number) * _SIZE_SCALE[suffix.lower()])


def format_size(nbytes: int) -> str:
    """Format bytes for NVSHMEM_SYMMETRIC_SIZE: whole GiB as "9G", whole MiB as "640M", else bytes."""
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} is negative")
    if nbytes and nbytes % GIB == 0:
        return f"{nbytes // GIB}G"
    if nbytes and nbytes % MIB == 0:
        return f"{nbytes // MIB}M"
    return str(nbytes)


def configure_symmetric_heap(
    nbytes: int,
    environ: MutableMapping[str, str] = os.environ,
    *,
    minimum_bytes: int | None = None,
) -> str:
    """Set NVSHMEM_SYMMETRIC_SIZE to `nbytes` unless the user set it; return the value in force.

    A user value is kept (they may know their job better), but it must be at least `minimum_bytes`
    (default: `nbytes`), else `HeapConfigError` names both sizes. Pass the raw buffer total as
    `minimum_bytes` and `heap_bytes_for(...)` as `nbytes` to accept any user value that can hold
    the buffers while still defaulting to a padded heap. Must run before NVSHMEM is initialised:
    NVSHMEM reads the variable at init.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} is negative")
    needed = nbytes if minimum_bytes is None else minimum_bytes
    current = environ.get(HEAP_ENV_VAR, "").strip()
    if current:
        have = parse_size(current)
        if have < needed:
            raise HeapConfigError(
                f"{HEAP_ENV_VAR}={current!r} ({have} bytes) is smaller than the {needed} bytes "
                f"({format_size(needed)}) this run needs; unset it to get {format_size(nbytes)} "
                f"automatically, or raise it"
            )
        if have < nbytes:
            log.warning(
                "%s=%s is below the recommended %s (buffers plus headroom); keeping the user's value",
                HEAP_ENV_VAR,
                current,
                format_size(nbytes),
            )
        return current
    value = format_size(nbytes)
    environ[HEAP_ENV_VAR] = value
    return value


def check_heap_fits(
    heap: str,
    ranks_per_gpu: int,
    gpu_bytes: int,
    fit_hint: Callable[[int], str] | None = None,
) -> None:
    """Refuse heaps that cannot all fit one GPU: ``ranks_per_gpu`` ranks, each with a heap of ``heap``
    (NVSHMEM_SYMMETRIC_SIZE) and ``RANK_OVERHEAD_BYTES`` beside it, in ``gpu_bytes``. The error names the
    sizes and what fits: the symmetric buffers one rank may have, and ``fit_hint(that many bytes)`` (a
    sentence naming a configuration that fits) when given."""
    each = parse_size(heap)
    need = ranks_per_gpu * (each + RANK_OVERHEAD_BYTES)
    if need <= gpu_bytes:
        return
    # The largest buffer total whose shared-GPU heap (rounded up to the granule) still fits a rank's room.
    granule = SHARED_HEAP_GRANULE
    heap_room = (gpu_bytes // ranks_per_gpu - RANK_OVERHEAD_BYTES) // granule * granule
    room = max(0, math.floor((heap_room - HEAP_RESERVE_BYTES) / (1 + SHARED_HEAP_HEADROOM)) - 1)
    hint = f"; {fit_hint(room)}" if fit_hint is not None and room > 0 else ""
    raise HeapConfigError(
        f"{ranks_per_gpu} ranks share a GPU of {format_gib(gpu_bytes)}, and each needs a symmetric heap of "
        f"{format_gib(each)} ({HEAP_ENV_VAR}={heap}) plus about {format_gib(RANK_OVERHEAD_BYTES)} beside it: "
        f"{format_gib(need)} in all. What fits: at most {format_gib(room)} of symmetric buffers per rank "
        f"(EpConfig.symmetric_bytes(); it grows with world_size x max_tokens x topk){hint}; or fewer ranks "
        f"per GPU"
    )


def format_gib(nbytes: int) -> str:
    """'7.03 GiB'."""
    return f"{nbytes / GIB:.2f} GiB"


# --------------------------------------------------------------------------------------------------
# unique id broadcast
# --------------------------------------------------------------------------------------------------


def share_unique_id(group: Any, make_uid: Callable[[], numpy.ndarray], rank: int) -> numpy.ndarray:
    """Rank 0 of `group` calls `make_uid()`; every rank returns the same bytes as a uint8 array.

    None means the default group. `rank` is the caller's rank in `group`. On a group that handles CPU
    tensors (gloo, or a ``cpu:gloo,...`` group) the length is broadcast first, then the bytes, so any id
    size works (NVSHMEM's is 128 bytes); a pure NCCL group carries no CPU tensors, so there the bytes go
    as one pickled object (staged on the current CUDA device).
    """
    import numpy as np
    import torch
    import torch.distributed as dist

    group_rank = dist.get_rank(group)
    if rank != group_rank:
        raise ValueError(f"rank={rank} but this process is rank {group_rank} of the group")
    src = 0 if group is None else dist.get_global_rank(group, 0)

    if dist.get_backend(group) == "nccl":
        box = [np.ascontiguousarray(make_uid()).view(np.uint8).tobytes() if rank == 0 else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return np.frombuffer(box[0], dtype=np.uint8).copy()

    if rank == 0:
        payload = np.ascontiguousarray(make_uid()).view(np.uint8).reshape(-1).copy()
        length = torch.tensor([payload.size], dtype=torch.int64)
    else:
        payload = None
        length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)

    if payload is not None:
        data = torch.from_numpy(payload)
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return data.numpy().copy()


# --------------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------------


_RUNTIME_STARTS = itertools.count()
"""Runtimes started in this process with a launcher's store (see ``Runtime._rendezvous_store``)."""


class Runtime:
    """torch.distributed (+ NVSHMEM) for one process; use as a context manager or call `close()`.

    Attributes after `start()`: `env`, `backend`, `group` (default group), `cpu_group` (a gloo group
    for host-side collectives), `device` (torch.device), `symmetric_size` (NVSHMEM_SYMMETRIC_SIZE in
    force, or None for gloo); with "nvshmem" also `placement` (`GpuPlacement`: the GPU and how many
    ranks share it), `device_sms` and `sm_share` (the SMs this rank may count on).
    """

    def __init__(
        self,
        env: DistEnv,
        *,
        symmetric_bytes: int = 0,
        backend: str = "nvshmem",
        timeout: timedelta | None = None,
        fit_hint: Callable[[int], str] | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if symmetric_bytes < 0:
            raise ValueError(f"symmetric_bytes={symmetric_bytes} is negative")
        self.env = env
        self.backend = backend
        self.symmetric_bytes = symmetric_bytes
        self.timeout = timeout
        self.fit_hint = fit_hint  # symmetric bytes a rank may have -> a sentence naming a config that fits
        self.group: Any = None
        self.cpu_group: Any = None
        self.device: torch.device | None = None
        self.symmetric_size: str | None = None
        self.placement: GpuPlacement | None = None  # nvshmem: this rank's GPU and who shares it
        self.device_sms: int | None = None  # nvshmem: the GPU's SM count
        self.sm_share: int | None = None  # nvshmem: SMs this rank may count on (its share of the GPU)
        self.mps: bool | None = None  # nvshmem on a shared GPU: whether CUDA MPS serves it
        self.mps_sm_limit: int | None = None  # nvshmem: SMs MPS lets this process use, when fewer than all
        self._env_set_here: list[str] = []  # variables this Runtime set (removed again at close)
        self._finalizers: list[Callable[[], object]] = []
        self._owns_process_group = False
        self._heap_env_set_here = False
        self._nvshmem_up = False
        self._started = False
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Runtime:
        """Initialise the process group (and NVSHMEM); on failure, undo what was done and re-raise."""
        if self._closed:
            raise RuntimeError("this Runtime was closed; make a new one")
        if self._started:
            return self
        self._started = True
        try:
            if self.backend == "gloo":
                self._start_gloo()
            else:
                self._start_nvshmem()
        except BaseException:
            # Local teardown only: the peers may never have arrived.
            self._close(collective=False, swallow=True)
            raise
        log.info("runtime up (%s): %s", self.backend, self.env.describe())
        return self

    def _init_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"rank": self.env.rank, "world_size": self.env.world_size}
        if self.env.launcher == "single":
            # A world of one meets nobody: an in-process store, not a TCP server on MASTER_PORT (two
            # single-process runs on one host collided there: EADDRINUSE on port 29500).
            import torch.distributed as dist

            kwargs["store"] = dist.HashStore()
        else:
            kwargs["store"] = self._rendezvous_store()
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        return kwargs

    def _rendezvous_store(self) -> Any:
        """The launcher's store, under a prefix of its own for this start of a Runtime in this process.

        Why: torch.distributed names its keys the same way at every init_process_group (the default group
        under "default_pg", groups numbered from 0 again after destroy_process_group), and a launcher's
        store (torchrun's agent store, one TCPStore server for the whole job) keeps the keys of the
        previous start. A second Runtime in the same process then read its peers' old addresses: on a
        2-core CPU machine 2 of 4 gloo launches hung at their second or third start, and at 2 ranks on
        GPUs NCCL failed with a remote error. Every rank starts Runtimes in the same order, so the count
        of starts in this process names the same prefix on every rank.
        """
        import torch.distributed as dist

        timeout = self.timeout or timedelta(minutes=30)  # torch's default for the gloo and NCCL groups
        store, _, _ = next(dist.rendezvous(self.env.init_method, self.env.rank, self.env.world_size,
                                           timeout=timeout))
        store.set_timeout(timeout)
        return dist.PrefixStore(f"cute_ep/runtime{next(_RUNTIME_STARTS)}", store)

    def _start_gloo(self) -> None:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", **self._init_kwargs())
        self._owns_process_group = True
        self.group = dist.group.WORLD
        self.cpu_group = self.group  # already gloo: no second group needed
        self.device = torch.device("cpu")

    def _start_nvshmem(self) -> None:
        import torch
        import torch.distributed as dist

        env = self.env
        # Where this rank goes, from the GPU count (NVML: CUDA is not initialised by it): local rank r binds
        # GPU r % G, and ranks beyond the GPU count share one (bootstrap/gpu_share.py).
        visible = torch.cuda.device_count()
        if visible == 0:
            raise RuntimeError(
                "backend='nvshmem' needs a CUDA GPU, but torch.cuda.device_count() is 0: on a machine "
                "without a GPU use Runtime(env, backend='gloo') with ReferenceEpBuffer (scripts: "
                "--backend reference)"
            )
        placement = place(env.local_rank, env.physical_local_world_size, gpus_in_use(visible, os.environ))
        # Ranks that share a GPU run unlimited under MPS, each launching at most its share of CTAs, so that
        # every rank's grid fits beside the others' (bootstrap/gpu_share.py says why no MPS percentage).
        for name, value in shared_gpu_environ(placement, os.environ).items():
            os.environ[name] = value
            self._env_set_here.append(name)
        self.placement = placement
        # Heap size first: NVSHMEM reads the variable when it initialises, and a user error here
        # should surface before any rendezvous.
        from .nvshmem_start import size_symmetric_heap, start_nvshmem

        heap = size_symmetric_heap(self.symmetric_bytes, placement.gpu, ranks_per_gpu=placement.ranks_per_gpu,
                                   shared_gpu=placement.shared, fit_hint=self.fit_hint)
        # Remember whether the size is ours: a later Runtime in this process must not take it for
        # the user's setting.
        self._heap_env_set_here = heap.set_here
        self.symmetric_size = heap.size

        torch.cuda.set_device(placement.gpu)
        self.device = torch.device("cuda", placement.gpu)
        torch.cuda.init()
        self._measure_sm_share(placement)

        # NCCL refuses two ranks on one GPU: a launch that shares one keeps every collective on gloo.
        backend = world_group_backend(placement)
        device_id = {} if placement.shared else {"device_id": self.device}
        dist.init_process_group(backend, **device_id, **self._init_kwargs())
        self._owns_process_group = True
        self.group = dist.group.WORLD
        if placement.shared:
            self.cpu_group = self.group
        else:
            # A pure gloo group keeps host-side traffic (the unique id, barriers) off NCCL.
            gloo_kwargs: dict[str, Any] = {"backend": "gloo"}
            if self.timeout is not None:
                gloo_kwargs["timeout"] = self.timeout
            self.cpu_group = dist.new_group(**gloo_kwargs)

        start_nvshmem(self.cpu_group, env.rank, env.world_size, placement.gpu, heap)
        self._nvshmem_up = True

    def _measure_sm_share(self, placement: GpuPlacement) -> None:
        """The GPU's SM count and this rank's share of it; refuse a shared GPU that MPS does not serve.

        Under an MPS active-thread limit this process's device attributes report its limit, so the GPU's
        own count comes from a child process without one; the share is the least of the limit and
        ``sm_share``'s split of the GPU."""
        import torch

        from cute_ep.bootstrap.cuda_driver import driver, unlimited_sm_count

        limit = torch.cuda.get_device_properties(self.device).multi_processor_count
        lib = driver()
        context_sms = lib.context_sm_count() if lib is not None else None
        limit = min(limit, context_sms or limit)
        self.device_sms = limit
        if placement.ranks_per_gpu > 1:
            self.mps = lib.mps_enabled(placement.gpu) if lib is not None else None
            if self.mps is False:
                raise GpuShareError(mps_missing_message(placement.gpu, placement.ranks_per_gpu))
            if os.environ.get(MPS_PERCENTAGE_VAR, "").strip():  # only a limit makes the attributes differ
                self.device_sms = max(unlimited_sm_count(placement.gpu) or limit, limit)
        self.mps_sm_limit = limit if limit < self.device_sms else None
        self.sm_share = sm_share(self.device_sms, placement.ranks_per_gpu, limit)

    def add_finalizer(self, fn: Callable[[], object]) -> None:
        """Register `fn` to run at `close()`, before NVSHMEM is finalised; run in reverse order."""
        self._finalizers.append(fn)

    def barrier(self, *, device_sync: bool = True) -> None:
        """Host barrier over all ranks; with a GPU, first wait for this rank's queued GPU work."""
        import torch
        import torch.distributed as dist

        if self.cpu_group is None:
            raise RuntimeError("Runtime is not started")
        if device_sync and self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.cpu_group)

    def close(self, *, collective: bool = True) -> None:
        """Run finalizers (reverse order), finalise NVSHMEM, destroy the process group. Idempotent.

        An error in one step does not stop the others; the first one is re-raised at the end.
        `collective=False` skips `nvshmem.core.finalize()`, which waits for every PE and would hang
        if a peer already failed; the process is expected to exit soon after.
        """
        self._close(collective=collective, swallow=False)

    def _close(self, *, collective: bool, swallow: bool) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:  # keep tearing down; report afterwards
                log.exception("rank %d: %s failed during close", self.env.rank, what)
                errors.append(exc)

        finalizers, self._finalizers = self._finalizers, []
        for fn in reversed(finalizers):
            attempt(f"finalizer {getattr(fn, '__qualname__', fn)!r}", fn)

        if self._nvshmem_up:
            self._nvshmem_up = False
            if collective:
                import nvshmem.core as nvshmem

                attempt("nvshmem.core.finalize()", nvshmem.finalize)
            else:
                log.warning("rank %d: skipping nvshmem.core.finalize() after an error", self.env.rank)

        if self._owns_process_group:
            self._owns_process_group = False
            import weakref

            import torch.distributed as dist

            mine = {id(g): g for g in (self.group, self.cpu_group) if g is not None}
            groups = [weakref.ref(g) for g in mine.values()]
            del mine
            if dist.is_initialized():
                attempt("torch.distributed.destroy_process_group()", dist.destroy_process_group)
            self.group = self.cpu_group = None
            attempt("releasing the process groups", lambda: self._check_groups_released(groups))
        self.group = self.cpu_group = None
        if self._heap_env_set_here:
            os.environ.pop(HEAP_ENV_VAR, None)
            self._heap_env_set_here = False
        for name in self._env_set_here:
            os.environ.pop(name, None)
        self._env_set_here = []

        if errors and not swallow:
            raise errors[0]

    def _check_groups_released(self, groups: list[Any]) -> None:
        """Free this Runtime's process groups now (``groups``: weak references to them), while the
        interpreter is fully alive; a group that something else still holds is looked at again at exit.

        Why: ``destroy_process_group()`` only forgets a group. The C++ group and its gloo worker threads
        live until the last Python reference to it goes, and a worker frees the work of a collective (and
        the collectives before a barrier, which the barrier's work keeps) a moment after the caller's
        wait returned. Freeing a tensor that Python made takes the GIL; a worker that does so while the
        interpreter exits is ended by CPython (3.13 and older), and the C++ runtime aborts the process:
        "terminate called without an active exception", SIGABRT, after a complete run (pytorch/pytorch
        PR #179291 and issue #190489 describe it). Seen in November 2026 on a 2-core CPU machine (torch
        2.13, Python 3.11) when a buffer still held the group after the ``with Runtime`` block. Freed here,
        the group joins its worker threads first (torch releases the GIL for that), so nothing of gloo is
        left at exit.
        """
        import gc

        if any(ref() is not None for ref in groups):
            gc.collect()  # a group that only a reference cycle still holds
        alive = [ref for ref in groups if ref() is not None]
        if alive:
            # Often a caller's local variable, gone when its function returns: warn only if the group is
            # still there when the interpreter exits (atexit runs while it is fully alive).
            log.debug("rank %d: %d process group(s) still referred to after close", self.env.rank, len(alive))
            import atexit

            atexit.register(_report_groups_left_at_exit, self.env.rank, alive)

    @property
    def closed(self) -> bool:
        """True once `close()` has run."""
        return self._closed

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            # Keep the original exception; teardown errors are logged by _close. No collective
            # NVSHMEM finalize: a peer that failed differently would leave us waiting forever.
            self._close(collective=False, swallow=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._started else "new")
        return f"Runtime(backend={self.backend!r}, {state}, {self.env.describe()})"


def _report_groups_left_at_exit(rank: int, groups: list[Any]) -> None:
    """At interpreter exit: warn about the groups (weak references) a closed Runtime could not free, naming
    the kinds of object that still hold them (``Runtime._check_groups_released`` says why it matters)."""
    import gc

    if any(ref() is not None for ref in groups):
        gc.collect()
    alive = [group for group in (ref() for ref in groups) if group is not None]
    if not alive:
        return
    holders = sorted({type(r).__name__ for g in alive for r in gc.get_referrers(g) if r is not alive})
    log.warning(
        "rank %d: %d process group(s) of a closed Runtime are still referred to at exit (by %s): their gloo "
        "worker threads can abort the interpreter's exit (SIGABRT, 'terminate called without an active "
        "exception'). Drop every reference to rt.group / rt.cpu_group (and to buffers' groups) before the "
        "program ends",
        rank, len(alive), ", ".join(holders) or "objects the garbage collector does not track, e.g. a dict",
    )


def start(
    env: DistEnv,
    *,
    symmetric_bytes: int = 0,
    backend: str = "nvshmem",
    timeout: timedelta | None = None,
    fit_hint: Callable[[int], str] | None = None,
) -> Runtime:
    """Create and start a `Runtime`; use it as ``with start(env, ...) as rt:``."""
    return Runtime(env, symmetric_bytes=symmetric_bytes, backend=backend, timeout=timeout,
                   fit_hint=fit_hint).start()
