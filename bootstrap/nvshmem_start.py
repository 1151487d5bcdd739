"""Starting NVSHMEM over the ranks of a process group: the start-up that ``Runtime`` (over the process
group it makes for a launch) and ``cute_ep.deep_ep`` (over the caller's group) both run.

    heap = start_nvshmem(group, rank, world_size, device_index, budget)

In order:

1. The symmetric heap is sized for ``budget`` bytes of symmetric buffers (``size_symmetric_heap``):
   ``NVSHMEM_SYMMETRIC_SIZE`` is set to ``heap_bytes_for(budget)``, or a value the user set is kept if it
   holds the budget; when several ranks share the GPU, their heaps must fit it together
   (``check_heap_fits``). Both refusals are ``HeapConfigError``s, raised before NVSHMEM is touched.
2. Rank 0 of the group makes NVSHMEM's unique id and every rank receives it over the group
   (``share_unique_id``).
3. NVSHMEM is initialised on GPU ``device_index`` with the group's rank as its PE.

A caller that must report a heap error before it meets its peers (``Runtime`` sizes the heap before its
rendezvous) calls ``size_symmetric_heap`` itself and passes the ``SymmetricHeap`` it returns in place of
the budget.

torch, NVSHMEM and cuda.core are imported inside the functions: the module loads on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .runtime import (
    HEAP_ENV_VAR,
    check_heap_fits,
    configure_symmetric_heap,
    heap_bytes_for,
    parse_size,
    share_unique_id,
)

__all__ = ["SymmetricHeap", "cuda_core_device", "nvshmem_core", "size_symmetric_heap", "start_nvshmem"]


@dataclass(frozen=True)
class SymmetricHeap:
    """The symmetric heap NVSHMEM gets at init.

    ``size``: NVSHMEM_SYMMETRIC_SIZE as in force ("8G", or the user's own text); ``nbytes``: the same in
    bytes; ``budget``: the bytes of symmetric buffers it was sized for; ``set_here``: the variable was unset
    and ``size_symmetric_heap`` set it, so the caller removes it once NVSHMEM is finalised (a later start in
    the process must not take it for the user's setting).
    """

    size: str
    nbytes: int
    budget: int
    set_here: bool


def size_symmetric_heap(
    budget: int,
    device_index: int,
    *,
    ranks_per_gpu: int = 1,
    shared_gpu: bool = False,
    fit_hint: Callable[[int], str] | None = None,
    gpu_bytes: int | None = None,
    environ: MutableMapping[str, str] = os.environ,
) -> SymmetricHeap:
    """Set NVSHMEM_SYMMETRIC_SIZE for ``budget`` bytes of symmetric buffers and check it, before NVSHMEM
    starts (it reads the variable at init).

    The size is ``heap_bytes_for(budget, shared_gpu=shared_gpu)`` (``shared_gpu``: some GPU serves several
    ranks, which calls for the smaller heap rule); a value the user set is kept if it is at least ``budget``
    (``configure_symmetric_heap``). With ``ranks_per_gpu`` > 1 (ranks on this rank's GPU, itself included)
    the heaps and each rank's overhead must fit GPU ``device_index`` (``gpu_bytes``: its memory, asked of
    torch when None; ``fit_hint``: see ``check_heap_fits``). Raises ``HeapConfigError`` for a user value
    that is malformed or too small and for heaps that do not fit; the variable is then as before the call.
    """
    if ranks_per_gpu < 1:
        raise ValueError(f"ranks_per_gpu={ranks_per_gpu} must be >= 1")
    set_here = HEAP_ENV_VAR not in environ
    size = configure_symmetric_heap(heap_bytes_for(budget, shared_gpu=shared_gpu), environ,
                                    minimum_bytes=budget)
    try:
        if ranks_per_gpu > 1:
            if gpu_bytes is None:
                import torch

                gpu_bytes = torch.cuda.get_device_properties(device_index).total_memory
            check_heap_fits(size, ranks_per_gpu, gpu_bytes, fit_hint)
    except BaseException:
        if set_here:
            environ.pop(HEAP_ENV_VAR, None)
        raise
    return SymmetricHeap(size=size, nbytes=parse_size(size), budget=budget, set_here=set_here)


def start_nvshmem(
    group: Any,
    rank: int,
    world_size: int,
    device_index: int,
    heap: int | SymmetricHeap,
    *,
    ranks_per_gpu: int = 1,
    shared_gpu: bool = False,
    fit_hint: Callable[[int], str] | None = None,
) -> SymmetricHeap:
    """Initialise NVSHMEM for this process as PE ``rank`` of ``world_size``, on GPU ``device_index``
    (collective over ``group``: every rank calls it).

    ``heap``: the bytes of symmetric buffers, for which the heap is sized here (``size_symmetric_heap``,
    with ``ranks_per_gpu``, ``shared_gpu`` and ``fit_hint``), or a ``SymmetricHeap`` already sized. Rank 0
    makes NVSHMEM's unique id and ``share_unique_id`` hands it to the other ranks over ``group`` (None: the
    default group; unused in a world of one, which needs no process group). ``rank`` is this process's
    rank in ``group``. Returns the heap in force. Raises ``HeapConfigError`` before any collective when
    the heap is refused, and ``RuntimeError`` if NVSHMEM reports another PE or PE count. When the heap was
    sized here and a later step fails, NVSHMEM_SYMMETRIC_SIZE is as before the call.
    """
    sized_here = not isinstance(heap, SymmetricHeap)
    if sized_here:
        heap = size_symmetric_heap(heap, device_index, ranks_per_gpu=ranks_per_gpu, shared_gpu=shared_gpu,
                                   fit_hint=fit_hint)
    try:
        _init_over_group(group, rank, world_size, device_index)
    except BaseException:
        if sized_here and heap.set_here:
            os.environ.pop(HEAP_ENV_VAR, None)
        raise
    return heap


def _init_over_group(group: Any, rank: int, world_size: int, device_index: int) -> None:
    import numpy as np

    nvshmem = nvshmem_core()
    device = cuda_core_device(device_index)
    device.set_current()  # NVSHMEM initialises on the current context: make it this GPU's

    uid = nvshmem.get_unique_id() if rank == 0 else nvshmem.get_unique_id(empty=True)
    # uid._data is a one-element numpy record array (128 bytes); view it as raw bytes, which alias the id.
    uid_bytes = uid._data.view(np.uint8)
    if world_size > 1:
        shared = share_unique_id(group, lambda: uid_bytes.copy(), rank)
        if shared.size != uid_bytes.size:
            raise RuntimeError(f"NVSHMEM unique id is {uid_bytes.size} bytes here, got {shared.size}")
        uid_bytes[:] = shared

    nvshmem.init(device=device, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
    pe, npes = nvshmem.my_pe(), nvshmem.n_pes()
    if (pe, npes) != (rank, world_size):
        raise RuntimeError(f"NVSHMEM reports PE {pe} of {npes}, expected rank {rank} of {world_size}")


def nvshmem_core() -> Any:
    """The ``nvshmem.core`` module (nvshmem4py), imported when first needed."""
    import nvshmem.core

    return nvshmem.core


def cuda_core_device(index: int) -> Any:
    """cuda.core's Device for GPU ``index`` (older cuda-core releases keep it in ``experimental``)."""
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    return Device(index)
