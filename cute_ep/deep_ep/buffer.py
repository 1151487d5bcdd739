"""``cute_ep.deep_ep.Buffer``: DeepEP v1.2.1's ``deep_ep.Buffer`` on cute-ep's backends.

The same names, arguments, defaults, shapes, dtypes and return tuples as DeepEP; what differs is listed
in each method's docstring and in docs/deep_ep.md. The receive sides are built on two dispatches of
``cute_ep``:

* normal mode (``dispatch`` / ``combine``): the rank layout (``layout="rank"``, rows grouped by source
  rank, tokens ascending: DeepEP's order), routed by ``is_token_in_rank`` with one expert per rank
  (``normal.rank_routing``); FP8 scales and top-k ids / weights travel in the token's row
  (``normal.RowFormat``);
* low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``): on GPUs the module's low-latency
  dispatch writes DeepEP's per-expert padded tensors in one launch (kernels/low_latency_dispatch.py) and
  its combine pushes them back and sums them (kernels/low_latency_combine.py); on the host backends the
  expert layout, rearranged with torch ops (``low_latency.padded_layout``). No host sync.

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

Streams (GPUs): as in DeepEP, a call with ``previous_event`` or ``async_finish`` runs on the Buffer's
communication stream (``get_comm_stream``, high priority), after ``previous_event`` or else after the
caller's current stream; with ``async_finish`` the caller's stream does not wait and the returned event
marks the end, otherwise it waits. A call with neither runs on the caller's stream (the same order,
without the streams' waits and the allocator's cross-stream bookkeeping). On a CPU
(the reference backend) every call is complete when it returns: ``async_finish`` returns an event with
nothing to wait for.
"""

from __future__ import annotations

from typing import Any

from cute_ep.deep_ep.checks import CallChecks
from cute_ep.deep_ep.handles import LowLatencyHandle, NormalHandle
from cute_ep.deep_ep.lifecycle import BUDGET_ENV_VAR, BufferLifecycle
from cute_ep.deep_ep.low_latency_mode import LowLatencyMode
from cute_ep.deep_ep.normal_mode import NormalMode
from cute_ep.deep_ep.pool import BufferPool
from cute_ep.deep_ep.utils import (
    Config,
    EventHandle,
    EventOverlap,
    get_low_latency_rdma_size_hint,
    plain_torch_defaults,
)

__all__ = ["BUDGET_ENV_VAR", "Buffer", "LowLatencyHandle", "NormalHandle"]


# Buffer's parts, one file each: lifecycle.py (creation, byte budget, NVSHMEM, destroy, the communication
# stream), pool.py (the backends' buffers per shape), checks.py (the argument checks both modes share),
# normal_mode.py and low_latency_mode.py (DeepEP's two modes). Buffer adds DeepEP's static helpers.
class Buffer(BufferLifecycle, BufferPool, CallChecks, NormalMode, LowLatencyMode):
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
        with plain_torch_defaults():
            self._init(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, comm,
                       backend, symmetric_bytes, runtime)

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

    def _buffer_sms(self) -> int:
        """``Buffer.num_sms`` (``set_num_sms``): the SMs of the kernels' buffers built now
        (``BufferPool._buffer``)."""
        return Buffer.num_sms
