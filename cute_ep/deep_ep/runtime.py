"""What a ``cute_ep.deep_ep.Buffer`` makes of DeepEP's ``group`` argument: the backend, and the runtime the
backend needs (``cute_ep.bootstrap.Runtime``'s attributes, made from an existing process group instead of
a launch environment).

Backends (``Buffer(..., backend=None)`` picks): "cute" (``EpBuffer``, the CuTe kernels on NVSHMEM) when the
group is NCCL and CUDA is available; "reference" (``ReferenceEpBuffer``, the torch references) otherwise. The
all-to-all backend is not offered: its combine takes only the handle of its own dispatch, and a DeepEP
dispatch and its combine may use buffers of different row widths here.

NVSHMEM: DeepEP's ``Buffer`` starts NVSHMEM itself, and so does the first "cute" Buffer of a process: its
PEs are the group's ranks (NVSHMEM's unique id is broadcast over the group), and its symmetric heap is
sized once, from that Buffer's byte budget (``NVSHMEM_SYMMETRIC_SIZE`` set by the user wins, if it holds
the budget). The start is ``cute_ep.bootstrap.nvshmem_start.start_nvshmem``, the one ``Runtime`` makes, with
its checks: where ranks of the group share a GPU, the heaps follow the shared-GPU rule and must fit the GPU
together (``HeapConfigError`` otherwise). Later Buffers of the process share it (same group only, and a
budget that fits the heap); ``destroy()`` of the last one finalizes it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from cute_ep.bootstrap.dist_env import LOCAL_WORLD_SIZE_OVERRIDE_VAR, DistEnv
from cute_ep.collectives import all_gather_objects, world_of
from cute_ep.deep_ep.checks import drain_gloo

__all__ = ["BACKENDS", "GroupRuntime", "choose_backend", "resolve_group"]

BACKENDS = ("cute", "reference")
"""``Buffer(..., backend=...)`` choices: the CuTe kernels (GPU), the torch reference (CPU)."""


def resolve_group(group: Any) -> Any:
    """The group a Buffer works on: ``group``; None means the default group when torch.distributed is
    initialised, else a world of one without a process group (None)."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _is_nccl(group: Any) -> bool:
    return group is not None and "nccl" in str(dist.get_backend(group)).lower()


def choose_backend(group: Any, backend: str | None, runtime: Any = None) -> str:
    """The backend for ``group``: ``backend`` if given (checked), else "cute" for an NCCL group with CUDA
    (or a given ``runtime`` that runs NVSHMEM), "reference" otherwise."""
    kernels_here = torch.cuda.is_available() and _is_nccl(group)
    if runtime is not None:
        kernels_here = getattr(runtime, "backend", None) == "nvshmem"
    if backend is None:
        return "cute" if kernels_here else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "cute" and not kernels_here:
        raise ValueError(
            'backend="cute" runs the CuTe kernels on CUDA GPUs with an NCCL group; here CUDA is '
            f"{'' if torch.cuda.is_available() else 'not '}available and the group is "
            f"{dist.get_backend(group) if group is not None else 'a world of one without a process group'}; "
            'on a CPU use backend="reference" with a gloo group'
        )
    return backend


def _node_size(group: Any, rank: int, world: int) -> int:
    """Ranks per host: every rank's host name gathered over the group (ranks must come host by host, in
    equal numbers), or ``CUTE_EP_LOCAL_WORLD_SIZE`` (virtual nodes) when set and dividing that."""
    hosts = all_gather_objects(socket.gethostname(), group)
    size = hosts.count(hosts[0])
    blocks = [hosts[i : i + size] for i in range(0, world, size)]
    if world % size or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ValueError(
            f"cute_ep.deep_ep: the group's ranks must come host by host in equal numbers (rank = node * "
            f"ranks per node + local rank), got hosts {hosts}"
        )
    override = os.environ.get(LOCAL_WORLD_SIZE_OVERRIDE_VAR, "").strip()
    if override:
        virtual = int(override)
        if virtual < 1 or size % virtual:
            raise ValueError(
                f"{LOCAL_WORLD_SIZE_OVERRIDE_VAR}={override} must divide the {size} ranks per host"
            )
        return virtual
    return size


class GroupRuntime:
    """A ``Runtime`` made from a group (the attributes the backends read): ``env`` (this rank's place in the
    group), ``device``, ``group``, ``cpu_group`` (the group itself: the host collectives are object
    collectives, which NCCL groups carry too), ``backend`` ("nvshmem" once NVSHMEM runs, else "gloo"),
    ``barrier()`` and ``add_finalizer()``."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.cpu_group = group
        self.device = device
        rank, world = world_of(group)
        size = _node_size(group, rank, world) if world > 1 else 1
        self.env = DistEnv(rank=rank, world_size=world, local_rank=rank % size,
                           physical_local_world_size=size, local_world_size=size)
        self.backend = "gloo"
        self.symmetric_size: str | None = None
        self._finalizers: list[Any] = []

    def barrier(self, *, device_sync: bool = True) -> None:
        """Host barrier over the group; with a GPU, first wait for this rank's queued work."""
        if device_sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.env.world_size > 1:
            dist.barrier(group=self.group)

    def add_finalizer(self, fn: Any) -> None:
        """Run ``fn`` at ``close()``, before NVSHMEM is finalized (reverse order)."""
        self._finalizers.append(fn)

    def close(self) -> None:
        """Run the finalizers (reverse order); then, on a gloo group, wait until its worker threads hold
        nothing of the collectives made so far (``checks.drain_gloo``, collective): the group is the caller's,
        which this runtime cannot free as ``Runtime.close`` frees its own, and the caller may keep it until
        the interpreter exits, where a worker still freeing a tensor aborts the process."""
        finalizers, self._finalizers = self._finalizers, []
        for fn in reversed(finalizers):
            fn()
        drain_gloo(self.group)


class NvshmemSession:
    """NVSHMEM for one process, started once over a group's ranks (see the module docstring)."""

    current: NvshmemSession | None = None

    def __init__(self, runtime: GroupRuntime, budget: int) -> None:
        from cute_ep.bootstrap.compile import ModuleRegistry
        from cute_ep.bootstrap.nvshmem_start import start_nvshmem

        self.ranks = _group_ranks(runtime.group)
        self.users = 0
        self.budget = budget
        index = runtime.device.index if runtime.device.index is not None else torch.cuda.current_device()
        env = runtime.env
        sharing = _most_ranks_on_one_gpu(runtime.group, env.world_size, index)
        heap = start_nvshmem(runtime.group, env.rank, env.world_size, index, budget, ranks_per_gpu=sharing,
                             shared_gpu=sharing > 1, fit_hint=_buffer_fit_hint)
        self._heap_env_set_here = heap.set_here
        self.heap_bytes = heap.nbytes
        self.registry = ModuleRegistry(device_id=index)
        NvshmemSession.current = self

    @classmethod
    def attach(cls, runtime: GroupRuntime, budget: int) -> NvshmemSession:
        """The process's session (started now if none runs) for a Buffer on ``runtime``'s group with
        ``budget`` bytes of symmetric buffers; marks the runtime as an NVSHMEM one."""
        session = cls.current
        if session is None:
            session = cls(runtime, budget)
        elif session.ranks != _group_ranks(runtime.group):
            raise NotImplementedError(
                f"cute_ep.deep_ep: NVSHMEM already runs in this process over the ranks {session.ranks}; a "
                f"Buffer on another group ({_group_ranks(runtime.group)}) needs a process of its own"
            )
        elif budget > session.budget:
            raise ValueError(
                f"cute_ep.deep_ep: this Buffer asks for {budget} bytes of symmetric buffers, but NVSHMEM's "
                f"heap was sized for {session.budget} by the first Buffer of this process; create the first "
                f"Buffer with the largest budget (num_nvl_bytes + num_rdma_bytes, or symmetric_bytes=), or "
                f"set CUTE_EP_DEEP_EP_SYMMETRIC_BYTES before it"
            )
        session.users += 1
        runtime.backend = "nvshmem"
        return session

    def release(self) -> None:
        """One Buffer less; the last one finalizes the compiled modules and NVSHMEM (collective)."""
        self.users -= 1
        if self.users > 0:
            return
        from cute_ep.bootstrap.nvshmem_start import nvshmem_core
        from cute_ep.bootstrap.runtime import HEAP_ENV_VAR

        NvshmemSession.current = None
        self.registry.finalize_all()
        nvshmem_core().finalize()
        if self._heap_env_set_here:
            os.environ.pop(HEAP_ENV_VAR, None)


def _buffer_fit_hint(room: int) -> str:
    """What a Buffer may ask for when its heap must fit a GPU that ranks share (``room``: the most bytes of
    symmetric buffers per rank that fit)."""
    return (f"for a Buffer, num_nvl_bytes + num_rdma_bytes (or symmetric_bytes=, or "
            f"CUTE_EP_DEEP_EP_SYMMETRIC_BYTES) of at most {room} bytes")


def _most_ranks_on_one_gpu(group: Any, world: int, index: int) -> int:
    """The most ranks of ``group`` that one GPU serves (1 in a world of one), every rank's GPU ``index``
    told apart by its UUID (collective), so ranks on different hosts or with different CUDA_VISIBLE_DEVICES
    never count as sharing. The most over the group, not this rank's own count: every rank then sizes the
    same heap and makes the same fit check, so a refused heap stops every rank before the unique id's
    broadcast, where the others would wait."""
    if world == 1:
        return 1
    gpus = all_gather_objects(str(torch.cuda.get_device_properties(index).uuid), group)
    return max(gpus.count(gpu) for gpu in gpus)


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None:
        return (0,)
    return tuple(dist.get_process_group_ranks(group))
